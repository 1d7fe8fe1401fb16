"""The reward-hacking monitor: says, per rollout, whether the shaping terms are winning over correctness.

The PPO task feeds it each rollout's global means (``train/reward``, ``train/reward/<component>``) and, when
validation runs, the held-out correctness; it keeps the series, asks `rl_lightning.algorithms.reward_trends` for a
verdict over the last `window` rollouts and returns ``train/shaping_dominates`` (1.0 or 0.0). The first alarm prints
one line naming the components and the window; with ``stop_on_shaping`` the caller stops the run.

What counts as correctness: the component named ``correctness_component`` (default: ``correct`` when the environment
has one). The shaping is everything else in the total: the other components (as weighted into the reward) and what
DAPO's length punishment adds (the total minus the weighted components, reported as ``length``). A run whose reward
is correctness alone, with no length punishment, has nothing to monitor: the monitor is off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
