"""SFT DataModule: validated, tokenised conversations served as one optimizer step's micro-batches per batch."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from rl_lightning.data.loading import load_rows
from rl_lightning.data.rows import check_sft_rows
from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages
from rl_lightning.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def pad_micro_batch(examples: list[TokenizedExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples into ``input_ids``, ``attention_mask``, ``position_ids`` and ``loss_mask``, each (B, T)."""
    length = max(len(e.input_ids) for e in examples)
    batch = {k: torch.zeros(len(examples), length, dtype=torch.long) for k in ("attention_mask", "loss_mask")}
    batch["input_ids"] = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    for i, example in enumerate(examples):
        n = len(example.input_ids)
        batch["input_ids"][i, :n] = torch.tensor(example.input_ids)
        batch["loss_mask"][i, :n] = torch.tensor(example.loss_mask)
        batch["attention_mask"][i, :n] = 1
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


class SFTDataModule(L.LightningDataModule):
    """Conversations for supervised fine-tuning; the loss covers assistant tokens only.

    Each training batch is one optimizer step on this rank: ``{"micro_batches": [micro_batch, ...]}`` with
    `batch_size` rows split into micro-batches of `micro_batch_size` rows (gradient accumulation happens inside the
    task, so the loss can be normalised by the step's global count of assistant tokens).

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
        micro_batch_size: conversations per forward/backward pass; must divide `batch_size`.
        num_workers: DataLoader worker processes.
        shuffle: shuffle the training rows every epoch (seeded by ``seed_everything``).
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
        micro_batch_size: int = 8,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        errors = []
        if max_length < 1:
            errors.append(f"data.max_length must be >= 1, got {max_length}")
        if batch_size < 1 or micro_batch_size < 1 or batch_size % micro_batch_size:
            errors.append(
                f"data.micro_batch_size ({micro_batch_size}) must be >= 1 and divide data.batch_size ({batch_size})"
            )
        if tokenizer_name is None:
            errors.append("data.tokenizer_name is not set (the CLI links it from model.model_name)")
        if errors:
            raise ConfigError("; ".join(errors))
        self.train_examples: list[TokenizedExample] = []
        self.val_examples: list[TokenizedExample] = []
        self.stats: dict[str, int] = {}
        self._tokenizer: Any = None
        if val_path is None:
            # Lightning skips validation when the hook is absent (`is_overridden` is False for None); returning an
            # empty loader instead makes it warn on every run.
            self.val_dataloader = None  # type: ignore[method-assign]

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from rl_lightning.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.hparams.tokenizer_name)
        return self._tokenizer

    def setup(self, stage: str) -> None:
        if not self.train_examples:
            self.train_examples = self._load(self.hparams.path, "train")
            world_size = self.trainer.world_size if self.trainer is not None else 1
            if len(self.train_examples) < self.hparams.batch_size * world_size:
                raise DataError(
                    f"{self.hparams.path}: {len(self.train_examples)} usable conversations, fewer than one step needs "
                    f"(data.batch_size={self.hparams.batch_size} x {world_size} ranks); lower data.batch_size"
                )
        if self.hparams.val_path and not self.val_examples:
            self.val_examples = self._load(self.hparams.val_path, "val")

    def _load(self, path: str, name: str) -> list[TokenizedExample]:
        rows = load_rows(path, self.hparams.split)
        check_sft_rows(rows)
        examples, truncated, dropped = [], 0, 0
        for i, row in enumerate(rows.rows):
            example = tokenize_messages(
                self.tokenizer,
                row["messages"],
                max_length=self.hparams.max_length,
                apply_chat_template=self.hparams.apply_chat_template,
                where=rows.locate(i),
            )
            truncated += example.truncated
            if sum(example.loss_mask) == 0:  # only possible after truncation
                dropped += 1
                continue
            examples.append(example)
        if not examples:
            raise DataError(
                f"{rows.source}: every row lost all assistant tokens to truncation; raise data.max_length "
                f"(now {self.hparams.max_length})"
            )
        self.stats.update({f"data/{name}_rows": len(rows), f"data/{name}_truncated": truncated,
                           f"data/{name}_dropped": dropped})
        if truncated:
            log.warning(
                "%s: %d of %d conversations are longer than data.max_length=%d and were truncated; %d of them kept no "
                "assistant token and were dropped", rows.source, truncated, len(rows), self.hparams.max_length, dropped
            )
        self._log_stats()
        return examples

    def _log_stats(self) -> None:
        trainer = self.trainer
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in self.stats.items()}, step=0)

    def _collate(self, examples: list[TokenizedExample]) -> dict[str, Any]:
        size = self.hparams.micro_batch_size
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
        return {"micro_batches": [pad_micro_batch(chunk, pad_id) for chunk in chunks]}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_examples,
            batch_size=self.hparams.batch_size,
            shuffle=self.hparams.shuffle,
            drop_last=True,
            collate_fn=self._collate,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_examples,
            batch_size=self.hparams.batch_size,
            collate_fn=self._collate,
            num_workers=self.hparams.num_workers,
        )
