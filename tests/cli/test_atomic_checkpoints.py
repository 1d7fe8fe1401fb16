"""Checkpoints survive a kill inside the save (`rl_lightning.parallel.checkpoint_io`): real CLI runs are SIGKILLed
while blocked in the middle of writing a checkpoint or swapping the ``last`` link, then ``--ckpt_path last`` resumes
from the previous complete checkpoint at its global step. Single process, and ParallelStrategy dp=2 (DCP, gloo)."""

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faults import SIGNAL_FD

from rl_lightning.parallel.checkpoint_io import LEFTOVER, resume_checkpoint

REPO = Path(__file__).resolve().parents[2]
DP2 = ["--trainer.devices", "2", "--trainer.strategy", "rl_lightning.parallel.ParallelStrategy",
       "--trainer.strategy.data_parallel_size", "2"]


def _overlay(workdir: Path, name: str, extra: str) -> str:
    path = workdir / f"{name}.yaml"
    path.write_text("trainer:\n  callbacks:\n"
                    "    - class_path: rl_lightning.parallel.checkpoint_io.AtomicModelCheckpoint\n"
                    "      init_args: {every_n_train_steps: 2, save_last: link}\n" + extra)
    return str(path)


def _command(overlay: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/sft.yaml", "--config", overlay,
            "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0",
            "--trainer.logger.init_args.run_name", "sft", *args]  # not named after the overlay: one run folder


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def _kill_inside_save(workdir: Path, stage: str, args: list[str]) -> None:
    """Run until rank 0 blocks inside the second save (step 4), then SIGKILL every process of the run."""
    overlay = _overlay(workdir, "block", "    - class_path: faults.BlockInsideSave\n"
                                         f"      init_args: {{at_save: 2, stage: {stage}}}\n")
    read_end, write_end = os.pipe()
    log = workdir / "killed.log"
    with open(log, "w") as out:
        process = subprocess.Popen(_command(overlay, *args), cwd=workdir, env={**_env(), SIGNAL_FD: str(write_end)},
                                   pass_fds=(write_end,), start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 600)
        blocked = os.read(read_end, 1) if ready else b""  # b"": the run ended without blocking
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        os.close(read_end)
    assert blocked == b"1", log.read_text()[-4000:]
    assert process.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "args"), [("write", []), ("link", []), ("write", DP2)],
                         ids=["file-write", "last-link", "dcp-dp2-write"])
def test_killed_inside_a_save_resumes_from_the_previous_checkpoint(workdir, stage, args):
    _kill_inside_save(workdir, stage, args)
    (run,) = [p for p in (workdir / "outputs" / "sft").iterdir() if p.name != "latest"]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "last.ckpt").resolve().name == "epoch=0-step=2.ckpt"  # the previous one, whole
    if stage == "write":  # killed mid-write: the new checkpoint exists only under its hidden name
        assert [p.name for p in checkpoints.iterdir() if LEFTOVER.match(p.name)], sorted(checkpoints.iterdir())
    assert resume_checkpoint(checkpoints) == checkpoints / "last.ckpt"

    start = workdir / "start_step.txt"
    overlay = _overlay(workdir, "resume", "    - class_path: faults.RecordStartStep\n"
                                          f"      init_args: {{path: {start}}}\n")
    result = subprocess.run(_command(overlay, "--ckpt_path", "last", *args), cwd=workdir, env=_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert start.read_text() == "2"  # resumed at the previous checkpoint's global step
    assert (checkpoints / "last.ckpt").resolve().name == "epoch=0-step=6.ckpt"
    kept = ["epoch=0-step=6.ckpt", "last.ckpt"]  # the killed save's leftovers are gone
    if stage == "link":  # this one was whole before the kill; the resumed run does not know it (and saved -v1)
        kept.insert(0, "epoch=0-step=4.ckpt")
    if not args:  # a file's digest beside it (a sharded folder keeps its SHA256SUMS inside)
        kept = sorted(kept + [f"{name}.sha256" for name in kept if name.startswith("epoch")])
    assert sorted(p.name for p in checkpoints.iterdir()) == kept
