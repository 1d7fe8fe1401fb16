"""The difficulty curriculum (``data.curriculum``) end to end through the real CLI on the tiny model: a GRPO run
SIGKILLed at the start of its 4th rollout and resumed with ``--ckpt_path last`` draws the same prompts, rollout by
rollout, as the uninterrupted run, and ends with the same curriculum state bit for bit; the pools are logged to
MLflow; a curriculum on a task without groups is one line at start-up."""

import json
import os
import subprocess
import sys

import mlflow
import pytest
import torch
from conftest import REPO

from rl_lightning.cli.main import main

TINY = ["--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--model.rollout.responses_per_prompt", "4",
        "--model.rollout.max_new_tokens", "8", "--model.rollout.reward_workers", "0", "--data.batch_size", "4",
        "--data.val_path", "null", "--trainer.num_sanity_val_steps", "0", "--model.max_rollouts", "6",
        "--trainer.enable_progress_bar", "false"]
CURRICULUM = ["--data.path", "train8.jsonl", "--data.curriculum.readmit_after", "3",
              "--trainer.logger.init_args.run_name", "curriculum"]  # not named after the overlay: one run folder
# Written into the run's working directory, which the CLI puts on sys.path: each rollout's prompts (after the
# curriculum drew them) appended to draws.jsonl; a SIGKILL of the whole process at the start of rollout `kill_at`.
CALLBACKS = '''
import json, os, signal
import lightning as L

class RecordDraws(L.Callback):
    def __init__(self, kill_at: int = 0):
        self.kill_at = kill_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.rollouts + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with open("draws.jsonl", "a") as f:
            f.write(json.dumps([pl_module.rollouts, [p.index for p in batch["prompts"]]]) + "\\n")
'''


def _overlay(workdir, kill_at):
    (workdir / "record_draws.py").write_text(CALLBACKS)
    path = workdir / f"overlay_{kill_at}.yaml"
    path.write_text("trainer:\n  callbacks:\n    - class_path: record_draws.RecordDraws\n"
                    f"      init_args: {{kill_at: {kill_at}}}\n"
                    "    - class_path: rl_lightning.parallel.checkpoint_io.AtomicModelCheckpoint\n"
                    "      init_args: {every_n_train_steps: 1, save_last: link}\n")
    return str(path)


def _fit(workdir, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rl_lightning", "fit", *TINY, *CURRICULUM, *args], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=900)


def _final_state(workdir):
    checkpoint = torch.load(workdir / "outputs" / "curriculum" / "latest" / "checkpoints" / "last.ckpt", weights_only=False)
    return checkpoint["PromptDataModule"]["curriculum"]


def _workdir(tmp_path, name):
    workdir = tmp_path / name
    workdir.mkdir()
    for entry in ("rl_lightning", "examples"):
        (workdir / entry).symlink_to(REPO / entry)
    lines = (REPO / "rl_lightning" / "assets" / "data" / "easy.jsonl").read_text().splitlines()[:8]
    (workdir / "train8.jsonl").write_text("\n".join(lines) + "\n")  # 2 rollouts a pass: prompts come back
    return workdir


@pytest.mark.slow
def test_a_killed_and_resumed_run_draws_what_the_uninterrupted_run_draws(tmp_path):
    straight, killed = _workdir(tmp_path, "straight"), _workdir(tmp_path, "killed")
    done = _fit(straight, "--config", _overlay(straight, 0))
    assert done.returncode == 0, done.stderr[-3000:]
    first = _fit(killed, "--config", _overlay(killed, 4))
    assert first.returncode == -9, first.stderr[-3000:]  # SIGKILL at the start of rollout 4
    resumed = _fit(killed, "--config", _overlay(killed, 0), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected = [json.loads(line) for line in (straight / "draws.jsonl").read_text().splitlines()]
    got = [json.loads(line) for line in (killed / "draws.jsonl").read_text().splitlines()]
    assert [r for r, _ in expected] == list(range(6)) and [r for r, _ in got] == [0, 1, 2, 3, 4, 5]
    assert got == expected
    a, b = _final_state(straight), _final_state(killed)
    assert a.keys() == b.keys() and a["rollouts"] == 6
    for key in a:
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
    assert int(a["seen"].gt(0).sum()) == 8  # every prompt observed: the pools were in play

    client = mlflow.MlflowClient(f"sqlite:///{straight / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rl_lightning/rl").experiment_id])
    pools = [sorted(client.get_metric_history(run.info.run_id, f"curriculum/{name}"), key=lambda m: m.step)
             for name in ("active", "solved", "hopeless")]
    assert all(len(p) == 6 for p in pools)
    assert all(sum(p[i].value for p in pools) == 8 for i in range(6))  # every prompt in exactly one pool


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])


def _one_line(args, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", *args])
    assert info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines[-5:]
    return lines[0]


def test_a_curriculum_without_groups_is_one_line(workdir, capsys):
    line = _one_line([*TINY, "--model.rollout.responses_per_prompt", "1", "--model.advantage_estimator", "reinforce_pp",
                      "--data.curriculum.decay", "0.5"], capsys)  # REINFORCE++ trains on single completions
    assert line.endswith("data.curriculum measures each prompt's pass rate over its group, but "
                         "model.rollout.responses_per_prompt=1; set it >= 2 (e.g. 8) or data.curriculum: null"), line


def test_a_curriculum_on_sft_is_one_line(workdir, capsys):
    line = _one_line(["--config", "recipes/sft.yaml", "--data.curriculum.decay", "0.5"], capsys)
    assert "data.curriculum" in line and "SFTDataModule" in line, line
