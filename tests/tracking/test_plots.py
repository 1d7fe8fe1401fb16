"""The run's pictures: real tiny GRPO and DPO runs through the CLI write plots/*.png into the run folder and the MLflow
run, and what the figures draw is the logged metric history; the pure parts (positions on the run's axis, trailing
mean, panel choice, lines and points) on hand-made series."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rl_lightning.cli.main import main
from rl_lightning.models.config import LMConfig
from rl_lightning.tracking.history import Point, Series, all_series, first_and_last, read_history
from rl_lightning.tracking.plots import (
    PAIR_PANELS,
    RL_PANELS,
    SFT_PANELS,
    RunPlots,
    draw,
    panel_figure,
    panels_for,
    rolling_mean,
    summary_figure,
    write_plots,
    zero_weight_components,
)

GRPO = ["fit", "--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--model.max_rollouts", "2",
        "--model.update_per_rollout", "1", "--data.batch_size", "2", "--model.rollout.responses_per_prompt", "2",
        "--model.rollout.max_new_tokens", "4", "--model.rollout.val_responses_per_prompt", "1",
        "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "0.02", "--trainer.enable_checkpointing",
        "false"]
DPO = ["fit", "--config", "recipes/dpo.yaml", "--trainer.max_steps", "3", "--data.batch_size", "4",
       "--data.path", "train.jsonl", "--data.val_path", "val.jsonl", "--trainer.val_check_interval", "2", "--trainer.num_sanity_val_steps", "0",
       "--trainer.enable_checkpointing", "false"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["rl_lightning"])


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk; fails unless the file is a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def _run(client: MlflowClient, experiment: str):
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def _lines(figure) -> dict[str, tuple[list, list]]:
    return {line.get_gid(): (list(line.get_xdata()), list(line.get_ydata())) for line in figure.axes[0].get_lines()}


def _logged(client: MlflowClient, run_id: str, name: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.timestamp)]


def _check_files(folder: Path, client: MlflowClient, run_id: str, names: set[str]) -> None:
    assert {p.name for p in folder.iterdir()} == names
    for name in names:
        width, height = _png_size(folder / name)
        assert width >= 600 and height >= 400 and 10_000 < (folder / name).stat().st_size < 1_000_000, name
    assert {Path(a.path).name for a in client.list_artifacts(run_id, "plots")} == names


def test_grpo_run_plots_reward_heldout_length_entropy_kl(workdir):
    main(GRPO)
    client = MlflowClient("sqlite:///mlflow.db")
    run_id = _run(client, "rl_lightning/rl").info.run_id
    folder = workdir / "outputs" / "grpo" / "latest" / "plots"
    # one on-policy update per rollout with the trainer's own weights and no KL term: every KL line is zero, so no
    # kl.png (the panel would be empty)
    assert all(abs(v) < 1e-6 for name in ("train/approx_kl", "train/mismatch_kl") for v in _logged(client, run_id, name))
    _check_files(folder, client, run_id, {"reward.png", "heldout.png", "completion_length.png", "entropy.png",
                                          "summary.png"})

    series = all_series(read_history(client, run_id))
    panels, xlabel = panels_for(list(series))
    assert [p.name for p in panels] == ["reward", "heldout", "completion_length", "entropy", "kl"]
    assert xlabel == "rollout"
    reward = _lines(panel_figure(panels[0], series, xlabel))
    for name in ("train/reward", "train/reward/correct", "train/reward/format"):
        assert reward[name] == ([1, 2], _logged(client, run_id, name))  # one point per rollout, as logged
    # validation of the starting policy (0), then after each rollout
    assert reward["val/reward"] == ([0, 1, 2], _logged(client, run_id, "val/reward"))
    heldout = _lines(panel_figure(panels[1], series, xlabel))
    assert heldout["val/reward/correct"] == ([0, 1, 2], _logged(client, run_id, "val/reward/correct"))
    entropy = _lines(panel_figure(panels[3], series, xlabel))
    assert entropy["train/entropy"][1] == _logged(client, run_id, "train/entropy")
    summary = summary_figure(panels, series, xlabel, "grpo")
    assert len(summary.axes) == 5 and summary.axes[0].get_title() == panels[0].title


def test_dpo_run_plots_loss_accuracy_margin_with_validation(workdir):
    pairs = (workdir / "rl_lightning/assets/data/preference.jsonl").read_text().splitlines()
    (workdir / "train.jsonl").write_text("\n".join(pairs[:16]) + "\n")  # a short file: little to tokenize
    (workdir / "val.jsonl").write_text("\n".join(pairs[16:20]) + "\n")  # one validation batch
    main(DPO)
    client = MlflowClient("sqlite:///mlflow.db")
    run_id = _run(client, "rl_lightning/dpo").info.run_id
    folder = workdir / "outputs" / "dpo" / "latest" / "plots"
    _check_files(folder, client, run_id, {"loss.png", "accuracy.png", "margin.png", "summary.png"})
    series = all_series(read_history(client, run_id))
    panels, xlabel = panels_for(list(series))
    assert panels == PAIR_PANELS and xlabel == "optimizer step"
    loss = _lines(panel_figure(panels[0], series, xlabel))
    assert loss["train/loss"] == ([1, 2, 3], _logged(client, run_id, "train/loss"))
    assert loss["val/loss"] == ([2], _logged(client, run_id, "val/loss"))  # after step 2
    accuracy = _lines(panel_figure(panels[1], series, xlabel))
    assert accuracy["val/accuracy"][1] == _logged(client, run_id, "val/accuracy")


def test_the_mlflow_step_is_the_position_and_a_resume_overwrites():
    # start validation at 0, steps 1-3 (the logger logs at steps done), a validation after step 2
    history = {"train/loss": [Point(1, 10, 3.0), Point(2, 20, 2.0), Point(3, 30, 1.5)],
               "val/loss": [Point(0, 5, 4.0), Point(2, 25, 2.5)]}
    series = all_series(history)
    assert series["train/loss"] == Series([1, 2, 3], [3.0, 2.0, 1.5])
    assert series["val/loss"] == Series([0, 2], [4.0, 2.5])
    # resumed from the checkpoint after step 2: step 3 logged again, a validation after it
    history["train/loss"].append(Point(3, 50, 1.25))
    history["val/loss"].append(Point(3, 55, 1.1))
    series = all_series(history)
    assert series["train/loss"] == Series([1, 2, 3], [3.0, 2.0, 1.25])  # the later value wins
    assert series["val/loss"] == Series([0, 2, 3], [4.0, 2.5, 1.1])
    assert first_and_last(history) == {"val/loss": ((0, 4.0), (3, 1.1))}


def test_rolling_mean_is_the_trailing_mean():
    assert rolling_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert rolling_mean([2.0, 4.0, 6.0], 5) == [2.0, 3.0, 4.0]


def test_panels_follow_the_task_and_drop_those_without_data():
    assert panels_for(["train/loss", "val/loss", "train/tokens"]) == (SFT_PANELS, "optimizer step")
    rl = ["train/rollouts", "train/reward", "train/entropy", "val/reward"]
    assert [p.name for p in panels_for(rl)[0]] == ["reward", "heldout", "entropy"]
    assert panels_for(["train/lr"])[0] == ()


def test_a_long_series_gets_its_trailing_mean_and_validation_its_line_colour():
    from matplotlib.figure import Figure

    x = list(range(1, 41))
    series = {"train/rollouts": Series(x, [float(i) for i in x]), "train/reward": Series(x, [i % 3 / 2 for i in x]),
              "val/reward": Series([0, 20, 40], [0.1, 0.4, 0.6])}
    ax = Figure().add_subplot()
    draw(ax, RL_PANELS[0], series, "rollout")
    lines = {line.get_gid(): line for line in ax.get_lines()}
    assert list(lines["train/reward"].get_ydata()) == series["train/reward"].y
    assert list(lines["train/reward:mean"].get_ydata()) == rolling_mean(series["train/reward"].y, 4)
    assert lines["val/reward"].get_color() == lines["train/reward"].get_color()
    assert lines["val/reward"].get_marker() == "o" and ax.get_xlabel() == "rollout (0 = start)"
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == ["train/reward (mean of last 4)", "val/reward"]  # the faint per-rollout line is not listed


def test_kl_leaves_out_a_line_that_is_zero_up_to_float_noise():
    from matplotlib.figure import Figure

    series = {"train/rollouts": Series([1, 2], [1.0, 2.0]), "train/approx_kl": Series([1, 2], [0.0, 0.01]),
              "train/mismatch_kl": Series([1, 2], [1.7e-13, -9e-14])}  # float noise
    ax = Figure().add_subplot()
    draw(ax, RL_PANELS[4], series, "rollout")
    assert [line.get_gid() for line in ax.get_lines()] == ["train/approx_kl"]


def test_a_panel_with_nothing_to_draw_and_zero_weight_components_are_left_out(tmp_path):
    """A run without a KL term whose updates stay on-policy logs KL lines that are zero throughout: no KL panel; the
    demo weighs `format` 0: no format line in the reward or the held-out panel."""
    import types

    from matplotlib.figure import Figure

    from rl_lightning.rollout.config import RolloutConfig

    x = [1, 2, 3]
    series = {"train/rollouts": Series(x, [1.0, 2.0, 3.0]), "train/reward": Series(x, [0.1, 0.2, 0.3]),
              "train/reward/correct": Series(x, [0.1, 0.2, 0.3]), "train/reward/format": Series(x, [0.5, 0.6, 0.9]),
              "val/reward": Series([0, 3], [0.2, 0.3]), "val/reward/correct": Series([0, 3], [0.2, 0.3]),
              "val/reward/format": Series([0, 3], [0.4, 1.0]), "train/entropy": Series(x, [1.0, 0.9, 0.8]),
              "train/approx_kl": Series(x, [0.0, 0.0, 0.0]), "train/mismatch_kl": Series(x, [1e-13, 0.0, -2e-13])}
    module = types.SimpleNamespace(rollout_config=RolloutConfig(env_path="e.py",
                                                                reward_weights={"correct": 1.0, "format": 0.0}))
    hidden = zero_weight_components(module)
    assert hidden == {"train/reward/format", "val/reward/format"}
    assert zero_weight_components(types.SimpleNamespace()) == set()  # SFT, DPO: no reward components
    paths = write_plots(series, tmp_path, "demo", hidden)
    assert [p.name for p in paths] == ["reward.png", "heldout.png", "entropy.png", "summary.png"]  # no kl.png
    ax = Figure().add_subplot()
    draw(ax, RL_PANELS[0], series, "rollout", hidden)
    assert [line.get_gid() for line in ax.get_lines()] == ["train/reward", "train/reward/correct", "val/reward"]
    figure = summary_figure([p for p in RL_PANELS if p.name in ("reward", "heldout", "entropy")], series, "rollout",
                            "demo", hidden)
    drawn = {line.get_gid() for ax in figure.axes for line in ax.get_lines()}
    assert drawn == {"train/reward", "train/reward/correct", "val/reward", "val/reward/correct", "train/entropy"}
    assert [p.name for p in write_plots(series, tmp_path / "all", "demo")] == [  # without weights: format is drawn
        "reward.png", "heldout.png", "entropy.png", "summary.png"]


def test_plots_can_be_switched_off(workdir):
    from rl_lightning.cli.main import RLLightningCLI

    overlay = workdir / "no_plots.yaml"
    overlay.write_text("trainer:\n  callbacks:\n    - class_path: rl_lightning.tracking.plots.RunPlots\n"
                       "      init_args: {enabled: false}\n")
    from lightning.pytorch import LightningDataModule, LightningModule

    cli = RLLightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         save_config_callback=None, parser_kwargs={"parser_mode": "omegaconf+"},
                         args=["--config", "recipes/sft.yaml", "--config", str(overlay)], run=False)
    (plots,) = [c for c in cli.trainer.callbacks if isinstance(c, RunPlots)]  # replaced in place, not added
    assert plots.enabled is False
    assert plots.write(cli.trainer, cli.model) == []


def test_a_crashed_run_still_gets_its_plots(workdir):
    import lightning as L
    from conftest import DEMO_DATA, TINY_MODEL

    from rl_lightning.data import SFTDataModule
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.tasks import SFT
    from rl_lightning.tracking.logger import MLFlowLogger
    from rl_lightning.tracking.mlflow_run import MLflowTracking

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:  # steps 1 and 2 are logged, the third never is
                raise RuntimeError("out of luck at step 3")

    logger = MLFlowLogger(experiment_name="crash", tracking_uri="sqlite:///mlflow.db")
    model = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")))
    chats = (DEMO_DATA / "sft.jsonl").read_text().splitlines()
    (workdir / "chats.jsonl").write_text("\n".join(chats[:32]) + "\n")
    data = SFTDataModule(str(workdir / "chats.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=96,
                         max_length_per_device=256)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=logger, log_every_n_steps=1, limit_val_batches=0,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[RunPlots(str(workdir / "plots")), Crash(),
                                   MLflowTracking(system_metrics=False, lineage=False)])  # the CLI's logging
    with pytest.raises(RuntimeError, match="out of luck"):
        trainer.fit(model, datamodule=data)
    assert _png_size(workdir / "plots" / "loss.png")[0] >= 600
    series = all_series(read_history(MlflowClient("sqlite:///mlflow.db"), logger.run_id))
    assert series["train/loss"].x == [1, 2]  # what the run logged before it failed
