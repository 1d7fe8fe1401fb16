"""`RolloutCallback`: before each training step, turn the batch's prompts into scored trajectories.

The engine samples ``responses_per_prompt`` completions per prompt (multi-turn through the environment's
``interact`` when ``max_turns`` > 1), the environment's ``reward_fn`` scores them, and the trajectories are attached to
the batch (``batch["trajectories"]``, grouped by prompt) for the PPO task's ``training_step``.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from rl_lightning.errors import ConfigError
from rl_lightning.rollout.engine import SamplingParams
from rl_lightning.rollout.env import load_environment
from rl_lightning.rollout.trajectory import rollout

ENGINES = ("hf",)


class RolloutCallback(L.Callback):
    """Generate and score trajectories for every training batch of prompts.

    Args:
        env_path: Python file defining ``reward_fn(messages, answer)`` (and optionally ``interact(messages)``).
        responses_per_prompt: completions sampled per prompt (the group size of group-baseline estimators).
        max_turns: assistant turns per conversation (> 1 needs ``interact``).
        temperature: sampling temperature (also used when the task recomputes log-probabilities).
        top_p: nucleus sampling threshold.
        top_k: top-k sampling (0 = off).
        max_new_tokens: tokens generated per turn.
        engine: ``hf`` (transformers generate on the policy).
        on_error: reward_fn failures: ``raise`` (stop, naming the prompt row) or ``zero`` (score 0 and count).
        seed: base seed of per-request sampling seeds (reproducible rollouts); None samples freshly.
    """

    def __init__(
        self,
        env_path: str,
        responses_per_prompt: int = 8,
        max_turns: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 256,
        engine: str = "hf",
        on_error: str = "raise",
        seed: int | None = 0,
    ) -> None:
        errors = []
        if responses_per_prompt < 1:
            errors.append(f"responses_per_prompt must be >= 1, got {responses_per_prompt}")
        if max_turns < 1:
            errors.append(f"max_turns must be >= 1, got {max_turns}")
        if engine not in ENGINES:
            errors.append(f"engine must be one of {', '.join(ENGINES)}, got '{engine}'")
        if temperature < 0 or max_new_tokens < 1:
            errors.append(f"temperature must be >= 0 and max_new_tokens >= 1, got {temperature}, {max_new_tokens}")
        if errors:
            raise ConfigError("; ".join(f"rollout callback: {e}" for e in errors))
        self.env = load_environment(env_path, on_error)
        if max_turns > 1 and self.env.interact is None:
            raise ConfigError(f"rollout callback: max_turns={max_turns} needs interact(messages) in {env_path}")
        self.responses_per_prompt, self.max_turns = responses_per_prompt, max_turns
        self.temperature, self.top_p, self.top_k, self.max_new_tokens = temperature, top_p, top_k, max_new_tokens
        self.engine_name, self.seed = engine, seed
        self.engine: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from rl_lightning.rollout.hf import HFEngine

        self.engine = HFEngine(pl_module.model, pl_module.tokenizer.pad_token_id)

    def sampling_params(self, step: int, rank: int) -> SamplingParams:
        seed = None if self.seed is None else self.seed + 1_000_003 * step + 7_919 * rank
        return SamplingParams(n=self.responses_per_prompt, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, max_new_tokens=self.max_new_tokens,
                              stop_token_ids=[self._stop_id], seed=seed)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, batch_idx: int
                             ) -> None:
        self._stop_id = pl_module.tokenizer.eos_token_id
        self.engine.wake()
        params = self.sampling_params(pl_module.rollouts, trainer.global_rank)
        batch["trajectories"] = rollout(self.engine, batch["prompts"], self.env, pl_module.tokenizer, params,
                                        self.max_turns)
        batch["group_size"] = self.responses_per_prompt
        batch["reward_failures"] = self.env.failures
        self.engine.sleep()
