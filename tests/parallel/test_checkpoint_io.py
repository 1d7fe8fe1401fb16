"""The pieces of atomic checkpointing (`rl_lightning.parallel.checkpoint_io`) one by one; the kills inside real runs
are in tests/cli/test_atomic_checkpoints.py."""

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import TorchCheckpointIO

from rl_lightning.parallel import ParallelStrategy
from rl_lightning.parallel.checkpoint_io import (
    AtomicCheckpointIO,
    AtomicModelCheckpoint,
    publish_folder,
    replace_link,
    resume_checkpoint,
)
from rl_lightning.parallel.checkpoint_trust import damage


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("killed mid-save")


def test_a_failed_save_leaves_the_old_file_and_no_partial(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        io.save_checkpoint({"step": 2, "bad": Unpicklable()}, path)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.sha256"]  # the old file and its digest
    assert torch.load(path)["step"] == 1 and damage(path) is None


def test_a_save_over_a_link_replaces_the_link_not_its_target(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 2}, tmp_path / "step=2.ckpt")
    replace_link(tmp_path / "step=2.ckpt", tmp_path / "last.ckpt")
    io.save_checkpoint({"step": 3}, tmp_path / "last.ckpt")  # save_last: true after save_last: link
    assert not (tmp_path / "last.ckpt").is_symlink() and torch.load(tmp_path / "last.ckpt")["step"] == 3
    assert torch.load(tmp_path / "step=2.ckpt")["step"] == 2
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["step=2.ckpt", "step=2.ckpt.sha256"]  # a digest goes with its file


def test_replace_link_swaps_links_and_folders(tmp_path):
    for name in ("a.ckpt", "b.ckpt"):
        (tmp_path / name).write_bytes(b"")
    link = tmp_path / "last.ckpt"
    replace_link(tmp_path / "a.ckpt", link)
    replace_link(tmp_path / "b.ckpt", link)
    assert os.readlink(link) == "b.ckpt"  # relative: the run folder can move
    link.unlink()
    link.mkdir()  # a full DCP copy
    (link / "meta.pt").write_bytes(b"")
    replace_link(tmp_path / "a.ckpt", link)
    assert os.readlink(link) == "a.ckpt"
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "b.ckpt", "last.ckpt"]


def test_publish_folder_replaces_a_folder_only_once_the_new_one_is_whole(tmp_path):
    old, staging = tmp_path / "step=2.ckpt", tmp_path / ".step=2.ckpt.partial"
    for folder, text in ((old, "old"), (staging, "new")):
        folder.mkdir()
        (folder / "meta.pt").write_text(text)
    publish_folder(staging, old)
    assert (old / "meta.pt").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["step=2.ckpt"]


def _dcp(folder, complete=True):
    folder.mkdir()
    for name in ("meta.pt", ".metadata") if complete else ("meta.pt",):
        (folder / name).write_bytes(b"")


def test_resume_checkpoint_takes_the_newest_complete_and_ignores_partial_saves(tmp_path):
    assert resume_checkpoint(tmp_path / "missing") is None
    io = AtomicCheckpointIO()
    io.save_checkpoint({}, tmp_path / "epoch=0-step=2.ckpt")
    io.save_checkpoint({}, tmp_path / "epoch=0-step=4.ckpt")
    (tmp_path / "epoch=0-step=6.ckpt").write_bytes(b"PK\x03\x04 truncated")  # a non-atomic writer's half file
    _dcp(tmp_path / ".epoch=0-step=8.ckpt.partial")
    assert resume_checkpoint(tmp_path) == tmp_path / "epoch=0-step=4.ckpt"  # no `last`: the newest whole one
    (tmp_path / "last.ckpt").symlink_to("epoch=0-step=9.ckpt")  # dangling (Lightning's delete-then-relink)
    assert resume_checkpoint(tmp_path) == tmp_path / "epoch=0-step=4.ckpt"
    replace_link(tmp_path / "epoch=0-step=2.ckpt", tmp_path / "last.ckpt")
    assert resume_checkpoint(tmp_path) == tmp_path / "last.ckpt"  # a whole `last` wins, as in Lightning
    _dcp(tmp_path / "last-v1.ckpt", complete=False)  # a DCP folder without DCP's metadata
    assert resume_checkpoint(tmp_path) == tmp_path / "last.ckpt"


class SpyIO(AtomicCheckpointIO):
    """A user's CheckpointIO: records where `last.ckpt` points when a checkpoint is deleted."""

    def __init__(self):
        self.removals = []

    def remove_checkpoint(self, path):
        last = os.path.join(os.path.dirname(path), "last.ckpt")
        self.removals.append((os.path.basename(path), os.path.basename(os.path.realpath(last))))
        super().remove_checkpoint(path)


def test_last_is_relinked_before_its_checkpoint_is_deleted_and_a_users_io_stays(tmp_path):
    spy = SpyIO()
    callback = AtomicModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last="link")
    trainer = L.Trainer(max_steps=3, callbacks=[callback], plugins=[spy], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert trainer.strategy.checkpoint_io is spy
    assert spy.removals == [("epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"), ("epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt")]
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt", "epoch=0-step=3.ckpt.sha256", "last.ckpt"]
    assert callback.state_key == ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last="link").state_key


def test_the_default_io_is_atomic_and_a_users_stays():
    callback = AtomicModelCheckpoint()
    trainer = L.Trainer(max_steps=1, callbacks=[callback], logger=False)
    trainer.strategy.connect(BoringModel())
    callback.setup(trainer, trainer.lightning_module, "fit")
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    assert type(ParallelStrategy().checkpoint_io) is AtomicCheckpointIO
    mine = TorchCheckpointIO()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ParallelStrategy(), plugins=[mine], logger=False)
    assert trainer.strategy.checkpoint_io is mine
