"""Data: loading (Hugging Face name or local file), row validation, chat-template tokenisation, DataModules.

May import: parallel, models, algorithms.
"""

from rl_lightning.data.loading import load_rows
from rl_lightning.data.preference import Pair, PreferenceDataModule
from rl_lightning.data.prompts import Prompt, PromptDataModule
from rl_lightning.data.sft import SFTDataModule
from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages

__all__ = ["Pair", "PreferenceDataModule", "Prompt", "PromptDataModule", "SFTDataModule", "TokenizedExample", "load_rows", "tokenize_messages"]
