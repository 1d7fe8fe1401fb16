"""A small verifiers (0.4, ``verifiers.v1``) environment over the demo's local arithmetic rows, for
``model.rollout.env_path: verifiers:rl_lightning/recipes/envs/verifiers_arithmetic.py`` (`rl_lightning.envs.adapters`).

- the taskset reads ``rl_lightning/assets/data/easy.jsonl`` (no network);
- two weighted rewards, logged as ``train/reward/correct`` and ``train/reward/bare_number``;
- a calculator toolset: ``<tool_call>{"name": "calculate", "arguments": {"expression": "3 + 4"}}</tool_call>`` in a
  completion is answered with a tool message (with ``model.rollout.max_turns`` > 1).
"""

import ast
import json
import operator
import re
from pathlib import Path

import verifiers.v1 as vf

ROWS = Path(__file__).resolve().parents[2] / "assets" / "data" / "easy.jsonl"  # rl_lightning/assets/data
NUMBER = re.compile(r"-?\d+")
MAX_MAGNITUDE = 10**15
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class ArithmeticData(vf.TaskData):
    answer: str


class ArithmeticTask(vf.Task[ArithmeticData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        numbers = NUMBER.findall(trace.last_reply)
        return float(bool(numbers) and numbers[-1] == task.answer)

    @vf.reward(weight=0.5)
    async def bare_number(self, trace: vf.Trace) -> float:
        return float(NUMBER.fullmatch(trace.last_reply) is not None)

    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.ToolsetConfig())]


class CalculatorToolset(vf.Toolset):
    TOOL_PREFIX = None  # the model calls `calculate`, not `calculator_toolset_calculate`

    @vf.tool
    def calculate(self, expression: str) -> str:
        """The value of an integer expression with +, - and *."""
        return str(_evaluate(ast.parse(expression, mode="eval").body))


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, vf.TasksetConfig]):
    def load(self):
        for line in ROWS.read_text().splitlines():
            row = json.loads(line)
            yield ArithmeticTask(ArithmeticData(prompt=row["messages"], answer=row["answer"]), self.config.task)


def _evaluate(node: ast.AST) -> int:
    """The expression's value; a number beyond `MAX_MAGNITUDE` at any step is refused (the model reads the error)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        value = OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    else:
        raise ValueError(f"unsupported expression: {ast.dump(node)[:200]}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a number beyond {MAX_MAGNITUDE:.0e} (the calculator's limit)")
    return value


__all__ = ["ArithmeticTaskset"]
