"""`RolloutCallback`: before each training step, turn the batch's prompts into scored trajectories.

The engine samples ``responses_per_prompt`` completions per prompt (multi-turn through the environment's
``interact`` when ``max_turns`` > 1), the environment's ``reward_fn`` scores them, and the trajectories are attached to
the batch (``batch["trajectories"]``, grouped by prompt) for the PPO task's ``training_step``.
"""

from __future__ import annotations

import random
import time
from typing import Any

import lightning as L
import torch

from rl_lightning.algorithms.dapo import GroupRefill, keep_groups, overlong_penalty
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.engine import SamplingParams
from rl_lightning.rollout.env import load_environment
from rl_lightning.rollout.scoring import start_pool
from rl_lightning.rollout.trajectory import rollout
from rl_lightning.rollout.vllm import INSTALL_HINT, vllm_available
from rl_lightning.rollout.weights import WeightSync

ENGINES = ("hf", "vllm")


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
        engine: ``hf`` (transformers generate on the policy itself: simple, slow) or ``vllm`` (a vLLM engine colocated
            in the training processes, fed the policy's weights after every optimizer step; see
            `rl_lightning.rollout.vllm`).
        engine_tp_size: ``vllm``: tensor-parallel size of each engine (independent of the trainer's parallelism;
            must divide the number of processes; consecutive ranks share an engine).
        max_model_len: ``vllm``: longest prompt + completion in tokens; default: ``data.max_prompt_length`` +
            ``max_new_tokens`` (single turn) or the model's ``max_position_embeddings`` (multi-turn).
        kv_cache_memory_bytes: ``vllm``: KV-cache size in bytes; on CPU it is always explicit (default 1 GiB), on GPU
            it overrides `gpu_memory_utilization` when set.
        gpu_memory_utilization: ``vllm`` on GPU: share of GPU memory the engine takes while awake (it sleeps while
            the trainer trains).
        weight_bucket_mb: ``vllm``: weights are gathered from their shards and sent in buckets of this many MiB.
        on_error: reward_fn failures (exceptions, non-finite values, timeouts): ``raise`` (stop, naming the prompt
            row) or ``zero`` (score 0 and count).
        reward_workers: processes scoring trajectories in parallel, each importing `env_path` (default: the CPUs
            shared among this node's training processes, at most 16); 0 scores in the trainer process, without a
            time limit (for debugging).
        reward_timeout_s: per-call limit of ``reward_fn`` in seconds with `reward_workers` > 0 (the worker is killed
            and replaced, the call counts as a failure under `on_error`); null: no limit.
        seed: base seed of per-request sampling seeds (reproducible rollouts); None samples freshly.
        filter_range: DAPO dynamic sampling: keep only prompt groups whose mean reward lies strictly inside
            (low, high), and refill the batch with more prompts (drawn from the training set) until it is full or
            `max_refill_rounds` rounds were tried; null disables.
        max_refill_rounds: generation rounds per rollout when filtering (the first included).
        overlong_cache_length: DAPO soft overlong punishment: completions longer than ``max_new_tokens -
            overlong_cache_length`` tokens lose up to 1 reward, linearly; null disables.
        mask_truncated: drop completions cut at `max_new_tokens` from the loss (DAPO's overlong filtering).
        reward_weights: for a ``reward_fn`` returning named components (a dict): one weight per component; each
            component is logged as ``train/reward/<name>``.
        reward_combination: ``weighted_sum`` or ``tchebycheff`` (-max_k w_k |ideal_k - r_k|).
        reward_ideal: Tchebycheff ideal point per component (default 1.0 each).

        val_temperature: validation sampling temperature (0: greedy).
        val_responses_per_prompt: completions per held-out prompt at validation (> 1 needs `val_temperature` > 0);
            their seeds stay the same across validations, so successive scores compare the same draws.

    Validation (``data.val_path``) scores `val_responses_per_prompt` completions per held-out prompt (``val/reward``,
    the mean); with ``trainer.num_sanity_val_steps: -1`` the untrained policy's value is logged at step 0.
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
        engine_tp_size: int = 1,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.3,
        weight_bucket_mb: int = 512,
        on_error: str = "raise",
        reward_workers: int | None = None,
        reward_timeout_s: float | None = 60.0,
        seed: int | None = 0,
        filter_range: tuple[float, float] | None = None,
        max_refill_rounds: int = 4,
        overlong_cache_length: int | None = None,
        mask_truncated: bool = False,
        reward_weights: dict[str, float] | None = None,
        reward_combination: str = "weighted_sum",
        reward_ideal: dict[str, float] | None = None,
        val_temperature: float = 0.0,
        val_responses_per_prompt: int = 1,
    ) -> None:
        errors = []
        if val_temperature < 0 or val_responses_per_prompt < 1 or (val_temperature == 0 and
                                                                   val_responses_per_prompt > 1):
            errors.append(f"val_temperature must be >= 0 and val_responses_per_prompt >= 1 (1 when greedy), got "
                          f"{val_temperature}, {val_responses_per_prompt}")
        if responses_per_prompt < 1:
            errors.append(f"responses_per_prompt must be >= 1, got {responses_per_prompt}")
        if max_turns < 1:
            errors.append(f"max_turns must be >= 1, got {max_turns}")
        if engine not in ENGINES:
            errors.append(f"engine must be one of {', '.join(ENGINES)}, got '{engine}'")
        errors += _vllm_errors(engine, engine_tp_size, max_model_len, kv_cache_memory_bytes, gpu_memory_utilization,
                               weight_bucket_mb, max_turns, filter_range)
        if temperature < 0 or max_new_tokens < 1:
            errors.append(f"temperature must be >= 0 and max_new_tokens >= 1, got {temperature}, {max_new_tokens}")
        if filter_range is not None and not filter_range[0] < filter_range[1]:
            errors.append(f"filter_range must be (low, high) with low < high, got {filter_range}")
        if max_refill_rounds < 1:
            errors.append(f"max_refill_rounds must be >= 1, got {max_refill_rounds}")
        if overlong_cache_length is not None and not 0 < overlong_cache_length <= max_new_tokens:
            errors.append(f"overlong_cache_length must be in (0, max_new_tokens={max_new_tokens}], got "
                          f"{overlong_cache_length}")
        if (reward_workers is not None and reward_workers < 0) or (reward_timeout_s is not None and
                                                                   not reward_timeout_s > 0):
            errors.append(f"reward_workers must be >= 0 (0: inline) and reward_timeout_s > 0 or null, got "
                          f"{reward_workers}, {reward_timeout_s}")
        if errors:
            raise ConfigError("; ".join(f"rollout callback: {e}" for e in errors))
        self.env = load_environment(env_path, on_error, weights=reward_weights, combination=reward_combination,
                                    ideal=reward_ideal)
        if max_turns > 1 and self.env.interact is None:
            raise ConfigError(f"rollout callback: max_turns={max_turns} needs interact(messages) in {env_path}")
        self.responses_per_prompt, self.max_turns = responses_per_prompt, max_turns
        self.temperature, self.top_p, self.top_k, self.max_new_tokens = temperature, top_p, top_k, max_new_tokens
        self.engine_name, self.seed = engine, seed
        self.engine_tp_size, self.max_model_len, self.weight_bucket_mb = engine_tp_size, max_model_len, weight_bucket_mb
        self.kv_cache_memory_bytes, self.gpu_memory_utilization = kv_cache_memory_bytes, gpu_memory_utilization
        self.weight_sync: WeightSync | None = None
        self.filter_range, self.max_refill_rounds = filter_range, max_refill_rounds
        self.overlong_cache_length, self.mask_truncated = overlong_cache_length, mask_truncated
        self.val_temperature, self.val_responses_per_prompt = val_temperature, val_responses_per_prompt
        self.reward_workers, self.reward_timeout_s = reward_workers, reward_timeout_s
        self.engine: Any = None
        self.refills = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.env.scorer is None:
            self.env.scorer = start_pool(self.env.path, self.reward_workers, self.reward_timeout_s, trainer.num_devices)
        if self.engine_name == "hf":
            from rl_lightning.rollout.hf import HFEngine

            self.engine = HFEngine(pl_module.model, pl_module.tokenizer.pad_token_id)
            return
        if self.engine is None:  # vLLM initialises once per process: a later fit reuses the engine
            self.engine = self._vllm_engine(trainer, pl_module)
        self.weight_sync = WeightSync(self.weight_bucket_mb << 20)  # a fresh fit always pushes its weights first

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.env.scorer is not None:  # the reward workers
            self.env.scorer.close()
            self.env.scorer = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def _vllm_engine(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        from rl_lightning.rollout.vllm import VLLMEngine, check_engine

        device_type = trainer.strategy.root_device.type
        check_engine(pl_module.model.config, self.engine_tp_size, trainer.world_size, device_type)
        return VLLMEngine(pl_module.hparams.model_name, self.engine_tp_size, self._max_model_len(trainer, pl_module),
                          device_type, self.gpu_memory_utilization, self.kv_cache_memory_bytes,
                          rank=trainer.global_rank, local_rank=trainer.local_rank, world_size=trainer.world_size)

    def _max_model_len(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        limit = getattr(pl_module.model.config, "max_position_embeddings", None)
        prompt = getattr(getattr(trainer, "datamodule", None), "hparams", {}).get("max_prompt_length")
        if prompt is None or (self.max_turns > 1 and limit is not None):  # tool messages take room too
            if limit is None:
                raise ConfigError("rollout callback: set max_model_len (the model config has no "
                                  "max_position_embeddings and the data module no max_prompt_length)")
            return limit
        needed = prompt + self.max_new_tokens * self.max_turns
        return needed if limit is None else min(needed, limit)

    def _prepare_engine(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Push the policy's weights into the engine unless no optimizer step happened since the last push (the HF
        engine samples from the policy itself), then wake it."""
        if self.weight_sync is not None:
            self.weight_sync(self.engine, pl_module.model, trainer.global_step)
        self.engine.wake()

    def sampling_params(self, step: int, prompts: list, refill_round: int = 0) -> SamplingParams:
        """Per-prompt seeds from the rollout count and each prompt's dataset position, never the rank: a prompt
        samples the same completions whatever the parallel layout (dp=2 == dp=1)."""
        seeds = None if self.seed is None else [self.seed + 1_000_003 * step + 7_919 * refill_round + p.index
                                                for p in prompts]
        return SamplingParams(n=self.responses_per_prompt, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, max_new_tokens=self.max_new_tokens,
                              stop_token_ids=[self._stop_id], seeds=seeds)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, batch_idx: int
                             ) -> None:
        self._stop_id = pl_module.tokenizer.eos_token_id
        self._prepare_engine(trainer, pl_module)
        start, self.env.reward_seconds = time.perf_counter(), 0.0
        params = self.sampling_params(pl_module.rollouts, batch["prompts"])
        trajectories = self._generate(batch["prompts"], pl_module.tokenizer, params)
        if self.filter_range is not None:
            trajectories = self._refill(trainer, pl_module, batch["prompts"], trajectories)
        pl_module.log("rollout/generate_s", time.perf_counter() - start)  # sampling, scoring and refills
        pl_module.log("rollout/reward_s", self.env.reward_seconds)  # scoring alone
        pl_module.log("rollout/reward_timeouts", float(self.env.timeouts))  # since the start
        if self.weight_sync is not None:
            pl_module.log("rollout/weight_sync_s", self.weight_sync.seconds)  # 0: skipped (no optimizer step)
        batch["trajectories"] = trajectories
        batch["group_size"] = self.responses_per_prompt
        batch["reward_failures"] = self.env.failures
        batch["refills"] = self.refills
        batch["reward_names"] = self.env.component_names
        self.engine.sleep()

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        """Held-out prompts: `val_responses_per_prompt` completions each (multi-turn as in training), scored."""
        self._stop_id = pl_module.tokenizer.eos_token_id
        self._prepare_engine(trainer, pl_module)
        sampled = self.val_temperature > 0
        params = SamplingParams(n=self.val_responses_per_prompt, temperature=self.val_temperature,
                                top_p=self.top_p if sampled else 1.0, top_k=self.top_k if sampled else 0,
                                max_new_tokens=self.max_new_tokens, stop_token_ids=[self._stop_id],
                                seeds=[(self.seed or 0) + 999_983 + p.index for p in batch["prompts"]])
        batch["trajectories"] = rollout(self.engine, batch["prompts"], self.env, pl_module.tokenizer, params,
                                        self.max_turns)
        batch["reward_names"] = self.env.component_names
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

    def _refill(self, trainer: L.Trainer, pl_module: L.LightningModule, prompts: list, trajectories: list) -> list:
        """DAPO dynamic sampling: keep informative groups, top up with freshly drawn prompts (a seeded stream per
        rank and rollout) until the batch is full or the rounds run out; the count of refill rounds is logged."""
        group = self.responses_per_prompt
        buffer = GroupRefill(target=len(prompts), max_rounds=self.max_refill_rounds)
        pool = trainer.datamodule.prompts["train"]
        rng = random.Random((self.seed or 0) + 104_729 * pl_module.rollouts + data_parallel_rank(trainer))
        while True:
            groups = [trajectories[i : i + group] for i in range(0, len(trajectories), group)]
            rewards = torch.tensor([t.reward for t in trajectories])
            buffer.add(groups, keep_groups(rewards, group, *self.filter_range))
            if buffer.exhausted:
                break
            self.refills += 1
            extra = rng.sample(pool, k=min(len(pool), len(prompts)))
            params = self.sampling_params(pl_module.rollouts, extra, buffer.rounds)
            trajectories = self._generate(extra, pl_module.tokenizer, params)
        return [t for kept in buffer.take() for t in kept]


def data_parallel_rank(trainer: L.Trainer) -> int:
    """The rank among ranks that see different prompts: context- and tensor-parallel peers share prompts, so they must
    share sampling seeds too (identical trajectories)."""
    dp_mesh = getattr(trainer.strategy, "dp_mesh", None)
    return trainer.global_rank if dp_mesh is None else dp_mesh.get_local_rank()


def _vllm_errors(engine: str, tp_size: int, max_model_len: int | None, kv_cache_memory_bytes: int | None,
                 gpu_memory_utilization: float, weight_bucket_mb: int, max_turns: int,
                 filter_range: tuple[float, float] | None) -> list[str]:
    errors = []
    if tp_size < 1 or weight_bucket_mb < 1 or (max_model_len is not None and max_model_len < 1):
        errors.append(f"engine_tp_size, weight_bucket_mb and max_model_len must be >= 1, got {tp_size}, "
                      f"{weight_bucket_mb}, {max_model_len}")
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 1:
        errors.append(f"kv_cache_memory_bytes must be > 0 or null, got {kv_cache_memory_bytes}")
    if not 0 < gpu_memory_utilization <= 1:
        errors.append(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if engine == "vllm" and not vllm_available():
        errors.append(f"engine=vllm needs vllm, which is not installed; {INSTALL_HINT}, or set engine: hf")
    if engine == "vllm" and tp_size > 1 and (max_turns > 1 or filter_range is not None):
        # the ranks of an engine generate together, but these loops decide per rank how often to generate
        errors.append(f"engine_tp_size={tp_size} does not support multi-turn rollouts (max_turns={max_turns}) or "
                      f"dynamic sampling (filter_range={filter_range}) yet; use engine_tp_size: 1")
    return errors
