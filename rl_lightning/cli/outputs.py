"""Each run's own output folder, so runs never overwrite each other.

``outputs/<run>/<YYYY-mm-dd_HH-MM-SS>/`` holds the run's ``checkpoints/``, its Hugging Face ``export/``, its
``plots/``, the resolved ``config.yaml`` and ``run.json`` (the MLflow run it logs to); ``outputs/<run>/latest`` points
at the newest. The CLI resumes ``--ckpt_path last`` in ``latest`` (same folder, same MLflow run).

A run folder belongs to one run: ``latest`` is followed only as a relative link to a folder inside its own
``outputs/<run>/`` (`latest_run_dir`), and the process that owns a folder (global rank 0) holds an ``flock`` on its
``run.lock`` while it fits (`RunLock`), so a second process resuming into it is refused in one line instead of
deleting the first one's save in progress. The kernel drops the lock when its process dies (``kill -9`` too).
``run.json`` is replaced atomically (`rl_lightning.parallel.checkpoint_io.write_atomic`) and readable by this user only
(``0o600``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from rl_lightning.cli.run_lock import RunLock
from rl_lightning.compat import mlflow as mlflow_compat
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.checkpoint_io import write_atomic
from rl_lightning.redaction import redact_text

log = logging.getLogger(__name__)

RUN_FILE = "run.json"


def new_run_dir(root: str | Path, name: str) -> Path:
    """A fresh ``<root>/<name>/<time stamp>`` (``-2``, ``-3``, ... appended when that second is taken), created."""
    parent = Path(root) / name
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for attempt in range(1, 1000):
        path = parent / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run folder under {parent} for {stamp}")


def point_latest(run_dir: Path) -> None:
    """Make ``<run_dir>/../latest`` a relative symlink to `run_dir`, replacing the old one atomically."""
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest-{os.getpid()}"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(run_dir.name, target_is_directory=True)
    os.replace(tmp, link)


def latest_run_dir(root: str | Path, name: str) -> Path | None:
    """The folder ``<root>/<name>/latest`` points at, or None when there is no earlier run.

    Raises:
        ConfigError: ``latest`` is not a relative link to a folder directly inside ``<root>/<name>`` (an absolute
            link, ``..``, a link through another link): resuming would adopt another run's folder and MLflow run.
    """
    parent = Path(root) / name
    link = parent / "latest"
    if not link.is_symlink():
        return None
    target = os.readlink(link)
    child = parent / target
    inside = (not os.path.isabs(target) and os.sep not in target and target not in (".", "..")
              and child.is_dir() and not child.is_symlink())
    if not inside:
        raise ConfigError(f"{link} points to {target} ({os.path.realpath(link)}), not to a run folder inside "
                          f"{parent}: remove the link (the next run makes a new one), or resume a run by its "
                          "checkpoint's path (--ckpt_path <run folder>/checkpoints/last.ckpt)")
    return Path(os.path.realpath(child))


def read_run_file(run_dir: Path) -> dict:
    """The run record (``run.json``) of `run_dir`, or {} when it has none."""
    path = run_dir / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


class RunOutputs(L.Callback):
    """Put the run's checkpoints and export in its own folder (see the module docstring).

    Only callbacks whose ``dirpath`` is unset are redirected: a ``ModelCheckpoint`` to ``<run folder>/checkpoints``,
    an ``HFExport`` to ``<run folder>/export`` and a ``RunPlots`` to ``<run folder>/plots``. Global rank 0 names the
    folder and every rank uses that name.

    Args:
        name: the run's name (the CLI passes the MLflow run name, from the recipe: ``grpo``, ``real-grpo``); null:
            ``run``.
        root: the folder holding every run's outputs.
        dirpath: use this run folder instead of a new one (the CLI passes ``latest`` when resuming).
    """

    def __init__(self, name: str | None = None, root: str = "outputs", dirpath: str | None = None) -> None:
        self.name, self.root = name or "run", root
        self.dirpath = Path(dirpath) if dirpath else None
        self.lock = RunLock()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is None:
            path = str(new_run_dir(self.root, self.name)) if trainer.is_global_zero else None
            self.dirpath = Path(trainer.strategy.broadcast(path))
        self.lock.acquire(self.dirpath, trainer)
        if trainer.is_global_zero:
            point_latest(self.dirpath)
            print(f"outputs: {self.dirpath}  ({Path(self.root) / self.name / 'latest'} points here)", flush=True)
        for callback in trainer.callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = os.path.realpath(self.dirpath / "checkpoints")
            elif type(callback).__name__ == "HFExport" and callback.dirpath is None:
                callback.dirpath = str(self.dirpath / "export")
            elif type(callback).__name__ == "RunPlots" and callback.dirpath is None:
                callback.dirpath = str(self.dirpath / "plots")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Let go of the run folder (the fit is over)."""
        self.lock.release()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Let go of the run folder (the fit failed)."""
        self.lock.release()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Record the MLflow run (so a resume continues it) and tag the run with this folder."""
        if not trainer.is_global_zero or self.dirpath is None:
            return
        from lightning.pytorch.loggers import MLFlowLogger

        record = read_run_file(self.dirpath)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                record.update({"mlflow_run_id": logger.run_id, "mlflow_experiment": mlflow_compat.experiment_name(logger),
                               "mlflow_tracking_uri": redact_text(mlflow_compat.tracking_uri(logger) or "")})  # no password
                logger.experiment.set_tag(logger.run_id, "output_dir", str(self.dirpath.resolve()))
        write_atomic(self.dirpath / RUN_FILE, json.dumps(record, indent=2) + "\n", mode=0o600)  # this user's only


def resume_dir(ckpt_path: str, root: str | Path, name: str) -> Path | None:
    """The run folder a resume continues; None for a fresh folder.

    That is ``latest`` for ``last``, or the folder holding the given checkpoint (a path ``<run folder>/checkpoints/<file
    or DCP folder>`` next to a ``run.json``).
    """
    if ckpt_path == "last":
        return latest_run_dir(root, name)
    path = Path(ckpt_path).resolve()
    folder = path.parent.parent
    return folder if path.parent.name == "checkpoints" and (folder / RUN_FILE).is_file() else None
