"""Reward scoring in worker processes (issue 12): calls are cut at `reward_timeout_s` (sleeping and never-returning
reward functions alike), hung workers are replaced, results keep their order, and the `on_error` policy decides
whether a timeout stops the run (one line naming the row and the limit) or scores 0 and is counted."""

import time

import lightning as L
import pytest
from conftest import DEMO_DATA, TINY_MODEL
from helpers import fit

from rl_lightning.data import PromptDataModule
from rl_lightning.envs.environment import load_environment
from rl_lightning.envs.workers import RewardFailure, RewardPool
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.models.config import LMConfig
from rl_lightning.models.optim import OptimConfig
from rl_lightning.rollout.callback import RolloutConfig
from rl_lightning.tasks import PPO

ENV = '''
import os, sys, time

def reward_fn(messages, answer):
    if answer == "sleep":
        time.sleep(60)
    if answer == "hang":
        while True:
            pass
    if answer == "boom":
        raise KeyError("no such key")
    if answer == "pid":
        return float(os.getpid())
    if answer == "torch?":
        return float("torch" in sys.modules)
    return float(answer)
'''


@pytest.fixture
def env_path(tmp_path):
    path = tmp_path / "env.py"
    path.write_text(ENV)
    return str(path)


def test_pool_cuts_hung_calls_replaces_workers_and_keeps_order(env_path):
    pool = RewardPool(env_path, workers=2, timeout_s=1.0)
    try:
        pids = pool.map([([], "pid"), ([], "pid")])
        start = time.monotonic()
        values = pool.map([([], "1"), ([], "sleep"), ([], "2"), ([], "hang"), ([], "boom"), ([], "3")])
        elapsed = time.monotonic() - start
        assert values[0::2] == [1.0, 2.0, RewardFailure("KeyError: 'no such key'")]
        assert values[1] == values[3] == RewardFailure("timed out after 1.0 s", timed_out=True)
        assert values[5] == 3.0
        assert 1.0 <= elapsed < 1.0 + 1.5  # both hung calls cut in parallel at the limit (+ process start-up)
        assert set(pool.map([([], "pid"), ([], "pid")])) != set(pids)  # the two hung workers were replaced
        assert pool.map([([], str(i)) for i in range(20)]) == [float(i) for i in range(20)]
        assert pool.map([([], "torch?")]) == [0.0]  # a worker imports the env file, not the trainer's torch
    finally:
        pool.close()
    assert all(w.process.poll() is not None for w in pool.workers) and pool.workers == []



def test_two_threads_mapping_at_once_each_get_their_own_results(env_path):
    """Two rollouts in flight score from two threads: each caller gets its own values, in its own order (without the
    pool's lock, one thread reads the other's replies: wrong values, or a result left None)."""
    import threading

    pool = RewardPool(env_path, workers=2, timeout_s=None)
    results: dict[int, list] = {}
    start = threading.Barrier(2)

    def caller(offset: int) -> None:
        start.wait()
        results[offset] = [pool.map([([], str(offset + i + j)) for j in range(8)]) for i in range(0, 40, 8)]

    try:
        threads = [threading.Thread(target=caller, args=(offset,)) for offset in (0, 1000)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        for offset in (0, 1000):
            assert results[offset] == [[float(offset + i + j) for j in range(8)] for i in range(0, 40, 8)]
    finally:
        pool.close()

def test_timeouts_follow_the_on_error_policy(env_path):
    lenient = load_environment(env_path, on_error="zero")
    lenient.scorer = RewardPool(env_path, workers=2, timeout_s=0.5)
    strict = load_environment(env_path, on_error="raise")
    strict.scorer = RewardPool(env_path, workers=1, timeout_s=0.5)
    try:
        scores = lenient.score_all([([], "4", "row 1"), ([], "hang", "row 2"), ([], "sleep", "row 3")])
        assert [s for s, _ in scores] == [4.0, 0.0, 0.0]
        assert lenient.failures == 2 and lenient.timeouts == 2 and lenient.reward_seconds >= 0.5
        with pytest.raises(DataError) as error:
            strict.score_all([([], "4", "data.jsonl row 7"), ([], "sleep", "data.jsonl row 8")])
        assert str(error.value) == (f"data.jsonl row 8: reward_fn from {env_path} timed out after 0.5 s "
                                    "(reward_timeout_s); make it faster or raise reward_timeout_s, or set "
                                    "model.rollout.on_error: zero to score such trajectories 0")
        assert strict.timeouts == 1
    finally:
        lenient.scorer.close()
        strict.scorer.close()


def test_reward_keys_are_checked(env_path):
    with pytest.raises(ConfigError, match="^model.rollout.reward_workers must be >= 0 .* got -1, 0$"):
        RolloutConfig(env_path, reward_workers=-1, reward_timeout_s=0)


class _Metrics(L.Callback):
    def __init__(self):
        self.history = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _hanging_reward(tmp_path, on_error):
    """PPO whose every trajectory's reward_fn never returns: each call is cut at 0.3 s by one of 4 workers."""
    env = tmp_path / "hang.py"
    env.write_text("def reward_fn(messages, answer):\n    while True:\n        pass\n")
    rollout = RolloutConfig(str(env), responses_per_prompt=4, max_new_tokens=4, on_error=on_error, reward_workers=4,
                            reward_timeout_s=0.3)
    return PPO(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")), rollout=rollout, max_rollouts=2)


def _fit(model):
    L.seed_everything(0)
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=1,
                            shuffle=False)
    metrics = _Metrics()
    fit(model, data, -1, [metrics], max_epochs=-1)  # PPO counts its run in rollouts: model.max_rollouts
    return metrics.history


def test_run_goes_on_under_zero_and_stops_in_one_line_under_raise(tmp_path):
    history = _fit(_hanging_reward(tmp_path, "zero"))
    assert len(history) == 2  # both steps trained
    assert [h["rollout/reward_timeouts"] for h in history] == [4.0, 8.0]
    assert history[-1]["train/reward_failures"] == 8.0
    assert all(0.3 <= h["rollout/reward_s"] < 0.3 + 3.0 for h in history)  # + start-up of 4 workers on 2 cores
    strict = _hanging_reward(tmp_path, "raise")
    with pytest.raises(DataError) as error:
        _fit(strict)
    assert strict.rollout_callback.env.scorer is None  # the workers were shut down with the failed run
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{DEMO_DATA / 'arithmetic.jsonl'} line 1: reward_fn from ")
    assert "timed out after 0.3 s (reward_timeout_s)" in message


def test_a_worker_that_dies_is_replaced_and_its_call_fails(env_path, tmp_path):
    dying = tmp_path / "dying.py"
    dying.write_text("import os\n\ndef reward_fn(messages, answer):\n    if answer == 'die':\n        os._exit(3)\n"
                     "    return float(answer)\n")
    pool = RewardPool(str(dying), workers=1, timeout_s=5.0)
    try:
        assert pool.map([([], "1"), ([], "die"), ([], "2")]) == [
            1.0, RewardFailure("the environment worker died (exit code 3)"), 2.0]
    finally:
        pool.close()
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nsys.exit(4)\n")  # load_environment would stop at it first; the pool must too
    pool = RewardPool(str(broken), workers=1, timeout_s=5.0)
    with pytest.raises(ConfigError, match=r"failed to import in a reward worker \(the worker exited with code 4\)"):
        pool.map([([], "1")])
    assert pool.workers == []
