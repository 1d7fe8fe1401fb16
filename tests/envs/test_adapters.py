"""Standard environments as ``env_path`` (`rl_lightning.envs.adapters`): the real verifiers taskset and OpenEnv
environment in ``rl_lightning/recipes/envs/`` score as their own rubrics do, their tools and observations come back as they
produce them, a reward worker builds the same adapter, GRPO through the CLI logs the rubric's components, and
environments of the wrong shape stop at start-up with one line."""

import asyncio
import json
import sys

import pytest
from conftest import REPO

from rl_lightning.envs.adapters import export_rows, load_adapter
from rl_lightning.envs.environment import load_environment
from rl_lightning.envs.workers import RewardPool
from rl_lightning.errors import ConfigError

pytest.importorskip("verifiers.v1", reason="the envs extra: pip install -e '.[envs]'")
pytest.importorskip("openenv.core", reason="the envs extra: pip install -e '.[envs]'")

VERIFIERS = f"verifiers:{REPO}/rl_lightning/recipes/envs/verifiers_arithmetic.py"
OPENENV = f"openenv:{REPO}/rl_lightning/recipes/envs/openenv_arithmetic.py"
PROMPT = [{"role": "system", "content": "You are a careful calculator. Answer with the number only."},
          {"role": "user", "content": "What is 3 + 4?"}]


def _module(spec):
    """The example's module as the adapter imported it (registered under its stable name)."""
    return sys.modules[f"rl_lightning_env_{spec.rsplit('/', 1)[-1].removesuffix('.py')}"]


def _own_verifiers_score(messages, answer):
    """verifiers' own scoring: the task's ``Task.score`` on a trace built here with verifiers' types."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    example = _module(VERIFIERS)
    task = example.ArithmeticTask(example.ArithmeticData(prompt=PROMPT, answer=answer))
    vf_messages = [vf.SystemMessage(content=PROMPT[0]["content"]), vf.UserMessage(content=PROMPT[1]["content"]),
                   *(vf.AssistantMessage(content=m["content"]) for m in messages[2:])]
    nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
             for i, m in enumerate(vf_messages)]
    trace = vf.Trace(task=TraceTask(type="ArithmeticTask", data=task.data), agent=AgentInfo(config=vf.AgentConfig()),
                     nodes=nodes)
    asyncio.run(task.score(trace))
    return trace.reward, {name: r.score for name, r in trace.rewards.items()}


@pytest.mark.parametrize(("completion", "expected"), [("7", 1.5), ("The answer is 7", 1.0), ("8", 0.5), ("", 0.0)])
def test_verifiers_reward_is_the_tasks_own_score(completion, expected):
    env = load_environment(VERIFIERS)
    assert env.weights == {"correct": 1.0, "bare_number": 0.5}  # the @vf.reward weights
    messages = [*PROMPT, {"role": "assistant", "content": completion}]
    reward, components = env.score(messages, "7", "row 1")
    own_reward, own_components = _own_verifiers_score(messages, "7")
    assert reward == own_reward == expected  # closed form: correct + 0.5 * bare_number
    assert components == own_components


def test_verifiers_exported_rows_carry_the_task_data(tmp_path):
    """export_rows writes the taskset's tasks; their dict answers rebuild the same task (same score as the string)."""
    rows = tmp_path / "rows.jsonl"
    assert export_rows(VERIFIERS, str(rows), limit=5) == 5
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    source = [json.loads(line) for line in (REPO / "rl_lightning/assets/data/easy.jsonl").read_text().splitlines()]
    assert [r["messages"] for r in lines] == [s["messages"] for s in source[:5]]
    env = load_environment(VERIFIERS)
    for row, plain in zip(lines, source, strict=False):
        messages = [*row["messages"], {"role": "assistant", "content": plain["answer"]}]
        assert env.score(messages, row["answer"], "r") == env.score(messages, plain["answer"], "r") == (
            1.5, {"correct": 1.0, "bare_number": 1.0})


def test_verifiers_tool_calls_come_back_as_the_toolset_answers():
    env = load_environment(VERIFIERS)
    toolset = _module(VERIFIERS).CalculatorToolset(None)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "%s"}}</tool_call>'
    text = "Let me check. " + call % "12 * (3 + 4)" + call % "2 - 9"
    replies = env.interact([*PROMPT, {"role": "assistant", "content": text}])
    assert [r["content"] for r in replies] == [toolset.calculate("12 * (3 + 4)"), toolset.calculate("2 - 9")] == [
        "84", "-7"]
    assert [r["role"] for r in replies] == ["tool", "tool"]
    bad = env.interact([*PROMPT, {"role": "assistant", "content": call.replace("calculate", "search") % "1"}])
    assert bad[0]["content"] == "error: ValueError: unknown tool 'search'; the tools are ['calculate']"
    assert env.interact([*PROMPT, {"role": "assistant", "content": "7"}]) == []  # no call: the conversation ends


