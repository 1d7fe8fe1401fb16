"""Checkpoints are data: read weights-only, checked against their digest, and refused in one line when damaged.

A checkpoint is a pickle, and unpickling runs whatever the file names. So every checkpoint the package reads (a
resume, ``--load_weights_only``, the resume check's look at the hyperparameters) is read with ``torch.load(...,
weights_only=True)``: tensors, plain containers and numbers, strings, nothing else. Our own checkpoints need nothing
more (hyperparameters are saved as dicts, rollout and callback state as plain data), so `SAFE_GLOBALS` is empty. A
checkpoint that needs more is refused in one line naming the global torch refused; ``--trust_checkpoint true``
loads it as code (full pickle), the only way to.

Sharded (DCP) folders: torch's reader unpickles ``.metadata`` with plain ``pickle`` and every non-tensor entry with
``torch.load(weights_only=False)``. Before such a folder loads, `unsafe_globals` reads ``.metadata`` with a
restricted unpickler (DCP's own metadata classes, ``torch.Size``, dtypes, layouts, paths) and every non-tensor entry
weights-only; anything else refuses the folder unless it is trusted. (The load that follows reads the same bytes,
which the digest pins.)

Digests: a ``.ckpt`` file's SHA-256 is computed while it is written (`HashingWriter`) and kept beside it in
``<name>.ckpt.sha256`` (``sha256sum -c`` reads it); a DCP folder's files are listed with theirs in its
``SHA256SUMS``. `damage` finds a truncated file, a folder missing its metadata, or a byte that changed since the
save; a checkpoint saved without a digest (before this version, or by another CheckpointIO) is checked for
completeness only.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickle
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from rl_lightning.errors import ConfigError

SAFE_GLOBALS: tuple[Any, ...] = ()  # our checkpoints hold plain types only (tests/parallel/test_checkpoint_trust.py)
TRUST = "--trust_checkpoint true"
DIGEST_SUFFIX = ".sha256"
FOLDER_DIGESTS = "SHA256SUMS"
DCP_FILES = ("meta.pt", ".metadata")  # Lightning's metadata and DCP's: both are written last
_CHUNK = 1 << 22


class HashingWriter:
    """A binary file that keeps the SHA-256 of everything written through it (``torch.save`` only writes)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data: bytes) -> int:
        """Write `data` and add it to the digest."""
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        """Flush the file."""
        self.file.flush()


def digest_path(path: Path) -> Path:
    """Where the digest of checkpoint file `path` is kept: ``<name>.sha256`` beside it."""
    return path.with_name(path.name + DIGEST_SUFFIX)


def digest_line(hexdigest: str, name: str) -> str:
    """One line of a ``sha256sum`` listing."""
    return f"{hexdigest}  {name}\n"


def file_digest(path: Path) -> str:
    """The SHA-256 of `path`'s bytes (remembered while the file keeps its size and modification time)."""
    stat = path.stat()
    return _file_digest(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
    return sha256.hexdigest()


def recorded_digests(path: Path) -> dict[str, str]:
    """The digests saved with checkpoint `path` (a file or a DCP folder), by file name; {} when it has none."""
    listing = path / FOLDER_DIGESTS if path.is_dir() else digest_path(path)
    if not listing.is_file():
        return {}
    pairs = (line.split(None, 1) for line in listing.read_text().splitlines() if line.strip())
    return {name.strip().lstrip("*"): hexdigest for hexdigest, name in pairs}


def damage(path: str | Path) -> str | None:
    """What makes checkpoint `path` unusable, as a phrase (``is truncated ...``); None for a whole checkpoint.

    A link (``last.ckpt``) is judged by what it points at.
    """
    real = Path(path).resolve()
    if real.is_dir():
        missing = [name for name in DCP_FILES if not (real / name).is_file()]
        if missing:
            return f"is an incomplete sharded checkpoint (no {', '.join(missing)})"
    elif not real.is_file():
        return "does not exist" if not Path(path).is_symlink() else f"is a link to {real}, which does not exist"
    elif not zipfile.is_zipfile(real):
        return "is truncated or not a torch checkpoint (no complete zip archive)"
    folder = real if real.is_dir() else real.parent
    for name, expected in recorded_digests(real).items():
        file = folder / name
        if not file.is_file():
            return f"lacks {name}, listed in its {FOLDER_DIGESTS}"
        if file_digest(file) != expected:
            listing = FOLDER_DIGESTS if real.is_dir() else digest_path(real).name
            return f"does not match its digest ({listing}{f': {name}' if real.is_dir() else ''}): a byte changed " \
                   "after it was written"
    return None


def previous_complete(path: str | Path) -> Path | None:
    """The newest whole checkpoint in `path`'s folder saved before `path` (None: there is none)."""
    path = Path(path)
    real = path.resolve()
    newest = real.stat().st_mtime if real.exists() else float("inf")
    candidates = [p for p in path.parent.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".")
                  and not p.is_symlink() and p.resolve() != real and p.stat().st_mtime <= newest]
    for candidate in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        if damage(candidate) is None:
            return candidate
    return None


