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
