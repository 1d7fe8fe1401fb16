"""Host and CUDA memory per phase of a training step, logged with the step's metrics.

Phases, as Lightning's hooks bound them:

- ``rollout`` (PPO-family tasks): from the end of the previous training step (or of validation, or the start of
  training) to the end of the rollout callback's ``on_train_batch_start``: fetching the prompts, the vLLM weight sync
  (``rollout/weight_sync_s`` times it; no hook separates it from generation, so its memory is part of this phase),
  generation and scoring (``rollout/generate_s``);
- ``train``: from there to ``on_train_batch_end``: the training step (for PPO: scoring, advantages and every
  minibatch's update; for SFT, DPO, RM: the whole step). Other tasks have only this phase.

Lightning runs the callbacks a module adds (PPO's rollout callback) after the Trainer's, so at ``setup`` this callback
moves itself to right after the rollout callback: its ``on_train_batch_start`` then runs when the rollout is done.

Logged (MiB, ``pl_module.log_dict`` at ``on_train_batch_end``, so at the step of the task's own metrics):

- ``memory/rss_mib``: this process's resident memory at the end of the step; ``memory/rollout/rss_mib``: right
  after the rollout; ``memory/peak_rss_mib``: the process's peak resident memory so far, never decreasing: the
  kernel's high-water mark (``getrusage``'s ``ru_maxrss``) or the highest resident memory measured here, whichever is
  larger (the high-water mark is folded in lazily and can trail the current value by a few hundred KiB);
- on CUDA, per phase: ``memory/<phase>/cuda_allocated_mib`` and ``cuda_reserved_mib`` at the phase's end, and
  ``cuda_peak_mib``, the most PyTorch had allocated during the phase (``torch.cuda.max_memory_allocated``; this
  callback resets the peak at each phase start). These count PyTorch's caching allocator in this process: memory a
  colocated vLLM engine takes through its own allocator pool (sleep mode) may not show; ``nvidia-smi`` sees it.

Each rank measures itself; the loggers write global rank 0's numbers.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.memory.phases import cuda_peak_mib, process_peak_mib, reset_cuda_peak

MIB = 1 << 20


class MemoryStats(L.Callback):
    """Log host resident memory and, on CUDA, PyTorch's allocated/reserved/peak memory.

    Both are logged for the rollout and the training step (see the module docstring). No arguments.
    """

    def __init__(self) -> None:
        self._rollout: dict[str, float] = {}
        self._peak_rss = 0.0  # MiB

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            _run_after_rollout_callback(self, trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _reset_peak(pl_module.device)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _reset_peak(pl_module.device)  # validation's own rollouts stay out of the next rollout phase

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        self._rollout = {}
        if isinstance(batch, dict) and "rollout" in batch:  # the rollout callback has run: its phase ends here
            self._rollout = {**_cuda_phase("rollout", pl_module.device), **self._rss("memory/rollout/rss_mib")}
        _reset_peak(pl_module.device)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        metrics = {**self._rollout, **_cuda_phase("train", pl_module.device), **self._rss("memory/rss_mib")}
        metrics["memory/peak_rss_mib"] = self._peak_rss = max(self._peak_rss, peak_rss_bytes() / MIB)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        _reset_peak(pl_module.device)

    def _rss(self, name: str) -> dict[str, float]:
        rss = current_rss_bytes()
        if rss is None:
            return {}
        self._peak_rss = max(self._peak_rss, rss / MIB)
        return {name: rss / MIB}


def _run_after_rollout_callback(callback: L.Callback, trainer: L.Trainer) -> None:
    from rl_lightning.rollout.callback import RolloutCallback

    callbacks = [c for c in trainer.callbacks if c is not callback]
    rollouts = [i for i, c in enumerate(callbacks) if isinstance(c, RolloutCallback)]
    if rollouts:
        callbacks.insert(rollouts[-1] + 1, callback)
        trainer.callbacks = callbacks  # a new list: Lightning is iterating the old one (this very setup hook)


def current_rss_bytes() -> int | None:
    """This process's resident memory: /proc/self/statm (Linux), else psutil if installed, else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (``ru_maxrss``: KiB on Linux, bytes on macOS).

    Includes what `rl_lightning.callbacks.memory_profile.MemoryProfile`'s per-phase resets of the kernel's high-water mark hid.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(peak if sys.platform == "darwin" else peak * 1024, int(process_peak_mib() * MIB))


def _cuda_phase(phase: str, device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {f"memory/{phase}/cuda_allocated_mib": torch.cuda.memory_allocated(device) / MIB,
            f"memory/{phase}/cuda_reserved_mib": torch.cuda.memory_reserved(device) / MIB,
            f"memory/{phase}/cuda_peak_mib": cuda_peak_mib(device)}


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        reset_cuda_peak(device)
