"""Reward environment for any reasoning-gym task (rows from a ``reasoning_gym:TASK`` data path or a JSONL file written by
``python -m rl_lightning.data.reasoning_gym``): the task's own scorer on the extracted answer (``correct``) and whether
the completion is the answer alone (``format``). Copy this file to write your own; see
`rl_lightning.rewards.reasoning_gym` for the extraction rules.
"""

from rl_lightning.rewards.reasoning_gym import reward_fn

__all__ = ["reward_fn"]
