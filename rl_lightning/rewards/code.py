"""Code reward: run the completion's program on stdin/stdout test cases in the sandbox."""

from __future__ import annotations

import logging
import re
from typing import Any

from rl_lightning.rewards.sandbox import run_sandboxed

log = logging.getLogger(__name__)
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last fenced code block of `text`, or None."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


def code_reward(messages: list[dict], answer: Any, timeout_s: float = 5.0, memory_mb: int = 512) -> float:
    """Fraction of test cases passed by the last message's program.

    Args:
        answer: ``[{"input": str, "output": str}, ...]``; outputs are compared after stripping trailing whitespace
            on every line.

    Failures (no code block, crash, timeout, memory, blocked operation) score 0 for that case and are logged with the
    reason; nothing the program does can stop the trainer.
    """
    code = extract_code(messages[-1]["content"])
    if code is None or not answer:
        return 0.0
    passed = 0
    for case in answer:
        result = run_sandboxed(code, case["input"], timeout_s=timeout_s, memory_mb=memory_mb)
        if result.ok and _normalise(result.stdout) == _normalise(case["output"]):
            passed += 1
        elif not result.ok:
            log.info("code reward: test case failed: %s", result.reason)
    return passed / len(answer)


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
