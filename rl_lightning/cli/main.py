"""``python -m rl_lightning fit --config <recipe>``: the LightningCLI entry point.

The recipe picks the task (``model: {class_path: rl_lightning.tasks.SFT, ...}``, or just ``SFT``) and its DataModule;
every knob is a typed ``__init__`` argument, so ``--help``, ``--model.help SFT`` and ``--print_config`` document the
whole surface; a typo or a bad value is one line on stderr (`rl_lightning.cli.config_errors`). The working directory is put
on ``sys.path`` so recipes can name the user's own callbacks and environments by dotted path. A recipe is a YAML file
or the name of a bundled one (``grpo``, ``real/grpo``: `rl_lightning.cli.recipes`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from rl_lightning.cli.config_errors import first_line, jsonargparse_debug, one_line_error
from rl_lightning.cli.config_logger import ConfigLogger, flatten_config  # noqa: F401 - flatten_config: for callers
from rl_lightning.cli.device_check import check_trainer_devices
from rl_lightning.cli.recipes import resolve_config_args, resolve_references
from rl_lightning.cli.renamed_keys import renamed_error
from rl_lightning.cli.run_names import configs_name, run_name
from rl_lightning.cli.run_seed import hand_seed, run_seed
from rl_lightning.compat.jsonargparse import cli_subcommand_parsers, nested_nulls
from rl_lightning.compat.lightning import KeepArgumentsOnCkptPath
from rl_lightning.errors import UserError
from rl_lightning.redaction import redact_text, redact_yaml, remember_env

log = logging.getLogger(__name__)

# What every recipe would otherwise repeat. A recipe's `trainer.logger` replaces the logger; `trainer.callbacks` in
# a recipe or an overlay ADDS to these (an entry of a class already listed replaces that one, in place).
TRAINER_DEFAULTS = {
    "trainer.logger": {"class_path": "rl_lightning.tracking.logger.MLFlowLogger",
                       "init_args": {"experiment_name": "rl_lightning", "tracking_uri": "sqlite:///mlflow.db"}},
    "trainer.callbacks": [
        {"class_path": "rl_lightning.tracking.plots.RunPlots"},  # first: its files exist when RunProgress sums up
        {"class_path": "rl_lightning.cli.progress.RunProgress"},
        {"class_path": "rl_lightning.parallel.checkpoint_io.AtomicModelCheckpoint", "init_args": {"save_last": "link"}},
        {"class_path": "rl_lightning.tracking.export.HFExport"},
        {"class_path": "rl_lightning.cli.outputs.RunOutputs"},
        {"class_path": "rl_lightning.tracking.mlflow_run.MLflowTracking"},
    ],
    "trainer.log_every_n_steps": 1,
    "trainer.enable_model_summary": False,
}


# MLflow experiment per task family (`rl_lightning/<family>`) unless the user names one: SFT losses and GRPO rewards
# do not belong in one table of runs.
EXPERIMENTS = {"SFT": "sft", "RewardModel": "reward-model", "DPO": "dpo", "PPO": "rl"}


class RLArgumentParser(LightningArgumentParser):
    """A parser whose command-line errors are one line on stderr with exit status 2, instead of usage + message."""

    argv: Sequence[str] = ()  # the command line (set by RLLightningCLI.parse_arguments): tells where a bad key was set

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or jsonargparse_debug():  # a nested parser raises: its caller reports
            super().error(message, ex)
        try:
            line = one_line_error(message, self, self.argv)
        except Exception:  # noqa: BLE001 - a bug in the rewording must not hide the user's error
            line = first_line(message)
        self.exit(2, f"rl_lightning: error: {redact_text(line)}\n")


class RLLightningCLI(KeepArgumentsOnCkptPath, LightningCLI):
    """LightningCLI with tasks by class path, a linked tokenizer, shared trainer defaults and one-line errors.

    The trainer defaults: MLflow logger, progress bar, last checkpoint, Hugging Face export. A run is named after its
    configs and the command line's settings (``grpo lr=2e-05``, `rl_lightning.cli.run_names`) unless
    ``trainer.logger.init_args.run_name`` says otherwise; its checkpoints, export and config go to its own folder
    ``outputs/<configs>/<time>/``
    (`rl_lightning.cli.outputs`), ``--ckpt_path last`` resumes ``outputs/<run>/latest`` (same folder, same MLflow run),
    and the MLflow experiment is ``rl_lightning/<task family>`` unless ``experiment_name`` is set anywhere.
    """

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Imported, the tasks and DataModules resolve by short name (`--model SFT`, `--data.help SFTDataModule`,
        # `class_path: SFT`) and --help lists them as known subclasses.
        import rl_lightning.data
        import rl_lightning.tasks

        _callbacks_add_in_config_files()
        if not issubclass(self.parser_class, RLArgumentParser):
            self.parser_class = RLArgumentParser
        data = [name for name in rl_lightning.data.__all__ if name.endswith("DataModule")]
        kwargs.setdefault("prog", "python -m rl_lightning")
        kwargs.setdefault("epilog", f"Tasks (--model): {', '.join(rl_lightning.tasks.__all__)}. DataModules (--data): "
                                    f"{', '.join(data)}. Their options: --model.help SFT, --data.help SFTDataModule. "
                                    "Other commands (each with --help): demo (GRPO on a real model, accuracy before "
                                    "-> after), eval (held-out accuracy and pass@k of a model), tune (Optuna search).")
        return super().init_parser(**kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.init_args.lm.name", "data.init_args.tokenizer_name", apply_on="parse")
        parser.set_defaults(TRAINER_DEFAULTS)
        parser.add_argument("--load_weights_only", type=bool, default=False,
                            help="fit: take only the model weights of --ckpt_path and start a new run under this "
                                 "config (step 0, fresh optimizer); without it a resume must match the checkpoint's "
                                 "run (task, model, rollout mode)")
        parser.add_argument("--trust_checkpoint", type=bool, default=False,
                            help="fit: load --ckpt_path with full pickle, which runs whatever code the file names; "
                                 "only for a checkpoint you trust as code. Without it checkpoints are read "
                                 "weights-only (tensors and plain values) and one that needs more is refused")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # the recipe's path, which the parsed namespace does not keep under a subcommand
        raw = [str(a) for a in (sys.argv[1:] if args is None else args)] if isinstance(args, list | None) else []
        if isinstance(args, list | None):  # --config grpo: the bundled recipe (rl_lightning.cli.recipes)
            raw = resolve_config_args(raw)
            if args is None:  # the command line itself (Lightning warns when given both it and `args`)
                sys.argv[1:] = nested_nulls(raw)
            else:
                args = nested_nulls(raw)
        self.raw_args, self.config_files = raw, []
        for i, arg in enumerate(raw):
            if arg == "--config" and i + 1 < len(raw):
                self.config_files.append(raw[i + 1])
            elif arg.startswith("--config="):
                self.config_files.append(arg.split("=", 1)[1])
        self.recipe = self.config_files[-1] if self.config_files else None
        self.config_texts = []
        for path in self.config_files:
            with contextlib.suppress(OSError):
                self.config_texts.append(open(path).read())
        remember_env([*raw, *self.config_texts])  # values read with ${oc.env:NAME} are shown as that reference
        for each in (parser, *cli_subcommand_parsers(self).values()):
            each.argv = raw
        if renamed := renamed_error(raw):  # a key that moved: one line naming the new key, before jsonargparse
            parser.exit(2, f"rl_lightning: error: {redact_text(renamed)}\n")
        if not any(arg.startswith("--print_config") for arg in raw):
            super().parse_arguments(parser, args)
            return
        # --print_config prints the config and exits: redacted, as every other copy (not jsonargparse's dump, which
        # it also loads back to resolve ${...} and to instantiate classes)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                super().parse_arguments(parser, args)
        finally:
            sys.stdout.write(redact_yaml(printed.getvalue()))

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        resolve_references(config)  # rl_lightning/assets/..., rl_lightning/recipes/envs/...: the installed package's
        trainer = config.get("trainer")
        if trainer is None:
            return
        check_trainer_devices(trainer)  # a GPU recipe on a machine without CUDA: one line, before any model loads
        trainer.callbacks = merge_callbacks(trainer.get("callbacks") or [], trainer.get("enable_progress_bar"),
                                            trainer.get("enable_checkpointing"))
        sources = [str(source) for source in config.get("config") or []] or self.config_files
        logger = trainer.get("logger")
        if not sources or not hasattr(logger, "get") or not str(logger.get("class_path", "")).endswith("MLFlowLogger"):
            return
        folder = logger.init_args.get("run_name") or configs_name(sources)
        if logger.init_args.get("run_name") is None:
            logger.init_args.run_name = run_name(sources, self.raw_args)
        family = EXPERIMENTS.get(str(config.get("model", {}).get("class_path", "")).rsplit(".", 1)[-1])
        if family and not self.mentions("experiment_name"):
            logger.init_args.experiment_name = f"rl_lightning/{family}"
        weights_only = config.get("load_weights_only")  # a new run (folder, MLflow run) from another's weights
        self.place_outputs(trainer, logger, None if weights_only else config.get("ckpt_path"), folder)
        if config.get("ckpt_path") == "last":
            config.ckpt_path = last_checkpoint(trainer.callbacks)

    @override
    def instantiate_classes(self) -> None:
        """Build the classes, then hand the DataModule the run's one seed (`rl_lightning.cli.run_seed`)."""
        seed = run_seed(self.config.get(self.subcommand) if self.subcommand else self.config)
        super().instantiate_classes()
        hand_seed(self.datamodule, seed)

    def before_fit(self) -> None:
        """Refuse ``--ckpt_path`` of another run before anything loads (`rl_lightning.cli.resume_check`)."""
        from rl_lightning.cli.resume_check import check_resume

        check_resume(self.config_init[self.subcommand], self.model, self.trainer)

    def mentions(self, key: str) -> bool:
        """Whether the command line or a config file names `key` (the user chose it: leave it as written)."""
        return any(key in text for text in [*self.raw_args, *self.config_texts])

    @staticmethod
    def place_outputs(trainer: Any, logger: Any, ckpt_path: str | None, folder: str) -> None:
        """Name the run's output folder `folder` (its configs' name, `rl_lightning.cli.run_names`).

        When resuming (``--ckpt_path last`` or a checkpoint inside a run folder), reuse that folder, its
        checkpoint/export paths and its MLflow run.
        """
        from rl_lightning.cli.outputs import read_run_file, resume_dir

        outputs = [c for c in trainer.callbacks if str(c.get("class_path", "")).endswith(".RunOutputs")]
        for callback in outputs:
            if callback.init_args.get("name") is None:
                callback.init_args.name = folder
        if not outputs or ckpt_path is None:
            return
        (callback,) = outputs[-1:]
        resumed = resume_dir(ckpt_path, callback.init_args.get("root") or "outputs", callback.init_args.name)
        if resumed is None:
            return
        callback.init_args.dirpath = callback.init_args.get("dirpath") or str(resumed)
        for other in trainer.callbacks:
            path = str(other.get("class_path", ""))
            if is_checkpoint(path) and other.init_args.get("dirpath") is None:
                other.init_args.dirpath = str(resumed / "checkpoints")
            elif path.endswith(".HFExport") and other.init_args.get("dirpath") is None:
                other.init_args.dirpath = str(resumed / "export")
        if logger.init_args.get("run_id") is None:
            logger.init_args.run_id = read_run_file(resumed).get("mlflow_run_id")

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"}}


