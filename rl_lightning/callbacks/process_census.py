"""The trainer process's host resources every `every_n_rollouts` rollouts: a leak watch for long runs.

Read from Linux's ``/proc`` (nothing else is imported), once per sampled rollout on every rank, at the end of the
training step:

| metric | what |
| --- | --- |
| ``host/rss_mib`` | this process's resident memory (``VmRSS`` of ``/proc/self/status``) |
| ``host/children_rss_mib`` | the summed resident memory of all its descendants (reward workers, sandboxes, ...) |
| ``host/fds`` | its open file descriptors (entries of ``/proc/self/fd``) |
| ``host/threads`` | its threads (``Threads`` of ``/proc/self/status``) |
| ``host/children`` | its live descendant processes, found through ``/proc/<pid>/task/*/children`` |

Each sample is logged with the step's metrics (``pl_module.log_dict``; the loggers write global rank 0's) and, with
`path`, appended to that JSON-lines file (one object per sample, keys ``rollout`` and the names above without
``host/``, plus ``pids``: the descendants' process ids, and ``files``: what each fd points at; ranks other than 0 write ``<path>.rank<r>``).
``benchmarks/soak.py`` reads that file. A descendant that exits between listing and reading counts no memory. Off Linux (no ``/proc``) the callback logs nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from rl_lightning.errors import ConfigError


class ProcessCensus(L.Callback):
    """Sample resident memory, file descriptors, threads and child processes of the trainer process.

    Args:
        every_n_rollouts: sample after rollouts 1, N, 2N, ... (training batches for tasks without rollouts).
        path: JSON-lines file each sample is appended to; null: only logged as metrics.
    """

    def __init__(self, every_n_rollouts: int = 10, path: str | None = None) -> None:
        if every_n_rollouts < 1:
            raise ConfigError(f"rl_lightning.callbacks.process_census.ProcessCensus: every_n_rollouts must be >= 1, got "
                              f"{every_n_rollouts}; set it to 1 or more")
        self.every_n_rollouts, self.path = every_n_rollouts, path
        self._seen = 0

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._seen += 1
        number = int(getattr(pl_module, "rollouts", self._seen))
        if not (number == 1 or number % self.every_n_rollouts == 0) or not os.path.isdir("/proc/self"):
            return
        sample = census(os.getpid())
        pids, files = sample.pop("pids"), sample.pop("files")
        pl_module.log_dict({f"host/{k}": float(v) for k, v in sample.items()}, on_step=True, on_epoch=False)
        if self.path is not None:
            path = Path(self.path if trainer.global_rank == 0 else f"{self.path}.rank{trainer.global_rank}")
            with path.open("a") as f:
                f.write(json.dumps({"rollout": number, **sample, "pids": pids, "files": files}) + "\n")


def census(pid: int) -> dict[str, Any]:
    """A sample of `pid`: ``rss_mib``, ``fds``, ``threads``, its descendants' ``children``, ``children_rss_mib``, ``pids``.

    ``files``: each fd's target (``readlink``), sorted.
    """
    status, files = _status(pid), _fd_targets(pid)
    descendants = _descendants(pid)
    children_rss = sum(_status(child).get("VmRSS", 0.0) for child in descendants)
    return {"rss_mib": status["VmRSS"] / 1024, "children_rss_mib": children_rss / 1024,
            "fds": len(files), "threads": int(status["Threads"]), "children": len(descendants),
            "pids": descendants, "files": files}


def _fd_targets(pid: int) -> list[str]:
    """What each open fd of `pid` points at (a path, ``socket:[inode]``, ``pipe:[inode]``, ...), sorted."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # the listing's own fd, closed by now
            continue
    return sorted(targets)


def _status(pid: int) -> dict[str, float]:
    """``VmRSS`` (KiB) and ``Threads`` of ``/proc/<pid>/status``; {} for a process that is gone."""
    found: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "Threads"):
                    found[key] = float(value.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return found


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children of each of its threads, recursively)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # exited meanwhile
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found
