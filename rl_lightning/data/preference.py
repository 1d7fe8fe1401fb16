"""Preference DataModule (reward modelling and DPO): a prompt with a chosen and a rejected completion.

Each pair is one packing unit: its chosen and rejected sequences always share a micro-batch (the pairwise losses need
both), in that order, so in a micro-batch sequence ``2p`` is pair p's chosen and ``2p + 1`` its rejected completion.
Each side is truncated to `max_length`, so a pair can take up to 2 x `max_length` tokens of the budget.

A task that trains on unpaired examples (``unpaired_examples = True``: DPO with ``loss_type: kto``) gets
`rl_lightning.data.unpaired.Unpaired` units instead, one per example, from unpaired rows and from pairs alike; other
tasks refuse unpaired rows at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from typing_extensions import override

from rl_lightning.data.datamodule import StepDataModule, saved_hparams
from rl_lightning.data.loading import Rows
from rl_lightning.data.rows import check_preference_rows
from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages
from rl_lightning.data.unpaired import Unpaired, unpaired_units
from rl_lightning.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass
class Pair:
    """A tokenised preference pair; `fields` are per-pair scalars passed to the task (``margin``)."""

    chosen: TokenizedExample
    rejected: TokenizedExample
    fields: dict[str, float] = field(default_factory=dict)

    @property
    def sequences(self) -> tuple[TokenizedExample, TokenizedExample]:
        """The chosen and the rejected sequence, in that order (they share a micro-batch)."""
        return self.chosen, self.rejected


class PreferenceDataModule(StepDataModule):
    """Preference pairs ``{"messages": [prompt...], "chosen": str, "rejected": str}`` for RM and DPO.

    An optional numeric ``margin`` field per row is passed to the Bradley–Terry loss (Llama 2 style margins). For KTO
    (``model.loss_type: kto``) rows may also be unpaired, ``{"messages" | "prompt": ..., "completion": str,
    "label": bool}``, and every unit is one example (see `rl_lightning.data.unpaired`).

    Args:
        path: training data (same sources as SFT); rows as above.
        tokenizer_name: tokenizer to use (linked from ``model.lm.name`` by the CLI).
        val_path: optional validation pairs (whole steps only; a remainder is not evaluated).
        split: split to read from Hugging Face datasets and ``DatasetDict`` folders.
        max_length: tokens kept per side (prompt + completion); longer sides are truncated on the right and counted;
            a pair where a side keeps no completion token is dropped and counted.
        apply_chat_template: render with the chat template (False: plain concatenation, EOS after the completion).
        batch_size: pairs (KTO: examples) per optimizer step per data-parallel rank.
        packing: pack pairs into micro-batches under `max_length_per_device` tokens (balanced); False pads
            `micro_batch_size` pairs per micro-batch.
        max_length_per_device: token budget of one packed micro-batch; a whole pair must fit.
        micro_batch_size: pairs per padded micro-batch (``packing: false``); must divide `batch_size`.
        shuffle: reshuffle the training pairs every epoch (seeded by ``seed_everything``).
        drop_overlong: skip (count and log) pairs longer than `max_length_per_device` instead of failing at start-up.
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
        micro_batch_size: int = 4,
        shuffle: bool = True,
        drop_overlong: bool = False,
    ) -> None:
        super().__init__(path, tokenizer_name, val_path, split, max_length, batch_size, packing,
                         max_length_per_device, micro_batch_size, shuffle)
        self.save_hyperparameters(logger=False)

    def _side(self, messages: list[dict], completion: str, where: str) -> TokenizedExample:
        hp = saved_hparams(self)
        conversation = messages + [{"role": "assistant", "content": completion}]
        # Only the completion is compared: earlier assistant turns of a multi-turn prompt are context.
        return tokenize_messages(self.tokenizer, conversation, hp.max_length, hp.apply_chat_template, where,
                                 last_turn_only=True)

    def _unpaired(self) -> bool:
        """Whether the task trains on unpaired examples (its ``unpaired_examples``, e.g. DPO with loss_type kto)."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        return bool(getattr(module, "unpaired_examples", False))

    def _pairs(self, rows: Rows) -> tuple[list[Pair], list[str]]:
        pairs = []
        for i, row in enumerate(rows.rows):
            where = rows.locate(i)
            chosen = self._side(row["messages"], row["chosen"], where)
            rejected = self._side(row["messages"], row["rejected"], where)
            pairs.append(Pair(chosen, rejected, {"margin": float(row.get("margin", 0.0))}))
        return pairs, [rows.locate(i) for i in range(len(rows))]

    @override
    def build_units(self, rows: Rows, name: str) -> tuple[list[Pair | Unpaired], list[str]]:
        hp = saved_hparams(self)
        unpaired = self._unpaired()
        check_preference_rows(rows, unpaired_ok=unpaired)
        candidates, wheres = (unpaired_units(self.tokenizer, rows, hp.max_length, hp.apply_chat_template) if unpaired
                              else self._pairs(rows))
        units, locations, truncated, overlong = [], [], 0, 0
        what = "example and its mismatched sequence" if unpaired else "chosen+rejected pair"
        for unit, where in zip(candidates, wheres, strict=True):
            # An unpaired example's mismatched sequence is only read for the KL estimate: the example decides.
            sides = unit.sequences[:1] if unpaired else unit.sequences
            truncated += any(s.truncated for s in sides)
            if not all(s.has_targets for s in sides):
                continue  # truncation left no completion token
            length = sum(len(s.input_ids) for s in unit.sequences)
            if hp.packing and length > hp.max_length_per_device:
                if not hp.drop_overlong:
                    raise ConfigError(
                        f"{where}: the {what} has {length} tokens, more than "
                        f"data.max_length_per_device={hp.max_length_per_device}; raise data.max_length_per_device, "
                        "lower data.max_length, or set data.drop_overlong: true to skip such pairs"
                    )
                overlong += 1
                continue
            units.append(unit)
            locations.append(where)
        kind = "examples" if unpaired else "pairs"
        if overlong:
            log.warning("%s: skipped %d %s longer than data.max_length_per_device=%d (data.drop_overlong)",
                        rows.source, overlong, kind, hp.max_length_per_device)
        if not units:
            raise DataError(f"{rows.source}: no usable {kind[:-1]} left after truncation/skipping; raise data.max_length")
        self.count(name, len(candidates), truncated, len(candidates) - len(units), rows.source, kind)
        self.stats[f"data/{name}_overlong"] = overlong
        return units, locations
