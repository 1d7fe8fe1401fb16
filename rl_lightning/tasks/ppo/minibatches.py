"""One rollout's trajectories packed into PPO's minibatches, and per-token values moved between layouts.

Minibatch k takes this rank's trajectories k, k + U, k + 2U, ... (U = ``update_per_rollout``); each is packed into
balanced micro-batches of at most the token budget (``model.max_length_per_device``), each a context-parallel shard
under ``strategy.context_parallel_size`` > 1. Every packed token carries its trajectory's index and its position
among the trajectory's completion tokens (``target_trajectory``, ``target_slot``): `gather` maps packed (1, N)
tensors to a (B, T) grid of trajectories and completion tokens, `scatter` maps back.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_lightning.data.packing import karmarkar_karp
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.reductions import Groups, data_parallel_max, local_micro_batch
from rl_lightning.rollout.trajectory import Trajectory

MicroBatch = dict[str, Any]
Minibatch = tuple[list[int], list[MicroBatch]]  # (trajectory indices, packed micro-batches)


def minibatches(trajectories: list[Trajectory], steps: int, budget: int, pad_token_id: int, groups: Groups,
                device: torch.device) -> list[Minibatch]:
    """Strided minibatches of this rank's trajectories, each packed into micro-batches.

    Since `steps` divides every rank's share, the global minibatch k is the same set of trajectories whatever the
    data-parallel size. Each is packed into the same number of micro-batches on every rank (dynamic sampling can
    leave a rank with none: it still runs filler micro-batches so every rank takes the same optimizer steps).

    Args:
        trajectories: this rank's trajectories of the rollout.
        steps: minibatches (optimizer steps) per rollout.
        budget: tokens per micro-batch.
        pad_token_id: the filler micro-batch's token.
        groups: the parallel layout (the micro-batch count is agreed over data-parallel ranks).
        device: where the packed tensors go.

    Returns:
        [(trajectory indices, micro-batches)] per minibatch.
    """
    parts = [list(range(k, len(trajectories), steps)) for k in range(steps)]
    return [(part, micro_batches(trajectories, part, budget, pad_token_id, groups, device)) for part in parts]


def micro_batches(trajectories: list[Trajectory], part: list[int], budget: int, pad_token_id: int, groups: Groups,
                  device: torch.device) -> list[MicroBatch]:
    """The trajectories `part` packed into the fewest micro-batches of at most `budget` tokens (the most over ranks).

    Args:
        trajectories: this rank's trajectories.
        part: the indices of the minibatch's trajectories.
        budget: tokens per micro-batch.
        pad_token_id: the filler micro-batch's token.
        groups: the parallel layout.
        device: where the packed tensors go.

    Returns:
        The packed micro-batches (this rank's context-parallel shard of each).
    """
    units = []
    for i in part:
        t = trajectories[i]
        slots = (torch.tensor(t.completion_mask).cumsum(0) - 1).clamp(min=0).tolist()
        units.append(t.example(trajectory=[float(i)] * len(t.input_ids), slot=[float(s) for s in slots]))
    if not units:
        units = [TokenizedExample([pad_token_id], [0], values={
            k: [0.0] for k in ("engine_logprobs", "trajectory", "slot")})]
    lengths = [len(u.input_ids) for u in units]
    if max(lengths) > budget:
        raise ConfigError(f"a trajectory of {max(lengths)} tokens (prompt + completion) does not fit "
                          f"model.max_length_per_device={budget}; raise it to at least {max(lengths)}")
    count = -(-sum(lengths) // budget)
    while True:  # the smallest count that fits locally, then the largest over ranks
        plan = karmarkar_karp(lengths, max(1, count))
        if all(sum(lengths[i] for i in p) <= budget for p in plan):
            break
        count += 1
    count = int(data_parallel_max(groups, torch.tensor(float(max(1, count)), device=groups.device)))
    return [local_micro_batch(groups, {k: v.to(device) if torch.is_tensor(v) else v for k, v in
                                       pack([units[i] for i in p], pad_token_id).items()})
            for p in karmarkar_karp(lengths, count)]


def repack(trajectories: list[Trajectory], part: list[int], packed: list[MicroBatch], budget: int,
           pad_token_id: int, groups: Groups, device: torch.device) -> list[MicroBatch]:
    """`part` packed again under a smaller `budget`, with the per-token values recorded in `packed` carried over.

    The values scoring and the advantages wrote (``old_logprobs``, ``ref_logprobs``, ``teacher_logprobs``,
    ``old_values``, ``advantages``, ``returns``) go through each token's trajectory and slot (0 off the targets, as computed). The
    first minibatch's ``old_logprobs``, if only partly recorded, come again from its forward.

    Args:
        trajectories: this rank's trajectories.
        part: the indices of the minibatch's trajectories.
        packed: its micro-batches at the former budget.
        budget: the new token budget.
        pad_token_id: the filler micro-batch's token.
        groups: the parallel layout.
        device: where the packed tensors go.

    Returns:
        The new micro-batches.
    """
    fresh = micro_batches(trajectories, part, budget, pad_token_id, groups, device)
    width = max((t.loss_tokens for t in trajectories), default=1)
    grid = torch.ones(len(trajectories), max(1, width), device=device)  # (B, T); only its shape is used
    for key in ("old_logprobs", "ref_logprobs", "teacher_logprobs", "old_values", "advantages", "returns"):
        if all(key in mb for mb in packed):
            per_trajectory = gather(groups, packed, [mb[key] for mb in packed], grid)  # (B, T)
            for mb in fresh:
                mb[key] = scatter(mb, per_trajectory)
    return fresh


def completion_grid(trajectories: list[Trajectory], device: torch.device) -> torch.Tensor:
    """(B, T) 1 on each trajectory's completion tokens, T the longest completion (at least 1).

    Args:
        trajectories: this rank's trajectories.
        device: where the mask goes.

    Returns:
        (B, T) float mask.
    """
    lengths = torch.tensor([t.loss_tokens for t in trajectories], dtype=torch.long)
    width = max(1, int(lengths.max())) if len(trajectories) else 1
    return (torch.arange(width)[None] < lengths[:, None]).float().to(device)  # (B, T)


def gather(groups: Groups, packed_micro_batches: list[MicroBatch], packed: list[torch.Tensor], grid: torch.Tensor
           ) -> torch.Tensor:
    """Packed per-token values (one (1, N) tensor per micro-batch) -> (B, T) per trajectory and completion token.

    Context-parallel peers each fill their shard's tokens, and a sum over the group completes the picture.

    Args:
        groups: the parallel layout (its context-parallel group).
        packed_micro_batches: the micro-batches `packed` belongs to.
        packed: (1, N) values per micro-batch.
        grid: (B, T) the output's shape, device and dtype (see `completion_grid`).

    Returns:
        (B, T) values, 0 where no token is.
    """
    out = torch.zeros_like(grid)
    for mb, values in zip(packed_micro_batches, packed, strict=True):
        at = mb["target_mask"][0] > 0
        out[mb["target_trajectory"][0, at].long(), mb["target_slot"][0, at].long()] = values[0, at].float()
    if groups.cp_size > 1:
        torch.distributed.all_reduce(out, group=groups.cp_group)
    return out


def scatter(mb: MicroBatch, per_trajectory: torch.Tensor) -> torch.Tensor:
    """(B, T) per trajectory and completion token -> this micro-batch's (1, N) packed tokens (0 off targets).

    Args:
        mb: the packed micro-batch.
        per_trajectory: (B, T) values.

    Returns:
        (1, N) float32 values.
    """
    at = mb["target_mask"] > 0
    out = torch.zeros(at.shape, dtype=torch.float32, device=per_trajectory.device)
    out[at] = per_trajectory[mb["target_trajectory"][at].long(), mb["target_slot"][at].long()]
    return out