def merge_callbacks(callbacks: list[Any], progress_bar: bool | None, checkpointing: bool | None) -> list[Any]:
    """The defaults followed by the configs' callbacks, an entry of a class already listed replacing that one in place.

    One progress bar (the last listed: a user's own replaces `RunProgress`); none of the progress bar or the
    checkpoint when ``enable_progress_bar`` / ``enable_checkpointing`` is false.
    """
    merged: dict[str, Any] = {}
    for callback in callbacks:
        path = str(callback.get("class_path", ""))
        if path.endswith(("ProgressBar", ".RunProgress")):
            merged = {k: v for k, v in merged.items() if not k.endswith(("ProgressBar", ".RunProgress"))}
        merged["ModelCheckpoint" if is_checkpoint(path) else path] = callback  # Lightning's replaces ours
    return [c for path, c in merged.items()
            if not (progress_bar is False and path.endswith(("ProgressBar", ".RunProgress")))
            and not (checkpointing is False and path == "ModelCheckpoint")]


def is_checkpoint(class_path: str) -> bool:
    """Lightning's ``ModelCheckpoint`` or the default `AtomicModelCheckpoint`: one slot in the callback list."""
    return class_path.rsplit(".", 1)[-1] in ("ModelCheckpoint", "AtomicModelCheckpoint")


