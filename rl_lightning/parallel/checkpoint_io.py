"""Atomic checkpoints: a kill at any moment of a save leaves the previous checkpoint whole and ``last`` loadable.

- `AtomicCheckpointIO` writes a ``.ckpt`` file under a hidden temporary name in the same folder, fsyncs it,
  moves it into place with ``os.replace`` and fsyncs the folder: the name holds the old bytes or the new, never a part.
  (Lightning's ``TorchCheckpointIO`` goes through fsspec's local transaction, which writes into the system's temp
  folder and moves the file in: a copy into the final name when that folder is on another filesystem, and no fsync.)
- `publish_folder` does the same for a sharded (DCP) checkpoint folder, which `ParallelStrategy` writes whole under a
  hidden name first; a folder already holding the name is moved aside and deleted only once the new one is in place.
- `AtomicModelCheckpoint` is Lightning's ``ModelCheckpoint`` with the ``last`` link swapped atomically (a symlink at
  a temporary name, moved over the old one by ``os.replace``; Lightning removes the old link, then links) and
  re-pointed at the newest checkpoint *before* the checkpoint it points at is deleted (Lightning deletes the previous
  top-k checkpoint first and relinks after, leaving ``last.ckpt`` dangling in between). It installs
  `AtomicCheckpointIO` on a strategy that has no CheckpointIO of the user's. The CLI's default checkpoint callback.
- `resume_checkpoint` is what the CLI's ``--ckpt_path last`` resumes: the newest whole ``last*.ckpt``, else the
  newest whole checkpoint of the folder; one it passes over (truncated, or changed since its save) is named in a
  warning.
- Every ``.ckpt`` file gets its SHA-256, computed as it is written, in ``<name>.ckpt.sha256`` beside it (a sharded
  folder: ``SHA256SUMS`` inside, `rl_lightning.parallel.strategy`); loads are weights-only
  (`rl_lightning.parallel.checkpoint_trust`).

Temporary names start with a dot and end in ``.partial`` (being written) or ``.removing`` (being deleted): nothing
that looks for checkpoints picks them (Lightning's ``last`` lookup matches ``last*.ckpt``), and the next run's
`AtomicModelCheckpoint` deletes those a killed run left behind.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from rl_lightning.compat.lightning import CheckpointLinkHooks, checkpoint_io_if_set, empty_wrapper, is_local_path
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.checkpoint_trust import HashingWriter, damage, digest_line, digest_path

log = logging.getLogger(__name__)

LEFTOVER = re.compile(r"^\..+\.(partial|removing)$")
LAST = re.compile(r"last(-\d+)?")  # Lightning's `last` checkpoint names (ModelCheckpoint._find_last_checkpoints)


def temporary_path(path: Path, kind: str = "partial") -> Path:
    """A fresh hidden name next to `path` (``.<name>.<random>.<kind>``)."""
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.{kind}"


def fsync_folder(path: Path) -> None:
    """Make a rename inside folder `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: str | bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` so that a reader or a kill sees the old content or the new, never a part.

    The bytes go to a hidden temporary name in the same folder with permissions `mode`, are fsynced, moved into place
    with ``os.replace``, and the folder is fsynced.
    """
    path = Path(path)
    tmp = temporary_path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # the umask may have narrowed it; `mode` is what the caller asked for
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def delete(path: Path) -> None:
    """Delete a file, link or folder, renamed to a hidden name first (a kill midway leaves no half checkpoint)."""
    if not (path.exists() or path.is_symlink()):
        return
    doomed = temporary_path(path, "removing")
    os.replace(path, doomed)
    if doomed.is_dir() and not doomed.is_symlink():
        shutil.rmtree(doomed)
    else:
        doomed.unlink()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a hidden name in the checkpoint's folder, fsync, then ``os.replace`` into place.

    The file's SHA-256, computed while it is written, goes to ``<name>.sha256`` beside it. Loads are weights-only
    unless the caller asks for ``weights_only=False`` (``--trust_checkpoint true``). Remote paths (``s3://``...) go
    through Lightning's fsspec writer as before.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = temporary_path(path)
        try:
            with open(partial, "wb") as f:
                writer = HashingWriter(f)
                torch.save(checkpoint, writer)
                f.flush()
                os.fsync(f.fileno())
            digest_path(path).unlink(missing_ok=True)  # never an old digest beside new bytes (a kill in between)
            os.replace(partial, path)  # a `last.ckpt` link is replaced itself, not written through
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        fsync_folder(path.parent)
        write_atomic(digest_path(path), digest_line(writer.sha256.hexdigest(), path.name))

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Lightning's load, weights-only unless `weights_only` is False (torch's default can be flipped by env)."""
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only is not False)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        if is_local_path(path):
            delete(Path(path))
            digest_path(Path(path)).unlink(missing_ok=True)
        else:
            super().remove_checkpoint(path)


