"""One trajectory per context x tensor parallel group: the group's leader samples, its peers receive the same rollout.

Context- and tensor-parallel peers train on the same sequences (ring attention and the tensor-parallel all-reduces
pair their micro-batches token for token), so they must hold identical trajectories. Sampling them on every peer's own
engine rests on two devices producing bit-identical samples (false with in-flight weight updates, whose push lands on
a timing-dependent segment boundary, and fragile in any mode), and it is redundant work (2x at cp=2, 4x at cp=2 tp=2).
Instead the group's first rank generates and scores; `share_from_leader` sends the result to the others. A cheap
digest of every trajectory's token ids (prompt and completion), masks and rewards (`trajectory_digest`) is compared across the group once per
rollout (`check_identical`), so a run whose peers disagree anyway stops in one line instead of hanging in a collective
or training on mismatched micro-batches.

Plain functions of a process group (the strategy's peer mesh group); no Trainer. On one rank (no group or a group of
one) they return what they were given.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import torch

from rl_lightning.errors import TrainingError


def _size(group: Any) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def is_leader(group: Any) -> bool:
    """Whether this rank samples for its peer group (the group's first rank; always true without a group)."""
    return _size(group) == 1 or torch.distributed.get_rank(group) == 0


def share_from_leader(value: Any, group: Any) -> Any:
    """The leader's `value` on every rank of `group` (peers pass None); `value` itself on a group of one.

    Objects travel pickled between this run's own ranks (``broadcast_object_list``), never from outside the run.
    """
    if _size(group) == 1:
        return value
    box = [value if is_leader(group) else None]
    torch.distributed.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def trajectory_digest(trajectories: Sequence[Any]) -> str:
    """A 16-byte hex digest of the trajectories' token ids, completion masks, rewards and order."""
    h = hashlib.blake2b(digest_size=16)
    for t in trajectories:
        h.update(struct.pack("<qd", len(t.input_ids), float(t.reward)))
        h.update(struct.pack(f"<{len(t.input_ids)}q", *t.input_ids))
        h.update(bytes(int(m) & 0xFF for m in t.completion_mask))
    return h.hexdigest()


def check_identical(digest: str, group: Any, rollout: int) -> None:
    """Raise a one-line `TrainingError` unless every rank of `group` holds the trajectories hashed to `digest`."""
    size = _size(group)
    if size == 1:
        return
    digests: list[Any] = [None] * size
    torch.distributed.all_gather_object(digests, digest, group=group)
    if len(set(digests)) > 1:
        ranks = [torch.distributed.get_global_rank(group, i) for i in range(size)]
        differ = [r for r, d in zip(ranks, digests, strict=True) if d != digests[0]]
        raise TrainingError(f"rollout {rollout}: context/tensor-parallel peers hold different trajectories (global "
                            f"ranks {differ} differ from rank {ranks[0]}); they would train on mismatched "
                            "micro-batches. This is a bug: report it with the run's config")
