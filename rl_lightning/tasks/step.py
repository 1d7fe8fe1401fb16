"""Plumbing every task's step shares: the parallel layout, model forward on a (context-parallel shard of a)
micro-batch, per-sequence sums, global counts, the optimizer step. No loss maths here (that is
`rl_lightning.algorithms`).

Normalisation contract: counts (tokens, pairs) come from the *whole* micro-batches, which every context/tensor-parallel
peer holds, and are summed over data-parallel ranks only (`data_parallel_sum`). Losses are computed on this rank's
tokens, divided by the global count and multiplied by `grad_average_size` (the ranks FSDP/DDP average gradients
over: data x context parallel), so the averaged gradient is the gradient of the global-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.algorithms import token_logprobs
from rl_lightning.data.steps import data_parallel_coords
from rl_lightning.optim import adamw, clip_grad_norm, scheduler


@dataclass
class Layout:
    """This rank's context-parallel coordinates (size 1 and no group without `ParallelStrategy`)."""

    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None


def parallel_layout(trainer: Any) -> Layout:
    strategy = trainer.strategy
    cp_mesh = getattr(strategy, "cp_mesh", None)
    if cp_mesh is None:
        return Layout()
    return Layout(cp_mesh.get_local_rank(), cp_mesh.size(), cp_mesh.get_group())


def local_micro_batch(layout: Layout, micro_batch: dict[str, Any]) -> dict[str, Any]:
    """This rank's share of a micro-batch: its zigzag slice under context parallelism, else the whole of it."""
    if layout.cp_size == 1:
        return micro_batch
    from rl_lightning.parallel.ring_attention import shard_micro_batch

    if "cu_seqlens" not in micro_batch:
        raise ValueError("context parallelism needs packed micro-batches; set data.packing: true")
    return shard_micro_batch(micro_batch, layout.cp_rank, layout.cp_size, layout.cp_group)


