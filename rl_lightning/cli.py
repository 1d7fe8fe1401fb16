"""``python -m rl_lightning fit --config recipes/<task>.yaml``: the LightningCLI entry point.

The recipe picks the task (``model: {class_path: rl_lightning.tasks.SFT, ...}``, or just ``SFT``) and its DataModule;
every knob is a typed ``__init__`` argument, so ``--help``, ``--model.help SFT`` and ``--print_config`` document the
whole surface; a typo or a bad value is one line on stderr (`rl_lightning.cli_errors`). The working directory is put
on ``sys.path`` so recipes can name the user's own callbacks and environments by dotted path.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from rl_lightning.cli_errors import first_line, jsonargparse_debug, one_line_error
from rl_lightning.errors import UserError

log = logging.getLogger(__name__)

# Lightning warnings that are expected with our design and only add noise to every run.
QUIET_WARNINGS = (
    ".*defined a `validation_step` but have no `val_dataloader`.*",  # validation is optional (data.val_path)
    ".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*",  # Lightning 2.6 vs torch 2.13, harmless
)
MLFLOW_PARAM_LIMIT = 6000  # mlflow >= 2.x accepts param values up to 6000 characters

# What every recipe would otherwise repeat; a recipe's own `trainer.logger` / `trainer.callbacks` replace these.
TRAINER_DEFAULTS = {
    "trainer.logger": {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
                       "init_args": {"experiment_name": "rl_lightning", "tracking_uri": "sqlite:///mlflow.db"}},
    "trainer.callbacks": [
        {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}},
        {"class_path": "rl_lightning.export.HFExport"},
    ],
    "trainer.log_every_n_steps": 1,
    "trainer.enable_model_summary": False,
}


def flatten_config(config: Any, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into ``{"model.lr": "1e-05", ...}``, dropping jsonargparse's ``init_args`` level."""
    if hasattr(config, "as_dict"):
        config = config.as_dict()
    flat: dict[str, str] = {}
    if isinstance(config, dict):
        for key, value in config.items():
            name = prefix if key == "init_args" else f"{prefix}.{key}" if prefix else str(key)
            flat.update(flatten_config(value, name))
    else:
        flat[prefix] = str(config)
    return flat


class ConfigLogger(SaveConfigCallback):
    """Log the resolved config to every logger: MLflow gets params (one per key) and ``config.yaml`` as an artifact.

    Lightning's own SaveConfigCallback needs ``trainer.log_dir``, which is None for MLflow's sqlite store
    (Lightning issue #19441); this writes ``config.yaml`` into the log_dir of loggers that have one.
    """

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        text = self.parser.dump(self.config, skip_none=False)
        params = flatten_config(self.config)
        for logger in trainer.loggers:
            try:
                self._log_to(logger, text, params)
            except Exception as e:  # noqa: BLE001 - never let logging kill rank 0 (the other ranks would hang)
                # e.g. MLflow refuses to change a parameter of a resumed run (MLFlowLogger(run_id=...)).
                log.warning("could not log the config to %s: %s", type(logger).__name__, str(e).splitlines()[0])

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


class RLArgumentParser(LightningArgumentParser):
    """A parser whose command-line errors are one line on stderr with exit status 2, instead of usage + message."""

    argv: Sequence[str] = ()  # the command line (set by RLLightningCLI.parse_arguments): tells where a bad key was set

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or jsonargparse_debug():  # a nested parser raises: its caller reports
            super().error(message, ex)
        try:
            line = one_line_error(message, self, self.argv)
        except Exception:  # noqa: BLE001 - a bug in the rewording must not hide the user's error
            line = first_line(message)
        self.exit(2, f"rl_lightning: error: {line}\n")


