"""The run's terminal: one progress bar over the whole run, validation results as lines, and a summary at the end.

Lightning's bars count batches per epoch. Here a run is counted the way it is bounded: PPO-family tasks in rollouts
(``model.max_rollouts``), the others in optimizer steps (``trainer.max_steps``, or the epochs' batches). The bar shows
the metrics a user watches (reward, completion length, KL, loss; DPO's accuracy and margin) from the values the task
logs. On a terminal it is a Rich live bar; in a log file (SLURM, ``> out.txt``) it prints a line at each tenth of the
run and at least every ``line_every_s`` seconds instead of a bar nobody can read.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from typing_extensions import override

from rl_lightning.compat import mlflow as mlflow_compat

# train/ metrics shown on the bar, in this order, by their MLflow names without ``train/`` (the names a user searches
# for in MLflow); the first present of each name wins
SHOWN = tuple((key, key.removeprefix("train/")) for key in (
    "train/reward", "train/completion_length", "train/kl", "train/policy_loss", "train/loss", "train/value_loss",
    "train/accuracy", "train/margin"))


def format_metrics(metrics: dict[str, float], shown: tuple[tuple[str, str], ...] = SHOWN) -> str:
    """``reward 0.742 · completion_length 3.12 · policy_loss -0.0123``: the `shown` keys present in `metrics`."""
    parts, names = [], set()
    for key, name in shown:
        if key in metrics and name not in names:
            names.add(name)
            parts.append(f"{name} {metrics[key]:.4g}")
    return " · ".join(parts)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):  # a non-scalar value has nothing to show
            continue
    return out


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


class RunProgress(ProgressBar):
    """One bar for the whole run, validation lines and an end-of-run summary (global rank 0 only).

    Args:
        metrics: extra ``{logged key: name shown}`` on the bar after the defaults (e.g.
            ``{"train/entropy": "entropy"}``; the defaults show the logged name without ``train/``).
        line_every_s: without a terminal, print a progress line at least this often (seconds) besides each tenth
            of the run.
    """

    def __init__(self, metrics: dict[str, str] | None = None, line_every_s: float = 60.0) -> None:
        super().__init__()
        self.shown = SHOWN + tuple((metrics or {}).items())
        self.line_every_s = line_every_s
        self._enabled = True
        self._progress: Any = None  # rich.progress.Progress on a terminal
        self._task: Any = None
        self._val_task: Any = None
        self._total = 0
        self._done = 0
        self._started = 0.0
        self._last_line = 0.0
        self._next_milestone = 1
        self.last_validation: dict[str, float] = {}

    # ------------------------------------------------------------------------------------ ProgressBar interface

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @property
    @override
    def is_enabled(self) -> bool:
        return self._enabled

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._progress is not None:
            self._progress.console.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    # ------------------------------------------------------------------------------------------- run bounds

    @staticmethod
    def unit(pl_module: L.LightningModule) -> str:
        """What the run counts: ``rollout`` for PPO-family tasks, else ``step`` (optimizer steps)."""
        return "rollout" if hasattr(pl_module, "run_rollouts") else "step"

    @staticmethod
    def run_total(trainer: L.Trainer, pl_module: L.LightningModule) -> int | None:
        """Rollouts (PPO-family tasks) or optimizer steps the run takes; None when unbounded or unknown."""
        try:
            total = pl_module.run_rollouts() if hasattr(pl_module, "run_rollouts") else trainer.estimated_stepping_batches
        except Exception:  # noqa: BLE001 - an unknowable length only loses the bar's total
            return None
        return None if total is None or math.isinf(total) else int(total)

    @staticmethod
    def run_done(trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """Rollouts (PPO-family tasks) or optimizer steps done so far."""
        return int(getattr(pl_module, "rollouts", trainer.global_step))

    def _description(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        name = run_name(trainer) or type(pl_module).__name__
        bounded_by_epochs = trainer.max_steps == -1 and not hasattr(pl_module, "run_rollouts")
        if bounded_by_epochs and trainer.max_epochs not in (None, -1, 1):
            return f"{name} epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"
        return name

    # ------------------------------------------------------------------------------------------------ hooks

    def _start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled or self._started:
            return
        self._started = self._last_line = time.monotonic()
        self._total = self.run_total(trainer, pl_module) or 0
        self._done = self.run_done(trainer, pl_module)
        if not sys.stdout.isatty():
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(), TextColumn("•"), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
            refresh_per_second=4,
        )
        self._progress.start()
        self._task = self._progress.add_task(self._description(trainer, pl_module), total=self._total or None,
                                             completed=self._done, unit=f"{self.unit(pl_module)}s", metrics="")

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer, pl_module)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._enabled:
            return
        self._done = self.run_done(trainer, pl_module)
        metrics = format_metrics(_floats(trainer.callback_metrics), self.shown)
        if self._progress is not None:
            self._progress.update(self._task, completed=self._done, metrics=metrics,
                                  description=self._description(trainer, pl_module))
            return
        now = time.monotonic()
        milestone = self._total and self._done * 10 >= self._next_milestone * self._total
        if milestone or now - self._last_line >= self.line_every_s or self._done == self._total:
            while self._total and self._done * 10 >= self._next_milestone * self._total:
                self._next_milestone += 1
            self._last_line = now
            total = f"/{self._total}" if self._total else ""
            print(f"{self._description(trainer, pl_module)} {self.unit(pl_module)} {self._done}{total} "
                  f"[{_duration(now - self._started)}] {metrics}".rstrip(), flush=True)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and self._progress is not None:
            total = sum(n for n in trainer.num_sanity_val_batches if not math.isinf(n)) if trainer.sanity_checking \
                else sum(n for n in trainer.num_val_batches if not math.isinf(n))
            self._val_task = self._progress.add_task("validation", total=total or None, unit="batches", metrics="")

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._val_task is not None:
            self._progress.advance(self._val_task)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_task is not None:
            self._progress.remove_task(self._val_task)
            self._val_task = None
        if not self._enabled:
            return
        # tasks whose start-of-run score Lightning would drop (sanity check) keep it in `validation_metrics`
        metrics = getattr(pl_module, "validation_metrics", None) or {
            k: v for k, v in _floats(trainer.callback_metrics).items() if k.startswith("val/")}
        if not metrics or (trainer.sanity_checking and not getattr(pl_module, "validation_metrics", None)):
            return  # Lightning's partial sanity pass (a few batches) says nothing worth printing
        self.last_validation = dict(metrics)
        where = "start" if trainer.sanity_checking else f"{self.unit(pl_module)} {self.run_done(trainer, pl_module)}"
        values = " · ".join(f"{k.removeprefix('val/')} {v:.4g}" for k, v in metrics.items())
        self.print(f"validation @ {where}: {values}")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.run_done(trainer, pl_module))
            self._progress.stop()
            self._progress = None

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the export (written at train end): the summary of what the run did and where everything went."""
        if not self._enabled or not self._started:
            return
        print(summary(trainer, pl_module, self, time.monotonic() - self._started), flush=True)


