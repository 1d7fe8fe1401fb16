"""Format reward for ``<think>...</think><answer>...</answer>`` completions (DeepSeek-R1 style)."""

from __future__ import annotations

import re
from typing import Any

from rl_lightning.rewards.math import answers_match

# Exactly one block of each: the contents may not contain another think/answer tag.
_FORMAT = re.compile(
    r"^\s*<think>((?:(?!</?think>|</?answer>).)*)</think>\s*<answer>((?:(?!</?think>|</?answer>).)*)</answer>\s*$",
    re.DOTALL,
)


def think_answer_format(messages: list[dict], answer: Any = None) -> float:
    """1.0 when the last message is exactly one think block followed by one answer block, else 0.0."""
    return float(_FORMAT.match(messages[-1]["content"]) is not None)


def think_answer_reward(messages: list[dict], answer: Any) -> float:
    """1.0 for the right format with a correct answer inside ``<answer>``, 0.1 for the right format only, else 0."""
    match = _FORMAT.match(messages[-1]["content"])
    if match is None:
        return 0.0
    return 1.0 if answers_match(match.group(2).strip(), answer) else 0.1


think_answer_reward.answer_types = (str, int, float)  # type: ignore[attr-defined]  # checked at start-up
