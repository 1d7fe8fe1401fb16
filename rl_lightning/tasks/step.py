"""Plumbing every task's step shares: model forward on a micro-batch, per-sequence sums, global counts, the
optimizer step. No loss maths here (that is `rl_lightning.algorithms`)."""

from __future__ import annotations

from typing import Any

import torch

from rl_lightning.algorithms import token_logprobs
from rl_lightning.data.steps import data_parallel_coords
from rl_lightning.optim import adamw, clip_grad_norm, scheduler


def model_inputs(micro_batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments for a transformers forward. Packed micro-batches pass no attention mask: with
    ``use_cache=False`` transformers builds a block-diagonal causal mask from the position-id resets."""
    inputs = {"input_ids": micro_batch["input_ids"], "position_ids": micro_batch["position_ids"], "use_cache": False}
    if "attention_mask" in micro_batch:
        inputs["attention_mask"] = micro_batch["attention_mask"]
    return inputs


def target_logprobs(model: Any, micro_batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """(B, T-1) log-probability of token t+1 given tokens up to t; align masks with ``[:, 1:]``."""
    logits = model(**model_inputs(micro_batch)).logits  # (B, T, V)
    return token_logprobs(logits[:, :-1], micro_batch["input_ids"][:, 1:], temperature)


def sequence_sums(values: torch.Tensor, mask: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(S,) per-sequence sums of ``values * mask`` for values aligned with targets ((B, T-1), as `target_logprobs`)."""
    seq_index = micro_batch["seq_index"][:, 1:]  # (B, T-1)
    keep = (mask > 0) & (seq_index >= 0)
    sums = torch.zeros(len(micro_batch["last_index"]), dtype=values.dtype, device=values.device)
    return sums.index_add(0, seq_index[keep], values[keep])


def data_parallel_sum(trainer: Any, value: torch.Tensor) -> torch.Tensor:
    """Sum a detached count over data-parallel ranks (tensor/context-parallel peers hold the same data)."""
    value = value.detach().float().clone()
    mesh = getattr(trainer.strategy, "device_mesh", None)
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        torch.distributed.all_reduce(value, group=mesh["data_parallel"].get_group())
        return value
    return trainer.strategy.reduce(value, reduce_op="sum")


def grad_average_size(trainer: Any) -> int:
    """How many ranks the strategy averages gradients over (DDP/FSDP mean-reduce over data-parallel ranks); losses
    normalised by a global count are multiplied by it so the averaged gradient is the global-batch gradient."""
    return data_parallel_coords(trainer)[1]


def optimizer_step(module: Any, max_grad_norm: float) -> torch.Tensor:
    """Clip, step and zero the module's single optimizer, advance its scheduler; returns the pre-clip grad norm."""
    optimizer, lr_scheduler = module.optimizers(), module.lr_schedulers()
    grad_norm = clip_grad_norm(module.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()
    return grad_norm


def configure_adamw(module: Any, model: torch.nn.Module) -> Any:
    """AdamW + warmup/decay schedule from the task's hparams (lr, weight_decay, betas, eps, warmup_steps,
    lr_schedule, min_lr_ratio), stepped once per optimizer step."""
    hp = module.hparams
    optimizer = adamw(model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.eps)
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