def run_name(trainer: L.Trainer) -> str | None:
    """The MLflow run name of the trainer's first ``MLFlowLogger``, or None without one."""
    from lightning.pytorch.loggers import MLFlowLogger

    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            return mlflow_compat.run_name(logger)
    return None


def summary(trainer: L.Trainer, pl_module: L.LightningModule, bar: RunProgress, seconds: float) -> str:
    """The end-of-run lines: length and time, last train and validation metrics, outputs, the MLflow run."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger

    done, unit = bar.run_done(trainer, pl_module), bar.unit(pl_module)
    name = run_name(trainer) or type(pl_module).__name__
    rows = [("train", format_metrics(_floats(trainer.callback_metrics), bar.shown)),
            ("validation", " · ".join(f"{k.removeprefix('val/')} {v:.4g}" for k, v in bar.last_validation.items()))]
    for callback in trainer.callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if isinstance(callback, ModelCheckpoint) and dirpath:
            rows.append(("checkpoints", _relative(dirpath)))
        elif type(callback).__name__ == "HFExport" and dirpath:
            rows.append(("export", f"{_relative(dirpath)}  (AutoModelForCausalLM.from_pretrained)"))
        elif type(callback).__name__ == "RunPlots" and dirpath and os.path.isfile(f"{dirpath}/summary.png"):
            rows.append(("plots", _relative(f"{dirpath}/summary.png")))
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger) and mlflow_compat.started_run_id(logger):
            rows += [("MLflow", f"run {mlflow_compat.run_name(logger) or ''} ({logger.run_id}) in experiment "
                                f"'{mlflow_compat.experiment_name(logger)}'"), ("", mlflow_link(logger)),
                     ("compare", experiment_link(logger).rsplit(" ", 1)[-1])]
    lines = [f"{name} finished: {done} {unit}{'s' if done != 1 else ''} in {_duration(seconds)}"]
    lines += [f"  {label:<11} {text}" for label, text in rows if text]  # the 2nd MLflow line: blank label
    return "\n".join(lines)


def mlflow_link(logger: Any) -> str:
    """How to open the run's page in the MLflow UI, in its model-training view.

    MLflow 3.17's UI picks its view from the address's ``workflowType``, else from the browser's last choice (GenAI
    in a fresh browser); it does not read the experiment's ``mlflow.experimentKind`` tag. The link carries
    ``workflowType=machine_learning``.
    """
    return _ui_address(logger, f"#/experiments/{logger.experiment_id}/runs/{logger.run_id}?{ML_VIEW}")


def experiment_link(logger: Any) -> str:
    """The experiment's runs table and charts (select runs, then Compare), in the model-training view."""
    return _ui_address(logger, f"#/experiments/{logger.experiment_id}/runs?{ML_VIEW}")


