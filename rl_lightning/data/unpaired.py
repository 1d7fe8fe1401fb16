"""Unpaired preference examples for KTO: a prompt, one completion, and whether that completion is desirable.

Rows are ``{"messages" | "prompt": ..., "completion": str, "label": bool}``; a paired row
``{"messages", "chosen", "rejected"}`` gives two examples (chosen desirable, rejected undesirable), as TRL's
``unpair_preference_dataset`` does. Both kinds may be mixed in one file.

KTO's reference point (its KL term) is estimated from *mismatched* (prompt, completion) pairs. TRL rotates the
completions by one within each per-device batch of a sequentially read dataset; here each example's prompt is followed
by the completion of the *previous row's* example on the same side (chosen after chosen, rejected after rejected;
the first row takes the last row's), fixed at start-up, so shuffling is allowed and every data-parallel layout sees
the same pairs. Each example and its mismatched sequence form one packing unit: in a micro-batch sequence ``2e`` is
example e and ``2e + 1`` its mismatched sequence, like a pair's chosen and rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl_lightning.data.loading import Rows
from rl_lightning.data.rows import is_unpaired, row_prompt
from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages


@dataclass
class Unpaired:
    """A tokenised KTO example and its mismatched sequence; `fields` carries ``label`` (1 desirable, 0 not)."""

    example: TokenizedExample
    mismatched: TokenizedExample
    fields: dict[str, float] = field(default_factory=dict)

    @property
    def sequences(self) -> tuple[TokenizedExample, TokenizedExample]:
        """The example and its mismatched sequence, in that order (they share a micro-batch)."""
        return self.example, self.mismatched


@dataclass
class _Side:
    prompt_ids: list[int]
    completion_ids: list[int]
    label: float


def row_sides(row: dict[str, Any]) -> list[tuple[str, float]]:
    """(completion, label) of each example a validated row gives: one if unpaired, chosen and rejected if paired."""
    if is_unpaired(row):
        return [(row["completion"], float(row["label"]))]
    return [(row["chosen"], 1.0), (row["rejected"], 0.0)]


def _split(tokenizer: Any, prompt: list[dict], completion: str, apply_chat_template: bool,
           where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids): the completion is the last assistant turn, so every target token ends the row."""
    conversation = prompt + [{"role": "assistant", "content": completion}]
    whole = tokenize_messages(tokenizer, conversation, None, apply_chat_template, where, last_turn_only=True)
    start = whole.loss_mask.index(1) if 1 in whole.loss_mask else len(whole.input_ids)
    return whole.input_ids[:start], whole.input_ids[start:]


def _sequence(prompt_ids: list[int], completion_ids: list[int], max_length: int) -> TokenizedExample:
    ids = prompt_ids + completion_ids
    mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    return TokenizedExample(ids[:max_length], mask[:max_length], truncated=len(ids) > max_length)


def unpaired_units(tokenizer: Any, rows: Rows, max_length: int, apply_chat_template: bool) -> tuple[list, list]:
    """Every example of validated `rows` as an `Unpaired` unit, in row order, with the row location of each.

    Examples whose completion is truncated away entirely are left out (their mismatched partners stay sources).
    """
    per_row: list[list[_Side]] = []
    for i, row in enumerate(rows.rows):
        prompt = row_prompt(row, rows.locate(i))
        sides = []
        for completion, label in row_sides(row):
            prompt_ids, completion_ids = _split(tokenizer, prompt, completion, apply_chat_template, rows.locate(i))
            sides.append(_Side(prompt_ids, completion_ids, label))
        per_row.append(sides)
    units, locations = [], []
    for r, sides in enumerate(per_row):
        previous = per_row[r - 1]  # r = 0 wraps to the last row
        for s, side in enumerate(sides):
            source = previous[min(s, len(previous) - 1)]
            example = _sequence(side.prompt_ids, side.completion_ids, max_length)
            mismatched = _sequence(side.prompt_ids, source.completion_ids, max_length)
            units.append(Unpaired(example, mismatched, {"label": side.label}))
            locations.append(rows.locate(r))
    return units, locations
