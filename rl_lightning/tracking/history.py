"""A run's metric history as MLflow holds it, and where each logged value sits on the run's own axis.

The plots (`rl_lightning.tracking.plots`) and the model card (`rl_lightning.tracking.model_card`) read the MLflow run
at the end rather than collecting values during the run: a resumed run (``--ckpt_path last``) logs to the same MLflow
run, so the history holds the whole run, the part before the resume included.

Positions. The CLI's logger (`rl_lightning.tracking.logger.MLFlowLogger`) logs every value at the run's own step
(rollouts or optimizer steps done; 0 = the start), the axis the terminal counts and the charts of the MLflow UI
use, so a value's MLflow step is its position. When a resumed run logs a step again, the later value wins.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rl_lightning.compat import mlflow as mlflow_compat


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

    return [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger) and mlflow_compat.started_run_id(logger) is not None]


def read_history(client: Any, run_id: str, prefixes: tuple[str, ...] = ("train/", "val/")) -> dict[str, list[Point]]:
    """Every logged value of the run's metrics whose name starts with one of `prefixes`, in logging order."""
    names = [name for name in client.get_run(run_id).data.metrics if name.startswith(prefixes)]
    history = {}
    for name in sorted(names):
        points = [Point(m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, name)]
        history[name] = sorted(points, key=lambda p: p.timestamp)
    return history


def series(points: list[Point]) -> Series:
    """A metric on the run's axis: one value per step (the last logged), steps increasing."""
    latest: dict[int, float] = {}
    for point in sorted(points, key=lambda p: p.timestamp):
        latest[point.step] = point.value
    xs = sorted(latest)
    return Series(xs, [latest[x] for x in xs])


def all_series(history: dict[str, list[Point]]) -> dict[str, Series]:
    """`series` of every metric in `history`."""
    return {name: series(points) for name, points in history.items()}


def first_and_last(history: dict[str, list[Point]], prefix: str = "val/") -> dict[str, tuple[XY, XY]]:
    """For each metric starting with `prefix`: its first and last value on the run's axis, as ``(x, value)``."""
    return {name: ((s.x[0], s.y[0]), (s.x[-1], s.y[-1])) for name, s in all_series(history).items()
            if name.startswith(prefix) and s.x}
