"""One thin LightningModule per task. Each orchestrates data → model → `rl_lightning.algorithms` → logging.

May import: rollout, data, parallel, models, memory, assets, algorithms.
"""

from rl_lightning.tasks.dpo import DPO
from rl_lightning.tasks.ppo import PPO
from rl_lightning.tasks.reward import RewardModel
from rl_lightning.tasks.sft import SFT

__all__ = ["DPO", "PPO", "SFT", "RewardModel"]