ML_VIEW = "workflowType=machine_learning"


def _ui_address(logger: Any, page: str) -> str:
    from rl_lightning.redaction import redact_text

    uri = redact_text(mlflow_compat.tracking_uri(logger) or "")  # a password in it stays off the terminal
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    return f"mlflow ui --backend-store-uri {uri}, then http://127.0.0.1:5000/{page}"


def _relative(path: str) -> str:
    """`path` relative to the working directory when it lies below it (what the user typed the run from)."""
    import os

    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


# Warnings that do not apply to runs of this library, each with the reason it does not.
QUIET_WARNINGS = (
    ".*defined a `validation_step` but have no `val_dataloader`.*",  # validation is optional (data.val_path)
    ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",  # Lightning 2.6 vs torch 2.13, harmless
    ".*`max_epochs` was not set.*",  # runs are bounded by max_steps / model.max_rollouts; the bar shows the bound
    ".*`IterableDataset` has `__len__` defined.*",  # our step datasets are sharded per rank, loaded in-process
    ".*self.log\\(.*sync_dist=True\\)`.*",  # every logged value is already reduced across ranks by the task
    ".*Using ModelCheckpoint with manual optimization.*",  # tasks step inside training_step: the state after it is
    # the one to save
    ".*torch.distributed.reduce_op` is deprecated.*",  # inside vLLM's import
)
# Start-up chatter of Lightning and MLflow, by logger: messages (prefixes) that tell a user of this CLI nothing.
QUIET_LOGS = {
    "lightning.pytorch.utilities.rank_zero": ("GPU available:", "TPU available:", "💡 Tip:", "HPU available:",
                                              "Loading `train_dataloader` to estimate", "`Trainer.fit` stopped:"),
    "lightning.pytorch.loggers.mlflow": ("Experiment with name",),
    "mlflow.store.db.utils": ("Creating initial MLflow database tables", "Updating database tables"),
    "mlflow.system_metrics.system_metrics_monitor": ("Skip logging GPU metrics", "Started monitoring",
                                                     "Stopping system metrics", "Successfully terminated"),
}


class _DropMessages:
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def filter(self, record: Any) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


def quiet(rank: int = 0) -> None:
    """Silence what does not apply (``QUIET_WARNINGS``, ``QUIET_LOGS``, transformers' weight-loading bars).

    On ranks other than 0, every Python warning is silenced too (rank 0 shows each once).
    """
    import logging
    import warnings

    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    if rank != 0:
        warnings.filterwarnings("ignore")
        logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)  # "[rank: 1] Seed set to"
    for name, prefixes in QUIET_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars on every load and export
