"""Step batches: each item the DataLoader yields is one optimizer step's micro-batches for this data-parallel rank.

All ranks walk the same seeded permutation of the dataset, take the same global step (``rows_per_rank`` x dp rows),
plan it with `plan_micro_batches` and keep their own share, so balancing sees the whole global batch and needs no
communication. The dataset is an ``IterableDataset`` so Lightning does not wrap it in a ``DistributedSampler``.

A micro-batch is a dict of tensors, all (B, T) unless noted; packed micro-batches have B = 1 and position ids that
restart at each sequence, padded ones add ``attention_mask``. Targets are stored at the position that predicts them, so
every per-token tensor can be sliced along T (context parallelism) without looking at neighbours:

- ``input_ids``, ``position_ids``;
- ``target_ids``: the next token of the same sequence (0 at a sequence's last token);
- ``target_mask``: 1 where ``target_ids`` is a training target (an assistant/completion token);
- ``last_mask``: 1 at each sequence's last token (where a reward model reads its score);
- ``seq_index``: which sequence of the micro-batch each token belongs to (-1 for padding);
- ``target_<name>``: float per-token values of the target token (from `TokenizedExample.values`, e.g. engine
  log-probabilities or advantages of sampled completions);
- ``cu_seqlens``: (S + 1,) int32 cumulative sequence lengths (packed only);
- ``num_sequences``, ``num_units`` (scalars) and per-unit scalars such as ``margin`` (U,).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

from rl_lightning.data.packing import plan_micro_batches
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import ConfigError, DataError

Unit = Any  # a TokenizedExample, or a tuple of them that must share a micro-batch (chosen, rejected)


def unit_sequences(unit: Unit) -> tuple[TokenizedExample, ...]:
    """The sequences of a packing unit.

    A unit is a `TokenizedExample`, or an object with ``sequences`` (e.g. a preference pair) whose sequences must
    share a micro-batch.
    """
    return (unit,) if isinstance(unit, TokenizedExample) else tuple(unit.sequences)


def unit_length(unit: Unit) -> int:
    """Total tokens of a packing unit (all its sequences)."""
    return sum(len(s.input_ids) for s in unit_sequences(unit))


def _sequence_tensors(sequences: Sequence[TokenizedExample], pad_token_id: int) -> list[dict[str, torch.Tensor]]:
    """Per sequence: ids, next-token targets (the last token has none) and which tokens are targets/last.

    ``last_mask`` marks the last token that is not the pad token, which is where transformers' sequence classifiers
    pool: when a tokenizer pads with EOS and sequences end with EOS, the reward is read before the trailing EOS, in
    training exactly as in the exported model.
    """
    out = []
    for s in sequences:
        ids = torch.tensor(s.input_ids, dtype=torch.long)
        target_mask = torch.zeros_like(ids)
        target_mask[:-1] = torch.tensor(s.loss_mask[1:], dtype=torch.long)  # token t predicts token t+1
        target_ids = torch.zeros_like(ids)
        target_ids[:-1] = ids[1:]
        last_mask = torch.zeros_like(ids)
        not_pad = (ids != pad_token_id).nonzero()
        last_mask[int(not_pad[-1]) if len(not_pad) else len(ids) - 1] = 1
        tensors = {"input_ids": ids, "target_ids": target_ids, "target_mask": target_mask, "last_mask": last_mask}
        for name, per_token in s.values.items():
            shifted = torch.zeros(len(ids), dtype=torch.float32)
            shifted[:-1] = torch.tensor(per_token[1:], dtype=torch.float32)
            tensors[f"target_{name}"] = shifted
        out.append(tensors)
    return out


def _token_fields(tensors: list[dict[str, torch.Tensor]]) -> list[str]:
    names = [set(t) for t in tensors]
    if any(n != names[0] for n in names):
        raise ValueError("every sequence of a micro-batch must carry the same per-token values")
    return sorted(names[0])


def pack(sequences: Sequence[TokenizedExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Concatenate sequences into one (1, N) row with restarting position ids."""
    if not sequences:  # an empty micro-batch still runs forward/backward so collectives stay matched
        sequences = [TokenizedExample([pad_token_id], [0])]
    tensors = _sequence_tensors(sequences, pad_token_id)
    lengths = torch.tensor([len(t["input_ids"]) for t in tensors])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    batch = {key: torch.cat([t[key] for t in tensors]).unsqueeze(0) for key in _token_fields(tensors)}  # (1, N)
    batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths.tolist()]).unsqueeze(0)  # (1, N)
    batch["seq_index"] = torch.repeat_interleave(torch.arange(len(lengths)), lengths).unsqueeze(0)  # (1, N)
    batch["cu_seqlens"] = cu_seqlens  # (S + 1,)
    batch["num_sequences"] = torch.tensor(len(lengths))
    return batch


