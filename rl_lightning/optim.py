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
    """Clip gradients to a total L2 norm of `max_norm` (no clipping when <= 0) and return the norm before clipping."""
    grads = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # DTensor norm under FSDP2
        norm = norm.full_tensor()
    return norm
