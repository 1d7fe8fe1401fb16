"""The reward-hacking monitor: says, per rollout, whether the shaping terms are winning over correctness.

The PPO task feeds it each rollout's global means (``train/reward``, ``train/reward/<component>``) and, when
validation runs, the held-out correctness; it keeps the series, asks `rl_lightning.algorithms.reward_trends` for a
verdict over the last `window` rollouts and returns ``train/shaping_dominates`` (1.0 or 0.0). The first alarm prints
one line naming the components and the window; with ``stop_on_shaping`` the caller stops the run.

What counts as correctness: the component named ``correctness_component`` (default: ``correct`` when the environment
has one). The shaping is everything else in the total: the other components (as weighted into the reward) and what
DAPO's length punishment adds (the total minus the weighted components, reported as ``length``). A run whose reward
is correctness alone, with no length punishment, has nothing to monitor: the monitor is off.

With ``stop_on_shaping`` the run also keeps, in host memory, the trainable weights that scored the best correctness
so far (`BestWeights`), and puts them back into the model when it stops: the export and the last checkpoint then hold
the best policy, not the gamed one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from rl_lightning.algorithms.reward_trends import ShapingVerdict, shaping_verdict

DEFAULT_CORRECTNESS = "correct"


class ShapingMonitor:
    """Per-rollout series of the total reward, the correctness signal and the shaping terms, and the verdict.

    Args:
        components: the environment's reward component names.
        weights: each component's weight in the reward (weighted sum; missing names weigh 1).
        correctness: the correctness component's name (None: ``correct`` if present).
        window: rollouts compared.
        length_shaping: whether a length punishment is added to the reward (DAPO's overlong cache).
    """

    def __init__(self, components: list[str], weights: Mapping[str, float] | None, correctness: str | None,
                 window: int, length_shaping: bool) -> None:
        self.correctness = correctness or DEFAULT_CORRECTNESS
        self.weights = {name: float((weights or {}).get(name, 1.0)) for name in components}
        self.shaping = [name for name in components if name != self.correctness and self.weights[name] != 0.0]
        self.length_shaping = length_shaping
        self.enabled = self.correctness in components and (bool(self.shaping) or length_shaping)
        self.window = window
        self.total: list[float] = []
        self.correct: list[float] = []
        self.held_out: list[float] = []
        self.parts: dict[str, list[float]] = {name: [] for name in [*self.shaping, "length"]}
        self.alarmed_at: int | None = None

    def observe(self, rollout: int, reward: float, components: Mapping[str, float]) -> ShapingVerdict | None:
        """Add one rollout's global means; the verdict over the window (None while it fills or when disabled)."""
        if not self.enabled:
            return None
        self.total.append(reward)
        self.correct.append(components[self.correctness])
        weighted = sum(self.weights[name] * components[name] for name in self.weights)
        for name in self.shaping:
            self.parts[name].append(self.weights[name] * components[name])
        self.parts["length"].append(reward - weighted)  # 0 without a length punishment
        correctness = self.held_out if len(self.held_out) >= 3 else self.correct
        shaping = {name: series for name, series in self.parts.items() if name != "length" or self.length_shaping}
        verdict = shaping_verdict(self.total, correctness, shaping, self.window)
        if verdict is not None and verdict.dominates and self.alarmed_at is None:
            self.alarmed_at = rollout
        return verdict

    def observe_held_out(self, value: float) -> None:
        """Add a validation's held-out correctness (preferred over the training component once 3 exist)."""
        if self.enabled:
            self.held_out.append(value)

    def state_dict(self) -> dict[str, Any]:
        """The series so far (a resumed run keeps its window)."""
        return {"total": list(self.total), "correct": list(self.correct), "held_out": list(self.held_out),
                "parts": {k: list(v) for k, v in self.parts.items()}, "alarmed_at": self.alarmed_at}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s series."""
        self.total, self.correct = list(state["total"]), list(state["correct"])
        self.held_out = list(state["held_out"])
        self.parts = {k: list(v) for k, v in state["parts"].items()}
        self.alarmed_at = state["alarmed_at"]


def _trainable(module: torch.nn.Module) -> list[torch.Tensor]:
    """`module`'s trainable parameters as this rank's local tensors (a DTensor's shard)."""
    from torch.distributed.tensor import DTensor

    return [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters() if p.requires_grad]


class BestWeights:
    """Host copies of a module's trainable weights (each rank its own shards): the best scoring so far.

    A rollout's training correctness judges the weights that sampled it, those before its update: `take` copies them
    at the rollout's start (the candidate) and `consider` keeps the candidate when its score is the best. A held-out
    correctness judges the weights of the moment: `consider_now`. Once a held-out value exists, only held-out values
    count (the best is chosen again among them). Costs two host copies of the trainable weights (the best and the candidate), one taken per rollout. With
    asynchronous rollouts (``async_steps: 1``) a rollout was sampled one update before its start: the weights kept
    are then one update newer than those that scored.
    """

    def __init__(self) -> None:
        self.candidate: list[torch.Tensor] | None = None
        self.best: list[torch.Tensor] | None = None
        self.score, self.label, self.held_out = -math.inf, "", False

    @staticmethod
    @torch.no_grad()
    def _copy(module: torch.nn.Module) -> list[torch.Tensor]:
        return [t.detach().to("cpu", copy=True) for t in _trainable(module)]

    def take(self, module: torch.nn.Module) -> None:
        """The weights about to sample and be updated (a rollout's start); not while held-out values decide."""
        if not self.held_out:
            self.candidate = self._copy(module)

    def consider(self, score: float, label: str) -> None:
        """The candidate's training correctness: kept when the best so far."""
        if not self.held_out and self.candidate is not None and score > self.score:
            self.best, self.score, self.label = self.candidate, score, label
        self.candidate = None

    def consider_now(self, module: torch.nn.Module, score: float, label: str) -> None:
        """A held-out correctness of the current weights: kept when the best held-out value so far."""
        if not self.held_out:
            self.held_out, self.score, self.candidate = True, -math.inf, None
        if score > self.score:
            self.best, self.score, self.label = self._copy(module), score, label

    @torch.no_grad()
    def restore(self, module: torch.nn.Module) -> bool:
        """Copy the best weights back into `module`; whether there were any."""
        if self.best is None:
            return False
        for tensor, best in zip(_trainable(module), self.best, strict=True):
            tensor.copy_(best)
        return True


class ShapingMonitorCallback(L.Callback):
    """The PPO task's monitor: after each rollout's update, the verdict on its logged global means.

    Logs ``train/shaping_dominates``; the first alarm prints one line (rank 0); with ``stop_on_shaping`` the run
    stops there (every rank reads the same global means, so all stop together) with the best-scoring weights put back
    (`BestWeights`). A held-out correctness (``val/reward/<correctness component>``) is taken at each validation.

    Args:
        config: the ``model.rollout`` settings (weights, the correctness component, window, stop switch).
        length_shaping: DAPO's length punishment is added to the reward (``model.dapo.overlong_cache_length``).
    """

    def __init__(self, config: Any, length_shaping: bool) -> None:
        self.config, self.length_shaping = config, length_shaping
        self.monitor: ShapingMonitor | None = None
        self._state: dict[str, Any] | None = None
        self.best = BestWeights() if config.stop_on_shaping else None

    def _monitor(self, components: list[str]) -> ShapingMonitor:
        if self.monitor is None:
            c = self.config
            self.monitor = ShapingMonitor(components, c.reward_weights, c.correctness_component, c.shaping_window,
                                          self.length_shaping)
            if self._state is not None:
                self.monitor.load_state_dict(self._state)
        return self.monitor

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """With ``stop_on_shaping``: the weights that sampled this rollout, before its update (a candidate best)."""
        if self.best is not None and isinstance(batch, dict) and batch.get("rollout") is not None and (
                self.monitor is None or self.monitor.enabled):
            self.best.take(pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Observe the rollout's logged ``train/reward`` and components; log the verdict; stop if asked."""
        rollout, logged = batch.get("rollout"), getattr(pl_module, "reward_means", None)
        if rollout is None or not logged:  # the task keeps the rollout's global means (``train/reward...``)
            return
        monitor = self._monitor(list(rollout.reward_names))
        if not monitor.enabled:
            self.best = None  # nothing to monitor: drop the first rollout's candidate copy, take no more
            return
        components = {name: float(logged[f"train/reward/{name}"]) for name in rollout.reward_names}
        verdict = monitor.observe(trainer.global_step, float(logged["train/reward"]), components)
        if self.best is not None:
            count = getattr(pl_module, "rollouts", trainer.global_step)  # rollouts done, this one included
            self.best.consider(components[monitor.correctness], f"the weights that sampled rollout {count}")
        dominates = verdict is not None and verdict.dominates
        pl_module.log("train/shaping_dominates", float(dominates), on_step=True, on_epoch=False)
        if dominates and monitor.alarmed_at == trainer.global_step:
            stop = self.config.stop_on_shaping
            rank_zero_warn(f"rollout {trainer.global_step}: {verdict.line(monitor.correctness)}; "  # type: ignore[union-attr]
                           + ("model.rollout.stop_on_shaping: stopping the run" if stop else
                              "set model.rollout.stop_on_shaping: true to stop here, or lower the shaping weights"))
            if stop:
                trainer.should_stop = True
                self._restore_best(pl_module, monitor.correctness)

    def _restore_best(self, pl_module: L.LightningModule, correctness: str) -> None:
        assert self.best is not None  # made whenever stop_on_shaping is on
        if self.best.restore(pl_module):
            rank_zero_warn(f"model.rollout.stop_on_shaping: the weights that scored the best {correctness} "
                           f"({self.best.score:.3f}, {self.best.label}) are put back; the export and the last "
                           "checkpoint hold them (the optimizer state is the last step's)")

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Take the held-out correctness, when validation logs it."""
        if self.monitor is None or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(f"val/reward/{self.monitor.correctness}")
        if value is not None:
            self.monitor.observe_held_out(float(value))
            if self.best is not None and self.monitor.enabled:
                self.best.consider_now(pl_module, float(value), f"held out after rollout {getattr(pl_module, 'rollouts', trainer.global_step)}")

    @override
    def state_dict(self) -> dict[str, Any]:
        """The monitor's series (a resumed run keeps its window)."""
        return {} if self.monitor is None else self.monitor.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the series once the environment's components are known."""
        self._state = state_dict or None
