"""A multi-turn tool environment: the model may call a calculator by writing ``<calc>12 * (3 + 4)</calc>``.

``interact`` answers the last call with a ``tool`` message (the conversation continues); a turn without a call ends
the conversation. ``reward_fn`` checks the final answer. The calculator evaluates arithmetic only (numbers, + - * /
and parentheses, parsed with ``ast``), never ``eval``. The expression is model output, so its work is bounded: at
most `MAX_LENGTH` characters, no number beyond `MAX_MAGNITUDE` at any step, and every arithmetic error comes back to
the model as the tool's answer (``error: ...``) instead of stopping the run.
"""

import ast
import operator
import re

from rl_lightning.rewards.math import math_reward

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_LENGTH = 1000
MAX_MAGNITUDE = 10**15


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error message the model can read."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return checked(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return checked(_OPS[type(node.op)](value(node.left), value(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return checked(_OPS[type(node.op)](value(node.operand)))
        raise ValueError("only numbers, + - * / and parentheses are allowed")

    def checked(number):
        if not abs(number) <= MAX_MAGNITUDE:  # also refuses nan and inf
            raise ValueError(f"a number beyond {MAX_MAGNITUDE:.0e} (the calculator's limit)")
        return number

    if len(expression) > MAX_LENGTH:
        return f"error: the expression is longer than {MAX_LENGTH} characters"
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def interact(messages):
    calls = _CALL.findall(messages[-1]["content"])
    if not calls:
        return []
    return [{"role": "tool", "content": calculate(calls[-1])}]


def reward_fn(messages, answer):
    return math_reward(messages, answer)


reward_fn.answer_types = math_reward.answer_types  # rows with another answer type: one line at start-up
