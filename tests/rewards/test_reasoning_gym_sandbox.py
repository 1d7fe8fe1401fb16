"""Reasoning-gym scorers that evaluate text run in the sandbox, never in the trainer or reward worker (issue 36.1).

For each task on `EVALUATING_TASKS`: a completion (or, where the scorer evaluates the row's own text, a data row)
whose evaluated text writes a file, reads a secret of the trainer's environment and connects to a loopback listener
does none of the three and scores as garbage, with the sandbox's audit gate on (the reward path) and off (the OS
isolation alone); the dataset's own answer still scores 1. One scorer process serves the whole module.
"""

import logging
import os
import socket

import pytest

pytest.importorskip("reasoning_gym")

from rl_lightning.errors import ConfigError, DataError  # noqa: E402
from rl_lightning.rewards import isolation  # noqa: E402
from rl_lightning.rewards.reasoning_gym import EVALUATING_TASKS, check_task_scoring, score  # noqa: E402
from rl_lightning.rewards.reasoning_gym_scan import evaluating_tasks  # noqa: E402
from rl_lightning.rewards.scorer_sandbox import shared_scorer  # noqa: E402

needs_bwrap = pytest.mark.skipif(isolation.isolation_level() != "bwrap",
                                 reason=f"no bubblewrap isolation on this machine; {isolation.INSTALL_HINT}")
SECRET = "s3cret-rg-token"
FLOOR = {"countdown": 0.01, "puzzle24": 0.01}  # reasoning-gym's own score for an answer it cannot parse
DATA_EVALUATED = {"bitwise_arithmetic": "problem", "number_sorting": "answer"}  # the row's text is evaluated
SCORABLE = sorted(set(EVALUATING_TASKS) - {"composite"})  # composite needs a config of datasets to score at all


def test_every_task_whose_scorer_evaluates_text_is_listed():
    """Rescan the installed reasoning-gym with the rule: a new release cannot add an evaluating scorer unnoticed."""
    found = evaluating_tasks()
    assert set(found) <= set(EVALUATING_TASKS), f"scored in-process but evaluate text: {set(found) - set(EVALUATING_TASKS)}"
    assert {"string_insertion", "spiral_matrix", "binary_matrix", "n_queens", "countdown", "puzzle24",
            "polynomial_multiplication", "simple_integration", "intermediate_integration"} <= set(found)
    assert "chain_sum" not in found  # the demo's task stays in-process (fast)


@pytest.fixture(scope="module")
def trap(tmp_path_factory):
    """A secret in the trainer's environment (set before the scorer starts), a listener, and the file to be written."""
    os.environ["RL_TEST_SECRET"] = SECRET
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    target = tmp_path_factory.mktemp("trap") / "written"
    program = (f'import os, pathlib, socket\\ntry: socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), '
               f'timeout=1)\\nexcept Exception: pass\\npathlib.Path("{target}").write_text("w" + os.environ.get('
               '"RL_TEST_SECRET", "-"))')
    payload = f"exec('{program}')"
    yield payload, target, listener
    listener.close()
    os.environ.pop("RL_TEST_SECRET", None)
    shared_scorer().close()


def _entry(task: str) -> dict:
    import reasoning_gym

    entry = reasoning_gym.create_dataset(task, seed=0, size=1)[0]
    return {"task": task, "answer": str(entry["answer"]), "metadata": entry["metadata"]}


def _hostile(task: str, payload: str) -> tuple[str, dict]:
    """The completion and row answer carrying `payload` to where `task`'s scorer evaluates it."""
    row = _entry(task) if task != "composite" else {"task": task, "answer": "1", "metadata": {
        "source_dataset": "countdown"}}
    if task == "bitwise_arithmetic":
        return "<answer>0x1</answer>", {**row, "metadata": {**row["metadata"], "problem": payload}}
    if task == "number_sorting":
        return "<answer>['1', '2']</answer>", {**row, "answer": payload}
    return f"<answer>{payload}</answer>", row


@needs_bwrap
@pytest.mark.parametrize("task", SCORABLE)
def test_honest_answers_still_score_one(task, trap):
    row = _entry(task)
    assert score(f"<answer>{row['answer']}</answer>", row) == {"correct": 1.0, "format": 1.0}


@needs_bwrap
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no-gate"])
@pytest.mark.parametrize("task", sorted(EVALUATING_TASKS))
def test_evaluated_text_writes_reads_and_connects_nothing(task, gate, trap, caplog):
    payload, target, listener = trap
    completion, row = _hostile(task, payload)
    with caplog.at_level(logging.INFO):
        if task == "composite":  # no config of datasets: reasoning-gym cannot build its scorer (as in-process)
            with pytest.raises(ValueError, match="composite"):
                score(completion, row)
            correct = 0.0
        elif gate:  # the scorer's own value (a floor of 0.01 for some tasks); the default counts full marks only
            correct = score(completion, row, partial_credit=True)["correct"]
            assert score(completion, row)["correct"] == 0.0
        else:
            entry = {"question": "", "answer": row["answer"], "metadata": row["metadata"]}
            extracted = completion.removeprefix("<answer>").removesuffix("</answer>")
            correct = shared_scorer().score(task, extracted, entry, audit_gate=False)
    assert correct == FLOOR.get(task, 0.0)
    assert not target.exists()
    assert SECRET not in caplog.text
    with pytest.raises(BlockingIOError):  # nobody connected
        listener.accept()


