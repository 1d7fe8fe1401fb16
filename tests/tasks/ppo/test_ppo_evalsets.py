"""PPO with several named held-out sets (``data.val_paths``) and with trajectories skipped on a stale importance ratio
(``model.skip_threshold``)."""


import lightning as L
import pytest
from conftest import DEMO_DATA, REPO
from helpers import GradientRecorder, Metrics, fit, ppo_task, prompts

from rl_lightning.cli.progress import RunProgress
from rl_lightning.errors import ConfigError, DataError

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
class ValCapture(L.Callback):
    def __init__(self):
        self.trajectories = {}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.trajectories.setdefault(dataloader_idx, []).extend(batch["rollout"].trajectories)


def test_each_named_held_out_set_is_scored_and_the_overall_mean_weighs_trajectories(parity_env, tmp_path, capsys):
    """Two sets of 3 and 5 prompts, 2 completions each: every set's metrics are its own trajectories' means, the
    overall `val/reward` their trajectory-weighted mean, and the terminal's validation line shows them all."""
    rows = (DEMO_DATA / "arithmetic.jsonl").read_text().splitlines()
    paths = {"small": tmp_path / "small.jsonl", "large": tmp_path / "large.jsonl"}
    paths["small"].write_text("\n".join(rows[:3]) + "\n")  # 2 batches of 2 prompts (the last one partial)
    paths["large"].write_text("\n".join(rows[10:15]) + "\n")  # 3 batches
    capture = ValCapture()
    L.seed_everything(0)
    model = ppo_task(parity_env, max_rollouts=1, rollout={"val_temperature": 1.0, "val_responses_per_prompt": 2})
    data = prompts(2, val_paths={name: str(p) for name, p in paths.items()})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[capture, RunProgress()], val_check_interval=1,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    assert data.val_names == ["small", "large"]
    assert sorted(capture.trajectories) == [0, 1]
    assert [len(capture.trajectories[i]) for i in (0, 1)] == [6, 10]
    got = model.validation_metrics
    everything = []
    for i, name in enumerate(data.val_names):
        trajectories = capture.trajectories[i]
        everything += trajectories
        assert got[f"val/{name}/reward"] == pytest.approx(sum(t.reward for t in trajectories) / len(trajectories))
        assert got[f"val/{name}/completion_length"] == pytest.approx(
            sum(t.completion_length for t in trajectories) / len(trajectories))
    assert got["val/reward"] == pytest.approx(sum(t.reward for t in everything) / len(everything))
    assert got["val/small/reward"] != got["val/large/reward"]  # so the weighting is tested
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("validation @ ")]
    for key in ("reward", "small/reward", "large/reward", "small/completion_length", "large/completion_length"):
        assert f" {key} " in line, line


def test_bad_held_out_sets_fail_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"data.val_paths is empty"):
        prompts(val_paths={})
    with pytest.raises(ConfigError, match=r"data.val_path='a.jsonl' and data.val_paths are exclusive"):
        prompts(val_path="a.jsonl", val_paths={"gsm": "b.jsonl"})
    with pytest.raises(ConfigError, match=r"data.val_paths names \['a/b'\] must be non-empty, without '/'"):
        prompts(val_paths={"a/b": "b.jsonl"})
    data = prompts(val_paths={"gsm": str(tmp_path / "missing.jsonl")})
    with pytest.raises(DataError, match=r"^data.val_paths.gsm: data file not found: '.*missing.jsonl'"):
        data.setup("fit")


def test_skip_threshold_is_validated():
    with pytest.raises(ConfigError, match=r"model.skip_threshold must be > 1 or null, got 1.0"):
        ppo_task(ENV, skip_threshold=1.0)


def test_a_tiny_skip_threshold_skips_every_stale_trajectory_and_their_loss_has_no_gradient(parity_env):
    """Two minibatches: the first is on-policy (ratio 1, never skipped), the second comes after an optimizer step, so
    every trajectory's ratio is off 1 by more than 1e-6 and is skipped: half the rollout, and a zero gradient."""
    grads, metrics = GradientRecorder(), Metrics()
    L.seed_everything(0)
    fit(ppo_task(parity_env, max_rollouts=1, update_per_rollout=2, skip_threshold=1 + 1e-6, optim={"lr": 1e-2}),
        prompts(4), -1, [grads, metrics])
    assert metrics.history[0]["train/skipped"] == 0.5
    first, second = grads.grads
    assert max(g.abs().max() for g in first.values()) > 0
    assert all((g == 0).all() for g in second.values())
