"""Reward for the demo arithmetic prompts: 1 when the completion's final number equals the answer, else 0."""

from rl_lightning.rewards.math import math_reward


def reward_fn(messages, answer):
    return math_reward(messages, answer)
