"""Pins `rl_lightning.compat.mlflow`: the private attributes of Lightning's ``MLFlowLogger`` and MLflow's private
tracking-URI scope still exist, with the shape relied on.

A failure names the private name, the versions tested and the module to update (`_pinned`).
"""

from importlib.metadata import version

import mlflow
from lightning.pytorch.loggers import MLFlowLogger

from rl_lightning.compat import mlflow as compat


def _pinned(condition: object, name: str, change: str = "is gone") -> None:
    assert condition, (f"{compat.TESTED} (installed mlflow {version('mlflow')}, lightning {version('lightning')}): "
                       f"{name} {change}; update rl_lightning/compat/mlflow.py")


def test_the_loggers_private_attributes_before_and_after_its_run_starts(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="pinned", run_name="a run", tracking_uri=uri)
    for name in ("_run_id", "_run_name", "_experiment_name", "_tracking_uri", "_initialized"):
        _pinned(hasattr(logger, name), f"MLFlowLogger.{name}")
    assert compat.started_run_id(logger) is None  # reading it started nothing
    assert (compat.run_name(logger), compat.experiment_name(logger), compat.tracking_uri(logger)) == (
        "a run", "pinned", uri)
    run_id = logger.run_id  # starts the run
    _pinned(compat.started_run_id(logger) == run_id, "MLFlowLogger._run_id", "no longer holds the started run's id")
    logger.experiment.delete_run(run_id)
    compat.forget_run(logger)
    logger.finalize("failed")  # leaves the deleted run alone
    _pinned(logger.experiment.get_run(run_id).info.lifecycle_stage == "deleted", "MLFlowLogger._initialized",
            "no longer stops finalize from touching the run")


def test_the_tracking_uri_scope(tmp_path):
    before = mlflow.get_tracking_uri()
    inside = f"sqlite:///{tmp_path / 'other.db'}"
    try:
        with compat.tracking_uri_scope(inside):
            seen = mlflow.get_tracking_uri()
    except ImportError as error:
        seen = f"cannot import it ({error})"
    _pinned(seen == inside, "mlflow.tracking._tracking_service.utils._use_tracking_uri", f"gave {seen!r}")
    assert mlflow.get_tracking_uri() == before
