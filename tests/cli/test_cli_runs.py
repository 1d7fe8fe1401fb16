"""Runs as a user lives them through the real CLI: overlays add callbacks, every run gets its own output folder,
`--ckpt_path last` resumes the latest one (same folder, same MLflow run), MLflow experiments per task family, and a
run that fails at start-up leaves no run behind."""

import json

import pytest
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from mlflow import MlflowClient

from rl_lightning.cli.main import RLLightningCLI, main
from rl_lightning.cli.outputs import RunOutputs
from rl_lightning.cli.progress import RunProgress
from rl_lightning.tracking.export import HFExport
from rl_lightning.tracking.mlflow_run import MLflowTracking


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["rl_lightning"])


def _cli(args):
    from lightning.pytorch import LightningDataModule, LightningModule

    return RLLightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                          save_config_callback=None, parser_kwargs={"parser_mode": "omegaconf+"}, args=args, run=False)


def _types(cli):
    return [type(c).__name__ for c in cli.trainer.callbacks]


def test_an_overlay_adds_callbacks_and_keeps_the_recipes(workdir):
    from rl_lightning.callbacks.rollout_samples import RolloutSamples

    overlay = workdir / "overlay.yaml"
    overlay.write_text("trainer:\n  callbacks:\n"
                       "    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
                       "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                       "      init_args: {every_n_train_steps: 7, save_last: true}\n")
    cli = _cli(["--config", "recipes/grpo.yaml", "--config", str(overlay)])
    callbacks = cli.trainer.callbacks
    for kind in (RunProgress, HFExport, RunOutputs, MLflowTracking, RolloutSamples, LearningRateMonitor):
        assert sum(isinstance(c, kind) for c in callbacks) == 1, (kind, _types(cli))
    (checkpoint,) = [c for c in callbacks if isinstance(c, ModelCheckpoint)]  # the overlay's replaced the default
    assert checkpoint._every_n_train_steps == 7
    rollout_samples = next(c for c in callbacks if isinstance(c, RolloutSamples))
    assert rollout_samples.every_n_rollouts == 10  # the recipe's settings


def test_progress_bar_and_checkpoint_switches(workdir):
    cli = _cli(["--config", "recipes/sft.yaml", "--trainer.enable_progress_bar", "false",
                "--trainer.enable_checkpointing", "false"])
    assert not any(isinstance(c, RunProgress | ModelCheckpoint) for c in cli.trainer.callbacks), _types(cli)
    overlay = workdir / "rich.yaml"
    overlay.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.RichProgressBar\n")
    cli = _cli(["--config", "recipes/sft.yaml", "--config", str(overlay)])
    assert isinstance(cli.trainer.progress_bar_callback, RichProgressBar)  # a user's bar replaces RunProgress
    assert not any(isinstance(c, RunProgress) for c in cli.trainer.callbacks)


def test_experiment_per_task_family_unless_named(workdir):
    assert _cli(["--config", "recipes/sft.yaml"]).trainer.logger._experiment_name == "rl_lightning/sft"
    assert _cli(["--config", "recipes/dpo.yaml"]).trainer.logger._experiment_name == "rl_lightning/dpo"
    assert _cli(["--config", "recipes/rm.yaml"]).trainer.logger._experiment_name == "rl_lightning/reward-model"
    named = _cli(["--config", "recipes/sft.yaml", "--trainer.logger.init_args.experiment_name", "rl_lightning"])
    assert named.trainer.logger._experiment_name == "rl_lightning"  # as written, even when it is the default


def _sft(*args):
    main(["fit", "--config", "recipes/sft.yaml", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
          *args])


def _runs(client, experiment="rl_lightning/sft"):
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def test_two_runs_two_folders_then_resume_the_latest(workdir, capsys):
    _sft()
    _sft()
    folders = sorted(p for p in (workdir / "outputs" / "sft").iterdir() if p.name != "latest")
    assert len(folders) == 2
    first, second = folders
    assert (workdir / "outputs" / "sft" / "latest").resolve() == second.resolve()
    for folder in folders:
        assert (folder / "checkpoints" / "last.ckpt").is_file() and (folder / "export" / "config.json").is_file()
        assert "class_path: rl_lightning.tasks.SFT" in (folder / "config.yaml").read_text()
    client = MlflowClient("sqlite:///mlflow.db")
    runs = {r.info.run_id: r for r in _runs(client)}
    assert len(runs) == 2
    by_folder = {r.data.tags["output_dir"]: r for r in runs.values()}
    assert set(by_folder) == {str(first.resolve()), str(second.resolve())}
    assert by_folder[str(second.resolve())].data.params["config"] == "[rl_lightning/recipes/sft.yaml]"  # not [Path_fsr(...)]
    out = capsys.readouterr().out
    assert f"outputs: outputs/sft/{second.name}" in out and "sft finished: 2 steps in " in out
    assert f"export      outputs/sft/{second.name}/export" in out

    # resume the latest run to 4 steps: same folder, same MLflow run, the step count goes on
    main(["fit", "--config", "recipes/sft.yaml", "--trainer.max_steps", "4", "--trainer.limit_val_batches", "0",
          "--ckpt_path", "last"])
    assert sorted(p.name for p in (workdir / "outputs" / "sft").iterdir()) == sorted([first.name, second.name,
                                                                                     "latest"])
    resumed = client.get_run(json.loads((second / "run.json").read_text())["mlflow_run_id"])
    assert resumed.info.run_id == by_folder[str(second.resolve())].info.run_id and len(_runs(client)) == 2
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "train/loss")]
    assert sorted(steps) == [1, 2, 3, 4]  # optimizer steps done, the resumed ones after the first run's
    assert "sft finished: 4 steps in " in capsys.readouterr().out


def test_a_start_up_failure_leaves_no_run(workdir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--trainer.max_steps", "5"])
    assert info.value.code == 2
    assert "set model.max_rollouts instead of trainer.max_steps=5" in capsys.readouterr().err
    client = MlflowClient("sqlite:///mlflow.db")
    assert _runs(client, "rl_lightning/rl") == []
