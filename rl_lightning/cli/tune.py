"""``python -m rl_lightning tune --config recipes/<task>.yaml --search space.yaml --n-trials N``: Optuna search.

Each trial is one ``fit`` run in this process (`rl_lightning.cli.main.main`) with the trial's values passed as dotted CLI
overrides (``--model.lm.optim.lr 0.003``), so any config key can be searched and a bad key fails with the CLI's own
one-line error (the overrides are dry-parsed once at start-up, with each key's first value, before any trial runs).

- The search space is a YAML mapping of dotted config keys to ``{type: float|int|categorical, ...}``
  (`rl_lightning.cli.search_space`); it is validated up front and every problem is reported on one line.
- The objective is a logged metric (``--metric``, default ``val/reward``) read back from the trial's MLflow run:
  its final value (``--objective-reduce last``) or its best one (``best``). ``--direction`` defaults to minimize for
  a metric named ``*loss*`` and maximize otherwise.
- Pruning (``--pruner median``): the `Pruning` callback reports every logged value of the metric to the trial
  (step = the optimizer step) and, when Optuna says prune, stops the fit (``trainer.should_stop``: the run ends
  normally, with its checkpoint) and the trial is marked PRUNED.
- MLflow: the study is a parent run (search space as params and ``search_space.yaml``, the best params and value at
  the end); every trial is a child run ``trial-<n>`` (tag ``mlflow.parentRunId``) created here and handed to the fit
  with ``--trainer.logger.init_args.run_id``. Trials' output folders are ``outputs/<study>-trial-<n>/<time>/``.

Trials run one after another in one process, so a trial uses one device (no multi-process strategy).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
from typing import Any

import lightning as L
import yaml
from typing_extensions import override

from rl_lightning.assets.package_files import shown_path
from rl_lightning.cli.search_space import Param, load_space, overrides
from rl_lightning.errors import ConfigError, UserError

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median")


class _Current:
    """The trial the running fit reports to (set by the tuner around each fit, read by `Pruning`)."""

    trial: Any = None
    pruned_at: int | None = None


class Pruning(L.Callback):
    """Report each logged value of `metric` to the current Optuna trial; stop the fit when Optuna prunes it.

    Added to every trial's fit by ``rl_lightning tune``; outside a tune run (no current trial) it does nothing.
    A ``val*`` metric is read after each validation, any other after each training batch (the last value logged
    there), and reported at the trainer's optimizer step.

    Args:
        metric: the logged metric to report (``train/loss``, ``val/reward``).
    """

    def __init__(self, metric: str = "val/reward") -> None:
        self.metric = metric
        self._last_step: int | None = None

    def _report(self, trainer: L.Trainer) -> None:
        trial, value = _Current.trial, trainer.callback_metrics.get(self.metric)
        if trial is None or value is None or trainer.sanity_checking or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        trial.report(float(value), trainer.global_step)
        if trial.should_prune():
            _Current.pruned_at = trainer.global_step
            trainer.should_stop = True

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self.metric.startswith("val"):
            self._report(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.metric.startswith("val"):
            self._report(trainer)


class TrialFailed(RuntimeError):
    """A trial's fit ended with an error (already printed by the CLI): the trial is FAILED, the study goes on."""


def build_parser() -> argparse.ArgumentParser:
    """The ``tune`` command's argument parser (the arguments it does not know go to every trial's ``fit``)."""
    parser = argparse.ArgumentParser(
        prog="python -m rl_lightning tune", allow_abbrev=False,
        description="Optuna search over any config key; every other argument is passed to each trial's `fit` "
                    "(e.g. --trainer.max_steps 50).")
    parser.add_argument("--config", metavar="YAML", action="append", required=True, help="recipe (and overlays), as for fit")
    parser.add_argument("--search", metavar="YAML", required=True, help="search-space YAML: {dotted.key: {type: ..., ...}}")
    parser.add_argument("--n-trials", metavar="N", type=int, help="number of trials (grid: default the grid's size)")
    parser.add_argument("--metric", metavar="NAME", default="val/reward", help="logged metric to optimise (default: val/reward)")
    parser.add_argument("--direction", choices=("minimize", "maximize"),
                        help="default: minimize for a metric named *loss*, maximize otherwise")
    parser.add_argument("--objective-reduce", choices=("last", "best"), default="last",
                        help="the trial's value: the metric's final logged value, or its best one")
    parser.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    parser.add_argument("--pruner", choices=PRUNERS, default="none")
    parser.add_argument("--pruner-startup-trials", metavar="N", type=int, default=2,
                        help="median pruner: complete this many trials before pruning any")
    parser.add_argument("--pruner-warmup-steps", metavar="STEP", type=int, default=0,
                        help="median pruner: never prune before this optimizer step")
    parser.add_argument("--study-name", metavar="NAME", help="default: <recipe name>-tune")
    parser.add_argument("--seed", metavar="N", type=int, default=0, help="sampler seed")
    return parser


