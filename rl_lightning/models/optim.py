"""Optimizer, learning-rate schedule and gradient clipping shared by every task (``model.lm.optim.*``).

Every task steps through `optimizer_step` (optimizer, schedule and parameters in, grad norm and metrics out), which
also skips a step whose gradient norm is not finite (see there).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_lightning.compat.torch import foreach_mul_
from rl_lightning.errors import ConfigError, TrainingError
from rl_lightning.memory.phases import phase

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


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with a warmup + decay learning-rate schedule, and gradient clipping: ``model.lm.optim.*`` of every task.

    Args:
        lr: peak learning rate; null: the task's default (SFT 1e-5, RewardModel 5e-6, DPO 5e-7, PPO 1e-6).
        weight_decay: AdamW weight decay (not applied to biases and norm weights).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup length in optimizer steps.
        lr_schedule: after warmup: ``cosine`` or ``linear`` decay to `min_lr_ratio` x `lr` at the end of the run, or
            ``constant``; null: the task's default (``constant`` for PPO, ``cosine`` for the others).
        min_lr_ratio: final learning rate as a fraction of `lr` (cosine and linear).
        max_grad_norm: clip the global gradient L2 norm to this value; <= 0 disables clipping (the norm is still
            logged).
        max_skipped_steps: an optimizer step whose loss or gradient is NaN or infinite is skipped (parameters,
            optimizer state and schedule untouched; counted in ``train/skipped_steps``); this many skipped in a row
            stop the run with an error.
    """

    lr: float | None = None
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_schedule: str | None = None
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    max_skipped_steps: int = 10

    def __post_init__(self) -> None:
        errors = []
        if isinstance(self.max_skipped_steps, bool) or not isinstance(self.max_skipped_steps, int) or \
                self.max_skipped_steps < 1:
            errors.append(f"model.lm.optim.max_skipped_steps must be an integer >= 1, got {self.max_skipped_steps!r}")
        if self.lr is not None and self.lr <= 0:
            errors.append(f"model.lm.optim.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            errors.append(f"model.lm.optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_schedule is not None and self.lr_schedule not in SCHEDULES:
            errors.append(f"model.lm.optim.lr_schedule must be one of {', '.join(SCHEDULES)}, got '{self.lr_schedule}'")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            errors.append(f"model.lm.optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
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


def materialize_adam_state(optimizer: Any) -> bool:
    """Give an Adam/AdamW optimizer with no state yet the state its first step would make; whether it did.

    The state made: step 0 and zero moments, for every parameter that trains. Until a step with a gradient, the
    optimizer has no state (an all-zero gradient steps nothing: `optimizer_step`). torch's ``get_optimizer_state_dict`` (a sharded checkpoint's save) makes a missing state by stepping at lr 0,
    which counts a step: the next real update would then be smaller (Adam's bias correction), so a run's result
    would depend on when it saved. Made here instead, a state equals the one AdamW makes lazily, bit for bit.
    Other optimizers, and Adam variants this does not mirror (amsgrad, fused, capturable), are left alone.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch optimizer
    if inner.state or type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if any(g.get("amsgrad") or g.get("fused") or g.get("capturable") for g in inner.param_groups):
        return False
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # as torch's Adam
    for group in inner.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                inner.state[p] = {"step": torch.tensor(0.0, dtype=scalar),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    return True


def typed(cls: type, value: Any) -> Any:
    """An argument group as its dataclass.

    The CLI passes instances, ``load_from_checkpoint`` the plain dicts a checkpoint keeps.
    """
    return cls(**value) if isinstance(value, dict) else value


def configure_adamw(model: torch.nn.Module, optim: OptimConfig, total_steps: int, lr: float | None = None
                    ) -> tuple[torch.optim.AdamW, dict[str, Any]]:
    """AdamW over `model`'s trainable parameters and its schedule over `total_steps` optimizer steps.

    The schedule is stepped once per optimizer step, see `optimizer_step`; `lr` overrides the peak learning rate. Logs
    the trainable parameter count (with LoRA: the adapters only, see `rl_lightning.models.lora`).
    """
    from lightning.pytorch.utilities import rank_zero_info

    from rl_lightning.models.lora import parameter_counts

    if optim.lr_schedule is None or (optim.lr is None and lr is None):  # a task resolves them (`LMConfig.for_task`)
        raise ValueError(f"configure_adamw needs a resolved lr and lr_schedule, got {optim.lr}, {optim.lr_schedule}")
    trainable, total = parameter_counts(model)
    rank_zero_info(f"{type(model).__name__}: {trainable:,} trainable parameters of {total:,} "
                   f"({100 * trainable / max(1, total):.3g}%)")
    optimizer = adamw(model, optim.lr if lr is None else lr, optim.weight_decay, tuple(optim.betas), optim.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, optim.warmup_steps, total_steps, optim.lr_schedule, optim.min_lr_ratio)
    )
    return optimizer, {"scheduler": schedule, "interval": "step"}


def run_length(total: float, optim: OptimConfig) -> int:
    """Optimizer steps of a run with one optimizer step per training batch (SFT, RM, DPO).

    `total` is the trainer's ``estimated_stepping_batches``. A decaying schedule spans them; a run bounded by neither
    ``trainer.max_steps`` nor ``trainer.max_epochs`` (an infinite estimate) only allows a constant one.
    """
    if math.isinf(total):
        if optim.lr_schedule == "constant":
            return 0
        raise ConfigError(f"model.lm.optim.lr_schedule={optim.lr_schedule} decays over the run, but the run is unbounded "
                          "(trainer.max_steps=-1 and trainer.max_epochs=-1): set trainer.max_steps or "
                          "trainer.max_epochs, or model.lm.optim.lr_schedule: constant")
    return int(total)


def optimizer_step(optimizer: Any, lr_scheduler: Any, parameters: Iterable[torch.nn.Parameter], optim: OptimConfig,
                   skipped: SkippedSteps, index: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip, step and zero `optimizer` and advance `lr_scheduler`; returns the pre-clip grad norm and the metrics.

    A non-finite norm of `parameters`' gradients (a NaN or infinite loss or gradient on any rank: the norm is global,
    so every rank decides alike) skips the step: the gradients are dropped, and the parameters, optimizer state,
    schedule and ``trainer.global_step`` stay as they were. `skipped` (the task's, checkpointed) counts it under
    `index` (the optimizer's place among the task's, None for the only one); ``optim.max_skipped_steps`` in a row
    raise `TrainingError`.

    A gradient that is zero everywhere (a rollout in which every advantage is zero: no group told its samples apart)
    leaves the parameters and the optimizer state as they were, while the schedule and ``trainer.global_step``
    advance: the gradients are dropped before the step, and AdamW passes over parameters without one. Stepped on a
    zero gradient, AdamW's momentum would go on moving the weights along the last rollouts' direction, on a batch
    with nothing to learn (on a task where correct samples are rare, most rollouts). `skipped` counts these steps
    in its ``empty`` field. The metrics (``train/skipped_steps`` and ``train/empty_steps``, the run's counts) are the
    caller's to log.

    Args:
        optimizer: the optimizer (a task's ``optimizers()`` entry: it steps through the strategy).
        lr_scheduler: its learning-rate schedule.
        parameters: the parameters it updates (their gradients are clipped).
        optim: ``model.lm.optim`` (``max_grad_norm``, ``max_skipped_steps``).
        skipped: the task's skipped-step counts.
        index: the optimizer's index among the task's, or None.

    Returns:
        The pre-clip gradient norm and ``{"train/skipped_steps": count, "train/empty_steps": count}``.
    """
    with phase("train/optimizer_step"):
        grad_norm = clip_grad_norm(parameters, optim.max_grad_norm)
        norm = grad_norm.item()  # global: clipping has synchronised already, so every rank decides alike
        finite = math.isfinite(norm)
        if norm == 0.0:
            optimizer.zero_grad(set_to_none=True)
            skipped.empty += 1
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if finite:
            lr_scheduler.step()
    total = skipped.count(finite, index, optim.max_skipped_steps, grad_norm)
    return grad_norm, {"train/skipped_steps": float(total), "train/empty_steps": float(skipped.empty)}


class SkippedStepsState:
    """Checkpointed skipped-step counts: a mixin, before ``L.LightningModule``, of a task using `optimizer_step`.

    Its `SkippedSteps` (``skipped_steps``, made on the first step) ride in the checkpoint, so a resumed run logs the
    uninterrupted run's ``train/skipped_steps`` and a streak goes on counting.
    """

    skipped_steps: SkippedSteps | None = None

    @property
    def skip_counter(self) -> SkippedSteps:
        """The task's `SkippedSteps`, made on first use."""
        if self.skipped_steps is None:
            self.skipped_steps = SkippedSteps()
        return self.skipped_steps

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Store the counts (none before the first step)."""
        skipped = self.skipped_steps
        if skipped is not None:
            checkpoint["skipped_steps"] = {"total": skipped.total, "streaks": list(skipped.streaks.items()),
                                           "empty": skipped.empty}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restore the counts (a checkpoint from before they were stored has none)."""
        state = checkpoint.get("skipped_steps")
        if state is not None:
            streaks = dict(map(tuple, state["streaks"]))
            self.skipped_steps = SkippedSteps(state["total"], streaks, state.get("empty", 0))  # stored since stop 45


@dataclass
class SkippedSteps:
    """Optimizer step counts: skipped ones and empty ones.

    Skipped for a non-finite gradient norm: the run's total and the current streak per optimizer. Empty (`empty`):
    the steps on an all-zero gradient, which change no parameter.
    """

    total: int = 0
    streaks: dict[int | None, int] = field(default_factory=dict)
    empty: int = 0

    def count(self, finite: bool, index: int | None, limit: int, grad_norm: torch.Tensor) -> int:
        """Record a step of optimizer `index`; returns the total; raises `TrainingError` at `limit` skipped in a row."""
        if finite:
            self.streaks[index] = 0
            return self.total
        self.total += 1
        self.streaks[index] = self.streaks.get(index, 0) + 1
        if self.streaks[index] >= limit:
            raise TrainingError(
                f"{limit} optimizer steps in a row had a non-finite loss or gradient (grad norm {grad_norm.item()}) "
                f"and were skipped (model.lm.optim.max_skipped_steps={limit}); lower model.lm.optim.lr, check the data, "
                "or raise model.lm.optim.max_skipped_steps")
        return self.total


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
            foreach_mul_(grads, coef)
    return total