def install_atomic_io(strategy: Any) -> None:
    """Give `strategy` an `AtomicCheckpointIO` unless it has a CheckpointIO of the user's (which stays)."""
    current = checkpoint_io_if_set(strategy)  # the property would create Lightning's default
    if current is None:
        strategy.checkpoint_io = AtomicCheckpointIO()
    elif empty_wrapper(current):
        current.checkpoint_io = AtomicCheckpointIO()


def publish_folder(staging: Path, path: Path) -> None:
    """Rename the complete folder `staging` to `path`, after fsyncing its files.

    A folder already named `path` is moved aside first and deleted after; a file or link there is removed.
    """
    for file in staging.iterdir():
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_folder(staging)
    old = None
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        old = temporary_path(path, "removing")
        os.rename(path, old)
    os.rename(staging, path)
    fsync_folder(path.parent)
    if old is not None:
        shutil.rmtree(old)


def replace_link(target: str | Path, link: str | Path) -> None:
    """Point symlink `link` at `target` (relative), replacing whatever `link` was in one ``os.replace``."""
    link = Path(link)
    new = temporary_path(link)
    new.symlink_to(os.path.relpath(target, link.parent))
    if link.is_dir() and not link.is_symlink():  # a full DCP copy (`save_last: true`) before: a folder
        delete(link)
    os.replace(new, link)
    fsync_folder(link.parent)


def resume_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint ``--ckpt_path last`` resumes from `folder`; None when there is no whole one.

    The newest (by modification time) whole ``last*.ckpt``, as Lightning picks among them; if none is whole (a link
    left dangling by Lightning's own ``ModelCheckpoint``, a truncated file), the newest whole ``*.ckpt``. Whole:
    complete and, where it has a digest, matching it (`rl_lightning.parallel.checkpoint_trust.damage`). Each newer
    checkpoint passed over is named in a warning with what is wrong with it. Hidden names (a save in progress or
    killed) never count.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    names = [p for p in folder.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".")]
    newest_first = sorted(names, key=lambda p: (not LAST.match(p.stem), -p.lstat().st_mtime))
    passed: dict[Path, str] = {}
    for candidate in newest_first:
        problem = damage(candidate)
        if problem is None:
            for skipped, why in passed.items():
                log.warning("%s %s; resuming from %s, the previous complete checkpoint", skipped, why, candidate)
            return candidate
        if candidate.resolve() not in {p.resolve() for p in passed}:
            passed[candidate] = problem
    if passed:
        damaged = "; ".join(f"{path.name} {why}" for path, why in passed.items())
        raise ConfigError(f"--ckpt_path last: no complete checkpoint in {folder} ({damaged}); start a new run "
                          "(no --ckpt_path), or from the weights of a checkpoint elsewhere (--load_weights_only true)")
    return None


def remove_leftovers(folder: Path) -> None:
    """Delete the temporary files and folders a killed save or removal left in `folder`."""
    for leftover in folder.iterdir() if folder.is_dir() else ():
        if not LEFTOVER.match(leftover.name):
            continue
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


class AtomicModelCheckpoint(CheckpointLinkHooks, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose saves and ``last`` link survive a kill (see the module docstring).

    Takes the same arguments; its state is saved under ``ModelCheckpoint``'s key, so checkpoints resume with either
    class.
    """

    @property
    @override
    def state_key(self) -> str:
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        install_atomic_io(trainer.strategy)
        if trainer.is_global_zero and self.dirpath and is_local_path(self.dirpath):
            remove_leftovers(Path(self.dirpath))

    @override
    def link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            replace_link(filepath, linkpath)
        trainer.strategy.barrier()

    @override
    def before_remove_checkpoint(self, trainer: Any, filepath: str, last_saved: str) -> None:
        # Lightning removes the previous top-k checkpoint before it relinks `last`: relink first
        if self.save_last == "link" and self.last_model_path and last_saved not in ("", filepath):
            link = Path(self.last_model_path)
            points_at = trainer.is_global_zero and link.is_symlink() and link.resolve() == Path(filepath).resolve()
            if trainer.strategy.broadcast(points_at):
                self.link_checkpoint(trainer, last_saved, self.last_model_path)
