"""Checkpoints are data (`rl_lightning.parallel.checkpoint_trust`): a checkpoint whose pickle would run code is
refused in one line naming what it holds and ``--trust_checkpoint true`` (and nothing runs), for a ``.ckpt`` file,
Lightning's own load and a sharded (DCP) folder's metadata and entries; a truncated or changed file is one line naming
the previous complete checkpoint; ``--ckpt_path last`` passing over a damaged newest checkpoint says so. Real files,
real ``torch.save`` / DCP saves, the real resume check."""

import hashlib
import logging
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.demos.boring_classes import BoringModel

from rl_lightning.cli.resume_check import check_resume
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.checkpoint_io import AtomicCheckpointIO, replace_link, resume_checkpoint

STATE = {"state_dict": {"w": torch.arange(4096, dtype=torch.float32)}, "global_step": 2,
         "hyper_parameters": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "x", "lora": None}}


class RunsCode:
    """Unpickling this runs ``touch <marker>`` (the crafted checkpoint of issue 36.2)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _resume(path, trust=False):
    """The CLI's resume check of `path` (a plain model: no hyperparameters to compare); the fit config after it."""
    config = {"ckpt_path": str(path), "load_weights_only": False, "trust_checkpoint": trust}
    check_resume(config, BoringModel(), None)
    return config


def _refusal(path, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        _resume(path, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_checkpoint_that_runs_code_is_refused_and_loads_only_when_trusted(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "evil.ckpt"
    torch.save({**STATE, "note": RunsCode(marker)}, path)
    assert _refusal(path) == (
        f"--ckpt_path {path} needs pickle beyond weights: it holds posix.system, which a weights-only load refuses "
        "(unpickling it could run code); pass --trust_checkpoint true only for a checkpoint you trust as code")
    with pytest.raises(pickle.UnpicklingError):  # Lightning's own load of it, through our CheckpointIO
        AtomicCheckpointIO().load_checkpoint(path)
    assert not marker.exists()
    assert _resume(path, trust=True)["weights_only"] is False  # the opt-in: Lightning loads it in full, as asked
    assert marker.exists()  # (the resume check read it: the file's code ran, as the flag says it may)


def test_our_checkpoints_are_plain_and_lightning_loads_them_weights_only(tmp_path):
    from rl_lightning.parallel.checkpoint_trust import SAFE_GLOBALS

    path = tmp_path / "step=2.ckpt"
    AtomicCheckpointIO().save_checkpoint(STATE, path)
    assert SAFE_GLOBALS == () and torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) == []
    assert _resume(path)["weights_only"] is True
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    assert loaded["hyper_parameters"] == STATE["hyper_parameters"] and torch.equal(loaded["state_dict"]["w"],
                                                                                  STATE["state_dict"]["w"])
    with pytest.raises(ConfigError, match="^--weights_only false unpickles the checkpoint in full"):
        check_resume({"ckpt_path": str(path), "weights_only": False}, BoringModel(), None)


def test_each_checkpoint_has_its_digest_and_a_changed_byte_is_refused(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(STATE, tmp_path / "epoch=0-step=2.ckpt")
    io.save_checkpoint({**STATE, "global_step": 4}, tmp_path / "epoch=0-step=4.ckpt")
    path = tmp_path / "epoch=0-step=4.ckpt"
    listing = (tmp_path / "epoch=0-step=4.ckpt.sha256").read_text()
    assert listing == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  epoch=0-step=4.ckpt\n"
    assert subprocess.run(["sha256sum", "-c", "--quiet", "epoch=0-step=4.ckpt.sha256"],
                          cwd=tmp_path).returncode == 0  # the usual tool reads it
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # a flipped bit inside the tensor data: still a valid zip archive
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["global_step"] == 4  # what the old code loaded without a word
    assert _refusal(path) == (
        f"--ckpt_path {path} does not match its digest (epoch=0-step=4.ckpt.sha256): a byte changed after it was "
        f"written; resume from the previous complete checkpoint, --ckpt_path {tmp_path / 'epoch=0-step=2.ckpt'}")


def test_a_truncated_checkpoint_is_one_line_naming_the_previous_one(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint(STATE, tmp_path / "epoch=0-step=2.ckpt")
    path = tmp_path / "epoch=0-step=4.ckpt"
    io.save_checkpoint(STATE, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert _refusal(path) == (
        f"--ckpt_path {path} is truncated or not a torch checkpoint (no complete zip archive); resume from the "
        f"previous complete checkpoint, --ckpt_path {tmp_path / 'epoch=0-step=2.ckpt'}")
    (tmp_path / "epoch=0-step=2.ckpt").unlink()
    assert _refusal(path).endswith(f"; no complete checkpoint precedes it in {tmp_path}")


def test_last_passing_over_a_damaged_newest_checkpoint_says_so(tmp_path, caplog):
    io = AtomicCheckpointIO()
    for step in (2, 4):
        io.save_checkpoint({**STATE, "global_step": step}, tmp_path / f"epoch=0-step={step}.ckpt")
    newest = tmp_path / "epoch=0-step=4.ckpt"
    replace_link(newest, tmp_path / "last.ckpt")
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 1
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="rl_lightning.parallel.checkpoint_io"):
        assert resume_checkpoint(tmp_path) == tmp_path / "epoch=0-step=2.ckpt"
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'last.ckpt'} does not match its digest (epoch=0-step=4.ckpt.sha256): a byte changed after it "
        f"was written; resuming from {tmp_path / 'epoch=0-step=2.ckpt'}, the previous complete checkpoint"]
    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"PK")  # the last whole one gone too: one line, no guess
    with pytest.raises(ConfigError, match=r"^--ckpt_path last: no complete checkpoint in .* \(last.ckpt does not "
                                          r"match its digest .*; epoch=0-step=2.ckpt is truncated"):
        resume_checkpoint(tmp_path)


def _sharded(folder: Path, extra: dict, meta: dict | None = None) -> Path:
    """A sharded checkpoint as ParallelStrategy writes it: DCP's shards and ``.metadata``, Lightning's ``meta.pt``."""
    state = {"state_dict": STATE["state_dict"], "optimizer_0": {"param_groups": [{"lr": 1e-3, "params": ["w"]}]},
             **extra}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 2, "hyper_parameters": {}, **(meta or {})}, folder / "meta.pt")
    return folder


