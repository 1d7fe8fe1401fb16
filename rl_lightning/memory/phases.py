"""Where memory goes: the peak host (and CUDA) memory of each named phase of a run, and giving freed host memory back.

The library marks its phases with ``with phase("train/backward"):`` (rollout generation, the weight sync, scoring,
the log-probability passes, forward, backward, optimizer step, checkpoint save, export). A marker costs nothing
unless a `PhaseProfiler` is active (``rl_lightning.callbacks.memory_profile.MemoryProfile`` turns one on). Then each phase
records, per occurrence:

- host: resident memory at its start and end, and its peak: the kernel's high-water mark (``VmHWM``), reset at
  the phase's start by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), so it is the phase's own peak and
  not the process's; elsewhere the process's ``ru_maxrss`` (a running maximum, flagged ``exact: False``);
- CUDA: ``torch.cuda.memory_allocated`` at start and end and ``max_memory_allocated`` during the phase (reset at its
  start).

Phases nest: an inner phase's peak also counts towards every phase around it.

`release_host_memory` returns the freed heap of glibc's allocator to the system (``malloc_trim``). Without it a
process's resident memory keeps the high-water mark of every earlier step: glibc keeps freed blocks of its heap
arenas for reuse, so three rollouts of SmolLM2-135M grew 2.9 -> 5.9 -> 7.1 GB (with jemalloc: 2.9 -> 4.2 -> 4.3).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import functools
import resource
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

MIB = 1 << 20


@dataclass
class PhaseRecord:
    """One occurrence of a phase (MiB, seconds)."""

    name: str
    start_rss_mib: float
    end_rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    start_cuda_mib: float = 0.0
    end_cuda_mib: float = 0.0
    peak_cuda_mib: float = 0.0
    seconds: float = 0.0
    exact: bool = True  # False: the host peak is the process's running maximum, not the phase's own


@dataclass
class PhaseProfiler:
    """Records every `phase` while active (``with profiler:``); `records` in the order phases end."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    thread: int = field(default_factory=threading.get_ident)  # phases on other threads (async rollouts) are not recorded
    records: list[PhaseRecord] = field(default_factory=list)
    _stack: list[tuple[PhaseRecord, float]] = field(default_factory=list)  # (record, its start time)

    def __post_init__(self) -> None:
        self.prefix = ""  # put before every phase name (``val:`` during validation)
        self._token: contextvars.Token | None = None

    def __enter__(self) -> PhaseProfiler:
        self._token = ACTIVE_PROFILER.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            ACTIVE_PROFILER.reset(self._token)
            self._token = None

    def enter(self, name: str) -> None:
        """Start phase `name`: fold the running peak into the enclosing phase, then reset the peaks."""
        self._fold_peak()
        record = PhaseRecord(name, start_rss_mib=rss_mib(), exact=_reset_host_peak())
        record.peak_rss_mib = record.start_rss_mib
        if self.device.type == "cuda":
            record.start_cuda_mib = record.peak_cuda_mib = torch.cuda.memory_allocated(self.device) / MIB
            _reset_cuda_peak(self.device)
        self._stack.append((record, time.perf_counter()))

    def exit(self, name: str) -> None:
        """End phase `name` (the innermost open one): its peak also counts for the phases around it."""
        self._fold_peak()
        record, started = self._stack.pop()
        if record.name != name:
            raise RuntimeError(f"memory phase '{name}' ended while '{record.name}' was open")
        record.end_rss_mib, record.seconds = rss_mib(), time.perf_counter() - started
        if self.device.type == "cuda":
            record.end_cuda_mib = torch.cuda.memory_allocated(self.device) / MIB
        for outer, _ in self._stack:
            outer.peak_rss_mib = max(outer.peak_rss_mib, record.peak_rss_mib)
            outer.peak_cuda_mib = max(outer.peak_cuda_mib, record.peak_cuda_mib)
            outer.exact = outer.exact and record.exact
        self.records.append(record)

    def _fold_peak(self) -> None:
        if not self._stack:
            return
        record = self._stack[-1][0]
        record.peak_rss_mib = max(record.peak_rss_mib, host_peak_mib(), rss_mib())
        if self.device.type == "cuda":
            record.peak_cuda_mib = max(record.peak_cuda_mib, torch.cuda.max_memory_allocated(self.device) / MIB)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase name: occurrences and the largest peak, start, end and growth (end - start) seen, in MiB."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            row = out.setdefault(r.name, {"count": 0, "peak_rss_mib": 0.0, "max_growth_mib": -float("inf"),
                                          "peak_cuda_mib": 0.0, "seconds": 0.0, "exact": 1.0})
            row["count"] += 1
            row["peak_rss_mib"] = max(row["peak_rss_mib"], r.peak_rss_mib)
            row["max_growth_mib"] = max(row["max_growth_mib"], r.end_rss_mib - r.start_rss_mib)
            row["peak_cuda_mib"] = max(row["peak_cuda_mib"], r.peak_cuda_mib)
            row["seconds"] += r.seconds
            row["exact"] = min(row["exact"], float(r.exact))
        return out


