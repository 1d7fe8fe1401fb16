"""Where this rank sits in the parallel layout (`Groups`), and the reductions every task's step needs.

`process_groups` reads the strategy's device mesh once, where the Trainer is known (a task's or a callback's
``setup``); everything below takes the frozen `Groups` it returns, never the Trainer.

Normalisation contract: counts (tokens, pairs, trajectories) come from *whole* micro-batches, which every
context/tensor-parallel peer holds, and are summed over data-parallel ranks only (`data_parallel_sum`). Anything
measured on this rank's *tokens* (a loss sum, a KL sum, the number of target tokens in a context-parallel shard) is
summed over data x context parallel ranks (`shard_sum`): context-parallel peers each hold a zigzag share of every
sequence. Losses are computed on this rank's tokens, divided by the global count and multiplied by
`Groups.grad_average_size` (the ranks FSDP/DDP average gradients over: data x context parallel), so the averaged
gradient is the gradient of the global-batch loss.

Outside `rl_lightning.parallel.ParallelStrategy` (single process, DDP) every rank is a data-parallel rank and there
is no context parallelism.

Device rule (DESIGN.md section 4): every tensor that meets a collective lives on `Groups.device` (the strategy's
``root_device``; NCCL rejects host tensors with "No backend type associated with device type cpu", gloo accepts them,
so CPU CI alone cannot see a slip). The reductions take a tensor or a plain number, put it on that device before any
collective, and return the result there, in a single process too; callers build their counts there in the first
place (``torch.tensor(..., device=groups.device)``) and read plain numbers back with ``int()``/``float()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Groups:
    """This rank's place in the parallel layout: device, data- and context-parallel coordinates and groups, TP size.

    The defaults are one process on the CPU. A group is only used when its size is above 1.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None
    tp_size: int = 1

    @property
    def world_size(self) -> int:
        """How many processes run the job: data x context x tensor parallel."""
        return self.dp_size * self.cp_size * self.tp_size

    @property
    def grad_average_size(self) -> int:
        """How many ranks gradients are averaged over: data x context parallel (FSDP's shard and replica groups)."""
        return self.dp_size * self.cp_size


def process_groups(trainer: Any) -> Groups:
    """`Groups` of this rank under `trainer`'s strategy (built once where the Trainer is known, then passed down).

    `rl_lightning.parallel.ParallelStrategy`: from its ``dp_mesh``/``cp_mesh``; DDP: every rank is a data-parallel
    rank of the default group; no trainer or one process: `Groups()` on the strategy's root device.
    """
    strategy: Any = getattr(trainer, "strategy", None)
    device = getattr(strategy, "root_device", None)
    device = torch.device("cpu") if device is None else device
    dp_mesh = getattr(strategy, "dp_mesh", None)
    if dp_mesh is not None:
        cp_mesh = strategy.cp_mesh
        return Groups(device, dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group(),
                      cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group(), strategy.tp_mesh.size())
    world_size = getattr(trainer, "world_size", 1)
    if world_size > 1:
        return Groups(device, trainer.global_rank, world_size, torch.distributed.group.WORLD)
    return Groups(device)


def local_micro_batch(groups: Groups, micro_batch: dict[str, Any]) -> dict[str, Any]:
    """This rank's share of a micro-batch: its zigzag slice under context parallelism, else the whole of it."""
    if groups.cp_size == 1:
        return micro_batch
    from rl_lightning.attention.zigzag import shard_micro_batch

    if "cu_seqlens" not in micro_batch:
        raise ValueError("context parallelism needs packed micro-batches; set data.packing: true")
    return shard_micro_batch(micro_batch, groups.cp_rank, groups.cp_size, groups.cp_group)


def _all_reduce(value: torch.Tensor | float, groups: Groups, over: tuple[str, ...], op: str) -> torch.Tensor:
    """All-reduce a detached float32 copy of `value` over the groups named in `over` ("dp", "cp"), on the device."""
    if torch.is_tensor(value):  # a copy: the collective works in place
        value = value.detach().to(device=groups.device, dtype=torch.float32, copy=True)
    else:
        value = torch.tensor(float(value), device=groups.device)
    reduce_op = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
    for name in over:
        if getattr(groups, f"{name}_size") > 1:
            torch.distributed.all_reduce(value, op=reduce_op, group=getattr(groups, f"{name}_group"))
    return value


def data_parallel_sum(groups: Groups, value: torch.Tensor | float) -> torch.Tensor:
    """Sum a detached count of whole micro-batches over data-parallel ranks (float32, on ``groups.device``).

    Context/tensor-parallel peers hold the same micro-batches.
    """
    return _all_reduce(value, groups, ("dp",), "sum")


def data_parallel_max(groups: Groups, value: torch.Tensor | float) -> torch.Tensor:
    """Max of a detached value over data-parallel ranks (float32, on ``groups.device``), e.g. a micro-batch count."""
    return _all_reduce(value, groups, ("dp",), "max")


def min_max_over_world(low: float, high: float, device: torch.device) -> tuple[float, float]:
    """(the least `low`, the largest `high`) over every process of the default group; as given in one process.

    For what every rank must agree on before it decides alone, e.g. the memory plan's device memory (the least free)
    and baseline (the largest), so that every rank refuses a run, or picks a token budget, as the others do.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return low, high
    if torch.distributed.get_world_size() == 1:
        return low, high
    values = torch.tensor([-float(low), float(high)], dtype=torch.float64, device=device)  # exact below 2**53
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return -float(values[0]), float(values[1])


def shard_sum(groups: Groups, value: torch.Tensor | float) -> torch.Tensor:
    """Sum a detached quantity measured on this rank's tokens over data x context parallel ranks (on the device).

    Tensor-parallel peers hold the same tokens.
    """
    return _all_reduce(value, groups, ("dp", "cp"), "sum")


class _SumAcrossContext(torch.autograd.Function):
    """All-reduce (sum) over the context-parallel group whose backward passes each rank's gradient through unchanged.

    Every context rank then computes the same loss from the summed values, and FSDP's sum over the data x context
    group adds up each rank's own contribution exactly once.
    """

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: Any) -> torch.Tensor:
        value = value.clone()
        torch.distributed.all_reduce(value, group=group)
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sequence_sums(values: torch.Tensor, mask: torch.Tensor, micro_batch: dict[str, Any]) -> torch.Tensor:
    """(S,) per-sequence sums of ``values * mask`` ((B, T) tensors of this rank's tokens).

    Completed over the context-parallel group when the micro-batch is a context-parallel shard (differentiable).
    """
    seq_index = micro_batch["seq_index"]
    keep = (mask > 0) & (seq_index >= 0)
    sums = torch.zeros(int(micro_batch["num_sequences"]), dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, seq_index[keep], values[keep])
    layout = micro_batch.get("cp_layout")
    return _SumAcrossContext.apply(sums, layout.group) if layout is not None else sums


def shard_sum_dict(groups: Groups, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`shard_sum` of every entry of a dict of per-rank sums, in one collective."""
    names = sorted(sums)
    totals = shard_sum(groups, torch.stack([sums[n].float() for n in names]))
    return dict(zip(names, totals, strict=True))
