"""``python -m rl_lightning tune``: search-space validation, the pruning callback, and real in-process studies on the
SFT recipe (tiny model, CPU) read back through the MLflow client."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from rl_lightning.cli.search_space import Param, parse_space
from rl_lightning.cli.tune import Pruning, _Current, run
from rl_lightning.errors import ConfigError

optuna = pytest.importorskip("optuna")
LR_SPACE = {"model.lm.optim.lr": {"type": "categorical", "choices": [1.0e-6, 3.0e-3]}}  # hopeless vs good, 8 steps


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])  # LightningCLI warns when pytest's own argv is present


@pytest.mark.parametrize(("spec", "grid", "message"), [
    ({"type": "floaty", "low": 0, "high": 1}, False, "a.b: unknown type 'floaty' (allowed: float, int, categorical)"),
    ({"type": "float", "low": 1.0, "high": 0.5}, False, "a.b: low (1.0) must be below high (0.5)"),
    ({"type": "float", "low": 0.0, "high": 1.0, "log": True}, False, "a.b: a log range needs low > 0, got 0.0"),
    ({"type": "float", "low": 0.1, "high": 1.0}, True, "a.b: the grid sampler needs a `step` for a float range"),
    ({"type": "int", "low": 1.5, "high": 4}, False, "a.b: `low` must be an integer, got 1.5"),
    ({"type": "categorical", "choices": []}, False, "a.b: categorical needs a non-empty list `choices`, got []"),
    ({"type": "int", "low": 1, "high": 4, "hgih": 5}, False, "a.b: unknown field 'hgih' for type int"),
    (0.1, False, "a.b: expected {type: float|int|categorical, ...}, got 0.1"),
])
def test_space_errors_are_one_line(spec, grid, message):
    with pytest.raises(ConfigError) as info:
        parse_space({"a.b": spec}, "space.yaml", grid=grid)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_space_errors_are_collected():
    with pytest.raises(ConfigError) as info:
        parse_space({"a": {"type": "nope"}, "b": {"type": "int", "low": 3, "high": 3}})
    assert str(info.value) == ("search space: a: unknown type 'nope' (allowed: float, int, categorical); "
                               "b: low (3) must be below high (3)")


def test_space_parses_and_grids():
    space = parse_space({"model.lm.optim.lr": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
                         "model.update_per_rollout": {"type": "int", "low": 1, "high": 4},
                         "data.max_length": {"type": "float", "low": 0.1, "high": 0.3, "step": 0.1},
                         "model.advantage_estimator": {"type": "categorical", "choices": ["drgrpo", "grpo"]}})
    assert [p.key for p in space] == ["model.lm.optim.lr", "model.update_per_rollout", "data.max_length",
                                      "model.advantage_estimator"]
    assert space[1].grid() == [1, 2, 3, 4] and space[2].grid() == [0.1, 0.2, 0.3]
    assert space[3].grid() == ["drgrpo", "grpo"] and space[0].first() == 1e-5


class FakeTrial:
    """Prunes once a reported value exceeds `limit`."""

    def __init__(self, limit: float) -> None:
        self.limit, self.reports = limit, []

    def report(self, value: float, step: int) -> None:
        self.reports.append((step, value))

    def should_prune(self) -> bool:
        return self.reports[-1][1] > self.limit


def test_pruning_callback_reports_and_stops(monkeypatch):
    trainer = SimpleNamespace(callback_metrics={}, sanity_checking=False, global_step=0, should_stop=False)
    callback, trial = Pruning("train/loss"), FakeTrial(limit=5.0)
    callback.on_train_batch_end(trainer, None)  # no current trial: nothing happens
    monkeypatch.setattr(_Current, "trial", trial)
    monkeypatch.setattr(_Current, "pruned_at", None)
    for step, loss in [(1, 4.0), (1, 4.0), (2, 4.5), (3, 6.0)]:  # the repeated step is reported once
        trainer.global_step, trainer.callback_metrics = step, {"train/loss": loss}
        callback.on_train_batch_end(trainer, None)
        callback.on_validation_end(trainer, None)  # a train/ metric is read after training batches only
    assert trial.reports == [(1, 4.0), (2, 4.5), (3, 6.0)]
    assert trainer.should_stop and _Current.pruned_at == 3


def _tune(*args: str) -> optuna.Study:
    with open("space.yaml", "w") as f:
        yaml.safe_dump(LR_SPACE, f)
    return run(["--config", "recipes/sft.yaml", "--search", "space.yaml", "--metric", "train/loss",
                "--sampler", "grid", "--trainer.max_steps", "8", *args])


def _runs(study_name: str):
    from mlflow import MlflowClient

    client = MlflowClient("sqlite:///mlflow.db")
    experiment = client.get_experiment_by_name("rl_lightning/sft")
    (parent,) = client.search_runs([experiment.experiment_id], f"tags.`mlflow.runName` = '{study_name}'")
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return client, parent, sorted(children, key=lambda r: r.info.run_name)


@pytest.mark.slow
def test_study_finds_the_better_learning_rate(workdir):
    study = _tune("--study-name", "lr-grid")
    assert study.best_params == {"model.lm.optim.lr": 3.0e-3}
    client, parent, children = _runs("lr-grid")
    assert parent.data.params["best.model.lm.optim.lr"] == "0.003"
    assert parent.data.metrics["best_value"] == pytest.approx(study.best_value)
    assert parent.data.params["space.model.lm.optim.lr"] == '{"type": "categorical", "choices": [1e-06, 0.003]}'
    assert parent.info.status == "FINISHED"
    assert [c.info.run_name for c in children] == ["trial-0", "trial-1"]
    losses = {float(c.data.params["model.lm.optim.lr"]): c.data.metrics["train/loss"] for c in children}
    assert losses[3.0e-3] < losses[1.0e-6] - 1.0, losses  # clearly different, not a coin flip
    assert all(c.info.status == "FINISHED" and c.data.tags["optuna.state"] == "COMPLETE" for c in children)
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == ["search_space.yaml"]


@pytest.mark.slow
def test_median_pruner_prunes_the_worse_trial(workdir):
    # grid order with seed 0: 3e-3 first (completes), then 1e-6, whose loss sits above the median from step 2 on
    study = _tune("--study-name", "lr-pruned", "--pruner", "median", "--pruner-startup-trials", "1")
    states = {t.params["model.lm.optim.lr"]: t.state for t in study.trials}
    assert states == {3.0e-3: optuna.trial.TrialState.COMPLETE, 1.0e-6: optuna.trial.TrialState.PRUNED}
    client, parent, children = _runs("lr-pruned")
    pruned = next(c for c in children if c.data.params["model.lm.optim.lr"] == "1e-06")
    assert pruned.data.tags["optuna.state"] == "PRUNED" and pruned.info.status == "KILLED"
    assert len(client.get_metric_history(pruned.info.run_id, "train/loss")) < 8  # stopped early
    assert parent.data.tags["trials.pruned"] == "1" and parent.data.params["best.model.lm.optim.lr"] == "0.003"


def test_bad_key_fails_before_any_trial(workdir, capsys):
    (workdir / "space.yaml").write_text("model.lm.optim.lrr: {type: categorical, choices: [0.1, 0.2]}\n")
    with pytest.raises(SystemExit) as info:
        run(["--config", "recipes/sft.yaml", "--search", "space.yaml", "--sampler", "grid"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("rl_lightning: error: model.lm.optim.lrr: ") and "did you mean 'model.lm.optim.lr'" in lines[0]
    assert not (workdir / "outputs").exists() and not (workdir / "mlflow.db").exists()  # no run, no parent


def test_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "rl_lightning", "tune", "--help"], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and "--search YAML" in result.stdout and "--pruner {none,median}" in result.stdout


def test_param_suggest_uses_optuna_distributions():
    trial = optuna.trial.FixedTrial({"x": 0.5, "n": 3, "c": "b"})
    assert Param("x", "float", 0.0, 1.0).suggest(trial) == 0.5
    assert Param("n", "int", 1, 4).suggest(trial) == 3
    assert Param("c", "categorical", choices=("a", "b")).suggest(trial) == "b"


def test_trial_value_reduces_the_metric_history():
    from rl_lightning.cli.tune import trial_value

    history = [SimpleNamespace(step=s, timestamp=s, value=v) for s, v in [(3, 2.0), (1, 5.0), (2, 1.0)]]
    client = SimpleNamespace(get_metric_history=lambda run_id, key: history if key == "m" else [],
                             get_run=lambda run_id: SimpleNamespace(data=SimpleNamespace(metrics={"m": 2.0})))
    assert trial_value(client, "r", "m", "last", "minimize") == 2.0  # the final step, not the last row
    assert trial_value(client, "r", "m", "best", "minimize") == 1.0
    assert trial_value(client, "r", "m", "best", "maximize") == 5.0
    with pytest.raises(ConfigError, match=r"^--metric val/reward: the trial logged no such metric \(it logged: m\)$"):
        trial_value(client, "r", "val/reward", "last", "maximize")