def _own_openenv_episode(a, b, completions):
    """OpenEnv's own episode: reset, one step per completion; the steps' observations."""
    example = _module(OPENENV)
    env = example.ArithmeticGame()
    env.reset(a=a, b=b)
    return [env.step(example.GuessAction(message=text)) for text in completions]


def test_openenv_reward_is_the_episodes_return_by_rubric_component(tmp_path):
    env = load_environment(OPENENV)
    assert env.weights == {"correct": 0.8, "bare_number": 0.2}  # the WeightedSum's children and weights
    rows = tmp_path / "rows.jsonl"
    assert export_rows(OPENENV, str(rows), resets=[{"a": 3, "b": 4}]) == 1
    (row,) = [json.loads(line) for line in rows.read_text().splitlines()]
    assert row["messages"] == [{"role": "user", "content": "What is 3 + 4?", "reset": {"a": 3, "b": 4}}]
    completions = ["It is 6", "7"]
    own = _own_openenv_episode(3, 4, completions)
    messages = [*row["messages"]]
    for text in completions:
        messages.append({"role": "assistant", "content": text})
        replies = env.interact(messages)
        messages += replies
    # the env's feedback after the wrong try, then the episode is done
    assert messages[2] == {"role": "user", "content": own[0].feedback} and replies == [] and own[1].done
    reward, components = env.score(messages, row["answer"], "row 1")
    assert reward == pytest.approx(sum(o.reward for o in own), abs=1e-12) and reward == pytest.approx(1.0, abs=1e-12)
    assert components == {"correct": 1.0, "bare_number": 1.0}  # summed over the two steps: 0 + 1 each


def test_a_reward_worker_builds_the_same_adapter():
    pool = RewardPool(VERIFIERS, workers=1, timeout_s=120)
    try:
        calls = [([*PROMPT, {"role": "assistant", "content": text}], "7") for text in ("7", "The answer is 7")]
        assert pool.map(calls) == [load_adapter(VERIFIERS).reward_fn(*call) for call in calls] == [
            {"correct": 1.0, "bare_number": 1.0}, {"correct": 1.0, "bare_number": 0.0}]
    finally:
        pool.close()


BAD_VERIFIERS = {
    "no-taskset": ("import verifiers.v1 as vf\nX = 1\n", "defines no verifiers.v1.taskset.Taskset subclasses; write one"),
    "no-reward": ("import verifiers.v1 as vf\nclass T(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):\n    pass\n"
                  "class S(vf.Taskset[T, vf.TasksetConfig]):\n    def load(self):\n        return []\n",
                  "its task T has no @vf.reward method"),
    "sync-reward": ("import verifiers.v1 as vf\nclass T(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):\n"
                    "    @vf.reward\n    def good(self, trace):\n        return 1.0\n"
                    "class S(vf.Taskset[T, vf.TasksetConfig]):\n    def load(self):\n        return []\n",
                    "rewards ['good'] of T are not async"),
    "import-error": ("import verifiers.v1 as vf\nraise RuntimeError('boom')\n", "failed to import: RuntimeError: boom"),
}
BAD_OPENENV = {
    "no-environment": ("X = 1\n", "defines no openenv.core.env_server.interfaces.Environment subclasses; write one"),
    "two-str-fields": ("from openenv.core.env_server import Action, Environment, Observation, State\n"
                       "class A(Action):\n    text: str\n    other: str = ''\n"
                       "class E(Environment[A, Observation, State]):\n"
                       "    def reset(self, seed=None, episode_id=None, **kw):\n        return Observation()\n"
                       "    def step(self, action: A, timeout_s=None, **kw):\n        return Observation()\n"
                       "    @property\n    def state(self):\n        return State()\n",
                       "its action A has 2 str fields ['text', 'other']"),
}


@pytest.mark.parametrize(("kind", "case"), [*(("verifiers", c) for c in BAD_VERIFIERS),
                                            *(("openenv", c) for c in BAD_OPENENV)])
def test_wrong_shapes_are_one_line_config_errors(kind, case, tmp_path):
    source, expected = {**BAD_VERIFIERS, **BAD_OPENENV}[case]
    path = tmp_path / f"bad_{case.replace('-', '_')}.py"
    path.write_text(source)
    with pytest.raises(ConfigError) as info:
        load_environment(f"{kind}:{path}")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"env_path='{kind}:{path}'") and expected in message, message


