"""The reward-hacking verdict: closed-form trends, a gamed reward, an honest one, and noise without a trend."""

import random

import pytest

from rl_lightning.algorithms.reward_trends import Z, shaping_verdict, trend


def test_a_straight_line_has_its_exact_change_and_no_error():
    t = trend([0.1, 0.3, 0.5, 0.7])
    assert t.change == pytest.approx(0.6, abs=1e-12) and t.stderr == pytest.approx(0.0, abs=1e-12)


def test_the_error_is_the_textbook_slope_error_times_the_span():
    values = [0.0, 1.0, 0.0, 1.0, 0.0]  # slope 0, residuals 0.4^2 / 0.6^2 around a mean of 0.4
    t = trend(values)
    sxx = 10.0  # sum of (i - 2)^2 for i = 0..4
    residuals = 3 * 0.4**2 + 2 * 0.6**2
    assert t.change == pytest.approx(0.0, abs=1e-12)
    assert t.stderr == pytest.approx((residuals / 3 / sxx) ** 0.5 * 4, rel=1e-12)


def test_a_trend_needs_three_points():
    with pytest.raises(ValueError, match="at least 3"):
        trend([1.0, 2.0])


def _gamed(n: int, rng: random.Random) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """The issue's collapse: format 0.3 -> 1.0 (weight 0.5), correct 0.08 -> 0.0, overlong -0.4 -> 0."""
    correct = [max(0.0, 0.08 - 0.08 * i / (n - 1) + rng.gauss(0, 0.01)) for i in range(n)]
    fmt = [0.3 + 0.7 * i / (n - 1) + rng.gauss(0, 0.03) for i in range(n)]
    overlong = [-0.4 + 0.4 * i / (n - 1) + rng.gauss(0, 0.03) for i in range(n)]
    total = [c + 0.5 * f + o for c, f, o in zip(correct, fmt, overlong, strict=True)]
    return total, correct, {"format": fmt, "overlong": overlong}


def test_a_gamed_reward_is_named_with_the_components_that_rose():
    total, correct, components = _gamed(10, random.Random(0))
    verdict = shaping_verdict(total, correct, components, window=8)
    assert verdict is not None and verdict.dominates
    assert set(verdict.rising) == {"format", "overlong"}
    assert verdict.total.change > 0.3 and verdict.correctness.change < -0.04
    line = verdict.line("correct")
    assert "last 8 rollouts" in line and "correct fell" in line and "format +" in line


def test_an_honest_reward_that_rises_with_correctness_raises_no_alarm():
    rng = random.Random(1)  # the demo's sums: correct 0.1 -> 0.4 and the total with it
    correct = [0.1 + 0.3 * i / 9 + rng.gauss(0, 0.04) for i in range(10)]
    verdict = shaping_verdict(correct, correct, {}, window=8)
    assert verdict is not None and not verdict.dominates and verdict.correctness.change > 0


def test_noise_without_a_trend_rarely_alarms():
    rng = random.Random(2)
    alarms = 0
    for _ in range(400):  # per-rollout means of 32 samples at p = 0.1 and a shaping term, no trend in either
        correct = [rng.gauss(0.1, 0.053) for _ in range(8)]
        total = [c + rng.gauss(0.3, 0.05) for c in correct]
        verdict = shaping_verdict(total, correct, {}, window=8)
        alarms += verdict.dominates
    # both trends beyond Z = 2 errors at once, independent: about 0.023^2 of windows (a few in 10k); 400 windows
    assert Z == 2.0 and alarms <= 2


def test_no_verdict_before_the_window_fills_and_a_held_out_series_may_be_shorter():
    total, correct, components = _gamed(10, random.Random(3))
    assert shaping_verdict(total[:7], correct[:7], components, window=8) is None
    held_out = [0.25, 0.12, 0.03]  # three validations: the held-out metric fell
    verdict = shaping_verdict(total, held_out, components, window=8)
    assert verdict is not None and verdict.dominates
