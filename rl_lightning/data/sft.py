"""SFT DataModule: validated, tokenised conversations served as balanced, packed micro-batches per optimizer step."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from rl_lightning.data.loading import load_rows
from rl_lightning.data.rows import check_sft_rows
from rl_lightning.data.steps import (
    StepDataset,
    check_batching_args,
    check_enough_rows,
    check_unit_budget,
    data_parallel_coords,
    log_stats,
)
from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages
from rl_lightning.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def tokenizer_for(name: str | None) -> Any:
    if name is None:
        raise ConfigError("data.tokenizer_name is not set (the CLI links it from model.model_name)")
    from rl_lightning.models import load_tokenizer

    return load_tokenizer(name)


class SFTDataModule(L.LightningDataModule):
    """Conversations for supervised fine-tuning; the loss covers assistant tokens only.

    Each training batch is one optimizer step on this rank, ``{"micro_batches": [...]}`` (see
    `rl_lightning.data.steps`): the step's `batch_size` x dp conversations are packed into micro-batches of at most
    `max_length_per_device` tokens, balanced across ranks and micro-batches. The task accumulates gradients over the
    micro-batches and normalises by the step's global number of assistant tokens.

    Args:
        path: training data: a local ``.json``/``.jsonl``/``.csv``/``.parquet``/``.arrow`` file, a ``save_to_disk``
            folder or a Hugging Face dataset name. Rows are ``{"messages": [{"role", "content"}, ...]}``.
        tokenizer_name: tokenizer to use (linked from ``model.model_name`` by the CLI).
        val_path: optional validation data in the same format.
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
        super().__init__()
        check_batching_args(max_length, batch_size, packing, max_length_per_device, micro_batch_size)
        self.save_hyperparameters(logger=False)
        self.tokenizer = tokenizer_for(tokenizer_name)
        self.train_examples: list[TokenizedExample] = []
        self.val_examples: list[TokenizedExample] = []
        self.stats: dict[str, int] = {}
        if val_path is None:
            # Lightning skips validation when the hook is absent (`is_overridden` is False for None).
            self.val_dataloader = None  # type: ignore[method-assign]

    def setup(self, stage: str) -> None:
        if not self.train_examples:
            self.train_examples = self._load(self.hparams.path, "train")
        if self.hparams.val_path and not self.val_examples:
            self.val_examples = self._load(self.hparams.val_path, "val")
        log_stats(self.trainer, self.stats)

    def _load(self, path: str, name: str) -> list[TokenizedExample]:
        hp = self.hparams
        rows = load_rows(path, hp.split)
        check_sft_rows(rows)
        examples, locations, truncated, dropped = [], [], 0, 0
        for i, row in enumerate(rows.rows):
            where = rows.locate(i)
            example = tokenize_messages(self.tokenizer, row["messages"], hp.max_length, hp.apply_chat_template, where)
            truncated += example.truncated
            if sum(example.loss_mask) == 0:  # only possible after truncation
                dropped += 1
                continue
            examples.append(example)
            locations.append(where)
        if not examples:
            raise DataError(f"{rows.source}: every row lost all assistant tokens to truncation; raise data.max_length")
        if hp.packing:
            check_unit_budget([len(e.input_ids) for e in examples], locations.__getitem__,
                              hp.max_length_per_device, "the conversation")
        if name == "train":
            check_enough_rows(len(examples), hp.batch_size, data_parallel_coords(self.trainer)[1], rows.source)
        self.stats.update({f"data/{name}_rows": len(rows), f"data/{name}_truncated": truncated,
                           f"data/{name}_dropped": dropped})
        if truncated:
            log.warning(
                "%s: %d of %d conversations are longer than data.max_length=%d and were truncated; %d of them kept no "
                "assistant token and were dropped", rows.source, truncated, len(rows), hp.max_length, dropped
            )
        return examples

    def _loader(self, examples: list[TokenizedExample], shuffle: bool) -> DataLoader:
        hp = self.hparams
        dp_rank, dp_size = data_parallel_coords(self.trainer)
        dataset = StepDataset(
            examples, hp.batch_size, dp_rank, dp_size, hp.packing, hp.max_length_per_device, hp.micro_batch_size,
            self.tokenizer.pad_token_id, shuffle, lambda: self.trainer.current_epoch if self.trainer else 0,
        )
        return DataLoader(dataset, batch_size=None)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_examples, self.hparams.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_examples, False)
