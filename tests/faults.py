"""Fault injection for tests (CLI runs name these callbacks by dotted path, ``faults.X``, with ``tests/`` on
PYTHONPATH): stop a save midway so the test can kill the process there, record where a resumed run starts, and make
a step's loss or gradient non-finite."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import lightning as L
import torch

SIGNAL_FD = "RL_TEST_SIGNAL_FD"  # the write end of a pipe the test reads: one byte = "blocked inside the save"


def _block_forever(*args, **kwargs):
    os.write(int(os.environ[SIGNAL_FD]), b"1")
    threading.Event().wait()  # until the test's SIGKILL


class BlockInsideSave(L.Callback):
    """At the `at_save`-th checkpoint save, block global rank 0 inside the write and tell the test, which kills it.

    ``write``: at the first ``os.fsync`` (the new checkpoint's bytes, or rank 0's DCP shard, written under the hidden
    name, nothing renamed yet); ``link``: at the ``os.replace`` that would swap the ``last`` link.
    """

    def __init__(self, at_save: int = 2, stage: str = "write") -> None:
        self.at_save, self.stage, self.saves = at_save, stage, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saves += 1
        if self.saves != self.at_save or not trainer.is_global_zero:
            return
        if self.stage == "write":
            os.fsync = _block_forever
        else:
            replace = os.replace
            os.replace = lambda src, dst: _block_forever() if os.path.islink(src) else replace(src, dst)


class RecordStartStep(L.Callback):
    """Write the global step a (resumed) run starts from to `path` (rank 0)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(str(trainer.global_step))


class NaNLoss(L.Callback):
    """Make the loss of training batches `batches` (indices; null: every batch) NaN on global ranks `ranks` (null:
    all): the policy's input embeddings return NaN, so its gradients are NaN too."""

    def __init__(self, batches: list[int] | None = None, ranks: list[int] | None = None) -> None:
        self.batches, self.ranks, self.hook = batches, ranks, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (self.batches is None or batch_idx in self.batches) and (self.ranks is None or
                                                                     trainer.global_rank in self.ranks):
            embeddings = pl_module.model.get_input_embeddings()
            self.hook = embeddings.register_forward_hook(lambda module, args, output: output * torch.nan)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


class NaNGradient(L.Callback):
    """Make a gradient NaN after every backward of training batches `batches` (PPO's rollouts use the policy, so its
    loss cannot be poisoned through the forward without poisoning the sampling too)."""

    def __init__(self, batches: list[int]) -> None:
        self.batches, self.active = batches, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.active = batch_idx in self.batches

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.active:
            next(p for p in pl_module.model.parameters() if p.grad is not None).grad.view(-1)[0] = torch.nan
