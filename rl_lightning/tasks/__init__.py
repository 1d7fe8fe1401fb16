"""One thin LightningModule per task. Each orchestrates data → model → `rl_lightning.algorithms` → logging."""

from rl_lightning.tasks.sft import SFT

__all__ = ["SFT"]
