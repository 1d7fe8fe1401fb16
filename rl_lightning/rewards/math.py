r"""Verifiable math rewards: the final answer (``\boxed{...}``, or the last number) compared with the reference.

The answer is model output, so every step is bounded: a number is read by one regular expression and refused (it is
then compared as text) when it has more than `MAX_DIGITS` digits or an exponent beyond `MAX_EXPONENT`, before any
arithmetic; ``\boxed{1e10000000}`` costs microseconds, not the minutes ``Fraction`` would spend on ``10**10000000``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
# a decimal (sign, digits, fraction digits, exponent), or a ratio of integers
_DECIMAL = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?")
_RATIO = re.compile(r"([+-]?\d+)/(\d+)")
MAX_DIGITS = 1000
"""Most digits a number may have (integer and fraction digits; numerator and denominator each); longer: not a number."""
MAX_EXPONENT = 1000
"""Largest exponent magnitude of scientific notation (``1e1000``); larger: not a number."""


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
    """`text` as an exact number, or None when it is not one or is beyond `MAX_DIGITS`/`MAX_EXPONENT`.

    Checked before any arithmetic, so the work is linear in the length of `text`.
    """
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    frac = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    if frac:
        cleaned = f"{frac.group(1)}/{frac.group(2)}"
    ratio = _RATIO.fullmatch(cleaned)
    if ratio:
        numerator, denominator = ratio.groups()
        if max(len(numerator), len(denominator)) > MAX_DIGITS + 1 or int(denominator) == 0:
            return None
        return Fraction(int(numerator), int(denominator))
    decimal = _DECIMAL.fullmatch(cleaned)
    if decimal is None:
        return None
    sign, whole, fraction, exponent = decimal.groups()
    fraction, exponent = fraction or "", exponent or "0"
    if not whole + fraction or len(whole + fraction) > MAX_DIGITS or len(exponent.lstrip("+-0")) > 6:
        return None
    if abs(int(exponent)) > MAX_EXPONENT:
        return None
    value = int(whole + fraction) * Fraction(10) ** (int(exponent) - len(fraction))
    return -value if sign == "-" else value


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


math_reward.answer_types = (str, int, float)  # type: ignore[attr-defined]  # checked at start-up
