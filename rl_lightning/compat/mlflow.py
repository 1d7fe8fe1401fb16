"""Private names of MLflow and of Lightning's ``MLFlowLogger``, behind named functions (mlflow 3.x, lightning 2.5-2.6).

Lightning's logger keeps what it was given in private attributes; its public ``run_id`` and ``experiment`` would
start a run (on a rank that logs nothing, or after the run failed), so these read the attributes instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

TESTED = "mlflow 3.x, lightning 2.5-2.6"


def started_run_id(logger: Any) -> str | None:
    """The id of the logger's MLflow run, None while it has none (``_run_id``; ``run_id`` would start one)."""
    return logger._run_id


def run_name(logger: Any) -> str | None:
    """The run name the logger was given (``_run_name``)."""
    return logger._run_name


def experiment_name(logger: Any) -> str:
    """The experiment name the logger was given (``_experiment_name``)."""
    return str(logger._experiment_name)


def tracking_uri(logger: Any) -> str | None:
    """The tracking URI the logger was given (``_tracking_uri``); may hold a password: redact before showing it."""
    return logger._tracking_uri


def forget_run(logger: Any) -> None:
    """Make Lightning's ``finalize`` leave the logger's run alone (``_initialized``; after the run was deleted)."""
    logger._initialized = False


@contextlib.contextmanager
def tracking_uri_scope(uri: str | None) -> Iterator[None]:
    """MLflow's fluent API (``mlflow.<flavor>.log_model``) talks to `uri` inside the block (``_use_tracking_uri``)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(uri):
        yield
