"""What the CLI adds to the MLflow run beyond metrics and the config.

- Every `rl_lightning.tracking.logger.MLFlowLogger` follows the trainer: values are logged at the run's step
  (rollouts or optimizer steps done), counters only when they move.
- The experiment is marked as model training (``mlflow.experimentKind``). MLflow 3.17's UI does not read that tag
  to pick its view (a feature flag makes it follow the ``workflowType`` address parameter, else the browser's last
  choice, GenAI for a fresh browser), so the terminal prints links that carry ``workflowType=machine_learning``
  (`rl_lightning.cli.progress.mlflow_link`); the tag is kept for MLflow versions and tools that read it.
- MLflow's system metrics (``system/*``: CPU, memory, disk, network; GPU utilisation and memory on CUDA machines with
  ``pynvml``) are sampled for the whole run.
- The data counters (``data/train_rows``, ...) and the config are logged at train start, once every start-up check
  has passed. Lightning creates the MLflow run before any setup hook runs, so a run that fails a start-up check
  (a ``UserError``: bad config or data) and has logged nothing is deleted (MLflow's soft delete: recoverable, hidden
  in the UI) instead of lingering as an empty FAILED run.
- The run's lineage (recipe, data and environment file with their hashes, git commit, base model:
  `rl_lightning.tracking.lineage`) is set as tags at train start, and an RL task's environment file is uploaded as the
  artifact ``environment/<file name>``. (The export is logged as a model by ``HFExport``, at train end.)
- A ``sqlite:`` store on a network file system (NFS, CIFS/SMB, Lustre, GPFS, BeeGFS, CephFS, ...: read from
  ``/proc/mounts``) gets a one-line warning at start-up: SQLite's file locking is unreliable there, so concurrent jobs
  writing one ``mlflow.db`` can lock each other out or corrupt it (`shared_sqlite_store`).
- Any other failed run gets the error (its first line, redacted: `rl_lightning.redaction`) as its description and an
  ``error`` tag.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from typing_extensions import override

from rl_lightning.compat import mlflow as mlflow_compat

log = logging.getLogger(__name__)

# file systems where SQLite's locks do not hold across machines (the SQLite FAQ: "NFS locking is broken")
NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                        "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "9p", "afs", "panfs", "wekafs", "virtiofs")


def shared_sqlite_store(tracking_uri: str | None, mounts: str) -> str | None:
    """The warning for a ``sqlite:`` tracking store on a network file system, or None.

    Args:
        tracking_uri: the MLflow tracking URI (``sqlite:///mlflow.db``, ``sqlite:////abs/path.db``).
        mounts: the text of ``/proc/mounts`` (device, mount point, type, ... per line).
    """
    import os
    from urllib.parse import unquote, urlsplit

    if not tracking_uri or not tracking_uri.startswith("sqlite:"):
        return None
    path = unquote(urlsplit(tracking_uri).path)
    path = path[1:] if path.startswith("/") else path  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
    path = os.path.realpath(path.removeprefix("file:"))
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    if kind not in NETWORK_FILE_SYSTEMS:
        return None
    return (f"MLflow store {path} is on a network file system ({kind} at {best}): SQLite's locking does not hold "
            "there, so concurrent runs writing it can lock each other out or corrupt it; give each job its own "
            "local sqlite file, or run an MLflow server (trainer.logger.init_args.tracking_uri: http://host:5000)")

EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's "machine learning" experiment type (vs genai_development)


def _mlflow_loggers(trainer: L.Trainer) -> list[Any]:
    from lightning.pytorch.loggers import MLFlowLogger

    return [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger)]


class MLflowTracking(L.Callback):
    """Experiment type, system metrics, data counters and failure notes for every ``MLFlowLogger`` (rank 0).

    Args:
        system_metrics: sample MLflow's system metrics during the run.
        sampling_interval_s: seconds between system-metric samples.
        lineage: tag the run with its lineage and upload the environment file (`rl_lightning.tracking.lineage`).
    """

    def __init__(self, system_metrics: bool = True, sampling_interval_s: float = 5.0, lineage: bool = True) -> None:
        self.system_metrics, self.lineage = system_metrics, lineage
        self.sampling_interval_s = sampling_interval_s
        self._monitors: list[Any] = []

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from rl_lightning.tracking.logger import MLFlowLogger

        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.follow(trainer)
        if trainer.is_global_zero:
            self._warn_shared_sqlite(trainer)

    @staticmethod
    def _warn_shared_sqlite(trainer: L.Trainer) -> None:
        try:
            with open("/proc/mounts") as f:
                mounts = f.read()
        except OSError:  # not Linux: nothing to read
            return
        from rl_lightning.redaction import redact_text

        for logger in _mlflow_loggers(trainer):
            warning = shared_sqlite_store(mlflow_compat.tracking_uri(logger), mounts)
            if warning:
                log.warning(redact_text(warning))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stats = getattr(trainer.datamodule, "stats", None) or {}
        if stats:
            for logger in trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in stats.items()}, step=0)
        if not trainer.is_global_zero:
            return
        from rl_lightning.tracking import lineage

        loggers = _mlflow_loggers(trainer)
        tags = lineage.collect(trainer, pl_module) if loggers and self.lineage else {}
        for logger in loggers:
            client, experiment_id = logger.experiment, logger.experiment_id
            if "mlflow.experimentKind" not in client.get_experiment(experiment_id).tags:
                client.set_experiment_tag(experiment_id, "mlflow.experimentKind", EXPERIMENT_KIND)
            if self.lineage:
                lineage.tag_run(client, logger.run_id, tags, lineage.env_path(pl_module))
            if self.system_metrics:
                self._start_monitor(logger)

    def _start_monitor(self, logger: Any) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(logger.run_id, sampling_interval=self.sampling_interval_s,
                                           tracking_uri=mlflow_compat.tracking_uri(logger), resume_logging=True)
        except Exception as e:  # noqa: BLE001 - e.g. psutil missing: the run goes on without system metrics
            log.warning("MLflow system metrics are off: %s", e)
            return
        monitor.start()
        self._monitors.append(monitor)

    def _stop_monitors(self) -> None:
        for monitor in self._monitors:
            monitor.finish()
        self._monitors.clear()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_monitors()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_monitors()
        if not trainer.is_global_zero:
            return
        from rl_lightning.errors import UserError
        from rl_lightning.redaction import redact_text

        message = redact_text((str(exception).strip().splitlines() or [type(exception).__name__])[0])
        for logger in _mlflow_loggers(trainer):
            if mlflow_compat.started_run_id(logger) is None:
                continue  # never started: nothing to mark
            try:
                data = logger.experiment.get_run(logger.run_id).data
                if isinstance(exception, UserError) and not data.metrics and not data.params:
                    logger.experiment.delete_run(logger.run_id)
                    mlflow_compat.forget_run(logger)  # Lightning's finalize("failed") would touch the deleted run
                    continue
                logger.experiment.set_tag(logger.run_id, "error", message[:5000])
                logger.experiment.set_tag(logger.run_id, "mlflow.note.content",
                                          f"Failed: {type(exception).__name__}: {message}")
            except Exception as e:  # noqa: BLE001 - the original error matters more than this note
                log.warning("could not record the error in MLflow: %s", e)
