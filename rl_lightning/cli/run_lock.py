"""`RunLock`: one process owns a run folder at a time (an ``flock`` on ``<run folder>/run.lock``).

Two processes in one run folder (a ``--ckpt_path last`` started while the run still trains) would delete each
other's checkpoint saves in progress (the checkpoint callback clears a killed save's leftovers at start-up). The
process that owns the folder, global rank 0, takes an exclusive ``flock`` on ``run.lock`` before anything is written
there and holds it until the fit ends; the lock file records its pid and host. The other ranks of the same job take
no lock: they learn rank 0's outcome by a broadcast, so a refused start stops every rank with the same line. The
kernel releases an ``flock`` when its process dies (``kill -9``, out of memory), so a resume after a crash is never
locked out. (``flock`` on NFS is emulated with byte-range locks from Linux 2.6.12; on a file system without locks at
all the lock is skipped with a warning.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import IO, Any

from rl_lightning.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunLock:
    """The exclusive ``flock`` on a run folder's `LOCK_FILE`, held by the folder's owner (global rank 0)."""

    def __init__(self) -> None:
        self.file: IO[str] | None = None

    def acquire(self, folder: Path, trainer: Any) -> None:
        """Create `folder` and lock it on global rank 0; every rank raises if another process holds it.

        Raises:
            ConfigError: one line naming the folder and the process that holds it.
        """
        refusal = self._take(folder) if trainer.is_global_zero and self.file is None else None
        refusal = trainer.strategy.broadcast(refusal)
        if refusal is not None:
            raise ConfigError(refusal)

    def _take(self, folder: Path) -> str | None:
        """Lock `folder`; the refusal's text when another process holds it."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_FILE
        file = open(path, "a+")  # noqa: SIM115 - held open for the fit: closing it releases the lock
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            return (f"{folder} is in use by {holder} (it holds {path}): a second run in one folder deletes the "
                    "other's checkpoint in progress; wait for that run to end, or start a new run (no --ckpt_path, "
                    "or --load_weights_only true)")
        except OSError as e:  # a file system without locks
            log.warning("could not lock %s (%s): nothing stops a second run from using this folder", path, e)
            file.close()
            return None
        file.seek(0)
        file.truncate()
        file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self.file = file
        return None

    def release(self) -> None:
        """Let go of the lock (closing the file releases it); the file stays."""
        if self.file is not None:
            self.file.close()
            self.file = None