def test_a_sharded_checkpoint_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    metadata = _sharded(tmp_path / "metadata.ckpt", {})
    loaded = pickle.loads((metadata / ".metadata").read_bytes())
    loaded.planner_data = RunsCode(marker)  # DCP reads .metadata with plain pickle
    (metadata / ".metadata").write_bytes(pickle.dumps(loaded))
    assert "it holds posix.system (in .metadata)" in _refusal(metadata)
    assert not marker.exists()
    plain = _sharded(tmp_path / "plain.ckpt", {})
    assert _resume(plain)["weights_only"] is True
    from rl_lightning.parallel.checkpoint_trust import refuse_untrusted

    entry = _sharded(tmp_path / "entry.ckpt", {"note": RunsCode(marker)})  # a non-tensor entry DCP unpickles
    with pytest.raises(ConfigError, match=r"^--ckpt_path .*entry.ckpt needs pickle beyond weights: it holds "
                                          r"posix.system \(in note\), which"):
        refuse_untrusted(entry)  # what ParallelStrategy.load_checkpoint and the resume check run first
    assert not marker.exists()


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path):
    from rl_lightning.parallel.checkpoint_io import write_atomic

    path = tmp_path / "run.json"
    write_atomic(path, "{}\n", mode=0o600)
    assert path.read_text() == "{}\n" and path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(TypeError):
        write_atomic(path, ["not", "bytes"])  # type: ignore[arg-type]  # fails inside the write
    assert path.read_text() == "{}\n" and os.listdir(tmp_path) == ["run.json"]  # old content, no temporary left
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o644


def test_damage_of_whole_and_incomplete_sharded_folders(tmp_path):
    from rl_lightning.parallel.checkpoint_trust import damage

    folder = _sharded(tmp_path / "step=2.ckpt", {})
    assert damage(folder) is None
    (folder / ".metadata").unlink()
    assert damage(folder) == "is an incomplete sharded checkpoint (no .metadata)"