def test_evaluating_tasks_are_refused_at_start_up_without_isolation(monkeypatch, tmp_path):
    """The environment's start-up check of the prompt rows (`Environment.check_answers`, called by the rollout
    callback's setup and by eval) refuses rows of an evaluating task in one line naming the row, before any model."""
    from types import SimpleNamespace

    from rl_lightning.data.loading import load_rows
    from rl_lightning.data.reasoning_gym import load_spec_rows, main
    from rl_lightning.envs.environment import load_environment
    from rl_lightning.rewards import reasoning_gym

    env = load_environment(str(reasoning_gym.__file__))  # what the example env file re-exports
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap on PATH
    monkeypatch.delenv(isolation.OPT_IN, raising=False)
    isolation.isolation_level.cache_clear()
    isolation.require_isolation.cache_clear()

    def prompts(rows, source):
        return [SimpleNamespace(answer=row["answer"], where=f"{source} row {i}") for i, row in enumerate(rows)]

    try:
        with pytest.raises(ConfigError) as error:
            env.check_answers(prompts(load_spec_rows("reasoning_gym:countdown?train_size=2&test_size=1"), "spec"))
        message = str(error.value)
        assert "\n" not in message and message.startswith("spec row 0: ") and "'countdown'" in message
        assert "parse_expr" in message and "apt-get install bubblewrap" in message and f"{isolation.OPT_IN}=1" in message
        check_task_scoring("chain_sum")  # scored in-process: no sandbox needed
        rows = load_spec_rows("reasoning_gym:chain_sum?train_size=2&test_size=1")
        env.check_answers(prompts(rows, "chain_sum"))
        row = rows[0]["answer"]
        assert score(f"<answer>{row['answer']}</answer>", row)["correct"] == 1.0
        assert len(load_spec_rows("reasoning_gym:countdown?train_size=2&test_size=1&format=sft")) == 2  # not scored
        main(["countdown", "--out", str(tmp_path), "--train-size", "2", "--test-size", "1"])  # writing is fine
        written = load_rows(str(tmp_path / "train.jsonl")).rows  # reading is fine; training on them is refused
        with pytest.raises(ConfigError, match=r"^train.jsonl row 0: reasoning-gym task 'countdown': its scorer evaluates"):
            env.check_answers(prompts(written, "train.jsonl"))
        with pytest.raises(DataError, match=r"^bad row 0: 'answer' is not a reasoning-gym answer"):
            env.check_answers([SimpleNamespace(answer={"answer": "3"}, where="bad row 0")])
    finally:
        isolation.isolation_level.cache_clear()
        isolation.require_isolation.cache_clear()


@needs_bwrap
def test_an_answer_can_neither_change_nor_stop_the_scorer(trap):
    """Code an answer runs (audit gate off) dies with its child: a patched scorer, a killed or forked scorer process
    do not reach the next answer."""
    scorer, row = shared_scorer(), _entry("string_insertion")
    entry = {"question": "", "answer": row["answer"], "metadata": row["metadata"]}
    assert scorer.score("string_insertion", row["answer"], entry) == 1.0
    pid = scorer.process.pid
    attacks = ["import reasoning_gym.algorithmic.string_insertion as m\\n"
               "m.StringInsertionDataset.score_answer = lambda *a: 1.0",
               "import os, signal\\nos.kill(os.getppid(), signal.SIGKILL)",
               "import os\\nos.fork()"]
    for attack in attacks:
        assert scorer.score("string_insertion", f"exec('{attack}')", entry, audit_gate=False) == 0.0
        assert scorer.score("string_insertion", "wrong", entry) == 0.0  # not 1.0 from a patched scorer
    assert scorer.score("string_insertion", row["answer"], entry) == 1.0
    assert scorer.process.pid == pid  # the same scorer process throughout


@needs_bwrap
def test_an_endless_answer_is_cut_at_the_limit(trap):
    import time

    scorer, row = shared_scorer(), _entry("polynomial_multiplication")
    entry = {"question": "", "answer": row["answer"], "metadata": row["metadata"]}
    scorer.timeout_s = 1.0
    try:
        start = time.monotonic()
        assert scorer.score("polynomial_multiplication", "9**9**9**9", entry) == 0.0  # passes the gate: arithmetic
        assert scorer.score("polynomial_multiplication", "exec('while True: pass')", entry, audit_gate=False) == 0.0
        assert time.monotonic() - start < 2 * 1.0 + 1.0
    finally:
        scorer.timeout_s = 10.0
    assert scorer.score("polynomial_multiplication", row["answer"], entry) == 1.0
