"""Environments: what scores a trajectory and answers its tool calls.

- `environment`: a user's ``env_path`` file (``reward_fn(messages, answer)``, optionally ``interact(messages)``),
  loaded, checked at start-up and called for a whole rollout (`Environment`);
- `adapters`: standard environments as ``env_path`` (``verifiers:<taskset>`` in `verifiers`, ``openenv:<module>`` in
  `openenv`);
- `workers`: the pool of worker processes that runs the user's code, each call with a time limit.

May import: rewards, data, algorithms, compat.
"""
