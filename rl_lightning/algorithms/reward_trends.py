"""Is the reward being gamed? The trend of the correctness signal against the shaping terms over a window.

When correct samples are rare, shaping terms (a format bonus, a length punishment) are most of the reward's signal, and
RL can raise the total reward by optimising them at the expense of the answer: the training reward rises while the
model gets worse. `shaping_verdict` compares, over the last `window` rollouts, the fitted change of the total reward
with that of the correctness component (or of a held-out metric): it says the shaping dominates when the total rose
and correctness fell, each by more than twice its own standard error (and by at least a minimum size, so a flat,
noiseless series raises no alarm).

Pure functions of Python floats: the caller keeps the per-rollout means (global over ranks) and decides what to do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Z = 2.0  # a change counts when it is at least Z standard errors of the fitted slope (about 95% one-sided at w >= 8)


@dataclass(frozen=True)
class Trend:
    """The least-squares line through a series: its change from the first to the last point and that change's error.

    Attributes:
        change: slope x (n - 1), the fitted rise over the window (negative: a fall).
        stderr: the standard error of `change` (residual-based; 0 for a series on a straight line).
    """

    change: float
    stderr: float

    def rose(self, minimum: float) -> bool:
        """Whether the series rose by more than `minimum` and by more than `Z` standard errors."""
        return self.change > minimum and self.change > Z * self.stderr

    def fell(self, minimum: float) -> bool:
        """Whether the series fell by more than `minimum` and by more than `Z` standard errors."""
        return -self.change > minimum and -self.change > Z * self.stderr


def trend(values: Sequence[float]) -> Trend:
    """The ordinary least-squares trend of `values` against 0, 1, ..., n-1 (n >= 3)."""
    n = len(values)
    if n < 3:
        raise ValueError(f"a trend needs at least 3 points, got {n}")
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    slope = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values)) / sxx
    residuals = sum((y - mean_y - slope * (i - mean_x)) ** 2 for i, y in enumerate(values))
    stderr = math.sqrt(residuals / (n - 2) / sxx)
    return Trend(change=slope * (n - 1), stderr=stderr * (n - 1))


@dataclass(frozen=True)
class ShapingVerdict:
    """What `shaping_verdict` found over one window.

    Attributes:
        dominates: the total reward rose while correctness fell (both beyond noise).
        total: the total reward's trend.
        correctness: the correctness signal's trend.
        rising: the other components (and the length punishment, if kept as one) whose trend rose, with their change.
        window: rollouts in the window.
    """

    dominates: bool
    total: Trend
    correctness: Trend
    rising: dict[str, float]
    window: int

    def line(self, correctness_name: str) -> str:
        """One line for the terminal: the window, the total's and correctness's changes, the rising components."""
        rising = ", ".join(f"{name} {change:+.3f}" for name, change in self.rising.items()) or "none"
        return (f"the reward rose {self.total.change:+.3f} over the last {self.window} rollouts while "
                f"{correctness_name} fell {self.correctness.change:+.3f}: the shaping terms dominate "
                f"(rising: {rising})")


def shaping_verdict(total: Sequence[float], correctness: Sequence[float], components: Mapping[str, Sequence[float]],
                    window: int, min_change: float = 0.02) -> ShapingVerdict | None:
    """The verdict over the last `window` points of each series, or None while fewer points exist.

    Args:
        total: the mean total reward per rollout (what the policy is optimising).
        correctness: the correctness signal per rollout (the correctness component's mean, or a held-out metric;
            it may be shorter than `total`, e.g. one point per validation, and then its own last `window` points
            are used).
        components: the other reward components' means per rollout (shaping terms), reported when they rose.
        window: rollouts compared (>= 3).
        min_change: the smallest change (in reward units) that counts as a rise or a fall.
    """
    if window < 3:
        raise ValueError(f"window must be >= 3, got {window}")
    if len(total) < window or len(correctness) < min(window, 3):
        return None
    total_trend = trend(total[-window:])
    correct_trend = trend(correctness[-window:])
    rising = {}
    for name, series in components.items():
        if len(series) >= window:
            t = trend(series[-window:])
            if t.rose(min_change):
                rising[name] = t.change
    dominates = total_trend.rose(min_change) and correct_trend.fell(min_change)
    return ShapingVerdict(dominates, total_trend, correct_trend, rising, window)
