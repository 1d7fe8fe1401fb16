"""Reward for the RL demo: two components, combined by the recipe's ``reward_weights``.

- ``correct``: 1 when the completion's final number equals the answer (`rl_lightning.rewards.math.math_reward`);
- ``format``: 1 when the completion is the bare number and nothing else, as the system prompt asks.

The warm-started demo model answers in two styles (``7`` and ``The answer is 7.``); GRPO learns the asked-for one,
which carries over to held-out questions, while keeping the answers right.
"""

import re

from rl_lightning.rewards.math import math_reward

BARE_NUMBER = re.compile(r"-?\d+")


def reward_fn(messages, answer):
    text = messages[-1]["content"].strip()
    return {"correct": math_reward(messages, answer), "format": float(BARE_NUMBER.fullmatch(text) is not None)}


reward_fn.answer_types = math_reward.answer_types  # rows with another answer type: one line at start-up