def model_inputs(micro_batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for a transformers forward. Packed micro-batches pass no attention mask (``rl_varlen``
    attention isolates the sequences by their position-id resets, or runs ring attention given ``cp_layout``)."""
    inputs = {"input_ids": micro_batch["input_ids"], "position_ids": micro_batch["position_ids"], "use_cache": False}
    if "attention_mask" in micro_batch:
        inputs["attention_mask"] = micro_batch["attention_mask"]
    if "cp_layout" in micro_batch:
        inputs["cp_layout"] = micro_batch["cp_layout"]
    return inputs


def target_logprobs(model: Any, micro_batch: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
    """(B, T) log-probability of ``target_ids`` (each token's next token); meaningful where ``target_mask`` is 1."""
    logits = model(**model_inputs(micro_batch)).logits  # (B, T, V)
    return token_logprobs(logits, micro_batch["target_ids"], temperature)


class _SumAcrossContext(torch.autograd.Function):
    """All-reduce (sum) over the context-parallel group whose backward passes each rank's gradient through
    unchanged: every context rank then computes the same loss from the summed values, and FSDP's sum over the
    data x context group adds up each rank's own contribution exactly once."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: Any) -> torch.Tensor:
        value = value.clone()
        torch.distributed.all_reduce(value, group=group)
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sequence_sums(values: torch.Tensor, mask: torch.Tensor, micro_batch: dict[str, Any]) -> torch.Tensor:
    """(S,) per-sequence sums of ``values * mask`` ((B, T) tensors of this rank's tokens), completed over the
    context-parallel group when the micro-batch is a context-parallel shard."""
    seq_index = micro_batch["seq_index"]
    keep = (mask > 0) & (seq_index >= 0)
    sums = torch.zeros(int(micro_batch["num_sequences"]), dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, seq_index[keep], values[keep])
    layout = micro_batch.get("cp_layout")
    return _SumAcrossContext.apply(sums, layout.group) if layout is not None else sums


def data_parallel_sum(trainer: Any, value: torch.Tensor) -> torch.Tensor:
    """Sum a detached count over data-parallel ranks (context/tensor-parallel peers hold the same micro-batches)."""
    value = value.detach().float().clone()
    dp_mesh = getattr(trainer.strategy, "dp_mesh", None)
    if dp_mesh is not None:
        if dp_mesh.size() > 1:
            torch.distributed.all_reduce(value, group=dp_mesh.get_group())
        return value
    return trainer.strategy.reduce(value, reduce_op="sum")


def shard_sum(trainer: Any, value: torch.Tensor) -> torch.Tensor:
    """Sum a detached per-rank quantity of this rank's tokens over data x context parallel ranks (tensor-parallel
    peers hold the same tokens)."""
    value = value.detach().float().clone()
    strategy = trainer.strategy
    if getattr(strategy, "cp_mesh", None) is None:
        return trainer.strategy.reduce(value, reduce_op="sum")
    for mesh in (strategy.dp_mesh, strategy.cp_mesh):
        if mesh.size() > 1:
            torch.distributed.all_reduce(value, group=mesh.get_group())
    return value


def grad_average_size(trainer: Any) -> int:
    """How many ranks gradients are averaged over: data x context parallel under `ParallelStrategy` (FSDP's shard
    and replica groups), the data-parallel size under DDP."""
    strategy = trainer.strategy
    if getattr(strategy, "cp_mesh", None) is not None:
        return strategy.dp_mesh.size() * strategy.cp_mesh.size()
    return data_parallel_coords(trainer)[1]


def optimizer_step(module: Any, max_grad_norm: float, index: int | None = None,
                   model: torch.nn.Module | None = None) -> torch.Tensor:
    """Clip, step and zero one optimizer of the module and advance its scheduler; returns the pre-clip grad norm.
    `index` picks among several optimizers (None: the only one); `model` limits clipping to its parameters."""
    optimizer, lr_scheduler = module.optimizers(), module.lr_schedulers()
    if index is not None:
        optimizer, lr_scheduler = optimizer[index], lr_scheduler[index]
    grad_norm = clip_grad_norm((model or module).parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()
    return grad_norm


def configure_adamw(module: Any, model: torch.nn.Module, lr: float | None = None) -> Any:
    """AdamW + warmup/decay schedule from the task's hparams (lr, weight_decay, betas, eps, warmup_steps,
    lr_schedule, min_lr_ratio), stepped once per optimizer step; `lr` overrides the peak learning rate."""
    hp = module.hparams
    optimizer = adamw(model, lr or hp.lr, hp.weight_decay, tuple(hp.betas), hp.eps)
    total = int(module.trainer.estimated_stepping_batches)
    schedule = scheduler(optimizer, hp.warmup_steps, total, hp.lr_schedule, hp.min_lr_ratio)
    return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def pair_slices(values: torch.Tensor, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) chosen and (P,) rejected entries of per-sequence values laid out chosen, rejected, chosen, ..."""
    return values[0 : 2 * num_pairs : 2], values[1 : 2 * num_pairs : 2]


def log_global_means(module: Any, sums: dict[str, torch.Tensor], count: torch.Tensor, prefix: str) -> None:
    """Log ``prefix/<name>`` = (sum over data-parallel ranks of sums[name]) / count (count already global)."""
    names = sorted(sums)
    totals = data_parallel_sum(module.trainer, torch.stack([sums[n].float() for n in names]))
    module.log_dict({f"{prefix}/{n}": totals[i] / count.clamp(min=1) for i, n in enumerate(names)})


def log_validation_means(module: Any, records: list[dict[str, torch.Tensor]], count_key: str) -> None:
    """Log ``val/<name>`` global means of per-micro-batch metric sums; `count_key` holds each record's count.
    Clears `records`."""
    if records:
        sums = {k: sum(r[k] for r in records) for k in records[0]}
        count = data_parallel_sum(module.trainer, sums.pop(count_key))
        log_global_means(module, sums, count, "val")
    records.clear()


def pairwise_step(module: Any, micro_batches: list[dict[str, Any]], pair_loss: Any, extras: list[Any]) -> None:
    """One optimizer step of a pairwise-preference task: ``pair_loss(micro_batch, extra, normaliser) -> (loss,
    metric sums)`` per micro-batch (`extras` aligned with them, e.g. reference log-probabilities), backward,
    step, and global-mean logging of the metrics per pair."""
    num_pairs = data_parallel_sum(module.trainer, sum(mb["num_units"] for mb in micro_batches))
    normaliser = num_pairs / grad_average_size(module.trainer)
    sums: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), device=module.device)
    for micro_batch, extra in zip(micro_batches, extras, strict=True):
        loss, metrics = pair_loss(micro_batch, extra, normaliser)
        module.manual_backward(loss)
        loss_sum += loss.detach() * normaliser
        sums = {k: sums.get(k, 0) + v for k, v in metrics.items()}
    grad_norm = optimizer_step(module, module.hparams.max_grad_norm)
    log_global_means(module, {**sums, "loss": loss_sum}, num_pairs, "train")
    module.log_dict({"train/grad_norm": grad_norm, "train/pairs": num_pairs})


def pairwise_validation(records: list[dict[str, torch.Tensor]], micro_batches: list[dict[str, Any]], pair_loss: Any,
                        extras: list[Any]) -> None:
    """Append each micro-batch's metric sums (and pair count) to `records` for `log_validation_means`."""
    for micro_batch, extra in zip(micro_batches, extras, strict=True):
        loss, metrics = pair_loss(micro_batch, extra, 1.0)
        records.append({**metrics, "loss": loss.detach(), "pairs": micro_batch["num_units"].float()})
