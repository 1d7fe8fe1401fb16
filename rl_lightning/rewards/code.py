"""Code reward: run the completion's program on stdin/stdout test cases in the sandbox.

Test cases come as ``[{"input": str, "output": str}, ...]`` or in the PRIME / APPS / TACO shape
``{"inputs": [...], "outputs": [...]}``, bare or under a ``test_cases`` key, as a dict or as its JSON string (PRIME's
Eurus-2 rows store ``test_cases`` as a string). Call-based cases (``fn_name``) are not run: the reward says so.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from rl_lightning.rewards.sandbox import run_sandboxed

log = logging.getLogger(__name__)
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
TOTAL_TIMEOUT_S = 30.0
"""`code_reward`'s default budget for all of a row's test cases: half the default ``reward_timeout_s``."""
MIN_CASE_S = 0.05
"""A test case is not started with less of the budget left than this (a sandbox takes about that to start)."""


def extract_code(text: str) -> str | None:
    """The last fenced code block of `text`, or None."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


def code_reward(messages: list[dict], answer: Any, timeout_s: float = 5.0, memory_mb: int = 512,
                total_timeout_s: float = TOTAL_TIMEOUT_S) -> float:
    """Fraction of test cases passed by the last message's program.

    Failures (no code block, crash, timeout, memory, blocked operation) score 0 for that case and are logged with the
    reason; nothing the program does can stop the trainer. The cases run one after another within one budget,
    `total_timeout_s`: each gets ``timeout_s`` or what is left of the budget if less, and cases left when it is spent
    are not run and score 0, so a program that loops forever costs at most `total_timeout_s` whatever the number of
    cases (keep it below ``model.rollout.reward_timeout_s``, 60 s by default, or the worker is killed instead).

    Args:
        messages: the conversation; the program is the last fenced code block of its last message.
        answer: the test cases in any shape `read_test_cases` reads; outputs are compared after stripping trailing
            whitespace on every line.
        timeout_s: wall-clock limit per test case, in seconds.
        memory_mb: memory limit of the program, in MiB.
        total_timeout_s: wall-clock budget of all the test cases together, in seconds.
    """
    if not total_timeout_s > 0 or not timeout_s > 0:
        raise ValueError(f"code_reward: timeout_s and total_timeout_s must be > 0, got {timeout_s}, {total_timeout_s}")
    cases = read_test_cases(answer)
    code = extract_code(messages[-1]["content"])
    if code is None or not cases:
        return 0.0
    deadline = time.monotonic() + total_timeout_s
    passed = 0
    for index, case in enumerate(cases):
        left = deadline - time.monotonic()
        if left < MIN_CASE_S:
            log.info("code reward: %d of %d test cases not run: total_timeout_s=%s spent", len(cases) - index,
                     len(cases), total_timeout_s)
            break
        result = run_sandboxed(code, case["input"], timeout_s=min(timeout_s, left), memory_mb=memory_mb)
        if result.ok and _normalise(result.stdout) == _normalise(case["output"]):
            passed += 1
        elif not result.ok:
            log.info("code reward: test case failed: %s", result.reason)
    return passed / len(cases)


code_reward.answer_types = (str, list, dict)  # type: ignore[attr-defined]  # the test cases, checked at start-up


def read_test_cases(answer: Any) -> list[dict[str, str]]:
    """``[{"input": str, "output": str}, ...]`` from the shapes the module docstring lists.

    An input or output given as a list of lines is joined with newlines. Raises ValueError naming what is wrong with
    any other shape.
    """
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"code test cases: a string answer must be JSON ({e})") from None
    if isinstance(answer, dict) and "test_cases" in answer:
        return read_test_cases(answer["test_cases"])
    if isinstance(answer, dict):
        if answer.get("fn_name"):
            raise ValueError(f"code test cases: call-based cases (fn_name={answer['fn_name']!r}) are not supported; "
                             "give stdin/stdout cases")
        inputs, outputs = answer.get("inputs"), answer.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("code test cases: expected {'inputs': [...], 'outputs': [...]} of equal length, got keys "
                             f"{sorted(answer)}")
        answer = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(answer, list) or not all(isinstance(c, dict) and {"input", "output"} <= set(c) for c in answer):
        raise ValueError("code test cases: expected [{'input': ..., 'output': ...}, ...] or {'inputs': [...], "
                         f"'outputs': [...]}}, got {type(answer).__name__}")
    return [{"input": _text(c["input"]), "output": _text(c["output"])} for c in answer]


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
