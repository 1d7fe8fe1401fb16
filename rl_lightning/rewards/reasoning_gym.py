"""Reward for reasoning-gym rows (`rl_lightning.data.reasoning_gym`): the task's own scorer on the extracted answer.

Each RL row's ``answer`` is ``{"task", "answer", "metadata"}``, so this one function scores any task. Two components,
combined by the rollout's ``reward_weights`` (unweighted they sum):

- ``correct``: 1 when reasoning-gym's ``score_answer`` gives full marks to the answer extracted from the completion
  (tolerating how models format it, see `extract_answer`), else 0. Many tasks' scorers give partial credit to a
  wrong answer that contains the right one ("10" for "1" scores 0.5): RL learns to collect it, and on the panel of
  issue 40 (``docs/real-model.md``) a run doing so raised its training reward while its held-out accuracy fell
  below base. `score` with ``partial_credit=True`` gives the scorer's own value, for an environment of your own;
- ``format``: 1 when the completion is the answer alone (or one ``<answer>…</answer>`` block), as the prompt asks.

Some tasks' scorers evaluate text as Python (``eval``, or sympy's parser, which calls it): `EVALUATING_TASKS`.
Their answers are scored in the code sandbox's isolation (`rl_lightning.rewards.scorer_sandbox`), never in this
process; the others in this process. `check_task_scoring` refuses an evaluating task at start-up where the sandbox
cannot run.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from rl_lightning.errors import ConfigError, DataError
from rl_lightning.rewards import isolation
from rl_lightning.rewards.math import last_boxed

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_PHRASE = re.compile(r"\banswer\b[^\n:=]*?(?:\bis\b|:|=)\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
FULL_MARKS = 1.0 - 1e-9  # a scorer's 1.0, allowing for a float sum that lands a hair below it


def _is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text.strip()) is not None


def extract_answer(text: str, reference: str = "") -> str | None:
    r"""The answer in a completion, first match wins.

    The last ``<answer>…</answer>``, the last ``\boxed{…}``, the text after "the answer is" / "answer …is" /
    "answer:" on its line; then, for a numeric reference, the last number, else the last non-empty line. Surrounding
    whitespace, ``**`` and a final period are dropped.
    """
    candidate = None
    tags = _TAG.findall(text)
    if tags:
        candidate = tags[-1]
    elif (boxed := last_boxed(text)) is not None:
        candidate = boxed
    else:
        phrases = [m.group(1) for line in text.splitlines() if (m := _PHRASE.search(line))]
        if phrases:
            candidate = phrases[-1]
        elif _is_number(reference):
            numbers = _NUMBER.findall(text)
            candidate = numbers[-1] if numbers else None
        else:
            lines = [line for line in text.splitlines() if line.strip()]
            candidate = lines[-1] if lines else None
    if candidate is None:
        return None
    candidate = candidate.strip().strip("*").strip()
    if candidate.endswith(".") and not candidate.endswith(".."):
        candidate = candidate[:-1].rstrip()
    if _is_number(reference) and not _is_number(candidate):  # "1 + 5 = 6" or "6 apples": the last number
        numbers = _NUMBER.findall(candidate)
        candidate = numbers[-1] if numbers else candidate
    return candidate


# Tasks of reasoning-gym 0.1.25 whose score_answer may evaluate text, found by the rule of
# `rl_lightning.rewards.reasoning_gym_scan` (tests/rewards/test_reasoning_gym_sandbox.py rescans the installed
# reasoning-gym and fails when a task it finds is missing here): scored in the sandbox.
EVALUATING_TASKS = {
    "binary_matrix": "eval() of the answer",
    "bitwise_arithmetic": "eval() of the row's metadata problem",
    "composite": "delegates to any task's scorer",
    "countdown": "sympy parse_expr (eval) of the answer",
    "intermediate_integration": "sympy parse_expr (eval) of the answer",
    "n_queens": "eval() of the answer",
    "number_sorting": "eval() of the row's answer",
    "polynomial_multiplication": "sympy parse_expr (eval) of the answer",
    "puzzle24": "sympy parse_expr (eval) of the answer",
    "simple_integration": "sympy parse_expr (eval) of the answer",
    "spiral_matrix": "eval() of the answer",
    "string_insertion": "eval() of the answer",
}


def check_task_scoring(task: str) -> None:
    """Where `task`'s scorer evaluates text, make sure it can run in the sandbox: a `ConfigError` in one line if not.

    Call at start-up (data loading does, for ``reasoning_gym:`` paths); logs the isolation level once.
    """
    if task not in EVALUATING_TASKS:
        return
    try:
        isolation.require_isolation()
    except ConfigError:
        raise ConfigError(f"reasoning-gym task '{task}': its scorer evaluates model or data text as Python "
                          f"({EVALUATING_TASKS[task]}), so it is scored only in the code sandbox, which has no OS "
                          f"isolation here; {isolation.INSTALL_HINT}, or set {isolation.OPT_IN}=1 to score it "
                          "unisolated on a machine where that is acceptable") from None


@cache
def _scorer(task: str) -> Any:
    from rl_lightning.data.reasoning_gym import import_reasoning_gym

    return import_reasoning_gym().get_score_answer_fn(task)


def score(completion: str, answer: dict, partial_credit: bool = False) -> dict[str, float]:
    """``{"correct": ..., "format": ...}`` for one completion of a reasoning-gym row (its ``answer`` field).

    ``correct`` is 1 for full marks from the task's scorer and 0 otherwise; with `partial_credit`, the scorer's value
    (in [0, 1]).
    """
    reference = str(answer["answer"])
    extracted = extract_answer(completion, reference)
    entry = {"question": "", "answer": reference, "metadata": answer.get("metadata", {})}
    correct = _correct(str(answer["task"]), extracted, entry) if extracted is not None else 0.0
    if not partial_credit:
        correct = float(correct >= FULL_MARKS)
    stripped = completion.strip()
    bare = stripped == extracted or (len(_TAG.findall(stripped)) == 1 and _TAG.fullmatch(stripped) is not None)
    return {"correct": correct, "format": float(bool(bare))}


def _correct(task: str, extracted: str, entry: dict) -> float:
    if task not in EVALUATING_TASKS:
        return float(_scorer(task)(extracted, entry))
    from rl_lightning.rewards.scorer_sandbox import shared_scorer

    check_task_scoring(task)
    return shared_scorer().score(task, extracted, entry)


def reward_fn(messages: list[dict], answer: dict) -> dict[str, float]:
    """Environment entry point: score the last (assistant) message against the row's reasoning-gym answer."""
    return score(messages[-1]["content"], answer)


def check_answer(answer: dict, where: str) -> None:
    """Start-up check of one prompt row's `answer` (named `where`): a task this machine can score.

    A row of a task whose scorer evaluates text is refused in one line where the sandbox cannot run
    (`check_task_scoring`), before any model loads.
    """
    task = answer.get("task")
    if not isinstance(task, str) or "answer" not in answer:
        raise DataError(f"{where}: 'answer' is not a reasoning-gym answer (a dict with 'task', 'answer' and "
                        f"'metadata', as `python -m rl_lightning.data.reasoning_gym` writes): got keys {sorted(answer)}")
    try:
        check_task_scoring(task)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


reward_fn.answer_types = (dict,)  # type: ignore[attr-defined]  # checked at start-up, then `check_answer` per row
reward_fn.check_answer = check_answer  # type: ignore[attr-defined]