def pad(sequences: Sequence[TokenizedExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad sequences into (B, T) rows with an attention mask."""
    if not sequences:
        sequences = [TokenizedExample([pad_token_id], [0])]
    tensors = _sequence_tensors(sequences, pad_token_id)
    size = (len(tensors), max(len(t["input_ids"]) for t in tensors))
    fields = _token_fields(tensors)
    batch = {key: torch.zeros(size, dtype=tensors[0][key].dtype) for key in fields}
    batch["attention_mask"] = torch.zeros(size, dtype=torch.long)
    batch["input_ids"].fill_(pad_token_id)
    batch["seq_index"] = torch.full(size, -1, dtype=torch.long)
    for i, t in enumerate(tensors):
        n = len(t["input_ids"])
        for key in fields:
            batch[key][i, :n] = t[key]
        batch["attention_mask"][i, :n] = 1
        batch["seq_index"][i, :n] = i
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    batch["num_sequences"] = torch.tensor(len(tensors))
    return batch


class StepDataset(IterableDataset):
    """Yields ``{"micro_batches": [...]}`` for each optimizer step of an epoch, this rank's share only.

    Args:
        units: packing units (sequences, or tuples of sequences that stay together).
        rows_per_rank: units per optimizer step per data-parallel rank.
        dp_rank, dp_size: this rank's data-parallel coordinates.
        packing: pack under `max_tokens` with balanced partitioning; False pads `micro_batch_size` units per pass.
        max_tokens: token budget of a packed micro-batch.
        micro_batch_size: units per padded micro-batch.
        pad_token_id: filler token for padding and empty micro-batches.
        shuffle: reshuffle every epoch, seeded by `seed` + the epoch number.
        epoch_fn: returns the current epoch (the trainer's), so shuffling survives restarts.
        start_step_fn: returns how many steps of this epoch are already done (the trainer's progress), so a run
            resumed mid-epoch continues with the next step's data instead of replaying the epoch's first steps.
        drop_remainder: skip the last, incomplete step (training: every step has the same global batch size);
            False serves it too (validation: every row is evaluated; ranks left without rows run filler passes).
        seed: the run's seed (``seed_everything``, handed down by the DataModule).
    """

    def __init__(
        self,
        units: Sequence[Unit],
        rows_per_rank: int,
        dp_rank: int,
        dp_size: int,
        packing: bool,
        max_tokens: int,
        micro_batch_size: int,
        pad_token_id: int,
        shuffle: bool,
        epoch_fn: Callable[[], int] = lambda: 0,
        start_step_fn: Callable[[], int] = lambda: 0,
        drop_remainder: bool = True,
        seed: int = 0,
    ) -> None:
        self.units, self.rows_per_rank, self.dp_rank, self.dp_size = units, rows_per_rank, dp_rank, dp_size
        self.packing, self.max_tokens, self.micro_batch_size = packing, max_tokens, micro_batch_size
        self.pad_token_id, self.shuffle, self.epoch_fn, self.start_step_fn = pad_token_id, shuffle, epoch_fn, start_step_fn
        self.drop_remainder, self.seed = drop_remainder, seed

    def __len__(self) -> int:
        rows = self.rows_per_rank * self.dp_size
        return len(self.units) // rows if self.drop_remainder else -(-len(self.units) // rows)

    def step_units(self, step_indices: Sequence[int]) -> list[list[Unit]]:
        """This rank's micro-batches (lists of units) for the global step made of `step_indices`."""
        units = [self.units[i] for i in step_indices]
        if self.packing:
            plan = plan_micro_batches([unit_length(u) for u in units], self.dp_size, self.max_tokens)[self.dp_rank]
            return [[units[i] for i in mb] for mb in plan]
        mine = units[self.dp_rank * self.rows_per_rank : (self.dp_rank + 1) * self.rows_per_rank]
        count = -(-self.rows_per_rank // self.micro_batch_size)  # the same on every rank, even for a short last step
        return [mine[i * self.micro_batch_size : (i + 1) * self.micro_batch_size] for i in range(count)]

    def collate(self, micro_batch: list[Unit]) -> dict[str, torch.Tensor]:
        """One micro-batch as tensors: its units' sequences packed (or padded), per-unit fields, ``num_units``."""
        sequences = [s for unit in micro_batch for s in unit_sequences(unit)]
        batch = (pack if self.packing else pad)(sequences, self.pad_token_id)
        # Per-unit scalars (e.g. a preference pair's margin) ride along as (U,) tensors; U may be 0.
        for key in getattr(self.units[0], "fields", {}) if self.units else {}:
            batch[key] = torch.tensor([float(u.fields[key]) for u in micro_batch], dtype=torch.float32)
        batch["num_units"] = torch.tensor(len(micro_batch))
        return batch

    def __iter__(self):
        order = torch.arange(len(self.units))
        if self.shuffle:
            seed = self.seed + self.epoch_fn()
            order = torch.randperm(len(self.units), generator=torch.Generator().manual_seed(seed))
        rows = self.rows_per_rank * self.dp_size
        for step in range(self.start_step_fn(), len(self)):
            indices = order[step * rows : (step + 1) * rows].tolist()
            yield {"micro_batches": [self.collate(mb) for mb in self.step_units(indices)]}


def check_unit_budget(lengths: Sequence[int], locate: Callable[[int], str], max_tokens: int, what: str) -> None:
    """Fail at start-up (not mid-run) when a unit cannot fit in one micro-batch."""
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ConfigError(
                f"{locate(i)}: {what} has {n} tokens, more than data.max_length_per_device={max_tokens}; "
                f"raise data.max_length_per_device to at least {max(lengths)} or lower data.max_length"
            )


def check_enough_rows(num_units: int, rows_per_rank: int, dp_size: int, source: str) -> None:
    """Raise a `DataError` when `source` has fewer usable rows than one step takes over all data-parallel ranks."""
    if num_units < rows_per_rank * dp_size:
        raise DataError(
            f"{source}: {num_units} usable rows, fewer than one step needs (data.batch_size={rows_per_rank} x "
            f"{dp_size} data-parallel ranks); lower data.batch_size"
        )


def check_batching_args(
    max_length: int, batch_size: int, packing: bool, max_length_per_device: int, micro_batch_size: int
) -> None:
    """Raise one `ConfigError` listing every invalid ``data.*`` batching argument."""
    errors = []
    if max_length < 1:
        errors.append(f"data.max_length must be >= 1, got {max_length}")
    if batch_size < 1:
        errors.append(f"data.batch_size must be >= 1, got {batch_size}")
    if packing and max_length_per_device < 1:
        errors.append(f"data.max_length_per_device must be >= 1, got {max_length_per_device}")
    if not packing and (micro_batch_size < 1 or batch_size % micro_batch_size):
        errors.append(
            f"data.micro_batch_size ({micro_batch_size}) must be >= 1 and divide data.batch_size ({batch_size}) "
            "when data.packing is false"
        )
    if errors:
        raise ConfigError("; ".join(errors))


def layout_stats(units: Sequence[Unit], dp_size: int, rows_per_rank: int, packing: bool, max_tokens: int,
                 micro_batch_size: int) -> tuple[float, float]:
    """How well a layout uses compute, over every full step of `units` (read in order).

    Returns (fraction of carried tokens that are real, worst max/min real-token load across data-parallel ranks).
    """
    real_total = carried_total = 0
    worst = 1.0
    for step in range(len(units) // (rows_per_rank * dp_size)):
        indices = list(range(step * rows_per_rank * dp_size, (step + 1) * rows_per_rank * dp_size))
        loads = []
        for rank in range(dp_size):
            dataset = StepDataset(units, rows_per_rank, rank, dp_size, packing, max_tokens, micro_batch_size, 0, False)
            micro_batches = dataset.step_units(indices)
            loads.append(sum(unit_length(u) for mb in micro_batches for u in mb))
            carried_total += sum(dataset.collate(mb)["input_ids"].numel() for mb in micro_batches)
        real_total += sum(loads)
        worst = max(worst, max(loads) / max(1, min(loads)))
    return real_total / carried_total, worst
