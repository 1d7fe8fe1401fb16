"""Where this rank sits in the parallel layout, and the reductions every task's step needs.

Normalisation contract: counts (tokens, pairs, trajectories) come from *whole* micro-batches, which every
context/tensor-parallel peer holds, and are summed over data-parallel ranks only (`data_parallel_sum`). Anything
measured on this rank's *tokens* (a loss sum, a KL sum, the number of target tokens in a context-parallel shard) is
summed over data x context parallel ranks (`shard_sum`): context-parallel peers each hold a zigzag share of every
sequence. Losses are computed on this rank's tokens, divided by the global count and multiplied by
`grad_average_size` (the ranks FSDP/DDP average gradients over: data x context parallel), so the averaged gradient is
the gradient of the global-batch loss.

Outside `rl_lightning.parallel.ParallelStrategy` (single process, DDP, Lightning's ModelParallelStrategy) every rank is
a data-parallel rank and there is no context parallelism.

Device rule (DESIGN.md section 4): every tensor that meets a collective lives on `root_device` (the strategy's
``root_device``; NCCL rejects host tensors with "No backend type associated with device type cpu", gloo accepts them,
so CPU CI alone cannot see a slip). The reductions take a tensor or a plain number, put it on `root_device` before any
collective, and return the result there, in a single process too; callers build their counts there in the first place
(``torch.tensor(..., device=root_device(trainer))``) and read plain numbers back with ``int()``/``float()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.compat.lightning import device_mesh


@dataclass
class Layout:
    """This rank's context-parallel coordinates (size 1 and no group without `ParallelStrategy`)."""

    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None


def parallel_layout(trainer: Any) -> Layout:
    """This rank's context-parallel coordinates under `trainer`'s strategy (from its ``cp_mesh``, if any)."""
    cp_mesh = getattr(trainer.strategy, "cp_mesh", None)
    if cp_mesh is None:
        return Layout()
    return Layout(cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group())


def data_parallel_coords(trainer: Any) -> tuple[int, int]:
    """(rank, size) of this process along the data-parallel dimension.

    Ranks that differ only in tensor/context parallel coordinates see the same data (and must draw the same sampling
    seeds).
    """
    if trainer is None:
        return 0, 1
    dp_mesh = getattr(trainer.strategy, "dp_mesh", None)  # rl_lightning.parallel.ParallelStrategy
    if dp_mesh is not None:
        return dp_mesh.get_local_rank(), dp_mesh.size()
    mesh = device_mesh(trainer.strategy)  # Lightning's ModelParallelStrategy
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        sub = mesh["data_parallel"]
        return sub.get_local_rank(), sub.size()
    return trainer.global_rank, trainer.world_size


def local_micro_batch(layout: Layout, micro_batch: dict[str, Any]) -> dict[str, Any]:
    """This rank's share of a micro-batch: its zigzag slice under context parallelism, else the whole of it."""
    if layout.cp_size == 1:
        return micro_batch
    from rl_lightning.attention.zigzag import shard_micro_batch

    if "cu_seqlens" not in micro_batch:
        raise ValueError("context parallelism needs packed micro-batches; set data.packing: true")
    return shard_micro_batch(micro_batch, layout.cp_rank, layout.cp_size, layout.cp_group)


def root_device(trainer: Any) -> torch.device:
    """Where tensors that meet a collective or a model input live: the strategy's root device.

    Under ``strategy.cpu_offload`` too: FSDP2 keeps the parameters on the CPU but computes (and moves forward inputs)
    on the root device. The CPU without a trainer (or with a stand-in strategy that names no device).
    """
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    return torch.device("cpu") if device is None else device


def _all_reduce(trainer: Any, value: torch.Tensor | float, meshes: tuple[str, ...], op: str) -> torch.Tensor:
    """All-reduce a detached float copy of `value` over `meshes` (or the whole world), on `root_device`."""
    device = root_device(trainer)
    if torch.is_tensor(value):  # a copy: the collective works in place
        value = value.detach().to(device=device, dtype=torch.float32, copy=True)
    else:
        value = torch.tensor(float(value), device=device)
    strategy = trainer.strategy
    if getattr(strategy, "dp_mesh", None) is None:  # no context parallelism: every rank is a data-parallel rank
        return strategy.reduce(value, reduce_op=op) if trainer.world_size > 1 else value
    reduce_op = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
    for name in meshes:
        mesh = getattr(strategy, name)
        if mesh.size() > 1:
            torch.distributed.all_reduce(value, op=reduce_op, group=mesh.get_group())
    return value


def data_parallel_sum(trainer: Any, value: torch.Tensor | float) -> torch.Tensor:
    """Sum a detached count of whole micro-batches over data-parallel ranks (float32, on `root_device`).

    Context/tensor-parallel peers hold the same micro-batches.
    """
    return _all_reduce(trainer, value, ("dp_mesh",), "sum")


def data_parallel_max(trainer: Any, value: torch.Tensor | float) -> torch.Tensor:
    """Max of a detached value over data-parallel ranks (float32, on `root_device`), e.g. a micro-batch count."""
    return _all_reduce(trainer, value, ("dp_mesh",), "max")


def shard_sum(trainer: Any, value: torch.Tensor | float) -> torch.Tensor:
    """Sum a detached quantity measured on this rank's tokens over data x context parallel ranks (on `root_device`).

    Tensor-parallel peers hold the same tokens.
    """
    return _all_reduce(trainer, value, ("dp_mesh", "cp_mesh"), "sum")


def grad_average_size(trainer: Any) -> int:
    """How many ranks gradients are averaged over.

    Data x context parallel under `ParallelStrategy` (FSDP's shard and replica groups), the data-parallel size
    otherwise.
    """
    strategy = trainer.strategy
    if getattr(strategy, "cp_mesh", None) is not None:
        return strategy.dp_mesh.size() * strategy.cp_mesh.size()
    return data_parallel_coords(trainer)[1]


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


def shard_sum_dict(trainer: Any, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`shard_sum` of every entry of a dict of per-rank sums, in one collective."""
    names = sorted(sums)
    totals = shard_sum(trainer, torch.stack([sums[n].float() for n in names]))
    return dict(zip(names, totals, strict=True))