# The profiler `phase` reports to: set by ``with profiler:`` for the code it wraps, in that thread's context only.
ACTIVE_PROFILER: contextvars.ContextVar[PhaseProfiler | None] = contextvars.ContextVar("rl_lightning_phase_profiler",
                                                                                       default=None)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of the run for the active `PhaseProfiler` (a no-op when none is active or on another thread).

    Phases are recorded on the profiler's own thread only: a rollout generated in the background (``async_steps:
    1``) overlaps the update, so its memory is part of whatever the training thread is doing then.
    """
    profiler = ACTIVE_PROFILER.get()
    if profiler is None or threading.get_ident() != profiler.thread:
        yield
        return
    name = profiler.prefix + name
    profiler.enter(name)
    try:
        yield
    finally:
        profiler.exit(name)


def rss_mib() -> float:
    """This process's resident memory now (MiB), from ``/proc/self/statm`` (Linux) or ``ru_maxrss`` elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / MIB
    except OSError:
        return host_peak_mib()


def host_peak_mib() -> float:
    """The process's resident high-water mark (MiB): ``VmHWM`` (resettable) on Linux, ``ru_maxrss`` elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024


# The kernel's high-water mark (which ``ru_maxrss`` and GNU time read too) and CUDA's peak statistic are
# process-wide: what the profiler's resets hid ("host", or a CUDA device) is kept here, process-wide too, so
# `process_peak_mib` and `cuda_peak_mib` stay true (tests/house/test_architecture.py lists it as process-wide state).
_PEAKS_BEFORE_RESETS: dict[str | torch.device, float] = {}


def _reset_host_peak() -> bool:
    """Reset the kernel's high-water mark to the current resident memory; False where that is not possible."""
    _PEAKS_BEFORE_RESETS["host"] = max(_PEAKS_BEFORE_RESETS.get("host", 0.0), host_peak_mib())
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def process_peak_mib() -> float:
    """The process's peak resident memory so far (MiB), including what the profiler's resets hid from the kernel."""
    return max(_PEAKS_BEFORE_RESETS.get("host", 0.0), host_peak_mib())


def _reset_cuda_peak(device: torch.device) -> None:
    _PEAKS_BEFORE_RESETS[device] = max(_PEAKS_BEFORE_RESETS.get(device, 0.0),
                                           torch.cuda.max_memory_allocated(device) / MIB)
    torch.cuda.reset_peak_memory_stats(device)


def reset_cuda_peak(device: torch.device) -> None:
    """Start a new CUDA peak window on `device` (``torch.cuda.reset_peak_memory_stats``, and the profiler's share)."""
    _PEAKS_BEFORE_RESETS.pop(device, None)
    torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_mib(device: torch.device) -> float:
    """The most PyTorch allocated on `device` since `reset_cuda_peak` (MiB), across the profiler's own resets."""
    return max(_PEAKS_BEFORE_RESETS.get(device, 0.0), torch.cuda.max_memory_allocated(device) / MIB)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None  # musl and others have no malloc_trim
    except OSError:
        return None


def release_host_memory() -> bool:
    """Give the freed part of glibc's heap back to the system (``malloc_trim(0)``); False where there is no glibc.

    Called after each rollout and training step: the next step's peak then starts from what is really in use. A few
    milliseconds per gigabyte of heap; a process running under jemalloc or tcmalloc (``LD_PRELOAD``) keeps glibc's
    symbol, whose heap is then nearly empty, so the call is harmless there.
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
