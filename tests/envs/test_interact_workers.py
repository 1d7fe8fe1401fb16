"""Multi-turn tools in the environment workers (issue 28.4): ``interact`` calls are cut at `interact_timeout_s`
(a hung tool no longer stops the run), a raising tool follows the `on_error` policy (stop in one line naming the row,
or end that conversation, log it and count it), and a well-behaved tool gives the same trajectories in the workers as
in the trainer process."""

import logging
import time

import lightning as L
import pytest
from conftest import DEMO_DATA, TINY_MODEL
from helpers import fit

from rl_lightning.data.prompts import PromptDataModule
from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.envs.environment import load_environment
from rl_lightning.envs.workers import RewardPool
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.models.config import LMConfig
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.optim import OptimConfig
from rl_lightning.rollout.config import RolloutConfig
from rl_lightning.rollout.trajectory import rollout
from rl_lightning.tasks import PPO

# `bad` is the first prompt's text: its conversations misbehave as `mode` says, the other prompt's go on.
ENV = '''
import time

def reward_fn(messages, answer):
    return float(sum(m["role"] == "tool" for m in messages))

def interact(messages):
    turn = sum(m["role"] == "assistant" for m in messages)
    if any(m["role"] == "user" and m["content"] == {bad!r} for m in messages):
        if "{mode}" == "hang":
            while True:
                pass
        if "{mode}" == "sleep":
            time.sleep(60)
        if "{mode}" == "raise" and turn == 2:
            raise ValueError("the calculator broke")
        if "{mode}" == "text":
            return "not a list"
    return [{{"role": "tool", "content": f"calculator says {{turn * 11}}"}}]
'''

# Every vocabulary id stops a turn, so each turn is exactly one generated token (and always "finished").
ALL_STOP = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, stop_token_ids=list(range(320)), seed=0)
LIMIT_S = 0.5
SFT_MODEL = TINY_MODEL.parent / "tiny-qwen2-sft"


@pytest.fixture(scope="module")
def parts():
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=2)
    data.setup("fit")
    engine = HFEngine(load_causal_lm(str(TINY_MODEL)), pad_token_id=data.tokenizer.pad_token_id)
    return data.tokenizer, engine, data.prompts["train"][:2]


def _env(tmp_path, prompts, mode, on_error="zero", workers=2):
    user = next(m["content"] for m in prompts[0].messages if m["role"] == "user")
    path = tmp_path / f"env_{mode}.py"
    path.write_text(ENV.format(bad=user, mode=mode))
    env = load_environment(str(path), on_error=on_error)
    if workers:
        env.scorer = RewardPool(str(path), workers, timeout_s=5.0, interact_timeout_s=LIMIT_S)
    return env


def _run(parts, env, max_turns=3):
    tokenizer, engine, prompts = parts
    try:
        return rollout(engine, prompts, env, tokenizer, ALL_STOP, max_turns=max_turns)
    finally:
        if env.scorer is not None:
            env.scorer.close()


def _fields(trajectories):
    return [(t.input_ids, t.completion_mask, t.engine_logprobs, t.messages, t.finished, t.turns, t.reward)
            for t in trajectories]


def test_a_normal_tool_gives_the_same_trajectories_in_workers_as_inline(parts, tmp_path):
    inline = _run(parts, _env(tmp_path, parts[2], "fine", workers=0))
    pooled = _run(parts, _env(tmp_path, parts[2], "fine"))
    assert [t.turns for t in inline] == [3, 3, 3, 3] and [t.reward for t in inline] == [2.0] * 4
    assert _fields(pooled) == _fields(inline)  # token for token, log-probability for log-probability


