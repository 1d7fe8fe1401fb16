"""Rollouts: the PPO task's callback that turns prompts into scored trajectories, and how it schedules them.

- `callback`: `RolloutCallback`, the per-step flow (wake the engine, push weights, generate, score, sleep);
  `config`: its ``model.rollout.*`` settings; `engine_setup`: building the engine those settings name;
- `trajectory`: prompts to trajectories (single- or multi-turn, token-in/token-out); `refill`: DAPO dynamic sampling
  across ranks; `replay`: the rollout dump's format and its replay; `pareto_archive`: the run's Pareto archive;
- `schedule`: the scheduling policies (synchronous, one-step-off) the callback composes; `async_rollout`: one-step-off
  rollouts' generator; `engine_thread`: the rank's engine thread (its device, stream, events); `inflight`: in-flight
  weight updates.

May import: envs, rewards, engines, data, parallel, memory, algorithms, compat.
"""