def last_checkpoint(callbacks: list[Any]) -> str:
    """What ``--ckpt_path last`` loads: the newest complete checkpoint in the checkpoint callback's folder.

    See `rl_lightning.parallel.checkpoint_io.resume_checkpoint` (a save killed midway never counts); ``last``
    (Lightning's own lookup) when that folder is unknown or holds none.
    """
    from rl_lightning.parallel.checkpoint_io import resume_checkpoint

    folders = [c.init_args.get("dirpath") for c in callbacks if is_checkpoint(str(c.get("class_path", "")))]
    found = resume_checkpoint(folders[-1]) if folders and folders[-1] else None
    return "last" if found is None else str(found)


def _callbacks_add_in_config_files() -> None:
    """Make ``trainer: {callbacks: [...]}`` in any config file append (jsonargparse's ``callbacks+``).

    An overlay that adds a callback keeps the recipe's and the defaults' (checkpoint, export, the rollout's) instead
    of replacing the list. ``--trainer.callbacks '[...]'`` on the command line still replaces the whole list.
    """
    from jsonargparse import get_loader, set_loader

    from rl_lightning.compat.jsonargparse import loader_exceptions, omegaconf_loader

    try:
        if getattr(get_loader("omegaconf+"), "adds_callbacks", False):
            return
    except KeyError:  # jsonargparse sets its omegaconf loaders up lazily
        pass
    base = omegaconf_loader("omegaconf+")  # the stock "omegaconf+" loader, wrapped below

    def load(value: str) -> Any:
        loaded = base(value)
        trainer = loaded.get("trainer") if isinstance(loaded, dict) else None
        if isinstance(trainer, dict) and "callbacks" in trainer:
            trainer["callbacks+"] = trainer.pop("callbacks")
        return loaded

    load.adds_callbacks = True  # type: ignore[attr-defined]  # marks the loader as installed
    set_loader("omegaconf+", load, loader_exceptions("yaml"))


def main(args: list[str] | None = None) -> None:
    """Run the command line (``args``, default ``sys.argv[1:]``); a `UserError` ends in one line and exit status 2."""
    from rl_lightning.cli.progress import quiet

    # Recipes may name user code (callbacks, environments) by dotted path relative to where the job is launched.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    quiet(int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_PROCID") or 0))
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
        print(f"rl_lightning: error: {redact_text(str(user_error))}", file=sys.stderr)
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
