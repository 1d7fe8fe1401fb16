"""A run's metric history as MLflow holds it, and where each logged value sits on the run's own axis.

The plots (`rl_lightning.tracking.plots`) and the model card (`rl_lightning.tracking.model_card`) read the MLflow run
at the end rather than collecting values during the run: a resumed run (``--ckpt_path last``) logs to the same MLflow
run, so the history holds the whole run, the part before the resume included.

Positions. Lightning logs a step's ``train/*`` metrics, and a validation that runs after that step, both at MLflow
step ``s`` (0-based), and PPO logs the validation of the starting policy at step 0 too. So a ``train/*`` value at
step ``s`` is placed at ``s + 1`` (optimizer steps or rollouts done), and a ``val/*`` value at one more than the step
of the last ``train/*`` value logged before it (its timestamp), 0 when none was: the start. When a resumed run logs
a step again, the later value wins.
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple


class Point(NamedTuple):
    """One logged value: MLflow's step, its timestamp (ms) and the value."""

    step: int
    timestamp: int
    value: float


class Series(NamedTuple):
    """A metric on the run's axis: x (optimizer steps or rollouts done; 0 = the start) and y, x increasing."""

    x: list[int]
    y: list[float]


XY = tuple[int, float]  # a value at its position on the run's axis


def mlflow_loggers(trainer: Any) -> list[Any]:
    """The trainer's ``MLFlowLogger`` loggers whose run has started (asking a logger for its run id would start one)."""
    from lightning.pytorch.loggers import MLFlowLogger

    return [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger) and logger._run_id is not None]


def read_history(client: Any, run_id: str, prefixes: tuple[str, ...] = ("train/", "val/")) -> dict[str, list[Point]]:
    """Every logged value of the run's metrics whose name starts with one of `prefixes`, in logging order."""
    names = [name for name in client.get_run(run_id).data.metrics if name.startswith(prefixes)]
    history = {}
    for name in sorted(names):
        points = [Point(m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, name)]
        history[name] = sorted(points, key=lambda p: p.timestamp)
    return history


def train_timeline(history: dict[str, list[Point]]) -> list[tuple[int, int]]:
    """``(timestamp, step)`` of every ``train/*`` value, in time order: when each step's training was logged."""
    return sorted((p.timestamp, p.step) for name, points in history.items() if name.startswith("train/")
                  for p in points)


def position(name: str, point: Point, timeline: list[tuple[int, int]]) -> int:
    """Where `point` of metric `name` sits on the run's axis (see the module docstring)."""
    if not name.startswith("val/"):
        return point.step + 1
    before = bisect.bisect_right(timeline, (point.timestamp, float("inf")))  # train values logged at or before it
    return timeline[before - 1][1] + 1 if before else 0


def series(name: str, points: list[Point], timeline: list[tuple[int, int]]) -> Series:
    """The metric `name` on the run's axis: one value per position (the last logged), positions increasing."""
    latest: dict[int, float] = {}
    for point in sorted(points, key=lambda p: p.timestamp):
        latest[position(name, point, timeline)] = point.value
    xs = sorted(latest)
    return Series(xs, [latest[x] for x in xs])


def all_series(history: dict[str, list[Point]]) -> dict[str, Series]:
    """`series` of every metric in `history`."""
    timeline = train_timeline(history)
    return {name: series(name, points, timeline) for name, points in history.items()}


def first_and_last(history: dict[str, list[Point]], prefix: str = "val/") -> dict[str, tuple[XY, XY]]:
    """For each metric starting with `prefix`: its first and last value on the run's axis, as ``(x, value)``."""
    return {name: ((s.x[0], s.y[0]), (s.x[-1], s.y[-1])) for name, s in all_series(history).items()
            if name.startswith(prefix) and s.x}
