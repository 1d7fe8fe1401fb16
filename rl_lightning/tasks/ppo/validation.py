"""PPO's validation: the rewards of held-out prompts, sampled by the rollout callback at ``rollout.val_temperature``.

Each validation step adds its rollout's sums (`rl_lightning.tasks.ppo.metrics.validation_record`) to its held-out
set's (one per validation dataloader, ``data.val_paths``); at the end of the validation the global means are logged
(`rl_lightning.tasks.ppo.metrics.validation_means`) and kept for the terminal.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_lightning.rollout.trajectory import Rollout
from rl_lightning.tasks.ppo import metrics


class HeldOutSums:
    """This rank's reward sums per held-out set, from a validation's first step to its end."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}  # (3 + components,) per validation dataloader
        self.component_names: list[str] = []

    def add(self, rollout: Rollout, dataloader_idx: int) -> None:
        """Add a held-out rollout's sums to its set's."""
        self.component_names = rollout.reward_names
        self.sums[dataloader_idx] = self.sums.get(dataloader_idx, 0) + metrics.validation_record(rollout)

    def log_means(self, task: Any) -> None:
        """Log ``val/reward``, ``val/completion_length``, ``val/reward/<component>`` (and per named set); reset.

        Means over every held-out trajectory (of all sets together: a set weighs by its trajectories); with named
        sets also ``val/<name>/...``, the same means over that set's trajectories. They are kept in
        ``task.validation_metrics`` (the terminal's, the sanity check's included). Nothing happens when no
        validation step ran.
        """
        sums, self.sums = self.sums, {}
        if not sums:
            return
        trainer = task.trainer
        # "": the single data.val_path; dataloaders given without the prompts DataModule are named by their index
        set_names = getattr(trainer.datamodule, "val_names", None) or (
            [""] if max(sums) == 0 else [str(i) for i in range(max(sums) + 1)])
        means = metrics.validation_means(task.groups, sums, self.component_names, set_names, task.device)
        task.validation_metrics = {k: float(v) for k, v in means.items()}
        if trainer.sanity_checking:  # Lightning drops sanity-check logs; keep the untrained policy's score
            for logger in trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in means.items()}, step=0)
        else:
            task.log_dict(means)