def dry_parse(fit_args: list[str]) -> dict[str, Any]:
    """The resolved config of ``fit <fit_args>`` without running it (``--print_config``).

    A bad key or value exits with the CLI's one-line error.
    """
    from rl_lightning.cli.main import main as cli_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            cli_main(["fit", *fit_args, "--print_config"])
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    return yaml.safe_load(printed.getvalue())


def experiment_name(config: dict[str, Any], fit_args: list[str], configs: list[str]) -> str:
    """The MLflow experiment a fit of this config logs to.

    The CLI's rule: ``rl_lightning/<family>`` unless ``experiment_name`` is set in a config file or on the command line.
    """
    from rl_lightning.cli.main import EXPERIMENTS

    texts = list(fit_args)
    for path in configs:
        with contextlib.suppress(OSError), open(path) as f:
            texts.append(f.read())
    named = config["trainer"]["logger"].get("init_args", {}).get("experiment_name") or "rl_lightning"
    family = EXPERIMENTS.get(str(config.get("model", {}).get("class_path", "")).rsplit(".", 1)[-1])
    return named if family is None or any("experiment_name" in text for text in texts) else f"rl_lightning/{family}"


def make_sampler(name: str, space: list[Param], seed: int) -> Any:
    """The Optuna sampler `name` (``grid`` over `space`, ``random`` or ``tpe``), seeded with `seed`."""
    import optuna

    if name == "grid":
        return optuna.samplers.GridSampler({p.key: p.grid() for p in space}, seed=seed)
    return optuna.samplers.RandomSampler(seed=seed) if name == "random" else optuna.samplers.TPESampler(seed=seed)


def make_pruner(args: argparse.Namespace) -> Any:
    """The Optuna pruner of ``--pruner``: the median pruner with its start-up/warm-up settings, or none."""
    import optuna

    if args.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=args.pruner_startup_trials,
                                           n_warmup_steps=args.pruner_warmup_steps)
    return optuna.pruners.NopPruner()


def trial_value(client: Any, run_id: str, metric: str, reduce: str, direction: str) -> float:
    """The trial's objective: the final (``last``) or best value of `metric` logged in its MLflow run."""
    history = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
    if not history:
        logged = ", ".join(sorted(client.get_run(run_id).data.metrics)) or "none"
        raise ConfigError(f"--metric {metric}: the trial logged no such metric (it logged: {logged})")
    values = [m.value for m in history]
    if reduce == "last":
        return values[-1]
    return max(values) if direction == "maximize" else min(values)


