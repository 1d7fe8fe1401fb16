"""The reward-hacking monitor over scripted rollouts: a gamed format bonus and length punishment, an honest reward."""

import random

from rl_lightning.rollout.shaping_monitor import ShapingMonitor


def _feed(monitor, rollouts):
    verdicts = []
    for i, (correct, fmt, length) in enumerate(rollouts):
        reward = correct + 0.5 * fmt + length
        verdicts.append(monitor.observe(i, reward, {"correct": correct, "format": fmt}))
    return verdicts


def _gamed(n=12, seed=0):
    """The issue's formatting task: format 0.30 -> 1.00, correct 0.08 -> 0.00, length punishment -0.40 -> 0."""
    rng = random.Random(seed)
    return [(max(0.0, 0.08 * (1 - i / (n - 1)) + rng.gauss(0, 0.01)), min(1.0, 0.3 + 0.7 * i / (n - 1)),
             -0.4 * (1 - i / (n - 1))) for i in range(n)]


def test_a_gamed_reward_alarms_once_the_window_fills_and_names_format_and_length():
    monitor = ShapingMonitor(["correct", "format"], {"correct": 1.0, "format": 0.5}, None, window=8,
                             length_shaping=True)
    verdicts = _feed(monitor, _gamed())
    assert all(v is None for v in verdicts[:7])
    assert verdicts[7].dominates and monitor.alarmed_at == 7
    assert set(verdicts[7].rising) == {"format", "length"}


def test_the_demos_honest_sums_never_alarm():
    rng = random.Random(1)  # correctness alone plus the length punishment: correct 0.10 -> 0.45, cut-offs vanish
    rollouts = [(0.1 + 0.35 * i / 11 + rng.gauss(0, 0.04), 0.0, -0.1 * (1 - i / 11)) for i in range(12)]
    monitor = ShapingMonitor(["correct", "format"], {"correct": 1.0, "format": 0.0}, None, window=8,
                             length_shaping=True)
    verdicts = _feed(monitor, rollouts)
    assert monitor.alarmed_at is None and verdicts[-1] is not None and not verdicts[-1].dominates


def test_held_out_correctness_takes_over_once_three_validations_exist():
    monitor = ShapingMonitor(["correct", "format"], {"format": 0.5}, None, window=8, length_shaping=False)
    rollouts = [(0.1, 0.3 + 0.05 * i, 0.0) for i in range(10)]  # training correctness flat, format rising
    assert not any(v.dominates for v in _feed(monitor, rollouts) if v is not None)
    for value in (0.25, 0.15, 0.05):  # but the held-out accuracy falls
        monitor.observe_held_out(value)
    verdict = monitor.observe(10, 0.1 + 0.5 * 0.85, {"correct": 0.1, "format": 0.85})
    assert verdict.dominates and monitor.alarmed_at == 10


def test_nothing_to_monitor_without_shaping_or_without_a_correctness_component():
    assert not ShapingMonitor(["correct"], None, None, window=8, length_shaping=False).enabled
    assert not ShapingMonitor(["score", "format"], None, None, window=8, length_shaping=True).enabled
    named = ShapingMonitor(["score", "format"], None, "score", window=8, length_shaping=False)
    assert named.enabled and named.shaping == ["format"]


def test_a_resumed_monitor_keeps_its_window():
    first = ShapingMonitor(["correct", "format"], {"format": 0.5}, None, window=8, length_shaping=True)
    rollouts = _gamed()
    _feed(first, rollouts[:5])
    second = ShapingMonitor(["correct", "format"], {"format": 0.5}, None, window=8, length_shaping=True)
    second.load_state_dict(first.state_dict())
    verdicts = [second.observe(i, c + 0.5 * f + length, {"correct": c, "format": f})
                for i, (c, f, length) in enumerate(rollouts) if i >= 5]
    assert verdicts[2].dominates and second.alarmed_at == 7
