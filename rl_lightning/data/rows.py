"""Row validation for the three task formats (seed formats, see README "Data formats").

- SFT: ``{"messages": [...]}`` with at least one assistant message.
- Preference (RM, DPO): ``{"messages": [prompt...], "chosen": str, "rejected": str}``; for KTO also unpaired
  ``{"messages" | "prompt": ..., "completion": str, "label": bool}``.
- Prompts (PPO family): ``{"messages": [prompt...], "answer": ...}``, optionally ``"completion": str`` (a reference
  completion, for distillation's dataset completions).

Every error names the file and row (see `Rows.locate`), the field, the value and what to do.
"""

from __future__ import annotations

import math
from typing import Any

from rl_lightning.data.loading import Rows
from rl_lightning.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_messages(messages: Any, where: str, key: str = "messages") -> None:
    """Raise `DataError` unless `messages` is a non-empty list of ``{"role": ROLE, "content": str}`` dicts."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: '{key}' must be a non-empty list of messages, got {_short(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {key}[{i}] must be a dict with 'role' and 'content', got {_short(message)}")
        for field in ("role", "content"):
            if field not in message:
                raise DataError(f"{where}: {key}[{i}] has no '{field}' field (has {sorted(message)}); every message "
                                f"needs 'role' (one of {', '.join(ROLES)}) and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: {key}[{i}] has unknown role {_short(role)}; allowed roles: {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise DataError(
                f"{where}: {key}[{i}] content must be a string, got {type(content).__name__} {_short(content)}"
            )


def _require(row: Any, where: str, key: str, fmt: str) -> Any:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object per row, got {type(row).__name__}")
    if key not in row:
        raise DataError(f"{where}: missing '{key}' (have {sorted(row)}); {fmt} rows need it")
    return row[key]


def check_sft_rows(rows: Rows) -> None:
    """Validate SFT rows: messages with at least one assistant message (otherwise nothing is learned)."""
    _check_nonempty(rows)
    for i, row in enumerate(rows.rows):
        where = rows.locate(i)
        messages = _require(row, where, "messages", "SFT")
        check_messages(messages, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message, so there is nothing to train on; add one or drop the row")


def is_unpaired(row: Any) -> bool:
    """Whether a preference row is an unpaired example (``completion`` and ``label``) rather than a pair."""
    return isinstance(row, dict) and "chosen" not in row and ("completion" in row or "label" in row)


def row_prompt(row: dict, where: str) -> list[dict]:
    """The prompt messages of a preference row: ``messages``, or ``prompt`` (a string is one user message)."""
    if "messages" not in row and isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    messages = row["messages"] if "messages" in row or "prompt" not in row else row["prompt"]
    check_messages(messages, where, "messages" if "messages" in row else "prompt")
    return messages


def check_preference_rows(rows: Rows, unpaired_ok: bool = False) -> None:
    """Validate RM/DPO rows: a prompt in `messages` and two different string completions.

    With `unpaired_ok` (KTO), a row may instead be one example ``{"messages" | "prompt", "completion": str,
    "label": bool}``; without it such a row is refused with the key that accepts it.
    """
    _check_nonempty(rows)
    for i, row in enumerate(rows.rows):
        where = rows.locate(i)
        if is_unpaired(row):
            if not unpaired_ok:
                raise DataError(f"{where}: an unpaired row ('completion', 'label') but this loss trains on pairs "
                                "('chosen', 'rejected'); set model.loss_type: kto (DPO task) or give paired rows")
            _check_unpaired(row, where)
            continue
        check_messages(_require(row, where, "messages", "preference"), where)
        chosen = _require(row, where, "chosen", "preference")
        rejected = _require(row, where, "rejected", "preference")
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__} {_short(value)}")
        if chosen == rejected:
            raise DataError(f"{where}: 'chosen' and 'rejected' are identical ({_short(chosen)}); drop the row")
        margin = row.get("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
            raise DataError(f"{where}: 'margin' must be a finite number, got {_short(margin)}; fix or remove it")


def _check_unpaired(row: dict, where: str) -> None:
    if "messages" not in row and "prompt" not in row:
        raise DataError(f"{where}: missing 'messages' (or 'prompt') (have {sorted(row)}); unpaired rows need a prompt")
    row_prompt(row, where)
    completion = _require(row, where, "completion", "unpaired preference")
    if not isinstance(completion, str):
        raise DataError(f"{where}: 'completion' must be a string, got {type(completion).__name__} {_short(completion)}")
    label = _require(row, where, "label", "unpaired preference")
    if not isinstance(label, bool):
        raise DataError(f"{where}: 'label' must be true (desirable) or false (undesirable), got {_short(label)}")


def check_prompt_rows(rows: Rows) -> None:
    """Validate RL rows: a prompt in `messages` and an `answer` the reward function checks against."""
    _check_nonempty(rows)
    for i, row in enumerate(rows.rows):
        where = rows.locate(i)
        check_messages(_require(row, where, "messages", "RL prompt"), where)
        _require(row, where, "answer", "RL prompt")
        if "completion" in row and not isinstance(row["completion"], str):  # optional: GKD's dataset completion
            raise DataError(f"{where}: 'completion' must be the reference completion's text, got "
                            f"{type(row['completion']).__name__} {_short(row['completion'])}")


def check_answer_type(answer: Any, where: str, expected: tuple[type, ...], reward: str) -> None:
    """Raise `DataError` unless a prompt row's `answer` is an instance of one of the `expected` types.

    `reward` names the reward function that declares them (its ``answer_types``). A bool is not a number here (JSON's
    ``true`` in a math row is a mistake), unless `expected` names ``bool``.
    """
    if isinstance(answer, expected) and (not isinstance(answer, bool) or bool in expected):
        return
    names = " or ".join(t.__name__ for t in expected)
    raise DataError(f"{where}: 'answer' is {type(answer).__name__} {_short(answer)}, but {reward} expects {names} "
                    "(it would score 0 forever): fix the row or point env_path at the reward for this data")


def _check_nonempty(rows: Rows) -> None:
    if len(rows) == 0:
        raise DataError(f"dataset '{rows.source}' is empty; point `path` at a file with at least one row")
