"""The run's terminal: the bar counts what bounds the run (rollouts or optimizer steps) with the right total, shows the
metrics a user watches, prints validation results and ends with a summary naming the outputs and the MLflow run."""

import re

import lightning as L
from conftest import DEMO_DATA, REPO, TINY_MODEL
from helpers import ppo_task, prompts

from rl_lightning.cli.progress import RunProgress, format_metrics
from rl_lightning.models.config import LMConfig

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")


def test_format_metrics_picks_known_keys_in_order():
    metrics = {"train/loss": 0.5, "train/reward": 0.25, "train/completion_length": 7.0, "train/lr": 1e-3,
               "train/policy_loss": -0.125}
    # the names are MLflow's without train/ (what a user searches for in MLflow)
    assert format_metrics(metrics) == "reward 0.25 · completion_length 7 · policy_loss -0.125 · loss 0.5"
    assert format_metrics({"train/loss": 1.23456789}) == "loss 1.235"
    assert format_metrics({"train/lr": 1.0}) == ""
    assert format_metrics({"train/entropy": 2.0}, (("train/entropy", "entropy"),)) == "entropy 2"


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


def test_ppo_run_counts_rollouts_prints_validation_and_summary(tmp_path, capsys):
    """Without a terminal (pytest captures stdout) the bar prints lines: every rollout of a 3-rollout run (each is a
    tenth or more) with the reward, length and loss, then the summary naming the MLflow run."""
    from lightning.pytorch.loggers import MLFlowLogger

    L.seed_everything(0)
    model = ppo_task(ENV, max_rollouts=3)
    data = prompts(2)
    logger = MLFlowLogger(experiment_name="progress", run_name="grpo-test", tracking_uri=f"sqlite:///{tmp_path}/m.db")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=-1, logger=logger, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[RunProgress()], log_every_n_steps=1)
    trainer.fit(model, datamodule=data)
    lines = _lines(capsys.readouterr().out)
    progress = [line for line in lines if line.startswith("grpo-test rollout")]
    assert [re.match(r"grpo-test rollout (\d+)/3 ", line).group(1) for line in progress] == ["1", "2", "3"], lines
    assert all(" reward " in line and " completion_length " in line and " policy_loss " in line
               for line in progress), progress
    assert not any("Epoch" in line for line in lines)
    summary = [i for i, line in enumerate(lines) if line.startswith("grpo-test finished: 3 rollouts in ")]
    assert len(summary) == 1 and summary[0] > lines.index(progress[-1])
    tail = lines[summary[0]:]
    assert any(line.strip().startswith("train ") and "reward" in line for line in tail)
    assert any(f"({logger.run_id}) in experiment 'progress'" in line for line in tail)
    link = f"#/experiments/{logger.experiment_id}/runs/{logger.run_id}?workflowType=machine_learning"
    assert any("mlflow ui --backend-store-uri sqlite:///" in line and link in line for line in tail)
    compare = f"http://127.0.0.1:5000/#/experiments/{logger.experiment_id}/runs?workflowType=machine_learning"
    assert any(line.split() == ["compare", compare] for line in tail), tail


def test_ppo_validation_lines_and_summary(tmp_path, capsys):
    L.seed_everything(0)
    model = ppo_task(ENV, max_rollouts=2, rollout={"val_temperature": 1.0})
    data = prompts(2, val_path=str(DEMO_DATA / "arithmetic.jsonl"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[RunProgress()], val_check_interval=2,
                        check_val_every_n_epoch=None, limit_val_batches=1, num_sanity_val_steps=-1)
    trainer.fit(model, datamodule=data)
    lines = _lines(capsys.readouterr().out)
    validation = [line for line in lines if line.startswith("validation @ ")]
    assert [line.split(":")[0] for line in validation] == ["validation @ start", "validation @ rollout 2"], lines
    reward = float(re.search(r" reward ([-\d.e]+)", validation[-1]).group(1))
    assert abs(reward - model.validation_metrics["val/reward"]) < 1e-3  # printed with 4 significant digits
    assert any(line.split()[:2] == ["validation", "reward"] for line in lines)  # repeated in the summary


def test_sft_counts_optimizer_steps_not_epochs(capsys):
    from rl_lightning.data import SFTDataModule
    from rl_lightning.tasks import SFT

    L.seed_everything(0)
    model = SFT(LMConfig(str(TINY_MODEL)))
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=64)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=20, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[RunProgress()], num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    lines = _lines(capsys.readouterr().out)
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"SFT step (\d+)/20 ", line))]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20], lines  # a line per tenth of the run
    assert all("loss " in line for line in lines if line.startswith("SFT step"))
    assert any(line.startswith("SFT finished: 20 steps in ") for line in lines)
    assert not any("Epoch" in line or "/-2" in line for line in lines)


def test_only_global_rank_zero_prints():
    bar = RunProgress()
    bar.disable()
    assert not bar.is_enabled


def test_quiet_drops_what_does_not_apply_and_other_ranks_warnings(caplog):
    import logging
    import warnings

    from rl_lightning.cli.progress import quiet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet(rank=0)
        warnings.warn("It is recommended to use `self.log('val/reward', ..., sync_dist=True)` when logging", stacklevel=1)
        warnings.warn("a warning that applies", stacklevel=1)
        assert [str(w.message) for w in caught] == ["a warning that applies"]
        quiet(rank=1)
        warnings.warn("another one", stacklevel=1)  # shown once, by rank 0
        assert len(caught) == 1
    with caplog.at_level(logging.INFO):
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("Restoring states from the checkpoint path")
    assert [r.getMessage() for r in caplog.records] == ["Restoring states from the checkpoint path"]
    assert len(logging.getLogger("mlflow.store.db.utils").filters) == 1  # quiet() twice adds its filter once
