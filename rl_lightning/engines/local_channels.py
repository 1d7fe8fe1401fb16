"""Channels between processes of one host that only this host can reach: a private `FileStore`, loopback gloo.

A ``TCPStore`` server binds every interface (``::``) whatever host it is given, and answers anyone, unauthenticated;
gloo binds the address the machine's host name resolves to (the cluster network on most nodes). For two processes on
one host neither is needed:

- `private_store`: a ``FileStore`` in a fresh folder only this user can enter (``0o700``): no socket, no port to pick
  (so no race for a free one), and no other user can join or read it;
- `loopback_gloo`: a gloo group whose device binds ``127.0.0.1``;
- `rl_lightning.parallel.local_group.loopback_environment`: the variables that make a child's own groups (vLLM's,
  NCCL's bootstrap) bind loopback (shared with the trainer's own group).

torch exposes a gloo group's device only through ``ProcessGroupGloo._Options`` (private, stable since torch 1.x);
this module is the one place that uses it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"


def private_folder(prefix: str) -> str:
    """A fresh folder in the temporary directory that only this user can enter (``mkdtemp``: mode ``0o700``)."""
    return tempfile.mkdtemp(prefix=prefix)


def private_store(folder: str, world_size: int, name: str = "store") -> Any:
    """A ``torch.distributed.FileStore`` at ``<folder>/<name>`` for `world_size` processes of this host."""
    import torch.distributed as dist

    return dist.FileStore(os.path.join(folder, name), world_size)


def remove_folder(folder: str | None) -> None:
    """Remove a `private_folder` (and the store in it), if it still exists."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def loopback_gloo(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A gloo process group over `store` whose sockets bind ``127.0.0.1`` only."""
    import torch.distributed as dist

    from rl_lightning.compat.torch import gloo_options

    return dist.ProcessGroupGloo(store, rank, size, gloo_options(LOOPBACK, timeout))
