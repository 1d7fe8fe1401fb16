"""Reward from a served reward model, called from ``reward_fn``: the RM task's export served by vLLM
(``vllm serve exports/rm --runner pooling --port 8000``), at the URL in ``RL_REWARD_MODEL_URL``.

One HTTP request per trajectory (in each reward worker); ``model.rollout.reward_model: {url: ...}`` scores a whole
rollout in batched requests instead, and is the better choice unless the score needs reshaping here.
"""

import os

from rl_lightning.rewards.reward_model import RewardModelClient

# module level: one client (and one tokenizer load) per process; it checks the server on first use
client = RewardModelClient(os.environ.get("RL_REWARD_MODEL_URL", "http://127.0.0.1:8000"), timeout_s=30, retries=2)


def reward_fn(messages, answer):
    return client.score([messages])[0]
