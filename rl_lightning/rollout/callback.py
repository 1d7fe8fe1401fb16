"""`RolloutCallback`: before each training step, turn the batch's prompts into scored trajectories.

The engine samples ``responses_per_prompt`` completions per prompt (multi-turn through the environment's
``interact`` when ``max_turns`` > 1), the environment's ``reward_fn`` scores them, and the trajectories are attached to
the batch (``batch["trajectories"]``, grouped by prompt) for the PPO task's ``training_step``.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import torch

from rl_lightning.algorithms.dapo import GroupRefill, keep_groups, overlong_penalty
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
        filter_range: DAPO dynamic sampling: keep only prompt groups whose mean reward lies strictly inside
            (low, high), and refill the batch with more prompts (drawn from the training set) until it is full or
            `max_refill_rounds` rounds were tried; null disables.
        max_refill_rounds: generation rounds per rollout when filtering (the first included).
        overlong_cache_length: DAPO soft overlong punishment: completions longer than ``max_new_tokens -
            overlong_cache_length`` tokens lose up to 1 reward, linearly; null disables.
        mask_truncated: drop completions cut at `max_new_tokens` from the loss (DAPO's overlong filtering).
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
        filter_range: tuple[float, float] | None = None,
        max_refill_rounds: int = 4,
        overlong_cache_length: int | None = None,
        mask_truncated: bool = False,
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
        if filter_range is not None and not filter_range[0] < filter_range[1]:
            errors.append(f"filter_range must be (low, high) with low < high, got {filter_range}")
        if max_refill_rounds < 1:
            errors.append(f"max_refill_rounds must be >= 1, got {max_refill_rounds}")
        if overlong_cache_length is not None and not 0 < overlong_cache_length <= max_new_tokens:
            errors.append(f"overlong_cache_length must be in (0, max_new_tokens={max_new_tokens}], got "
                          f"{overlong_cache_length}")
        if errors:
            raise ConfigError("; ".join(f"rollout callback: {e}" for e in errors))
        self.env = load_environment(env_path, on_error)
        if max_turns > 1 and self.env.interact is None:
            raise ConfigError(f"rollout callback: max_turns={max_turns} needs interact(messages) in {env_path}")
        self.responses_per_prompt, self.max_turns = responses_per_prompt, max_turns
        self.temperature, self.top_p, self.top_k, self.max_new_tokens = temperature, top_p, top_k, max_new_tokens
        self.engine_name, self.seed = engine, seed
        self.filter_range, self.max_refill_rounds = filter_range, max_refill_rounds
        self.overlong_cache_length, self.mask_truncated = overlong_cache_length, mask_truncated
        self.engine: Any = None
        self.refills = 0

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
        trajectories = self._generate(batch["prompts"], pl_module.tokenizer, params)
        if self.filter_range is not None:
            trajectories = self._refill(trainer, pl_module, batch["prompts"], trajectories, params)
        batch["trajectories"] = trajectories
        batch["group_size"] = self.responses_per_prompt
        batch["reward_failures"] = self.env.failures
        batch["refills"] = self.refills
        self.engine.sleep()

    def _generate(self, prompts: list, tokenizer: Any, params: SamplingParams) -> list:
        trajectories = rollout(self.engine, prompts, self.env, tokenizer, params, self.max_turns)
        if self.overlong_cache_length is not None:
            lengths = torch.tensor([t.completion_length for t in trajectories])
            penalties = overlong_penalty(lengths, self.max_new_tokens * self.max_turns, self.overlong_cache_length)
            for t, penalty in zip(trajectories, penalties.tolist(), strict=True):
                t.reward += penalty
        if self.mask_truncated:
            for t in trajectories:
                if not t.finished:
                    t.completion_mask = [0] * len(t.completion_mask)
        return trajectories

    def _refill(self, trainer: L.Trainer, pl_module: L.LightningModule, prompts: list, trajectories: list,
                params: SamplingParams) -> list:
        """DAPO dynamic sampling: keep informative groups, top up with freshly drawn prompts (a seeded stream per
        rank and rollout) until the batch is full or the rounds run out; the count of refill rounds is logged."""
        group = self.responses_per_prompt
        buffer = GroupRefill(target=len(prompts), max_rounds=self.max_refill_rounds)
        pool = trainer.datamodule.prompts["train"]
        rng = random.Random((self.seed or 0) + 104_729 * pl_module.rollouts + trainer.global_rank)
        while True:
            groups = [trajectories[i : i + group] for i in range(0, len(trajectories), group)]
            rewards = torch.tensor([t.reward for t in trajectories])
            buffer.add(groups, keep_groups(rewards, group, *self.filter_range))
            if buffer.exhausted:
                break
            self.refills += 1
            extra = rng.sample(pool, k=min(len(pool), len(prompts)))
            params = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed
                                       + 31 * buffer.rounds})
            trajectories = self._generate(extra, pl_module.tokenizer, params)
        return [t for kept in buffer.take() for t in kept]
