"""Built-in rewards, and the sandbox containing hostile programs while the trainer process carries on."""

import json
import os
import time

import pytest

from rl_lightning.rewards.code import code_reward, extract_code
from rl_lightning.rewards.math import answers_match, final_answer, last_boxed, math_reward
from rl_lightning.rewards.sandbox import run_sandboxed
from rl_lightning.rewards.tags import think_answer_format, think_answer_reward


def _said(text):
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]


def test_math_answers():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{42}") == "42"
    assert last_boxed(r"\boxed{x^{2}+1}") == "x^{2}+1"
    assert final_answer("12 + 30 = 42.") == "42"
    assert answers_match("1,000", "1000.0") and answers_match(r"\frac{2000}{2}", 1000)
    assert not answers_match("41", "42") and not answers_match(None, "1")
    assert math_reward(_said(r"The answer is \boxed{-48}"), "-48") == 1.0
    assert math_reward(_said("-47"), "-48") == 0.0


def test_think_answer_tags():
    good = "<think>2 + 2 is 4</think><answer>4</answer>"
    assert think_answer_format(_said(good)) == 1.0 and think_answer_reward(_said(good), "4") == 1.0
    assert think_answer_reward(_said(good), "5") == 0.1
    assert think_answer_format(_said("<answer>4</answer>")) == 0.0
    assert think_answer_format(_said(good + "<answer>5</answer>")) == 0.0


def test_code_reward_runs_test_cases():
    program = "Sure:\n```python\nn = int(input())\nprint(n * n)\n```"
    cases = [{"input": "3\n", "output": "9\n"}, {"input": "4", "output": "16"}, {"input": "5", "output": "24"}]
    assert extract_code(program).startswith("n = int")
    assert code_reward(_said(program), cases) == pytest.approx(2 / 3)
    assert code_reward(_said("no code here"), cases) == 0.0


@pytest.mark.parametrize(
    ("code", "expected_reason"),
    [
        ("while True:\n    pass", "timeout"),
        ("x = bytearray(10 * 1024 ** 3)", "MemoryError"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "sandbox: socket"),
        ("import os\nwhile True:\n    os.fork()", "sandbox: os.fork is not allowed"),
        ("import subprocess\nsubprocess.run(['true'])", "sandbox: subprocess.Popen is not allowed"),
        ("open('/tmp/rl_sandbox_escape.txt', 'w').write('x')", "outside the working directory"),
        ("import os\nos.remove('/etc/hostname')", "outside the working directory"),
        ("import ctypes", "is not allowed"),
    ],
    ids=["infinite-loop", "10GB", "socket", "fork-bomb", "subprocess", "write-outside", "delete-outside", "ctypes"],
)
def test_sandbox_contains_hostile_programs(code, expected_reason):
    start = time.monotonic()
    result = run_sandboxed(code, timeout_s=2.0, memory_mb=256)
    assert not result.ok
    assert expected_reason in result.reason, result
    assert time.monotonic() - start < 10  # killed promptly, and this (trainer) process goes on
    assert not os.path.exists("/tmp/rl_sandbox_escape.txt")
    assert os.path.exists("/etc/hostname")


def test_sandbox_cpu_limit_is_a_backstop_above_the_wall_clock():
    """A busy loop must end as ``timeout``: with the CPU limit equal to the wall-clock one, a loaded machine let the
    kernel's CPU-time kill win the race now and then (``exit code 137``)."""
    result = run_sandboxed("import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU)[0])", timeout_s=2.0)
    assert result.ok, result
    assert int(result.stdout) == 3  # 2 s rounded up, plus one


def test_sandbox_allows_normal_programs_and_cleans_up():
    result = run_sandboxed("import math\nopen('scratch.txt', 'w').write(input())\nprint(open('scratch.txt').read())",
                           stdin="hello", timeout_s=5)
    assert result.ok and result.stdout == "hello\n" and result.reason == ""


def test_code_test_cases_in_the_prime_shape():
    from rl_lightning.rewards.code import read_test_cases

    expected = [{"input": "3\n", "output": "9\n"}, {"input": "1\n2", "output": "1"}]
    prime = {"inputs": ["3\n", ["1", "2"]], "outputs": ["9\n", "1"]}  # APPS/TACO give some inputs as lists of lines
    assert read_test_cases(prime) == expected
    assert read_test_cases({"test_cases": json.dumps(prime)}) == expected  # PRIME's Eurus-2 rows: a JSON string
    assert read_test_cases(json.dumps(prime)) == expected
    assert read_test_cases(expected) == expected
    with pytest.raises(ValueError, match=r"call-based cases \(fn_name='solve'\) are not supported"):
        read_test_cases({"inputs": [[1]], "outputs": [1], "fn_name": "solve"})
    with pytest.raises(ValueError, match="of equal length, got keys"):
        read_test_cases({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="a string answer must be JSON"):
        read_test_cases("not json")


def test_a_prime_row_scores_with_the_code_reward(tmp_path):
    """A data row in PRIME's shape goes through the prompt DataModule and the built-in code reward."""
    from conftest import TINY_MODEL

    from rl_lightning.data import PromptDataModule

    row = {"messages": [{"role": "user", "content": "Read n, print n squared."}],
           "answer": {"test_cases": json.dumps({"inputs": ["3\n", "4\n", "5\n"], "outputs": ["9\n", "16\n", "24\n"]})}}
    path = tmp_path / "prime.jsonl"
    path.write_text(json.dumps(row) + "\n")
    data = PromptDataModule(str(path), tokenizer_name=str(TINY_MODEL), batch_size=1)
    data.setup("fit")
    (prompt,) = data.prompts["train"]
    program = "```python\nn = int(input())\nprint(n * n)\n```"
    assert code_reward(prompt.messages + [{"role": "assistant", "content": program}], prompt.answer) == pytest.approx(2 / 3)


@pytest.mark.parametrize(("task", "reference", "completion", "partial"), [
    ("letter_counting", "1", 'The letter "i" appears 10 times in the text.', 0.5),  # seen in a panel run's samples
    ("chain_sum", "73", "The answer is 173.", 2 / 3),
])
def test_reasoning_gym_correct_is_full_marks_only(task, reference, completion, partial):
    """A wrong answer containing the right one gets reasoning-gym's partial credit, which RL learns to collect:
    ``correct`` counts full marks only; ``partial_credit=True`` gives the scorer's own value."""
    pytest.importorskip("reasoning_gym")
    from rl_lightning.rewards.reasoning_gym import score

    answer = {"task": task, "answer": reference, "metadata": {}}
    assert score(completion, answer)["correct"] == 0.0
    assert score(completion, answer, partial_credit=True)["correct"] == pytest.approx(partial, abs=1e-12)
    assert score(f"The answer is {reference}.", answer) == {"correct": 1.0, "format": 0.0}
    assert score(reference, answer, partial_credit=True) == {"correct": 1.0, "format": 1.0}
