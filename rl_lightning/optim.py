"""Optimizer, learning-rate schedule and gradient clipping shared by every task."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from rl_lightning.errors import ConfigError

SCHEDULES = ("cosine", "linear", "constant")


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based).

    Linear warmup from ``1/warmup_steps`` to 1 over `warmup_steps`, then decay to `min_lr_ratio` at `total_steps`:
    cosine ``m + (1 - m) * (1 + cos(pi * p)) / 2`` or linear ``1 - (1 - m) * p`` with ``p`` the decay progress.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - min_lr_ratio) * progress


def check_optim_args(lr: float, warmup_steps: int, schedule: str, min_lr_ratio: float, prefix: str = "model") -> None:
    errors = []
    if lr <= 0:
        errors.append(f"{prefix}.lr must be > 0, got {lr}")
    if warmup_steps < 0:
        errors.append(f"{prefix}.warmup_steps must be >= 0, got {warmup_steps}")
    if schedule not in SCHEDULES:
        errors.append(f"{prefix}.lr_schedule must be one of {', '.join(SCHEDULES)}, got '{schedule}'")
    if not 0.0 <= min_lr_ratio <= 1.0:
        errors.append(f"{prefix}.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if errors:
        raise ConfigError("; ".join(errors))


def adamw(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW with no weight decay on biases and norm weights (1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, schedule, min_lr_ratio)
    )


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm of `max_norm` (no clipping when <= 0); returns the norm before clipping.

    Works when gradients live on different device meshes or placements (TP-sharded linears next to FSDP-only norms),
    which ``torch.nn.utils.clip_grad_norm_`` rejects (pytorch#180346): one norm per (mesh, placements) group, made
    full and combined, then one Python-float coefficient for every group — the same arithmetic as torch's
    ``max_norm / (norm + 1e-6)`` clamped to 1, so sharded and single-process runs clip identically.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = (id(p.grad.device_mesh), tuple(p.grad.placements)) if hasattr(p.grad, "device_mesh") else None
            groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not norms:
        return torch.zeros(())
    total = torch.stack([n.float() for n in norms]).norm()
    coef = max_norm / (float(total) + 1e-6) if max_norm > 0 else 1.0
    if coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total