class Tuner:
    """Runs the study: one parent MLflow run, one child run and one in-process fit per trial."""

    def __init__(self, args: argparse.Namespace, fit_args: list[str], space: list[Param]) -> None:
        from mlflow import MlflowClient

        self.args, self.fit_args, self.space = args, fit_args, space
        base = [a for path in args.config for a in ("--config", path)] + fit_args
        config = dry_parse(base + overrides({p.key: p.first() for p in space}))
        logger = config["trainer"].get("logger") or {}
        if not str(logger.get("class_path", "")).endswith("MLFlowLogger"):
            raise ConfigError(f"tune reads trial metrics from MLflow: trainer.logger must be the MLFlowLogger, "
                              f"got {logger.get('class_path')!r}")
        self.tracking_uri = logger["init_args"].get("tracking_uri") or "sqlite:///mlflow.db"
        self.client = MlflowClient(self.tracking_uri)
        name = experiment_name(config, fit_args, args.config)
        found = self.client.get_experiment_by_name(name)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(name)
        self.base = base

    def start_parent(self, study_name: str, direction: str, n_trials: int) -> str:
        """Create the study's parent MLflow run with the settings and the search space; returns its id."""
        a = self.args
        tags = {"rl_lightning.tune": "study", "optuna.study": study_name}
        self.parent = self.client.create_run(self.experiment_id, run_name=study_name, tags=tags).info.run_id
        params = {"recipe": shown_path(a.config[-1]), "metric": a.metric, "direction": direction, "sampler": a.sampler,
                  "pruner": a.pruner, "n_trials": n_trials, "seed": a.seed, "objective_reduce": a.objective_reduce,
                  "fit_args": " ".join(self.fit_args)}
        for p in self.space:
            spec = {"type": p.type, "choices": list(p.choices)} if p.type == "categorical" else \
                {"type": p.type, "low": p.low, "high": p.high, "step": p.step, "log": p.log}
            params[f"space.{p.key}"] = json.dumps(spec)
        for key, value in params.items():
            self.client.log_param(self.parent, key, str(value)[:6000])
        with open(a.search) as f:
            self.client.log_text(self.parent, f.read(), "search_space.yaml")
        return self.parent

    def objective(self, trial: Any) -> float:
        """Run one trial as a child MLflow run and a fit; returns its objective value (raises when pruned or failed)."""
        import optuna

        values = {p.key: p.suggest(trial) for p in self.space}
        tags = {"mlflow.parentRunId": self.parent, "optuna.study": trial.study.study_name,
                "optuna.trial": str(trial.number)}
        child = self.client.create_run(self.experiment_id, run_name=f"trial-{trial.number}", tags=tags).info.run_id
        trial.set_user_attr("mlflow_run_id", child)
        pruning = json.dumps({"class_path": "rl_lightning.cli.tune.Pruning", "init_args": {"metric": self.args.metric}})
        args = ["fit", *self.base, *overrides(values), "--trainer.logger.init_args.run_id", child,
                "--trainer.logger.init_args.tracking_uri", self.tracking_uri,
                "--trainer.logger.init_args.run_name", f"{trial.study.study_name}-trial-{trial.number}",
                "--trainer.callbacks+", pruning]
        _Current.trial, _Current.pruned_at = trial, None
        try:
            self._fit(args, child)
        finally:
            _Current.trial = None
        if _Current.pruned_at is not None:
            self.client.set_tag(child, "optuna.state", "PRUNED")
            self.client.set_terminated(child, "KILLED")
            raise optuna.TrialPruned(f"pruned at step {_Current.pruned_at}")
        value = trial_value(self.client, child, self.args.metric, self.args.objective_reduce,
                            trial.study.direction.name.lower())
        self.client.set_tag(child, "optuna.state", "COMPLETE")
        self.client.log_metric(self.parent, "trial_value", value, step=trial.number)
        return value

    def _fit(self, args: list[str], child: str) -> None:
        from rl_lightning.cli.main import main as cli_main

        try:
            cli_main(args)
        except SystemExit as e:  # the CLI printed its one-line error
            if e.code in (0, None):
                return
            self.client.set_tag(child, "optuna.state", "FAIL")
            self.client.set_terminated(child, "FAILED")
            raise TrialFailed(f"the trial's fit exited with status {e.code}") from None
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.set_tag(child, "optuna.state", "FAIL")
                self.client.set_terminated(child, "FAILED")
            raise

    def finish(self, study: Any) -> None:
        """Record the trial counts and the best trial in the parent run and close it; no completed trial is an error."""
        import optuna

        states = [t.state for t in study.trials]
        for state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL):
            self.client.set_tag(self.parent, f"trials.{state.name.lower()}", str(states.count(state)))
        if optuna.trial.TrialState.COMPLETE not in states:
            self.client.set_terminated(self.parent, "FAILED")
            raise UserError(f"study {study.study_name}: no trial completed ({len(states)} run)")
        best = study.best_trial
        for key, value in best.params.items():
            self.client.log_param(self.parent, f"best.{key}", str(value))
        self.client.log_metric(self.parent, "best_value", best.value)
        self.client.set_tag(self.parent, "best_trial", str(best.number))
        self.client.set_tag(self.parent, "best_run_id", best.user_attrs.get("mlflow_run_id", ""))
        self.client.set_terminated(self.parent, "FINISHED")
        print(f"tune: best trial {best.number}: {self.args.metric} = {best.value:.6g} with {best.params} "
              f"(MLflow parent run {self.parent})", flush=True)


def run(argv: list[str]) -> Any:
    """Parse the tune arguments, validate the space, run the study; returns the `optuna.Study`."""
    import optuna

    from rl_lightning.cli.recipes import find_config
    from rl_lightning.cli.run_names import configs_name

    args, fit_args = build_parser().parse_known_args(argv)
    args.config = [find_config(path) for path in args.config]  # --config grpo: the bundled recipe
    space = load_space(args.search, grid=args.sampler == "grid")
    n_trials = args.n_trials
    if n_trials is None and args.sampler != "grid":
        raise ConfigError(f"--n-trials is required with --sampler {args.sampler} (only the grid has a natural size)")
    if n_trials is None:
        n_trials = math.prod(len(p.grid()) for p in space)
    if n_trials < 1:
        raise ConfigError(f"--n-trials must be at least 1, got {n_trials}")
    direction = args.direction or ("minimize" if "loss" in args.metric else "maximize")
    study_name = args.study_name or f"{configs_name(args.config)}-tune"
    tuner = Tuner(args, fit_args, space)
    parent = tuner.start_parent(study_name, direction, n_trials)
    print(f"tune: {n_trials} trials, {direction} the {args.objective_reduce} value of {args.metric}, "
          f"sampler {args.sampler}, pruner {args.pruner}; MLflow parent run {parent}", flush=True)
    study = optuna.create_study(study_name=study_name, direction=direction,
                                sampler=make_sampler(args.sampler, space, args.seed), pruner=make_pruner(args))
    try:
        study.optimize(tuner.objective, n_trials=n_trials, catch=(TrialFailed,))
    except BaseException:
        tuner.client.set_terminated(parent, "FAILED")
        raise
    tuner.finish(study)
    return study


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m rl_lightning tune``: user errors are one line on stderr, exit status 2."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[2:] if argv is None else argv
    sys.argv = sys.argv[:1]  # LightningCLI warns when it is given args and sys.argv holds others (the tune ones)
    try:
        run(argv)
    except UserError as e:
        print(f"rl_lightning: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
