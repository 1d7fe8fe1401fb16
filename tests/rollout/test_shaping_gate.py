"""``model.rollout.gate_shaping`` through the real PPO task and rollout callback: shaping counts only in groups
with a correct completion; a setting that cannot work is one line at start-up."""

import lightning as L
import pytest

from rl_lightning.errors import ConfigError

# correct when the completion's length is odd; a "format" bonus that grows with the length (the shaping)
SHAPED_ENV = '''
def reward_fn(messages, answer):
    text = messages[-1]["content"]
    return {"correct": float(len(text) % 2), "format": len(text) / 100}
'''


def _rewards(tmp_path, gate, **dapo):
    from helpers import run_ppo

    env = tmp_path / "shaped.py"
    env.write_text(SHAPED_ENV)
    captured = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            captured.extend(batch["rollout"].trajectories)

    rollout = {"reward_weights": {"correct": 1.0, "format": 1.0}, "reward_workers": 0, "gate_shaping": gate,
               "responses_per_prompt": 2, "max_new_tokens": 6}
    run_ppo(str(env), rollouts=2, batch_size=4, callbacks=[Capture()], rollout=rollout, dapo=dapo)
    groups = [captured[i:i + 2] for i in range(0, len(captured), 2)]
    return [[(t.reward, len(t.messages[-1]["content"])) for t in group] for group in groups]


@pytest.mark.parametrize("cache", [None, 2], ids=["no-length-punishment", "length-punishment"])
def test_only_groups_with_a_correct_completion_keep_their_shaping(tmp_path, cache):
    gated = _rewards(tmp_path, True, overlong_cache_length=cache)
    plain = _rewards(tmp_path, False, overlong_cache_length=cache)
    wrong_groups = [group for group in gated if all(chars % 2 == 0 for _, chars in group)]
    assert wrong_groups and len(wrong_groups) < len(gated)  # both kinds of group were sampled
    for group in gated:
        if all(chars % 2 == 0 for _, chars in group):  # no correct completion: no shaping, reward 0
            assert [reward for reward, _ in group] == [0.0, 0.0]
    # the same seed samples the same completions: where a group has a correct one, the rewards are the plain run's
    for gated_group, plain_group in zip(gated, plain, strict=True):
        assert [chars for _, chars in gated_group] == [chars for _, chars in plain_group]
        if any(chars % 2 for _, chars in gated_group):
            assert gated_group == plain_group
        else:
            assert any(reward != 0.0 for reward, _ in plain_group)  # ungated, the shaping was the signal


def test_a_gate_without_a_correctness_component_is_one_line(tmp_path):
    from helpers import ppo_task

    env = tmp_path / "shaped.py"
    env.write_text(SHAPED_ENV)
    with pytest.raises(ConfigError) as error:
        ppo_task(str(env), rollout={"reward_weights": {"correct": 1.0, "format": 1.0}, "gate_shaping": True,
                                    "correctness_component": "right"})
    assert str(error.value) == ("model.rollout.gate_shaping needs a correctness component, got none named 'right' "
                                "among the environment's ['correct', 'format']; set model.rollout.correctness_component "
                                "to one of them")
    from rl_lightning.rollout.config import RolloutConfig

    with pytest.raises(ConfigError) as error:
        RolloutConfig("env.py", reward_weights={"correct": 1.0, "format": 1.0}, reward_combination="tchebycheff",
                      gate_shaping=True)
    assert str(error.value) == ("model.rollout.gate_shaping needs reward_combination: weighted_sum (a reward that is "
                                "correctness plus shaping), got 'tchebycheff'; set gate_shaping: false")
