"""SFT DataModule: validated, tokenised conversations served as balanced, packed micro-batches per optimizer step."""

from __future__ import annotations

from typing_extensions import override

from rl_lightning.data.datamodule import StepDataModule, saved_hparams
from rl_lightning.data.loading import Rows
from rl_lightning.data.rows import check_sft_rows
from rl_lightning.data.steps import check_unit_budget
from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages
from rl_lightning.errors import DataError


class SFTDataModule(StepDataModule):
    """Conversations for supervised fine-tuning; the loss covers assistant tokens only.

    Each training batch is one optimizer step on this rank, ``{"micro_batches": [...]}`` (see
    `rl_lightning.data.steps`): the step's `batch_size` x dp conversations are packed into micro-batches of at most
    `max_length_per_device` tokens, balanced across ranks and micro-batches. The task accumulates gradients over the
    micro-batches and normalises by the step's global number of assistant tokens.

    Args:
        path: training data: a local ``.json``/``.jsonl``/``.csv``/``.parquet``/``.arrow`` file, a ``save_to_disk``
            folder or a Hugging Face dataset name. Rows are ``{"messages": [{"role", "content"}, ...]}``.
        tokenizer_name: tokenizer to use (linked from ``model.lm.name`` by the CLI).
        val_path: optional validation data in the same format (whole steps only; a remainder is not evaluated).
        split: split to read from Hugging Face datasets and ``DatasetDict`` folders.
        max_length: tokens kept per conversation; longer ones are truncated on the right, counted and logged
            (``data/train_truncated``); a conversation left with no assistant token is dropped and counted.
        apply_chat_template: render with the tokenizer's chat template (chat models). False concatenates the
            contents and appends EOS after each assistant message (base models).
        batch_size: conversations per optimizer step per data-parallel rank.
        packing: pack conversations into micro-batches under `max_length_per_device` tokens (balanced); False pads
            `micro_batch_size` conversations per micro-batch.
        max_length_per_device: token budget of one packed micro-batch (the memory knob).
        micro_batch_size: conversations per padded micro-batch (``packing: false``); must divide `batch_size`.
        shuffle: reshuffle the training rows every epoch (seeded by ``seed_everything``).
    """

    def __init__(
        self,
        path: str,
        tokenizer_name: str | None = None,
        val_path: str | None = None,
        split: str = "train",
        max_length: int = 1024,
        apply_chat_template: bool = True,
        batch_size: int = 8,
        packing: bool = True,
        max_length_per_device: int = 8192,
        micro_batch_size: int = 8,
        shuffle: bool = True,
    ) -> None:
        super().__init__(path, tokenizer_name, val_path, split, max_length, batch_size, packing,
                         max_length_per_device, micro_batch_size, shuffle)
        self.save_hyperparameters(logger=False)

    @property
    def train_examples(self) -> list[TokenizedExample]:
        """The tokenised training conversations (available after ``setup``)."""
        return self.units["train"]

    @override
    def build_units(self, rows: Rows, name: str) -> tuple[list[TokenizedExample], list[str]]:
        hp = saved_hparams(self)
        check_sft_rows(rows)
        examples, locations, truncated = [], [], 0
        for i, row in enumerate(rows.rows):
            where = rows.locate(i)
            example = tokenize_messages(self.tokenizer, row["messages"], hp.max_length, hp.apply_chat_template, where)
            truncated += example.truncated
            if example.has_targets:  # False only after truncation: nothing left to learn, drop it
                examples.append(example)
                locations.append(where)
        if not examples:
            raise DataError(f"{rows.source}: every row lost all assistant tokens to truncation; raise data.max_length")
        if hp.packing:
            check_unit_budget([len(e.input_ids) for e in examples], locations.__getitem__,
                              hp.max_length_per_device, "the conversation")
        self.count(name, len(rows), truncated, len(rows) - len(examples), rows.source, "conversations")
        return examples, locations
