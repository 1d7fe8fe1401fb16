"""The run's config, as every copy of it is kept: ``config.yaml`` in the run folder, MLflow params and artifact.

Every copy is redacted first (`rl_lightning.redaction`), and so are the hyperparameters a checkpoint stores.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from typing_extensions import override

from rl_lightning.assets.package_files import shown_path
from rl_lightning.redaction import redact, redact_yaml

log = logging.getLogger(__name__)

MLFLOW_PARAM_LIMIT = 6000  # mlflow >= 2.x accepts param values up to 6000 characters


def flatten_config(config: Any, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into ``{"model.lr": "1e-05", ...}``, dropping jsonargparse's ``init_args`` level.

    A list of classes (``trainer.callbacks``) gives one key per class, ``trainer.callbacks.RunPlots``, whose value is
    its arguments as ``key=value, ...`` (``defaults`` when it has none set).
    """
    if hasattr(config, "as_dict"):
        config = config.as_dict()
    flat: dict[str, str] = {}
    if isinstance(config, list) and config and all(isinstance(v, dict) and "class_path" in v for v in config):
        for item in config:
            name = f"{prefix}.{str(item['class_path']).rsplit('.', 1)[-1]}"
            args = flatten_config(item.get("init_args") or {})
            value = ", ".join(f"{k}={v}" for k, v in args.items()) or "defaults"
            flat[name] = value if name not in flat else f"{flat[name]}; {value}"
    elif isinstance(config, dict):
        for key, value in config.items():
            name = prefix if key == "init_args" else f"{prefix}.{key}" if prefix else str(key)
            flat.update(flatten_config(value, name))
    elif isinstance(config, list | tuple):  # paths as written (`[my.yaml]`), not `[Path_fsr(...)]`; bundled ones
        flat[prefix] = "[" + ", ".join(shown_path(str(v)) if prefix == "config" else str(v) for v in config) + "]"
    else:
        flat[prefix] = str(config)
    return flat


class ConfigLogger(SaveConfigCallback):
    """Write the resolved config into the run's folder at setup, and log it to every logger at train start.

    ``config.yaml`` goes into the run's output folder at setup (readable by its owner only); at train start (after the
    start-up checks) MLflow gets params (one per key) and ``config.yaml`` as an artifact. Every copy, and the
    checkpoints' hyperparameters, are redacted first (`rl_lightning.redaction`: credentials as ``***``, values read
    with ``${oc.env:NAME}`` as that reference). Lightning's own SaveConfigCallback needs ``trainer.log_dir``, which is None for MLflow's sqlite store
    (Lightning issue #19441); this writes ``config.yaml`` into the log_dir of loggers that have one.
    """

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from rl_lightning.cli.outputs import RunOutputs
        from rl_lightning.parallel.checkpoint_io import write_atomic

        text = redact_yaml(self.parser.dump(self.config, skip_none=False))
        # RunOutputs.setup has run: it comes before this callback (`callbacks` is set by Lightning's connector)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, RunOutputs) and callback.dirpath is not None:
                write_atomic(callback.dirpath / self.config_filename, text, mode=0o600)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        text = redact_yaml(self.parser.dump(self.config, skip_none=False))
        params = flatten_config(redact(self.config.as_dict()))
        for logger in trainer.loggers:
            try:
                self._log_to(logger, text, params)
            except Exception as e:  # noqa: BLE001 - never let logging kill rank 0 (the other ranks would hang)
                # e.g. MLflow refuses to change a parameter of a resumed run (MLFlowLogger(run_id=...)).
                log.warning("could not log the config to %s: %s", type(logger).__name__, str(e).splitlines()[0])

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Redact the hyperparameters a checkpoint stores (values read with ``oc.env`` stay: a resume compares them)."""
        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            if key in checkpoint:
                checkpoint[key] = redact(checkpoint[key], env=False)

    def _log_to(self, logger: Any, text: str, params: dict[str, str]) -> None:
        from lightning.pytorch.loggers import MLFlowLogger

        if isinstance(logger, MLFlowLogger):
            from mlflow.entities import Param

            items = [Param(k, v[:MLFLOW_PARAM_LIMIT]) for k, v in sorted(params.items())]
            for start in range(0, len(items), 100):
                logger.experiment.log_batch(logger.run_id, params=items[start : start + 100])
            logger.experiment.log_text(logger.run_id, text, self.config_filename)
            return
        logger.log_hyperparams(params)
        # Not trainer.log_dir: it broadcasts, and this hook runs on rank 0 only (a multi-process deadlock).
        log_dir = getattr(logger, "log_dir", None)
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, self.config_filename), "w") as f:
                f.write(text)
