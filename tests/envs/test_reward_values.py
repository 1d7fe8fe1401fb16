"""Rewards are finite real numbers (issue 36.6): text such as ``"0.75"`` is refused like any bad return (it was parsed),
and a reward model's non-finite score follows the same ``on_error`` policy as ``reward_fn``'s (it skipped the step)."""

import math

import pytest
import torch
from conftest import TINY_MODEL

from rl_lightning.envs.environment import load_environment
from rl_lightning.errors import DataError
from rl_lightning.rewards.reward_model import RewardModelConfig

RETURNS = "VALUES = {'text': '0.75', 'bytes': b'1', 'list': [1.0], 'none': None, 'true': True, 'int': 3, " \
          "'numpy': __import__('numpy').float32(0.5), 'components': {'a': '1.0'}}\n\n" \
          "def reward_fn(messages, answer):\n    return VALUES[answer]\n"


def _env(tmp_path, source, **kwargs):
    path = tmp_path / "env.py"
    path.write_text(source)
    return load_environment(str(path), **kwargs)


@pytest.mark.parametrize(("answer", "kind"), [("text", "str"), ("bytes", "bytes"), ("list", "list"),
                                              ("none", "NoneType")])
def test_a_reward_that_is_not_a_number_is_refused(tmp_path, answer, kind):
    with pytest.raises(DataError, match=rf"row 3: reward_fn from .*env.py failed \(ValueError: returned a value of "
                                        rf"type {kind} \(.*\), not a number\); fix it, or set model.rollout.on_error"):
        _env(tmp_path, RETURNS).score([], answer, "row 3")
    lenient = _env(tmp_path, RETURNS, on_error="zero")
    assert lenient.score([], answer, "row 3") == (0.0, {}) and lenient.failures == 1


def test_numbers_and_bools_are_rewards(tmp_path):
    """A bool is an int in Python's numeric tower (``return guess == answer``): 1.0 or 0.0; numpy scalars count."""
    env = _env(tmp_path, RETURNS)
    assert [env.score([], a, "row 1")[0] for a in ("true", "int", "numpy")] == [1.0, 3.0, 0.5]
    with pytest.raises(DataError, match=r"returned component 'a' of type str \('1.0'\), not a number"):
        _env(tmp_path, RETURNS, weights={"a": 1.0}).score([], "components", "row 2")


@pytest.fixture(scope="module")
def nan_rm(tmp_path_factory):
    """A real one-label Qwen2 sequence classifier whose score head is NaN: every conversation scores NaN."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(TINY_MODEL, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    folder = tmp_path_factory.mktemp("rm") / "nan_rm"
    model.save_pretrained(folder)
    return str(folder)


def test_a_reward_models_nan_follows_on_error(tmp_path, nan_rm):
    calls = [([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": a}], None, f"row {i}")
             for i, a in enumerate(("4", "five"))]
    source = "def reward_fn(messages, answer):\n    return 0.5\n"
    strict = _env(tmp_path, source, reward_model=RewardModelConfig(path=nan_rm, tokenizer=str(TINY_MODEL)))
    assert math.isnan(strict.reward_model.score([calls[0][0]])[0])  # the model really scores NaN
    with pytest.raises(DataError, match=r"^row 0: the reward model \(reward_model\) scored it nan, not a finite "
                                               r"number; .*model.rollout.reward_model.on_error: zero"):
        strict.score_all(calls)
    lenient = _env(tmp_path, source, reward_model=RewardModelConfig(path=nan_rm, tokenizer=str(TINY_MODEL),
                                                                    on_error="zero"))
    assert lenient.score_all(calls) == [(0.5, {"reward_model": 0.0})] * 2 and lenient.failures == 2


def test_answers_of_a_type_the_reward_cannot_read_are_refused_at_start_up(tmp_path):
    """A math row whose answer is a list (or a bool, or null) would score 0 forever: one line naming the file, the
    line and the field, before any generation; the bundled rows pass."""
    from conftest import DEMO_DATA, REPO

    from rl_lightning.data.prompts import PromptDataModule

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}\n'
                    '{"messages": [{"role": "user", "content": "2+2?"}], "answer": ["4"]}\n')
    data = PromptDataModule(str(rows), tokenizer_name=str(TINY_MODEL), batch_size=1)
    data.setup("fit")
    env = load_environment(str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"))
    assert env.answer_types == (str, int, float)
    with pytest.raises(DataError, match=r"^.*rows.jsonl line 2: 'answer' is list \['4'\], but the reward_fn of .*"
                                        r"arithmetic.py expects str or int or float \(it would score 0 forever\)"):
        env.check_answers(data.prompts["train"])
    with pytest.raises(DataError, match=r"'answer' is bool True"):
        env.check_answers([data.prompts["train"][0].__class__([], [], True, "row 7")])
    bundled = PromptDataModule(str(DEMO_DATA / "easy.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=1)
    bundled.setup("fit")
    env.check_answers(bundled.prompts["train"])
    load_environment(str(REPO / "examples" / "calculator" / "env.py")).check_answers(bundled.prompts["train"])
    anything = _env(tmp_path, "def reward_fn(messages, answer):\n    return 0.0\n")
    assert anything.answer_types is None  # nothing declared: nothing checked
    anything.check_answers(data.prompts["train"])
