"""A run folder belongs to one run (`rl_lightning.cli.outputs`, `rl_lightning.cli.run_lock`): ``latest`` is followed
only to a run folder of its own (an outside target would hand ``--ckpt_path last`` another folder and its MLflow run),
and a second process taking a folder another one still fits in is refused in one line, while a folder whose owner was
killed (``kill -9``) is free at once. Real links, real processes, a real Trainer."""

import os
import signal
import subprocess
import sys
import textwrap

import lightning as L
import pytest

from rl_lightning.cli.outputs import RUN_FILE, RunOutputs, new_run_dir, point_latest, resume_dir
from rl_lightning.errors import ConfigError

OWNER = textwrap.dedent('''
    import sys, time
    import lightning as L
    from rl_lightning.cli.outputs import RunOutputs

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    outputs = RunOutputs("sft", root=sys.argv[1], dirpath=sys.argv[2])  # the trainer holds it for the fit
    outputs.setup(trainer, None, "fit")
    print("ready", flush=True)
    time.sleep(600)
''')


def test_latest_is_followed_only_to_a_run_folder_of_its_own(tmp_path):
    root, parent = tmp_path / "outputs", tmp_path / "outputs" / "grpo"
    run = new_run_dir(root, "grpo")
    point_latest(run)
    assert resume_dir("last", root, "grpo") == run.resolve()
    foreign = tmp_path / "colleague" / "run"
    foreign.mkdir(parents=True)
    (foreign / RUN_FILE).write_text('{"mlflow_run_id": "theirs"}')
    (parent / "inside").symlink_to(foreign)  # a child that is itself a link out
    link = parent / "latest"
    for target in (str(foreign), "../../colleague/run", "inside"):
        link.unlink()
        link.symlink_to(target)
        with pytest.raises(ConfigError) as info:
            resume_dir("last", root, "grpo")
        assert str(info.value) == (
            f"{link} points to {target} ({foreign}), not to a run folder inside {parent}: remove the link (the next "
            "run makes a new one), or resume a run by its checkpoint's path (--ckpt_path <run "
            "folder>/checkpoints/last.ckpt)")


def _setup(root, folder) -> RunOutputs:
    outputs = RunOutputs("sft", root=str(root), dirpath=str(folder))
    outputs.setup(L.Trainer(accelerator="cpu", devices=1, logger=False), None, "fit")
    return outputs


def test_a_second_owner_of_a_run_folder_is_refused_and_a_killed_owners_is_free(tmp_path):
    root = tmp_path / "outputs"
    folder = new_run_dir(root, "sft")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(root), str(folder)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert "ready\n" in iter(owner.stdout.readline, "")  # after its "outputs: ..." line
        with pytest.raises(ConfigError) as info:
            _setup(root, folder)
        assert str(info.value).startswith(f"{folder} is in use by process {owner.pid} on ")
        assert str(info.value).endswith(f"(it holds {folder / 'run.lock'}): a second run in one folder deletes the "
                                        "other's checkpoint in progress; wait for that run to end, or start a new run "
                                        "(no --ckpt_path, or --load_weights_only true)")
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
    outputs = _setup(root, folder)  # the kernel released the dead owner's lock
    assert (folder / "run.lock").read_text() == f"process {os.getpid()} on {os.uname().nodename}\n"
    outputs.teardown(None, None, "fit")
    _setup(root, folder).teardown(None, None, "fit")  # a fit over: the same process may take it again
