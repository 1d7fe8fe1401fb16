"""Run a function on N CPU processes joined by a gloo process group, the way Lightning expects external launches."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    # Lightning treats these as an external launcher (torchrun-like) and does not re-execute sys.argv.
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "NODE_RANK": "0", "RANK": str(rank), "OMP_NUM_THREADS": "1",
    })
    fn(rank, *args)


def run_on_cpu_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, *args)`` in `world_size` spawned processes; raises if any of them fails."""
    mp.start_processes(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, start_method="spawn")