@pytest.mark.parametrize("mode", ["hang", "sleep"])
def test_a_hung_tool_is_cut_and_ends_its_conversation_under_zero(parts, tmp_path, caplog, mode):
    env = _env(tmp_path, parts[2], mode)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rl_lightning.envs.environment"):
        trajectories = _run(parts, env)
    elapsed = time.monotonic() - start
    # the first prompt's two conversations end after their first turn (cut in parallel, one worker each); the
    # second prompt's go on to max_turns with their tool messages
    assert [t.turns for t in trajectories] == [1, 1, 3, 3]
    assert [t.reward for t in trajectories] == [0.0, 0.0, 2.0, 2.0]
    assert env.interact_timeouts == env.interact_failures == 2 and env.failures == env.timeouts == 0
    assert LIMIT_S <= elapsed < LIMIT_S + 10.0  # + worker start-ups (twice: the hung ones are replaced) on 2 cores
    where = parts[2][0].where
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"{where}: interact from {env.path} timed out after {LIMIT_S} s (interact_timeout_s); the "
                        "conversation ends at this turn (on_error: zero)"] * 2


def test_a_hung_tool_stops_the_run_in_one_line_under_raise(parts, tmp_path):
    env = _env(tmp_path, parts[2], "hang", on_error="raise")
    with pytest.raises(DataError) as error:
        _run(parts, env)
    assert str(error.value) == (f"{parts[2][0].where}: interact from {env.path} timed out after {LIMIT_S} s "
                                "(interact_timeout_s); make it faster or raise interact_timeout_s, or set "
                                "model.rollout.on_error: zero to end such conversations there")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_raising_tool_follows_the_policy_inline_and_in_workers(parts, tmp_path, workers):
    env = _env(tmp_path, parts[2], "raise", workers=workers)
    trajectories = _run(parts, env)
    assert [t.turns for t in trajectories] == [2, 2, 3, 3]  # turn 2's call raised: those conversations end there
    assert env.interact_failures == 2 and env.interact_timeouts == 0
    if workers:  # the same trajectories as inline
        assert _fields(trajectories) == _fields(_run(parts, _env(tmp_path, parts[2], "raise", workers=0)))
    strict = _env(tmp_path, parts[2], "raise", on_error="raise", workers=workers)
    with pytest.raises(DataError) as error:
        _run(parts, strict)
    assert str(error.value) == (f"{parts[2][0].where}: interact from {strict.path} failed (ValueError: the "
                                "calculator broke); fix it, or set model.rollout.on_error: zero to end such "
                                "conversations there")


def test_a_tool_returning_no_list_of_messages_is_a_failure(parts, tmp_path):
    env = _env(tmp_path, parts[2], "text")
    assert [t.turns for t in _run(parts, env)] == [1, 1, 3, 3]
    assert env.interact_failures == 2


def test_interact_timeout_is_checked():
    with pytest.raises(ConfigError, match=r"^model.rollout.interact_timeout_s must be > 0 \(seconds\) or null "
                                          r"\(no limit\), got 0$"):
        RolloutConfig("env.py", interact_timeout_s=0)


class _Metrics(L.Callback):
    def __init__(self):
        self.history = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_ppo_logs_the_counts_once_a_tool_misbehaves(parts, tmp_path):
    """Rollout 1's prompt has a well-behaved tool (nothing logged), rollout 2's hangs: its 4 calls are cut.

    The SFT'd tiny model ends its turns within 48 tokens (only a finished turn calls ``interact``).
    """
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(SFT_MODEL), batch_size=1,
                            shuffle=False)
    data.setup("fit")
    env = _env(tmp_path, data.prompts["train"][1:2], "hang", workers=0)
    config = RolloutConfig(env.path, responses_per_prompt=4, max_new_tokens=48, max_turns=2, on_error="zero",
                           reward_workers=2, interact_timeout_s=0.3)
    model = PPO(LMConfig(str(SFT_MODEL), optim=OptimConfig(lr=1e-6, lr_schedule="constant")), rollout=config, max_rollouts=2)
    metrics = _Metrics()
    L.seed_everything(0)
    fit(model, data, -1, [metrics], max_epochs=-1)
    first, second = metrics.history
    assert "rollout/interact_timeouts" not in first and "rollout/interact_failures" not in first
    assert second["rollout/interact_timeouts"] == second["rollout/interact_failures"] == 4.0
    assert model.rollout_callback.env.scorer is None  # the workers were shut down with the run
