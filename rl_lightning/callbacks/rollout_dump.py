"""Every rollout's trajectories as JSONL files on disk (ColossalChat's ``rollout-save-dir``), rotated by size.

One line per trajectory: ``{"rollout", "step", "rank", "split", "prompt_row", "messages", "answer", "reward",
"reward_components", "completion_length", "finished", "turns"}`` (``rollout`` counts from 1: the line of rollout k
was sampled as the task's rollout k - 1; ``messages`` is the whole conversation: the prompt and what was generated,
tool turns included; ``prompt_row`` locates the prompt in the data file), plus what a replay needs
(``model.rollout.replay``, format 2, see `rl_lightning.rollout.replay`): ``format``, the exact ``input_ids``,
``completion_mask`` and ``engine_logprobs``, the prompt's ``prompt_index`` and its length in tokens and messages
(``prompt_tokens``, ``prompt_messages``), the line's place ``trajectory`` among the rollout's ``trajectories`` on
this rank, and the rollout's ``group_size``, ``reward_names``, ``reward_failures`` and ``refills``. Rank 0 writes
``manifest.json`` beside them (format, model, tokenizer fingerprint, rollout shape, sampling settings). Each rank writes
its own share to ``rollouts-rank<r>-<n>.jsonl`` under `dirpath` (default: the run's output folder, ``outputs/<run>/
<time>/rollouts``); when a file passes `max_file_mb` the next one starts, and only the newest `keep_files` files of a
rank are kept (0: all). Validation rollouts are written too with ``"split": "val"`` when `validation` is true.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from rl_lightning.errors import ConfigError
from rl_lightning.rollout.replay import MANIFEST, MUST_MATCH, dump_files, run_manifest, trajectory_record

WHERE = "rl_lightning.callbacks.rollout_dump.RolloutDump"


class RolloutDump(L.Callback):
    """Write each rollout's trajectories as JSONL (see the module docstring).

    Args:
        dirpath: the folder; null: ``rollouts/`` in the run's output folder (``rl_lightning.cli.outputs.RunOutputs``),
            or ``rollouts/`` in the working directory without one.
        max_file_mb: start a new file once the current one is this large (MiB).
        keep_files: newest files kept per rank (0: keep every file).
        validation: also write validation rollouts.
    """

    def __init__(self, dirpath: str | None = None, max_file_mb: float = 100.0, keep_files: int = 0,
                 validation: bool = False) -> None:
        errors = []
        if max_file_mb <= 0:
            errors.append(f"max_file_mb must be > 0, got {max_file_mb}")
        if keep_files < 0:
            errors.append(f"keep_files must be >= 0 (0: keep all), got {keep_files}")
        if errors:
            raise ConfigError(f"{WHERE}: " + "; ".join(errors))
        self.dirpath = Path(dirpath) if dirpath else None
        self.max_bytes, self.keep_files, self.validation = int(max_file_mb * (1 << 20)), keep_files, validation
        self._file: Path | None = None
        self._number = 0

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            outputs = next((c for c in trainer.callbacks if type(c).__name__ == "RunOutputs"), None)
            base = outputs.dirpath if outputs is not None and outputs.dirpath is not None else Path(".")
            self.dirpath = Path(base) / "rollouts"
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self._rank = trainer.global_rank
        existing = self._files()
        self._number = int(existing[-1].stem.rsplit("-", 1)[1]) if existing else 0  # a resumed run appends
        if stage == "fit" and trainer.is_global_zero and hasattr(pl_module, "rollout_config"):
            self._write_manifest(trainer, pl_module)

    def _write_manifest(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``manifest.json`` (`rl_lightning.rollout.replay.manifest`); a resumed run's must match the one there."""
        written = run_manifest(trainer, pl_module, pl_module.rollout_config)
        path = self.dirpath / MANIFEST
        if path.exists():
            there = json.loads(path.read_text())
            differ = [k for k in ("format", *MUST_MATCH) if there.get(k) != written[k]]
            if differ:
                raise ConfigError(f"{WHERE}: dirpath={self.dirpath} holds another run's dump ({', '.join(differ)} "
                                  "differ): choose another dirpath")
            return
        path.write_text(json.dumps(written, indent=1) + "\n")

    def _files(self) -> list[Path]:
        return dump_files(self.dirpath, self._rank, f"{WHERE}: dirpath")  # a stray name: one line at setup

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if isinstance(batch, dict) and "rollout" in batch:
            self.write(batch["rollout"], int(getattr(pl_module, "rollouts", 0)), trainer.global_step, "train")

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.validation and isinstance(batch, dict) and "rollout" in batch:
            self.write(batch["rollout"], int(getattr(pl_module, "rollouts", 0)), trainer.global_step, "val")

    def write(self, rollout: Any, number: int, step: int, split: str) -> None:
        """Append one JSON line per trajectory of `rollout` (rollout `number`, `step`, `split`) to this rank's file."""
        lines = "".join(json.dumps({
            "rollout": number, "step": step, "rank": self._rank, "split": split, "prompt_row": t.prompt.where,
            "messages": t.messages, "answer": t.prompt.answer, "reward": t.reward,
            "reward_components": t.reward_components, "completion_length": t.completion_length,
            "finished": t.finished, "turns": t.turns, **trajectory_record(t, i, rollout)}, default=str) + "\n"
            for i, t in enumerate(rollout.trajectories))
        path = self._current()
        with path.open("a") as f:
            f.write(lines)

    def _current(self) -> Path:
        path = self.dirpath / f"rollouts-rank{self._rank}-{self._number}.jsonl"
        if path.exists() and path.stat().st_size >= self.max_bytes:
            self._number += 1
            path = self.dirpath / f"rollouts-rank{self._rank}-{self._number}.jsonl"
            if self.keep_files:  # the new file is one of the kept
                written = self._files()
                for stale in written[: max(0, len(written) - (self.keep_files - 1))]:
                    stale.unlink()
        return path
