"""``model.dapo`` (`rl_lightning.rollout.config.DAPOConfig`): PPO's DAPO group, its own checks together."""

import pytest

from rl_lightning.errors import ConfigError
from rl_lightning.rollout.config import DAPOConfig


def test_dapo_group_reports_every_bad_key_together():
    """``model.dapo`` (PPO): each bad key in one line; the cache longer than the completions is PPO's check."""
    with pytest.raises(ConfigError) as info:
        DAPOConfig(filter_range=(1.0, 0.0), max_refill_rounds=0, overlong_cache_length=0)
    assert str(info.value) == ("model.dapo.filter_range must be (low, high) with low < high, got (1.0, 0.0); "
                               "model.dapo.max_refill_rounds must be >= 1, got 0; "
                               "model.dapo.overlong_cache_length must be > 0 or null, got 0")
    assert DAPOConfig(overlong_cache_length=4).errors_with(max_new_tokens=4) == []
    assert DAPOConfig(overlong_cache_length=5).errors_with(max_new_tokens=4) == [
        "model.dapo.overlong_cache_length must be in (0, model.rollout.max_new_tokens=4], got 5"]


def test_gated_shaping_keeps_shaping_only_in_groups_with_a_correct_completion():
    """Groups of 3: the first has a correct completion (unchanged), the second none (each reward becomes
    2 x its correctness: 0, and -2 for a scorer that punishes a wrong answer)."""
    from rl_lightning.algorithms.dapo import gated_shaping

    rewards = [2.3, -0.5, 0.25, 0.4, -0.75, -1.6]
    correct = [1.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    assert gated_shaping(rewards, correct, 3, 2.0) == [2.3, -0.5, 0.25, 0.0, 0.0, -2.0]
    with pytest.raises(ValueError, match="5 rewards and 5 correctness values in groups of 2"):
        gated_shaping(rewards[:5], correct[:5], 2, 1.0)