def refuse_damaged(path: str | Path, key: str = "--ckpt_path") -> None:
    """Raise a one-line `ConfigError` when checkpoint `path` is damaged, naming the previous complete checkpoint."""
    problem = damage(path)
    if problem is None:
        return
    previous = previous_complete(path)
    fix = (f"resume from the previous complete checkpoint, {key} {previous}" if previous is not None
           else f"no complete checkpoint precedes it in {Path(path).parent}")
    raise ConfigError(f"{key} {path} {problem}; {fix}")


def refuse_untrusted(path: str | Path, key: str = "--ckpt_path") -> None:
    """Raise a one-line `ConfigError` when checkpoint `path` needs more than a weights-only load."""
    unsafe = unsafe_globals(Path(path))
    if unsafe:
        shown = ", ".join(unsafe[:4]) + (f" and {len(unsafe) - 4} more" if len(unsafe) > 4 else "")
        raise ConfigError(f"{key} {path} needs pickle beyond weights: it holds {shown}, which a weights-only load "
                          f"refuses (unpickling it could run code); pass {TRUST} only for a checkpoint you trust as "
                          "code")


def load_file(path: str | Path, trust: bool = False, mmap: bool = True) -> Any:
    """``torch.load`` of checkpoint file `path` on the CPU: weights-only unless `trust`."""
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        return torch.load(path, map_location="cpu", weights_only=not trust, mmap=mmap)


def unsafe_globals(path: Path) -> list[str]:
    """The globals a weights-only read of checkpoint `path` (a file or a DCP folder) refuses; [] when none."""
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        if not path.is_dir():
            return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(str(path / "meta.pt"))
        try:
            metadata = read_dcp_metadata(path)
        except pickle.UnpicklingError as e:
            return [*refused, f"{e} (in .metadata)"]
        return refused + _unsafe_entries(path, metadata)


def _unsafe_entries(path: Path, metadata: Any) -> list[str]:
    """The refused globals of a DCP folder's non-tensor entries (each a ``torch.save`` of its own)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    refused = []
    for index, storage in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(storage, "transform_descriptors", None):  # compressed by a DCP extension: cannot be read here
            refused.append(f"{index.fqn} (a transformed entry)")
            continue
        with open(path / storage.relative_path, "rb") as f:
            f.seek(storage.offset)
            entry = io.BytesIO(f.read(storage.length))
        refused += [f"{name} (in {index.fqn})" for name in torch.serialization.get_unsafe_globals_in_checkpoint(entry)]
    return refused


def read_dcp_metadata(path: Path) -> Any:
    """A DCP folder's ``.metadata``, unpickled with only DCP's metadata types allowed (`_MetadataUnpickler`)."""
    with open(path / ".metadata", "rb") as f:
        return _MetadataUnpickler(f).load()


_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle`` for DCP's ``.metadata``: its own dataclasses and enums, sizes, dtypes, layouts, paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        """The global `module.name` if it is one of those, else `pickle.UnpicklingError` naming it."""
        if (module, name) in _METADATA_GLOBALS or self._torch_constant(module, name) or self._dcp_type(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    @staticmethod
    def _torch_constant(module: str, name: str) -> bool:
        return module == "torch" and isinstance(getattr(torch, name, None),
                                                torch.dtype | torch.layout | torch.memory_format)

    @staticmethod
    def _dcp_type(module: str, name: str) -> bool:
        if module != _DCP_METADATA:
            return False
        import torch.distributed.checkpoint.metadata as metadata

        value = getattr(metadata, name, None)
        return isinstance(value, type) and value.__module__ == _DCP_METADATA


def folder_digests(folder: Path, names: list[str]) -> str:
    """The ``sha256sum`` lines of files `names` in `folder`."""
    return "".join(digest_line(file_digest(folder / name), name) for name in sorted(names))


def own_shards(folder: Path, rank: int) -> list[str]:
    """The DCP shard files rank `rank` wrote into `folder` (``__<rank>_<n>.distcp``)."""
    return sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))
