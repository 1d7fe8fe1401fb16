"""The CLI's MLflow logger: values at the run's step (optimizer steps or rollouts done; validation after step s at s,
the start at 0), counters only when they move, no ``epoch`` chart; a real Lightning fit into a real sqlite store."""

from __future__ import annotations

import lightning as L
import torch
from mlflow import MlflowClient

from rl_lightning.tracking.logger import MLFlowLogger, counter_start
from rl_lightning.tracking.mlflow_run import MLflowTracking

RETRIES = [0.0, 0.0, 1.0, 1.0, 3.0]  # train/oom_retries after steps 1..5: moves at 3 and 5


class Counting(L.LightningModule):
    """A linear model that logs a loss, a counter, a constant and a validation value."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).square().mean()
        self.log_dict({"train/loss": loss, "train/oom_retries": RETRIES[batch_idx], "train/trajectories": 4.0})
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch).square().mean())

    def on_train_start(self):  # what PPO does with its start-of-run validation: logged before any step
        for logger in self.trainer.loggers:
            logger.log_metrics({"val/start": 1.0, "data/train_dropped": 0.0, "data/train_rows": 10.0}, step=0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(5, 2), batch_size=1)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(1, 2), batch_size=1)


def _fit(tmp_path, name: str, module: L.LightningModule, max_steps: int, val_every: int) -> tuple[MlflowClient, str]:
    """Fit `module` with the MLflow logger and `MLflowTracking` on a sqlite store in `tmp_path`; (client, run id)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name=name, tracking_uri=uri, run_name=name)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, val_check_interval=val_every,
                        check_val_every_n_epoch=None, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[MLflowTracking(system_metrics=False, lineage=False)])
    trainer.fit(module)
    return MlflowClient(uri), logger.run_id


def _steps(client: MlflowClient, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def test_values_sit_at_steps_done_and_counters_only_when_they_move(tmp_path):
    client, run_id = _fit(tmp_path, "axis", Counting(), max_steps=5, val_every=2)
    assert [step for step, _ in _steps(client, run_id, "train/loss")] == [1, 2, 3, 4, 5]  # optimizer steps done
    assert [step for step, _ in _steps(client, run_id, "val/loss")] == [2, 4]  # after steps 2 and 4
    assert _steps(client, run_id, "val/start") == [(0, 1.0)]
    assert _steps(client, run_id, "train/oom_retries") == [(3, 1.0), (5, 3.0)]  # 0 until it moved
    assert _steps(client, run_id, "train/trajectories") == [(1, 4.0)]  # a constant: once
    assert _steps(client, run_id, "data/train_rows") == [(0, 10.0)]
    metrics = client.get_run(run_id).data.metrics
    assert "data/train_dropped" not in metrics and "epoch" not in metrics


def test_on_its_own_it_logs_as_lightnings(tmp_path):
    logger = MLFlowLogger(experiment_name="plain", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    logger.log_metrics({"train/refills": 0.0, "x": 1.0}, step=7)
    history = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(logger.run_id, "train/refills")
    assert [(m.step, m.value) for m in history] == [(7, 0.0)]


def test_counter_names():
    assert counter_start("train/refills") == (True, 0.0) and counter_start("data/val_dropped") == (True, 0.0)
    assert counter_start("epoch") == (True, 0.0) and counter_start("train/trajectories") == (True, None)
    assert counter_start("train/reward") == (False, None)


class Rewarding(Counting):
    """Logs what an RL task logs for its headline: the training reward, the held-out reward and its `correct` part."""

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).square().mean()
        self.log_dict({"train/loss": loss, "train/reward": float(batch_idx)})
        return loss

    def validation_step(self, batch, batch_idx):
        self.log_dict({"val/reward": 0.5, "val/reward/correct": 0.25})


def test_the_headline_is_also_logged_in_the_run_pages_first_section(tmp_path):
    """MLflow orders chart sections by name (the metric name up to its last "/"), capitals first: `Summary` comes
    before `data`, `memory`, `train`, `val` (the real page is checked in tests/tracking/test_mlflow_ui.py)."""
    client, run_id = _fit(tmp_path, "headline", Rewarding(), max_steps=3, val_every=3)
    assert _steps(client, run_id, "Summary/reward") == _steps(client, run_id, "train/reward") == [
        (1, 0.0), (2, 1.0), (3, 2.0)]
    assert _steps(client, run_id, "Summary/held-out accuracy") == [(3, 0.25)]
    assert _steps(client, run_id, "Summary/held-out reward") == [(3, 0.5)]
    sections = sorted({name.rsplit("/", 1)[0] for name in client.get_run(run_id).data.metrics if "/" in name})
    assert sections[0] == "Summary" and sections == ["Summary", "data", "train", "val", "val/reward"]
