"""The panel's bookkeeping (`benchmarks/panel.py`): units, the results file, and the Markdown table.

Pure functions on JSON records, no model: `tests/benchmarks/test_panel.py` runs them on a small fake results file.

A *unit* is one measurement, named by ``(task, seed, setting)``: the setting ``base`` (seed 0) is the starting model's
held-out greedy accuracy on the task, any other setting a GRPO run with that seed and its held-out accuracy after. The
results file holds one JSON object per finished unit, one a line, appended as each finishes; a unit already in it is
not run again, and a last line cut short (the sweep killed while writing) is ignored, so a sweep can be stopped at any
time and started again.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BASE = "base"


def unit_key(record: dict[str, Any]) -> tuple[str, int, str]:
    """The unit `record` measured: ``(task, seed, setting)``."""
    return record["task"], int(record["seed"]), record["setting"]


def load_results(path: Path) -> list[dict[str, Any]]:
    """The finished units in the results file `path` (none when it does not exist); a line that is not a whole JSON
    object (a write cut short) is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and {"task", "seed", "setting"} <= record.keys():
            records.append(record)
    return records


def append_result(path: Path, record: dict[str, Any]) -> None:
    """Append `record` as one line of the results file `path` (created with its folder if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.is_file() else ""
    prefix = "\n" if text and not text.endswith("\n") else ""  # a cut-short last line stays a line of its own
    with path.open("a") as f:
        f.write(prefix + json.dumps(record, sort_keys=True) + "\n")


def pending(units: Iterable[tuple[str, int, str]], records: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """The `units` not yet in `records`, in their order, each once."""
    done = {unit_key(r) for r in records}
    todo: list[tuple[str, int, str]] = []
    for unit in units:
        if unit not in done and unit not in todo:
            todo.append(unit)
    return todo


def sweep_units(tasks: list[str], seeds: list[int], settings: list[str]) -> list[tuple[str, int, str]]:
    """Every unit of a sweep, one task at a time: each task's base, then its settings for each seed."""
    units = []
    for task in tasks:
        units.append((task, 0, BASE))
        units += [(task, seed, setting) for seed in seeds for setting in settings]
    return units


def _cell(values: list[float]) -> str:
    if not values:
        return ""
    if len(values) == 1:
        return f"{values[0]:.3f} (1 seed)"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({len(values)} seeds)"


def _seeds(runs: list[dict[str, Any]]) -> str:
    """Each run's accuracy in seed order, the seed named where the seeds are not 0, 1, 2, ..."""
    plain = [r["seed"] for r in runs] == list(range(len(runs)))
    return ", ".join(f"{r['greedy']:.3f}" if plain else f"{r['greedy']:.3f} (seed {r['seed']})" for r in runs)


def _runs(latest: dict[tuple[str, int, str], dict[str, Any]], task: str, setting: str) -> list[dict[str, Any]]:
    """`task`'s records of `setting`, in seed order."""
    return [r for (t, _, s), r in sorted(latest.items()) if t == task and s == setting]


def noise_points(accuracy: float, questions: int) -> float:
    """Two standard errors of an accuracy measured on `questions` questions, in points: 2 sqrt(p (1 - p) / n)."""
    return 200 * math.sqrt(accuracy * (1 - accuracy) / questions)


def table(records: list[dict[str, Any]], tasks: list[str] | None = None, settings: list[str] | None = None,
          per_seed: bool = False) -> str:
    """The Markdown table: per task its base greedy accuracy, the noise, and, per setting, the mean ± sample std over
    seeds of the accuracy after (`per_seed`: each seed's, in seed order) and the worst seed's change (min over seeds
    of after - base, in points).

    The noise is two standard errors of the base accuracy over the task's held-out questions, in points
    (`noise_points`): a worst change below minus the noise is a loss, marked ✗.

    `tasks` / `settings` fix the rows' / columns' order (None: as first seen in `records`; an empty list: none); a
    task's later record of one unit wins over an earlier one.
    """
    latest = {unit_key(r): r for r in records}
    if tasks is None:
        tasks = list(dict.fromkeys(r["task"] for r in records))
    if settings is None:
        settings = list(dict.fromkeys(r["setting"] for r in records if r["setting"] != BASE))
    header = ["task", "base", "noise (points)"]
    for setting in settings:
        header += [f"{setting}: after" + (", by seed" if per_seed else ""), f"{setting}: min Δ (points)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task in tasks:
        base_record = latest.get((task, 0, BASE))
        base = base_record["greedy"] if base_record else None
        noise = noise_points(base, base_record.get("questions", 256)) if base_record else None
        row = [f"`{task}`", "" if base is None else f"{base:.3f}", "" if noise is None else f"{noise:.1f}"]
        for setting in settings:
            runs = _runs(latest, task, setting)
            after = [r["greedy"] for r in runs]
            change = 100 * (min(after) - base) if after and base is not None else None
            worst = "" if change is None else f"{change:+.1f}" + (" ✗" if noise is not None and change < -noise else "")
            row += [_seeds(runs) if per_seed else _cell(after), worst]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], tasks: list[str], settings: list[str], path: Path) -> int:
    """``--plot``: each task's training correctness per rollout (``train/reward/correct``), a line per seed of each
    of `settings`; the title gives the base accuracy, the legend each setting's accuracies after. Saved as the PNG
    `path`; returns the number of curves drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {unit_key(r): r for r in records}
    shown = [t for t in tasks if any(t == k[0] and k[2] in settings for k in latest)]
    columns = 3
    rows = max(1, math.ceil(len(shown) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    drawn = 0
    for ax, task in zip(axes.flat, shown, strict=False):
        base = latest.get((task, 0, BASE), {}).get("greedy")
        for i, setting in enumerate(settings):
            runs = _runs(latest, task, setting)
            after = ", ".join(f"{x['greedy']:.2f}" for x in runs)
            for r in runs:
                curve = (r.get("curves") or {}).get("train/reward/correct") or []
                ax.plot(range(1, len(curve) + 1), curve, color=f"C{i}", alpha=0.8, linestyle="-" if i == 0 else "--",
                        label=f"{setting} (after: {after})" if r is runs[0] else None)
                drawn += 1
        name = task.split(":", 1)[-1].split("?")[0]  # a data path without its "reasoning_gym:" too
        ax.set_title(f"{name}: base {base:.2f}" if base is not None else name, fontsize=10)
        ax.set_xlabel("rollout", fontsize=8)
        ax.set_ylabel("training correctness", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return drawn
