"""Stop training once a metric has reached a threshold for `patience` consecutive checks (e.g. ``train/reward``).

A check reads the metric from ``trainer.callback_metrics``: ``val/...`` metrics at the end of each validation (the
sanity check excluded), every other metric at the end of each training step (for PPO-family tasks: each rollout).
A check where the metric is absent (not logged yet, or not by this task) counts neither way; one that misses the
threshold (or is NaN) starts the count again. When the count reaches `patience`, ``trainer.should_stop`` is set
(Lightning ends the run after the current step, or validation) and the reason is printed once.

The metrics this project's tasks log are already reduced over ranks (``train/reward`` is a global mean), so every
rank counts the same; the decision is still combined over ranks (stop when every rank says stop) in case a metric is
not, so that all processes stop together.

Lightning's ``EarlyStopping`` stops on a metric that stops improving, checked per epoch or validation; its
``stopping_threshold`` stops at the first check that reaches it, without patience. This counts consecutive checks at
every training step instead. The count is saved in checkpoints, so a resumed run carries on counting.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from typing_extensions import override

from rl_lightning.compat.lightning import callback_state_key
from rl_lightning.errors import ConfigError

MODES = ("max", "min")
WHERE = "rl_lightning.callbacks.early_stop.EarlyStopOnReward"


class EarlyStopOnReward(L.Callback):
    """Stop when `metric` has reached `threshold` (>= for ``max``, <= for ``min``) `patience` checks in a row.

    Args:
        threshold: the value to reach.
        metric: a logged metric: ``train/...`` (checked every training step), ``val/...`` (every validation).
        patience: consecutive checks at or past the threshold before stopping.
        mode: ``max`` (stop when metric >= threshold) or ``min`` (stop when metric <= threshold).
    """

    def __init__(self, threshold: float, metric: str = "train/reward", patience: int = 1, mode: str = "max") -> None:
        errors = []
        if math.isnan(threshold):
            errors.append(f"threshold must be a number, got {threshold}")
        if not metric:
            errors.append("metric must name a logged metric (e.g. train/reward), got ''")
        if patience < 1:
            errors.append(f"patience must be >= 1, got {patience}")
        if mode not in MODES:
            errors.append(f"mode must be one of {', '.join(MODES)}, got '{mode}'")
        if errors:
            raise ConfigError(f"{WHERE}: " + "; ".join(errors))
        self.threshold, self.metric, self.patience, self.mode = threshold, metric, patience, mode
        self.count = 0  # consecutive checks at or past the threshold
        self.stopped = False

    @property
    @override
    def state_key(self) -> str:
        return callback_state_key(self, metric=self.metric, mode=self.mode, threshold=self.threshold)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict.get("count", 0)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # before a checkpoint's count is restored
            self.count, self.stopped = 0, False

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.metric.startswith("val/"):
            self.check(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.metric.startswith("val/") and not trainer.sanity_checking:
            self.check(trainer)

    def reached(self, value: float) -> bool:
        """Whether `value` is at or past the threshold (>= for ``max``, <= for ``min``; NaN never is)."""
        return value >= self.threshold if self.mode == "max" else value <= self.threshold

    def check(self, trainer: L.Trainer) -> None:
        """Count this check; set ``trainer.should_stop`` once `patience` checks in a row reached the threshold."""
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            return
        value = float(value)
        self.count = self.count + 1 if self.reached(value) else 0
        stop = trainer.strategy.reduce_boolean_decision(self.count >= self.patience, all=True)
        if stop:
            trainer.should_stop = True
            if trainer.is_global_zero and not self.stopped:
                sign = ">=" if self.mode == "max" else "<="
                print(f"{WHERE}: stopping: {self.metric}={value:.4g} {sign} {self.threshold:g} for {self.count} "
                      f"consecutive check(s) (patience {self.patience})", flush=True)
            self.stopped = True
