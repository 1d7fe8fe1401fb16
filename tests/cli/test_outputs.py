"""Per-run output folders and what the MLflow run records: two runs never share a folder, `latest` points at the
newest, the MLflow experiment is a model-training one with system metrics and data counters, a run that fails at
start-up leaves no MLflow run, and a run that fails later carries its error."""

import json
import os
import stat
import time

import lightning as L
import pytest
from conftest import DEMO_DATA, TINY_MODEL
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger

from rl_lightning.cli.outputs import RunOutputs, latest_run_dir, new_run_dir, read_run_file
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig
from rl_lightning.tracking.export import HFExport
from rl_lightning.tracking.mlflow_run import EXPERIMENT_KIND, MLflowTracking


def _sft_run(tmp_path, callbacks=(), max_steps=2, logger=None, dirpath=None):
    from rl_lightning.data import SFTDataModule
    from rl_lightning.tasks import SFT

    L.seed_everything(0)
    model = SFT(LMConfig(str(TINY_MODEL)))
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=64)
    outputs = RunOutputs("sft", root=str(tmp_path / "outputs"), dirpath=dirpath)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=logger or False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[outputs, ModelCheckpoint(save_last=True), HFExport(), *callbacks])
    trainer.fit(model, datamodule=data)
    return outputs, trainer


def test_new_run_dirs_never_collide(tmp_path):
    first, second = new_run_dir(tmp_path, "grpo"), new_run_dir(tmp_path, "grpo")  # within the same second
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name in (first.name + "-2", ) or second.name > first.name


def test_two_runs_write_two_folders_and_latest_follows(tmp_path):
    outputs_a, _ = _sft_run(tmp_path)
    outputs_b, trainer = _sft_run(tmp_path)
    a, b = outputs_a.dirpath, outputs_b.dirpath
    assert a != b and a.parent == b.parent == tmp_path / "outputs" / "sft"
    for run in (a, b):
        assert (run / "checkpoints" / "last.ckpt").is_file()
        assert (run / "export" / "config.json").is_file() and (run / "export" / "model.safetensors").is_file()
    assert latest_run_dir(tmp_path / "outputs", "sft") == b.resolve()
    assert os.readlink(tmp_path / "outputs" / "sft" / "latest") == b.name  # relative: the tree can move
    checkpoint = next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint))
    assert checkpoint.dirpath == os.path.realpath(b / "checkpoints")


def test_a_given_checkpoint_or_export_dirpath_is_kept(tmp_path):
    from rl_lightning.data import SFTDataModule
    from rl_lightning.tasks import SFT

    mine = tmp_path / "mine"
    outputs = RunOutputs("sft", root=str(tmp_path / "outputs"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[outputs, ModelCheckpoint(dirpath=str(mine), save_last=True),
                                   HFExport(str(tmp_path / "my_export"))])
    trainer.fit(SFT(LMConfig(str(TINY_MODEL))), datamodule=SFTDataModule(str(DEMO_DATA / "sft.jsonl"),
                                                              tokenizer_name=str(TINY_MODEL), batch_size=4,
                                                              max_length=64))
    assert (mine / "last.ckpt").is_file() and (tmp_path / "my_export" / "config.json").is_file()
    assert not (outputs.dirpath / "checkpoints").exists() and not (outputs.dirpath / "export").exists()


class _Slow(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.25)


def test_mlflow_run_records_kind_system_metrics_data_counters_and_folder(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="outputs-test", tracking_uri=uri, run_name="sft")
    # MLflow publishes a sample at the end of each interval: the steps are slowed so the run spans several
    outputs, _ = _sft_run(tmp_path, [MLflowTracking(sampling_interval_s=0.2), _Slow()], max_steps=6, logger=logger)
    client = logger.experiment
    run = client.get_run(logger.run_id)
    assert client.get_experiment(logger.experiment_id).tags["mlflow.experimentKind"] == EXPERIMENT_KIND
    assert run.data.metrics["data/train_rows"] == 2000
    system = [k for k in run.data.metrics if k.startswith("system/")]
    assert "system/cpu_utilization_percentage" in system and "system/system_memory_usage_megabytes" in system, system
    assert run.data.tags["output_dir"] == str(outputs.dirpath.resolve())
    assert read_run_file(outputs.dirpath)["mlflow_run_id"] == logger.run_id
    assert json.loads((outputs.dirpath / "run.json").read_text())["mlflow_tracking_uri"] == uri
    assert stat.S_IMODE(os.stat(outputs.dirpath / "run.json").st_mode) == 0o600  # this user's only (issue 36)


def test_start_up_failure_leaves_no_mlflow_run(tmp_path):
    """PPO refuses trainer.max_steps in setup. Lightning has created the MLflow run by then (before any setup
    hook); it holds nothing, so it is deleted rather than left as an empty FAILED run."""
    from helpers import ppo_task, prompts

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="startup", tracking_uri=uri, run_name="grpo")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=logger, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[RunOutputs("grpo", root=str(tmp_path / "outputs")), MLflowTracking()])
    with pytest.raises(ConfigError, match="set model.max_rollouts instead of trainer.max_steps"):
        trainer.fit(ppo_task(str(DEMO_DATA.parent.parent.parent / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"),
                             max_rollouts=1), datamodule=prompts(2))
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments) == []
    (deleted,) = client.search_runs(experiments, run_view_type=ViewType.DELETED_ONLY)  # recoverable, not erased
    assert deleted.info.run_id == logger._run_id


class _FailAtStep(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            raise RuntimeError("disk full\nmore detail")


def test_a_failure_after_start_is_written_on_the_run(tmp_path):
    logger = MLFlowLogger(experiment_name="failing", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", run_name="sft")
    with pytest.raises(RuntimeError, match="disk full"):
        _sft_run(tmp_path, [MLflowTracking(system_metrics=False), _FailAtStep()], max_steps=5, logger=logger)
    run = logger.experiment.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "disk full"
    assert run.data.tags["mlflow.note.content"] == "Failed: RuntimeError: disk full"


def test_resume_dir_for_last_and_for_a_checkpoint_inside_a_run_folder(tmp_path):
    from rl_lightning.cli.outputs import RUN_FILE, point_latest, resume_dir

    assert resume_dir("last", tmp_path, "grpo") is None  # no earlier run: a fresh folder
    older, newer = new_run_dir(tmp_path, "grpo"), new_run_dir(tmp_path, "grpo")
    point_latest(newer)
    assert resume_dir("last", tmp_path, "grpo") == newer.resolve()
    (older / RUN_FILE).write_text("{}")
    (older / "checkpoints").mkdir()
    assert resume_dir(str(older / "checkpoints" / "last.ckpt"), tmp_path, "grpo") == older.resolve()
    assert resume_dir(str(newer / "checkpoints" / "last.ckpt"), tmp_path, "grpo") is None  # no run.json there
    assert resume_dir(str(tmp_path / "elsewhere" / "x.ckpt"), tmp_path, "grpo") is None
