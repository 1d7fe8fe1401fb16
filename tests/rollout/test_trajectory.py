"""Multi-turn rollouts: generated tokens are the only targets, tool tokens are masked, the loop stops at max_turns
or when interact returns [], and rewards come from the environment."""

import pytest
from conftest import DEMO_DATA, TINY_MODEL

from rl_lightning.data.prompts import PromptDataModule
from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.envs.environment import load_environment
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.rollout.trajectory import rollout

ENV = '''
def reward_fn(messages, answer):
    return float(sum(m["role"] == "tool" for m in messages))

def interact(messages):
    turn = sum(m["role"] == "assistant" for m in messages)
    if "{stop}" == "yes" and turn >= 2:
        return []
    return [{{"role": "tool", "content": f"calculator says {{turn * 11}}"}}]
'''


@pytest.fixture(scope="module")
def setup_parts(tmp_path_factory):
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=2)
    data.setup("fit")
    engine = HFEngine(load_causal_lm(str(TINY_MODEL)), pad_token_id=data.tokenizer.pad_token_id)
    return data, engine, tmp_path_factory.mktemp("envs")


def _env(folder, stop):
    path = folder / f"env_{stop}.py"
    path.write_text(ENV.format(stop=stop))
    return load_environment(str(path))


# Every vocabulary id stops a turn, so each turn is exactly one generated token (and always "finished").
ALL_STOP = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, stop_token_ids=list(range(320)), seed=0)


@pytest.mark.parametrize(("stop", "max_turns", "expected_turns"), [("no", 3, 3), ("no", 1, 1), ("yes", 5, 2)])
def test_multi_turn_masks_tool_tokens_and_stops(setup_parts, stop, max_turns, expected_turns):
    data, engine, folder = setup_parts
    tokenizer = data.tokenizer
    prompts = data.prompts["train"][:2]
    trajectories = rollout(engine, prompts, _env(folder, stop), tokenizer, ALL_STOP, max_turns=max_turns)
    assert len(trajectories) == 4 and [t.prompt for t in trajectories] == [prompts[0]] * 2 + [prompts[1]] * 2
    for t in trajectories:
        assert t.turns == expected_turns
        tools = [m for m in t.messages if m["role"] == "tool"]
        assert len(tools) == expected_turns - 1 and t.reward == float(len(tools))
        assert t.completion_length == expected_turns  # one generated token per turn, nothing else is a target
        assert len(t.input_ids) == len(t.completion_mask) == len(t.engine_logprobs)
        assert t.input_ids[: len(t.prompt.prompt_ids)] == t.prompt.prompt_ids
        context = tokenizer.decode([i for i, m in zip(t.input_ids, t.completion_mask, strict=True) if not m])
        for tool in tools:
            assert f"<|im_start|>tool\n{tool['content']}<|im_end|>\n<|im_start|>assistant\n" in context
        generated = [lp for lp, m in zip(t.engine_logprobs, t.completion_mask, strict=True) if m]
        assert all(lp <= 0 for lp in generated) and len(generated) == expected_turns
        example = t.example()
        assert example.loss_mask == t.completion_mask and example.values["engine_logprobs"] == t.engine_logprobs


FLOODING_ENV = '''
def reward_fn(messages, answer):
    return 0.0

def interact(messages):
    return [{"role": "tool", "content": "y" * 50_000}, {"role": "tool", "content": "z" * 10}]
'''


def test_tool_messages_are_capped_with_a_note(setup_parts):
    """One interact call adds at most max_tool_chars characters (the default 8192; here 100), every message kept."""
    data, engine, folder = setup_parts
    path = folder / "flooding.py"
    path.write_text(FLOODING_ENV)
    assert load_environment(str(path)).max_tool_chars == 8192
    env = load_environment(str(path), max_tool_chars=100)
    trajectories = rollout(engine, data.prompts["train"][:2], env, data.tokenizer, ALL_STOP, max_turns=3)
    for t in trajectories:
        assert t.turns == 3 and [m["content"] for m in t.messages if m["role"] == "tool"] == [
            "y" * 100 + "\n[... 49900 more characters cut: model.rollout.max_tool_chars]",
            "\n[... 10 more characters cut: model.rollout.max_tool_chars]"] * 2
    assert env.tool_truncations == 8  # 4 conversations x 2 interact calls


def test_a_conversation_that_would_outgrow_max_model_len_ends_there(setup_parts):
    """The next turn needs its tokens + the tool tokens + max_new_tokens <= max_model_len: else the conversation ends
    at the turn it had (finished, scored), instead of the engine refusing the prompt and failing the batch."""
    data, engine, folder = setup_parts
    path = folder / "flooding.py"
    path.write_text(FLOODING_ENV)
    env = load_environment(str(path), max_tool_chars=100)
    prompts = data.prompts["train"][:2]
    limit = max(len(p.prompt_ids) for p in prompts) + 1 + ALL_STOP.max_new_tokens + 10  # room for 10 tool tokens
    trajectories = rollout(engine, prompts, env, data.tokenizer, ALL_STOP, max_turns=3, max_model_len=limit)
    assert [t.turns for t in trajectories] == [1] * 4 and env.overlong_conversations == 4
    assert all(t.finished and len(t.input_ids) <= limit and t.messages[-1]["role"] == "assistant"
               for t in trajectories)
