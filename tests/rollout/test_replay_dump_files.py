"""A rollout dump is data (`rl_lightning.rollout.replay`): the last line a killed run was writing is skipped with a
warning naming it (its rollout then counts as incomplete), while a damaged line elsewhere, a stray file name among the
dump's files or an unreadable manifest is one line naming the file (and line), never a traceback. Dumps written by
the real `RolloutDump` from real `Rollout` objects; no model needed."""

import json
import logging

import lightning as L
import pytest

from rl_lightning.callbacks.rollout_dump import RolloutDump
from rl_lightning.data.prompts import Prompt
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.replay import FORMAT_VERSION, ReplayDump
from rl_lightning.rollout.trajectory import Rollout, Trajectory


def _rollout(group: int = 2) -> Rollout:
    prompt = Prompt([1, 2], [{"role": "user", "content": "1+1"}], "2", "data.jsonl row 1", 0)
    trajectories = [Trajectory(prompt, [1, 2, 3 + i, 4], [0, 0, 1, 1], [-0.5, -0.25], [{"role": "user",
                    "content": "1+1"}, {"role": "assistant", "content": "2"}], True, reward=float(i))
                    for i in range(group)]
    return Rollout(trajectories, group)


def _dump(tmp_path, rollouts: int = 2):
    """A dump folder of `rollouts` rollouts of 2 trajectories (rank 0), and its file."""
    folder = tmp_path / "rollouts"
    dump = RolloutDump(str(folder))
    dump.setup(L.Trainer(accelerator="cpu", devices=1, logger=False), None, "fit")
    for number in range(1, rollouts + 1):
        dump.write(_rollout(), number, number, "train")
    (folder / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION}))
    return folder, folder / "rollouts-rank0-0.jsonl"


def _refused(folder) -> str:
    with pytest.raises(ConfigError) as info:
        ReplayDump(str(folder), 0)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_whole_dump_reads_back(tmp_path):
    folder, _ = _dump(tmp_path)
    dump = ReplayDump(str(folder), 0)
    assert sorted(dump.lines) == [1, 2]
    assert [t.reward for t in dump.rollout(1, None).trajectories] == [0.0, 1.0]


def test_the_line_a_killed_run_was_writing_is_skipped_with_a_warning(tmp_path, caplog):
    folder, file = _dump(tmp_path)
    text = file.read_text()
    file.write_text(text[: len(text) - 40])  # killed mid-write: the last line is cut short, without its newline
    with caplog.at_level(logging.WARNING, logger="rl_lightning.rollout.replay"):
        dump = ReplayDump(str(folder), 0)
    assert [r.getMessage() for r in caplog.records if r.name == "rl_lightning.rollout.replay"] == [
        f"model.rollout.replay={folder}: rollouts-rank0-0.jsonl line 4 is cut short (the run was stopped while "
        "writing it): skipped"]
    assert len(dump.lines[1]) == 2 and len(dump.lines[2]) == 1  # rollout 2 is incomplete: `check` says so if needed


def test_a_damaged_line_a_stray_file_and_a_bad_manifest_are_one_line(tmp_path):
    folder, file = _dump(tmp_path)
    lines = file.read_text().splitlines(keepends=True)
    file.write_text("".join([lines[0], lines[1][:30] + "\n", *lines[2:]]))  # cut inside, not a kill's doing
    assert _refused(folder).startswith(f"model.rollout.replay={folder}: rollouts-rank0-0.jsonl line 2 is not JSON (")
    file.write_text("".join([lines[0], lines[1].replace('"reward": ', '"reward": ' + "9" * 5000 + ", \"r\": ", 1),
                             *lines[2:]]))  # an integer Python refuses to convert (a ValueError, not a JSON error)
    assert _refused(folder).startswith(f"model.rollout.replay={folder}: rollouts-rank0-0.jsonl line 2 is not JSON "
                                       "(Exceeds the limit (4300 digits) for integer string conversion")
    file.write_text("".join([lines[0], json.dumps({"split": "train", "format": FORMAT_VERSION}) + "\n"]))
    assert _refused(folder) == (f"model.rollout.replay={folder}: rollouts-rank0-0.jsonl line 2 lacks rollout, "
                                "trajectory, trajectories; dump the run again with this version")
    file.write_text("".join(lines))
    (folder / "rollouts-rank0-0 (copy).jsonl").write_text("".join(lines))
    assert _refused(folder) == (f"model.rollout.replay={folder}: rollouts-rank0-0 (copy).jsonl is not a dump file "
                                "(rollouts-rank0-<n>.jsonl, as RolloutDump names them); move it out of the folder")
    (folder / "rollouts-rank0-0 (copy).jsonl").unlink()
    (folder / "manifest.json").write_text('{"format": 2,')
    assert _refused(folder).startswith(f"model.rollout.replay={folder}: {folder / 'manifest.json'} is not JSON (")


def test_a_stray_file_in_the_dump_folder_stops_the_writer_at_setup_in_one_line(tmp_path):
    """The writer reads the same folder when a run resumes (it appends after the newest file): a stray name there was
    an `int()` ValueError traceback; it is one line at setup, before any rollout."""
    folder, _ = _dump(tmp_path, rollouts=1)
    (folder / "rollouts-rank0-copy.jsonl").write_text("")
    dump = RolloutDump(str(folder))
    with pytest.raises(ConfigError) as info:
        dump.setup(L.Trainer(accelerator="cpu", devices=1, logger=False), None, "fit")
    message = str(info.value)
    assert "\n" not in message and "rollouts-rank0-copy.jsonl is not a dump file" in message
    assert message.startswith("rl_lightning.callbacks.rollout_dump.RolloutDump: dirpath=")
