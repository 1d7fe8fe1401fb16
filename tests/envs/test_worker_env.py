"""Reward and interact workers start with a minimal environment (issue 36.1): the trainer's secrets never reach
``reward_fn``/``interact``, only the allow-list and the names the user lists in ``model.rollout.worker_env``."""

import pytest

from rl_lightning.envs.workers import WORKER_ENV, WORKER_ENV_PREFIXES, RewardPool
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.config import RolloutConfig

ENV = '''
import os

def reward_fn(messages, answer):
    return float(os.environ.get(answer) == "v")

def interact(messages):
    return sorted(os.environ)
'''


def test_trainer_secrets_reach_a_worker_only_when_listed(tmp_path, monkeypatch):
    path = tmp_path / "env.py"
    path.write_text(ENV)
    for name in ("RL_TEST_SECRET", "AWS_SECRET_ACCESS_KEY", "JUDGE_API_KEY", "OMP_NUM_THREADS", "RL_LIGHTNING_X"):
        monkeypatch.setenv(name, "v")
    pool = RewardPool(str(path), workers=1, timeout_s=60.0, worker_env=["JUDGE_API_KEY"])
    try:
        names = ["RL_TEST_SECRET", "AWS_SECRET_ACCESS_KEY", "JUDGE_API_KEY", "OMP_NUM_THREADS", "RL_LIGHTNING_X"]
        assert pool.map([([], name) for name in names]) == [0.0, 0.0, 1.0, 1.0, 1.0]
        (seen,) = pool.map([([],)], "interact")
        assert "RL_TEST_SECRET" not in seen and "JUDGE_API_KEY" in seen
        assert all(n in WORKER_ENV or n.startswith(WORKER_ENV_PREFIXES) or n == "JUDGE_API_KEY" for n in seen), seen
    finally:
        pool.close()


def test_a_listed_variable_must_exist_and_be_a_name(tmp_path, monkeypatch):
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="model.rollout.worker_env: JUDGE_API_KEY not set in the trainer's env"):
        RewardPool(str(tmp_path / "env.py"), workers=1, timeout_s=None, worker_env=["JUDGE_API_KEY"])
    with pytest.raises(ConfigError, match=r"model.rollout.worker_env must list environment variable names .*'A=B'"):
        RolloutConfig(env_path="env.py", worker_env=["OK_NAME", "A=B"])
