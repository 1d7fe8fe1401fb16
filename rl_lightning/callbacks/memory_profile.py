"""Where the memory goes, phase by phase: ``--trainer.callbacks+=rl_lightning.callbacks.memory_profile.MemoryProfile``.

Turns on `rl_lightning.memory.phases.PhaseProfiler` for the fit. The library marks its phases: for RL,
``rollout/weight_sync`` (push to the engine and wake it), ``rollout/generate``, ``rollout/score`` (the reward
function), ``train/score`` (old and reference log-probabilities, values), ``train/forward``, ``train/backward``,
``train/optimizer_step``; for SFT, DPO and RM ``train/score`` (DPO's reference pass), ``train/forward``,
``train/backward`` and ``train/optimizer_step``; for every task ``checkpoint_save`` and ``export``. Each training step logs, per phase seen
during it, ``memory/phase/<phase>/peak_rss_mib`` (the phase's own host peak: the kernel's high-water mark, reset at
the phase's start) and ``growth_rss_mib`` (resident memory at its end minus at its start), and on CUDA
``peak_cuda_mib`` (``torch.cuda.max_memory_allocated`` within the phase). At the end of the fit the whole table
(every phase: occurrences, largest peak, largest growth, total seconds) is printed, written to
``memory_phases.md`` (in `dirpath`, default the run's output folder or the Trainer's ``default_root_dir``) and
logged to each MLflow run as an artifact.

Phases inside validation are named ``val:<phase>``. Rank 0's numbers are logged and written; each rank measures
itself. The per-phase host peak resets the kernel's high-water mark, which GNU time and ``ru_maxrss`` also read:
while this callback is on, take the process's peak from ``memory/peak_rss_mib`` (`rl_lightning.callbacks.memory_stats`, which
accounts for the resets) or this table, not from ``/usr/bin/time``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from rl_lightning.memory.phases import PhaseProfiler, phase


class MemoryProfile(L.Callback):
    """Per-phase host (and CUDA) memory peaks, logged per step and tabled at the end (see the module docstring).

    Args:
        dirpath: where ``memory_phases.md`` is written; default: the run's output folder (``RunOutputs``) or the
            Trainer's ``default_root_dir``.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.profiler: PhaseProfiler | None = None
        self._logged = 0  # records already logged

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.profiler = PhaseProfiler(device=trainer.strategy.root_device).__enter__()
        save = trainer.save_checkpoint

        @functools.wraps(save)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            with phase("checkpoint_save"):
                return save(*args, **kwargs)

        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profiler is not None:
            self.profiler.prefix = "val:"  # validation's rollouts apart from training's

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profiler is not None:
            self.profiler.prefix = ""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.profiler is None:
            return
        metrics: dict[str, float] = {}
        for record in self.profiler.records[self._logged:]:
            prefix = f"memory/phase/{record.name}"
            metrics[f"{prefix}/peak_rss_mib"] = max(metrics.get(f"{prefix}/peak_rss_mib", 0.0), record.peak_rss_mib)
            growth = record.end_rss_mib - record.start_rss_mib
            metrics[f"{prefix}/growth_rss_mib"] = max(metrics.get(f"{prefix}/growth_rss_mib", growth), growth)
            if record.peak_cuda_mib:
                metrics[f"{prefix}/peak_cuda_mib"] = max(metrics.get(f"{prefix}/peak_cuda_mib", 0.0),
                                                         record.peak_cuda_mib)
        self._logged = len(self.profiler.records)
        if metrics:
            pl_module.log_dict(metrics, rank_zero_only=True)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.profiler is None:
            return
        self.profiler.__exit__()
        table = markdown_table(self.profiler)
        self.profiler = None
        if not trainer.is_global_zero or table is None:
            return
        print(table, flush=True)
        path = self._dirpath(trainer) / "memory_phases.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table + "\n")
        from lightning.pytorch.loggers import MLFlowLogger

        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_artifact(logger.run_id, str(path))

    def _dirpath(self, trainer: L.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if type(callback).__name__ == "RunOutputs" and getattr(callback, "dirpath", None) is not None:
                return Path(callback.dirpath)
        return Path(trainer.default_root_dir)


def markdown_table(profiler: PhaseProfiler) -> str | None:
    """The profiler's per-phase summary as a Markdown table (None when no phase was recorded)."""
    summary = profiler.summary()
    if not summary:
        return None
    cuda = any(row["peak_cuda_mib"] for row in summary.values())
    head = "| phase | count | peak RSS (MiB) | largest growth (MiB) |" + (" peak CUDA (MiB) |" if cuda else "")
    lines = [head + " seconds |", "|---" * (head.count("|") - 1 + 1) + "|"]
    for name, row in summary.items():
        exact = "" if row["exact"] else " (process max)"
        cells = [name, f"{row['count']:.0f}", f"{row['peak_rss_mib']:.0f}{exact}", f"{row['max_growth_mib']:+.0f}"]
        if cuda:
            cells.append(f"{row['peak_cuda_mib']:.0f}")
        cells.append(f"{row['seconds']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