def test_missing_module_and_mismatched_weights_are_one_line_config_errors():
    with pytest.raises(ConfigError, match=r"^env_path='verifiers:no_such_taskset' failed to import: "
                                          r"ModuleNotFoundError.*name an importable module"):
        load_environment("verifiers:no_such_taskset")
    with pytest.raises(ConfigError, match=r"^model.rollout.reward_weights \{'correct': 1.0, 'format': 0.5\} does not "
                                          r"name the components of env_path='openenv:.*' \['bare_number', 'correct'\]"
                                          r": set it to \{\} \(or null in YAML\)"):
        load_environment(OPENENV, weights={"correct": 1.0, "format": 0.5})
    assert load_environment(OPENENV, weights={"correct": 1.0, "bare_number": 0.0}).weights == {
        "correct": 1.0, "bare_number": 0.0}  # the user's weights win when they name the components


def _grpo(workdir, env_path, data, *extra):
    import mlflow

    from rl_lightning.cli.main import main

    main(["fit", "--config", "recipes/grpo.yaml", "--model.rollout.env_path", env_path,
          "--model.rollout.reward_weights", "{}", "--model.rollout.engine", "hf", "--model.max_rollouts", "2",
          "--model.rollout.responses_per_prompt", "2", "--model.rollout.max_new_tokens", "8",
          "--model.rollout.reward_workers", "1", "--data.path", str(data), "--data.batch_size", "4",
          "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--trainer.callbacks", "[]",
          *extra])
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {key: [m.value for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}


@pytest.mark.slow
def test_grpo_through_the_cli_logs_the_verifiers_reward_functions(workdir, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])
    metrics = _grpo(workdir, "verifiers:rl_lightning/recipes/envs/verifiers_arithmetic.py", REPO / "rl_lightning/assets/data/easy.jsonl")
    assert len(metrics["train/reward/correct"]) == len(metrics["train/reward/bare_number"]) == 2
    for correct, bare, reward in zip(metrics["train/reward/correct"], metrics["train/reward/bare_number"],
                                     metrics["train/reward"], strict=True):
        assert reward == pytest.approx(correct + 0.5 * bare, abs=1e-6)  # float32 logging of the means


@pytest.mark.slow
def test_grpo_through_the_cli_logs_the_openenv_rubric_multi_turn(workdir, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])
    rows = workdir / "openenv_rows.jsonl"
    export_rows("openenv:rl_lightning/recipes/envs/openenv_arithmetic.py", str(rows),
                resets=[{"a": a, "b": b} for a in range(1, 5) for b in range(1, 3)])
    metrics = _grpo(workdir, "openenv:rl_lightning/recipes/envs/openenv_arithmetic.py", rows, "--model.rollout.max_turns", "2")
    assert len(metrics["train/reward/correct"]) == len(metrics["train/reward/bare_number"]) == 2
    for correct, bare, reward in zip(metrics["train/reward/correct"], metrics["train/reward/bare_number"],
                                     metrics["train/reward"], strict=True):
        assert reward == pytest.approx(0.8 * correct + 0.2 * bare, abs=1e-6)  # float32 logging of the means


def test_an_installed_taskset_by_module_name_and_a_class_picked_by_name(tmp_path, monkeypatch):
    """``verifiers:<module>`` imports from sys.path (as verifiers' own ids do); two tasksets need ``:<Name>``."""
    source = (REPO / "rl_lightning/recipes/envs/verifiers_arithmetic.py").read_text()
    (tmp_path / "my_tasksets.py").write_text(source + "\n\nclass Harder(ArithmeticTaskset):\n    pass\n\n\n"
                                             "__all__ = ['ArithmeticTaskset', 'Harder']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^env_path='verifiers:my_tasksets': my_tasksets defines 2 \(\['ArithmeticTaskset', "
                                          r"'Harder'\]\) verifiers.v1.taskset.Taskset subclasses; pick one with :<Name>$"):
        load_environment("verifiers:my_tasksets")
    env = load_environment("verifiers:my_tasksets:Harder")
    assert env.score([*PROMPT, {"role": "assistant", "content": "7"}], "7", "r") == (
        1.5, {"correct": 1.0, "bare_number": 1.0})
    monkeypatch.delitem(sys.modules, "my_tasksets")


def test_openenv_reset_arguments_may_follow_a_system_message():
    env = load_environment(OPENENV)
    user = {"role": "user", "content": "What is 2 + 2?", "reset": {"a": 2, "b": 2}}
    system = {"role": "system", "content": "Answer with the number only."}
    completion = {"role": "assistant", "content": "4"}
    assert env.score([system, user, completion], None, "r") == env.score([user, completion], None, "r") == (
        pytest.approx(1.0, abs=1e-12), {"correct": 1.0, "bare_number": 1.0})