class RLLightningCLI(LightningCLI):
    """LightningCLI with task/data selection by class path, linked tokenizer, shared trainer defaults (MLflow logger,
    progress bar, last checkpoint, Hugging Face export) and one-line errors.

    A run is named after its recipe (``recipes/grpo.yaml`` -> ``grpo``) unless ``trainer.logger.init_args.run_name``
    says otherwise; checkpoints and the export go to ``checkpoints/<run>`` and ``exports/<run>`` unless their
    ``dirpath`` is set.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Imported, the tasks and DataModules resolve by short name (`--model SFT`, `--data.help SFTDataModule`,
        # `class_path: SFT`) and --help lists them as known subclasses.
        import rl_lightning.data
        import rl_lightning.tasks

        if not issubclass(self.parser_class, RLArgumentParser):
            self.parser_class = RLArgumentParser
        data = [name for name in rl_lightning.data.__all__ if name.endswith("DataModule")]
        kwargs.setdefault("epilog", f"Tasks (--model): {', '.join(rl_lightning.tasks.__all__)}. DataModules (--data): "
                                    f"{', '.join(data)}. Their options: --model.help SFT, --data.help SFTDataModule.")
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.init_args.model_name", "data.init_args.tokenizer_name", apply_on="parse")
        parser.set_defaults(TRAINER_DEFAULTS)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # the recipe's path, which the parsed namespace does not keep under a subcommand
        raw = [str(a) for a in (sys.argv[1:] if args is None else args)] if isinstance(args, list | None) else []
        self.recipe = None
        for i, arg in enumerate(raw):
            if arg == "--config" and i + 1 < len(raw):
                self.recipe = raw[i + 1]
            elif arg.startswith("--config="):
                self.recipe = arg.split("=", 1)[1]
        for each in (parser, *getattr(self, "_subcommand_parsers", {}).values()):
            each.argv = raw
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = config.get("trainer")
        if trainer is None:
            return
        # the defaults' progress bar and checkpoint give way to enable_progress_bar / enable_checkpointing: false
        disabled = {".RichProgressBar": trainer.get("enable_progress_bar") is False,
                    ".ModelCheckpoint": trainer.get("enable_checkpointing") is False}
        defaults = [c["class_path"] for c in TRAINER_DEFAULTS["trainer.callbacks"]]
        if [str(c.get("class_path")) for c in trainer.get("callbacks") or []] == defaults:
            trainer.callbacks = [c for c in trainer.callbacks
                                 if not any(str(c.get("class_path", "")).endswith(k) and v for k, v in disabled.items())]
        sources = config.get("config") or []
        recipe = str(sources[-1]) if sources else self.recipe
        run = run_name(recipe) if recipe else None
        logger = trainer.get("logger")
        if run is None or not hasattr(logger, "get") or not str(logger.get("class_path", "")).endswith("MLFlowLogger"):
            return
        if logger.init_args.get("run_name") is None:
            logger.init_args.run_name = run
        run = logger.init_args.run_name
        for callback in trainer.get("callbacks") or []:
            path = str(callback.get("class_path", ""))
            if path.endswith(".ModelCheckpoint") and callback.init_args.get("dirpath") is None:
                callback.init_args.dirpath = f"checkpoints/{run}"
            elif path.endswith(".HFExport") and callback.init_args.get("dirpath") is None:
                callback.init_args.dirpath = f"exports/{run}"

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"}}


def run_name(config_path: str) -> str:
    """A run's default name from its recipe: the path below ``recipes/`` without the extension, ``/`` -> ``-``
    (``recipes/real/grpo.yaml`` -> ``real-grpo``); other files: their stem."""
    parts = os.path.normpath(os.path.splitext(config_path)[0]).split(os.sep)
    if "recipes" in parts[:-1]:
        parts = parts[len(parts) - 1 - parts[::-1].index("recipes") + 1 :]
        return "-".join(parts)
    return parts[-1]


def main(args: list[str] | None = None) -> None:
    # Recipes may name user code (callbacks, environments) by dotted path relative to where the job is launched.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    try:
        RLLightningCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=ConfigLogger,
            save_config_kwargs={"save_to_log_dir": False},
            auto_configure_optimizers=False,  # every task steps its own optimizers: no --optimizer/--lr_scheduler
            parser_kwargs={"parser_mode": "omegaconf+"},
            seed_everything_default=42,
            args=args,
        )
    except Exception as e:
        user_error = find_user_error(e)
        if user_error is None:
            raise
        print(f"rl_lightning: error: {user_error}", file=sys.stderr)
        raise SystemExit(2) from None


def find_user_error(exc: BaseException | None) -> UserError | None:
    """The `UserError` behind `exc`, if any (jsonargparse wraps errors raised while instantiating classes)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
