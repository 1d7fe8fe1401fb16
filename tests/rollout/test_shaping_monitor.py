"""The reward-hacking monitor over scripted rollouts: a gamed format bonus and length punishment, an honest reward."""

import random
import re

import pytest
import torch

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


GAMED_ENV = '''
calls = 0


def reward_fn(messages, answer):
    """Scripted by rollout (8 completions each): correctness 0.5 -> falls 0.05 a rollout, format rises 0.1."""
    global calls
    rollout, calls = calls // 8, calls + 1
    return {"correct": max(0.0, 0.5 - 0.05 * rollout), "format": min(1.0, 0.1 * rollout)}
'''


def test_a_ppo_fit_whose_shaping_is_gamed_logs_it_and_stops_at_the_first_alarm(tmp_path, recwarn):
    """The real task and callback: rollouts 0-7 fill the window, the 8th rollout's verdict stops the run."""
    from helpers import run_ppo

    env = tmp_path / "gamed.py"
    env.write_text(GAMED_ENV)
    rollout = {"reward_weights": {"correct": 1.0, "format": 1.0}, "reward_workers": 0, "stop_on_shaping": True}
    model, trainer = run_ppo(str(env), rollouts=12, rollout=rollout)
    assert model.rollouts == 8 and trainer.should_stop  # stopped after the 8th rollout, not the 12th
    assert trainer.callback_metrics["train/shaping_dominates"] == 1.0
    assert model.reward_means["train/reward/correct"] == pytest.approx(0.15)
    lines = [str(w.message) for w in recwarn if "shaping terms dominate" in str(w.message)]
    assert len(lines) == 1 and "last 8 rollouts" in lines[0] and "format +" in lines[0]
    assert "model.rollout.stop_on_shaping: stopping the run" in lines[0]


def test_a_window_under_three_rollouts_is_refused_in_one_line():
    from rl_lightning.errors import ConfigError
    from rl_lightning.rollout.config import RolloutConfig

    with pytest.raises(ConfigError) as error:
        RolloutConfig("env.py", shaping_window=2)
    assert "shaping_window must be a number of rollouts >= 3, got 2" in str(error.value)
    assert "\n" not in str(error.value)


SCRIPTED_ENV = '''
calls = 0
CORRECT = {correct}


def reward_fn(messages, answer):
    """Scripted by rollout (8 completions each), plus 0.01 for an odd length (so that the updates move weights)."""
    global calls
    rollout, calls = calls // 8, calls + 1
    odd = 0.01 * (len(messages[-1]["content"]) % 2)
    return {{"correct": CORRECT[min(rollout, len(CORRECT) - 1)] + odd, "format": 0.2 * rollout}}
'''
# correctness falls from the first rollout; or peaks at rollout 3 (sampled by the weights after two updates)
SCRIPTS = {"falls": [0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1], "rises-then-falls": [0.2, 0.3, 0.5, 0.4, 0.3,
                                                                                            0.2, 0.1, 0.0]}


@pytest.mark.parametrize("script", ["falls", "rises-then-falls"])
def test_stopping_on_shaping_puts_back_the_weights_that_scored_best(tmp_path, recwarn, script):
    """The gamed script's best correctness is its first rollout's: the model ends with the initial weights. The
    second script peaks at rollout 3, sampled by the weights after the second update: the model ends with those."""
    import lightning as L
    from helpers import run_ppo

    env = tmp_path / "scripted.py"
    env.write_text(SCRIPTED_ENV.format(correct=SCRIPTS[script]))
    after_update = []

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            after_update.append([p.detach().clone() for p in pl_module.parameters() if p.requires_grad])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after_update.append([p.detach().clone() for p in pl_module.parameters() if p.requires_grad])

    rollout = {"reward_weights": {"correct": 1.0, "format": 1.0}, "reward_workers": 0, "stop_on_shaping": True,
               "shaping_window": 4}
    model, trainer = run_ppo(str(env), rollouts=12, rollout=rollout, callbacks=[Record()])
    assert trainer.should_stop and model.rollouts < 12
    best = 0 if script == "falls" else 2  # weights before update k sampled rollout k + 1
    final = [p.detach() for p in model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(final, after_update[best], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(final, after_update[best + 1], strict=True))
    lines = [str(w.message) for w in recwarn if "are put back" in str(w.message)]
    assert len(lines) == 1, lines
    found = re.fullmatch(r"model\.rollout\.stop_on_shaping: the weights that scored the best correct \(([0-9.]+), the "
                         r"weights that sampled rollout (\d+)\) are put back; the export and the last checkpoint hold "
                         r"them \(the optimizer state is the last step's\)", lines[0])
    assert found and int(found[2]) == best + 1
    assert SCRIPTS[script][best] <= float(found[1]) <= SCRIPTS[script][best] + 0.01  # + 0.01 x the odd share
