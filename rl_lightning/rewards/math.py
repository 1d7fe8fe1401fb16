r"""Verifiable math rewards: the final answer (``\boxed{...}``, or the last number) compared with the reference."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    begin = i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin : i - 1].strip() if depth == 0 else None


def final_answer(text: str) -> str | None:
    """The boxed answer if there is one, else the last number in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    frac = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    if frac:
        cleaned = f"{frac.group(1)}/{frac.group(2)}"
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(prediction: str | None, reference: Any) -> bool:
    r"""Numerically equal when both parse as numbers, else equal as whitespace-normalised strings.

    For example ``1,000`` = ``1000.0`` = ``\frac{2000}{2}``.
    """
    if prediction is None:
        return False
    a, b = _as_number(prediction), _as_number(str(reference))
    if a is not None and b is not None:
        return a == b
    return " ".join(prediction.split()) == " ".join(str(reference).split())


def math_reward(messages: list[dict], answer: Any) -> float:
    """1.0 when the last message's final answer equals `answer`, else 0.0."""
    return float(answers_match(final_answer(messages[-1]["content"]), answer))
