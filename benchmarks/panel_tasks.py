"""The panel's tasks (`benchmarks/panel.py`): the rule that picks them, and their data paths.

The rule, fixed before any accuracy was measured:

1. two fixed tasks: the demo's two-term sums and products of two 1-2-digit numbers (`FIXED`);
2. candidates: every other reasoning-gym task with its *default* config that passes `check_candidate`: 1,256
   distinct questions (1,000 training + 256 held out) generated offline within a minute, every reference answer an
   integer of at most 4 characters (a short number, as the fixed tasks have: a task whose scorer accepts any valid
   answer and stores a placeholder such as ``None`` does not count), every question at most 600 characters (the
   prompt well inside the recipe's 256 tokens);
3. the candidates in alphabetical order, each accepted when the starting model's greedy accuracy on its 256 held-out
   questions is in [0.02, 0.40] (the panel spans 0-40%; below 2%, 5 of 256, a run cannot measurably lose accuracy),
   else passed over for the next, until four are accepted;
4. if the candidates run out first (they did, 2026-11-28: 13 candidates, three accepted), the next panel task comes
   from widening step 2 to any answer of at most 8 characters that is not a placeholder (``None``), the new
   candidates taken as in step 3 (written down before any of them was measured). Measured at stop 45: of the
   widened candidates (color_cube_rotation, course_schedule, game_of_life_halting, isomorphic_strings, ransom_note,
   syllogism, tsumego), the first three were passed over (base 0.000, 0.484, 1.000) and ``isomorphic_strings``
   (base 0.031; answers ``True``/``False``) is the sixth task.

``python benchmarks/panel_tasks.py`` prints every task's filter result (step 2) as JSON lines.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SUMS = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2"
PRODUCTS = "reasoning_gym:products?min_terms=2&max_terms=2&min_digits=1&max_digits=2"
FIXED = (SUMS, PRODUCTS)
TRAIN_SIZE, TEST_SIZE, DATA_SEED = 1000, 256, 0
MAX_ANSWER_CHARS, MAX_QUESTION_CHARS, GENERATE_S = 4, 600, 60
WIDENED_ANSWER_CHARS, PLACEHOLDERS = 8, ("None",)  # step 4
ACCEPT = (0.02, 0.40)  # base greedy accuracy a candidate must have
# Step 3's outcome (benchmarks/results/panel_cpu.md has the base accuracies): the accepted candidates, in order, and
# the ones passed over.
ACCEPTED = ("reasoning_gym:aiw", "reasoning_gym:lcm", "reasoning_gym:letter_counting",
            "reasoning_gym:isomorphic_strings")  # the last by step 4
SKIPPED = {f"reasoning_gym:{name}": f"base {base}" for name, base in (
    ("binary_alternation", 0.004), ("count_bits", 0.000), ("count_primes", 0.004), ("gcd", 0.012),
    ("largest_island", 0.000), ("leg_counting", 0.000), ("maze", 0.012), ("self_reference", 0.000),
    ("simple_equations", 0.000), ("simple_geometry", 0.000),
    ("color_cube_rotation", 0.000), ("course_schedule", 0.484), ("game_of_life_halting", 1.000))}  # step 4
PANEL = FIXED + ACCEPTED


def data_path(task: str, split: str) -> str:
    """`task`'s (a ``reasoning_gym:`` path without sizes) data path of `split` with the panel's sizes and data seed."""
    sep = "&" if "?" in task else "?"
    return f"{task}{sep}train_size={TRAIN_SIZE}&test_size={TEST_SIZE}&seed={DATA_SEED}&split={split}"


def short_name(task: str) -> str:
    """A folder name for `task`: ``chain_sum_min_terms2_max_terms2_max_digits2``."""
    body = task.split(":", 1)[1]
    return body.replace("?", "_").replace("&", "_").replace("=", "")


def check_candidate(name: str) -> dict[str, Any]:
    """Step 2 of the rule for the reasoning-gym task `name` (default config): ``passes`` and why."""
    from rl_lightning.data.reasoning_gym import generate
    from rl_lightning.errors import ConfigError

    try:
        entries = generate(name, TRAIN_SIZE, TEST_SIZE, DATA_SEED, ())
    except (ConfigError, Exception) as e:  # noqa: BLE001 - a task that cannot generate is not a candidate
        return {"task": name, "passes": False, "why": f"generation: {str(e)[:120]}"}
    rows = entries["test"] + entries["train"]
    answer = max(len(r["answer"].strip()) for r in rows)
    question = max(len(r["question"]) for r in rows)
    integers = all(re.fullmatch(r"-?\d+", r["answer"].strip()) for r in rows)
    placeholder = any(r["answer"].strip() in PLACEHOLDERS for r in rows)
    passes = integers and answer <= MAX_ANSWER_CHARS and question <= MAX_QUESTION_CHARS
    widened = not placeholder and answer <= WIDENED_ANSWER_CHARS and question <= MAX_QUESTION_CHARS
    return {"task": name, "passes": passes, "passes_step4": widened and not passes, "max_answer_chars": answer,
            "max_question_chars": question, "integer_answers": integers, "placeholder_answers": placeholder,
            "example": [rows[0]["question"][:80], rows[0]["answer"]]}


def _child(name: str, queue: Any) -> None:
    os.chdir(tempfile.mkdtemp(prefix="panel_candidate_"))  # some tasks write files into the working folder
    queue.put(check_candidate(name))


def candidates() -> None:
    """Print step 2's result for every reasoning-gym task (each in a child process, stopped after `GENERATE_S`)."""
    from rl_lightning.data.reasoning_gym import task_names

    fixed = {t.split(":", 1)[1].split("?")[0] for t in FIXED}
    for name in task_names():
        if name in fixed:
            continue
        queue: Any = multiprocessing.Queue()
        child = multiprocessing.Process(target=_child, args=(name, queue))
        child.start()
        child.join(GENERATE_S)
        if child.is_alive():
            child.kill()
            result = {"task": name, "passes": False, "why": f"generation took over {GENERATE_S} s"}
        else:
            result = queue.get() if not queue.empty() else {"task": name, "passes": False, "why": "child died"}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    candidates()
