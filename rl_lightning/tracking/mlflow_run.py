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
- Any other failed run gets the error (its first line, redacted: `rl_lightning.redaction`) as its description and an
  ``error`` tag.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from typing_extensions import override

log = logging.getLogger(__name__)

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
                                           tracking_uri=logger._tracking_uri, resume_logging=True)
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
            if logger._run_id is None:
                continue  # never started: nothing to mark
            try:
                data = logger.experiment.get_run(logger.run_id).data
                if isinstance(exception, UserError) and not data.metrics and not data.params:
                    logger.experiment.delete_run(logger.run_id)
                    logger._initialized = False  # Lightning's finalize("failed") would touch the deleted run
                    continue
                logger.experiment.set_tag(logger.run_id, "error", message[:5000])
                logger.experiment.set_tag(logger.run_id, "mlflow.note.content",
                                          f"Failed: {type(exception).__name__}: {message}")
            except Exception as e:  # noqa: BLE001 - the original error matters more than this note
                log.warning("could not record the error in MLflow: %s", e)
