"""Rollout settings (``model.rollout.*`` of the PPO task) and the `RolloutCallback` the task runs them with.

Before each training batch, the callback turns the batch's prompts into scored trajectories: the engine samples
``responses_per_prompt`` completions per prompt (multi-turn through the environment's ``interact`` when ``max_turns``
> 1), the environment's ``reward_fn`` scores them, and a `Rollout` is attached to the batch (``batch["rollout"]``) for
the task's ``training_step``.

The PPO task owns its rollout: it builds the callback from its ``rollout`` argument group and hands it to the Trainer
through ``configure_callbacks``, so ``--model.rollout.env_path my_env.py`` works from the command line and the
sampling temperature the task recomputes log-probabilities at is the one the engine sampled at. The callback reads
the task's policy interface only: ``model``, ``tokenizer``, ``model_name`` and ``rollouts`` (completed rollouts).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch

from rl_lightning.algorithms.dapo import GroupRefill, keep_groups, overlong_penalty
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.reductions import data_parallel_coords, data_parallel_sum
from rl_lightning.rewards.reward_model import RewardModelConfig
from rl_lightning.rollout.async_rollout import ThreadGenerator, async_errors, read_ahead
from rl_lightning.rollout.engine import SamplingParams
from rl_lightning.rollout.env import load_environment
from rl_lightning.rollout.pareto_archive import ParetoArchive
from rl_lightning.rollout.scoring import start_pool
from rl_lightning.rollout.trajectory import Rollout, rollout
from rl_lightning.rollout.vllm import INSTALL_HINT, vllm_available
from rl_lightning.rollout.weights import WeightSync, named_weights

ENGINES = ("hf", "vllm", "vllm_process")
VLLM_ENGINES = ("vllm", "vllm_process")
WEIGHT_SYNCS = ("auto", "full", "adapter")


@dataclass(frozen=True)
class RolloutConfig:
    """How trajectories are sampled and scored: ``model.rollout.*``.

    Args:
        env_path: Python file defining ``reward_fn(messages, answer)`` (and optionally ``interact(messages)``).
        responses_per_prompt: completions sampled per prompt (the group size of group-baseline estimators).
        max_turns: assistant turns per conversation (> 1 needs ``interact``).
        temperature: sampling temperature; the task recomputes old, reference and current log-probabilities at it.
        top_p: nucleus sampling threshold.
        top_k: top-k sampling (0 = off).
        max_new_tokens: tokens generated per turn.
        engine: ``hf`` (transformers generate on the policy itself: simple, slow) or ``vllm`` (a vLLM engine colocated
            in the training processes, fed the policy's weights after every optimizer step; see
            `rl_lightning.rollout.vllm`) or ``vllm_process`` (vLLM in a process of its own, not a trainer rank, fed
            full weights over a gloo group of its own: disaggregated generation, one training process for now; see
            `rl_lightning.rollout.engine_process`).
        engine_tp_size: ``vllm``: tensor-parallel size of each engine (independent of the trainer's parallelism;
            must divide the number of processes; consecutive ranks share an engine).
        max_model_len: ``vllm``: longest prompt + completion in tokens; default: ``data.max_prompt_length`` +
            ``max_new_tokens`` (single turn) or the model's ``max_position_embeddings`` (multi-turn).
        kv_cache_memory_bytes: ``vllm``: KV-cache size in bytes; on CPU it is always explicit (default 1 GiB), on GPU
            it overrides `gpu_memory_utilization` when set.
        gpu_memory_utilization: ``vllm`` on GPU: share of GPU memory the engine takes while awake (it sleeps while
            the trainer trains).
        weight_bucket_mb: ``vllm``: weights are gathered from their shards and sent in buckets of this many MiB.
        weight_sync: ``vllm``: what reaches the engine after each optimizer step: ``full`` (every weight; a LoRA
            policy's merged ``W + scaling * B @ A``), ``adapter`` (a LoRA policy only: the base weights once, then
            only the adapter, which vLLM applies itself) or ``auto`` (``adapter`` on GPU for a LoRA policy whose
            adapter vLLM can serve, else ``full``: on CPU vLLM's LoRA kernels slow generation more than the
            smaller sync saves).
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
        pareto_archive_size: keep the Pareto front of the rollouts' mean reward components, at most this many
            (evicting the least hypervolume contributor), log ``train/hypervolume`` and ``train/pareto_size`` and
            the MLflow table ``pareto_archive.json`` (see `rl_lightning.rollout.pareto_archive`); null: off. Needs
            >= 2 components in `reward_weights`.
        pareto_reference: hypervolume reference point per component (default 0.0 each: fixed, so hypervolumes
            compare across runs); set it below the lowest value a component can take, e.g. for negative rewards.
        val_temperature: validation sampling temperature (0: greedy).
        val_responses_per_prompt: completions per held-out prompt at validation (> 1 needs `val_temperature` > 0);
            their seeds stay the same across validations, so successive scores compare the same draws.
        reward_model: a reward model scoring every trajectory as one more reward component (served: ``url``; or an
            RM folder in the trainer process: ``path``), see `rl_lightning.rewards.reward_model.RewardModelConfig`.
        async_steps: 0: synchronous rollouts (each sampled by the policy it trains); 1: one-step-off-policy, rollout
            k+1 is generated (and scored) in the background while the trainer updates on rollout k, by the policy
            one update older (``vllm`` with ``engine_tp_size: 1``; the engine stays awake, so on GPU it keeps its
            memory while the trainer trains; pair it with the task's mismatch correction, ``model.correction``; see
            `rl_lightning.rollout.async_rollout`).

    Validation (``data.val_path``, or each named set of ``data.val_paths``) scores `val_responses_per_prompt`
    completions per held-out prompt (``val/reward``, the mean); with ``trainer.num_sanity_val_steps: -1`` the untrained policy's value is logged at step 0.
    """

    env_path: str
    responses_per_prompt: int = 8
    max_turns: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    engine: str = "hf"
    engine_tp_size: int = 1
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.3
    weight_bucket_mb: int = 512
    weight_sync: str = "auto"
    on_error: str = "raise"
    reward_workers: int | None = None
    reward_timeout_s: float | None = 60.0
    seed: int | None = 0
    filter_range: tuple[float, float] | None = None
    max_refill_rounds: int = 4
    overlong_cache_length: int | None = None
    mask_truncated: bool = False
    reward_weights: dict[str, float] | None = None
    reward_combination: str = "weighted_sum"
    reward_ideal: dict[str, float] | None = None
    pareto_archive_size: int | None = None
    pareto_reference: dict[str, float] | None = None
    val_temperature: float = 0.0
    val_responses_per_prompt: int = 1
    reward_model: RewardModelConfig | None = None
    async_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.reward_model, dict):  # from a checkpoint's hyperparameters
            object.__setattr__(self, "reward_model", RewardModelConfig(**self.reward_model))
        errors = []
        if self.val_temperature < 0 or self.val_responses_per_prompt < 1 or (self.val_temperature == 0 and
                                                                             self.val_responses_per_prompt > 1):
            errors.append(f"val_temperature must be >= 0 and val_responses_per_prompt >= 1 (1 when greedy), got "
                          f"{self.val_temperature}, {self.val_responses_per_prompt}")
        if self.responses_per_prompt < 1:
            errors.append(f"responses_per_prompt must be >= 1, got {self.responses_per_prompt}")
        if self.max_turns < 1:
            errors.append(f"max_turns must be >= 1, got {self.max_turns}")
        if self.engine not in ENGINES:
            errors.append(f"engine must be one of {', '.join(ENGINES)}, got '{self.engine}'")
        errors += _vllm_errors(self) + _pareto_errors(self) + async_errors(self)
        if self.temperature <= 0 or self.max_new_tokens < 1:
            errors.append(f"temperature must be > 0 (training samples) and max_new_tokens >= 1, got "
                          f"{self.temperature}, {self.max_new_tokens}")
        if self.filter_range is not None and not self.filter_range[0] < self.filter_range[1]:
            errors.append(f"filter_range must be (low, high) with low < high, got {self.filter_range}")
        if self.max_refill_rounds < 1:
            errors.append(f"max_refill_rounds must be >= 1, got {self.max_refill_rounds}")
        if self.overlong_cache_length is not None and not 0 < self.overlong_cache_length <= self.max_new_tokens:
            errors.append(f"overlong_cache_length must be in (0, max_new_tokens={self.max_new_tokens}], got "
                          f"{self.overlong_cache_length}")
        if (self.reward_workers is not None and self.reward_workers < 0) or (
                self.reward_timeout_s is not None and not self.reward_timeout_s > 0):
            errors.append(f"reward_workers must be >= 0 (0: inline) and reward_timeout_s > 0 or null, got "
                          f"{self.reward_workers}, {self.reward_timeout_s}")
        if errors:
            raise ConfigError("; ".join(f"model.rollout.{e}" for e in errors))

    @property
    def max_completion_tokens(self) -> int:
        """The generation budget of one trajectory: `max_new_tokens` per turn x `max_turns`."""
        return self.max_new_tokens * self.max_turns


class RolloutCallback(L.Callback):
    """Generate and score trajectories for every training (and validation) batch of prompts, as `config` says."""

    def __init__(self, config: RolloutConfig) -> None:
        self.config = c = config
        self.env = load_environment(c.env_path, c.on_error, weights=c.reward_weights, combination=c.reward_combination,
                                    ideal=c.reward_ideal, reward_model=c.reward_model)
        if c.max_turns > 1 and self.env.interact is None:
            raise ConfigError(f"model.rollout.max_turns={c.max_turns} needs interact(messages) in {c.env_path}")
        self.weight_sync: WeightSync | None = None
        self.adapter_sync = False  # set with the vLLM engine: LoRA adapter-only weight sync
        self.engine: Any = None
        self.refills = 0
        self.generator = ThreadGenerator() if c.async_steps else None  # one-step-off-policy rollouts
        self.pareto = None if c.pareto_archive_size is None else ParetoArchive(
            self.env.component_names, c.pareto_archive_size, c.pareto_reference)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        c = self.config
        if c.engine == "hf" and trainer.world_size > 1 and (c.filter_range is not None or c.max_turns > 1):
            # the sharded policy's forwards are collectives, and these loops decide per rank how often to generate
            raise ConfigError(f"model.rollout.engine=hf on {trainer.world_size} processes does not support dynamic "
                              f"sampling (filter_range={c.filter_range}) or multi-turn rollouts "
                              f"(max_turns={c.max_turns}) yet; use engine: vllm or one process")
        if self.env.scorer is None:
            self.env.scorer = start_pool(self.env.path, c.reward_workers, c.reward_timeout_s, trainer.num_devices)
        if self.env.reward_model is not None:  # the server answers (or the RM folder loads) before any training
            self.env.reward_model.start(pl_module.device)
        if c.engine == "vllm_process" and trainer.world_size > 1:
            raise ConfigError(f"model.rollout.engine=vllm_process serves one training process for now (got "
                              f"{trainer.world_size}): use engine: vllm (one colocated engine per rank)")
        if c.engine == "hf":
            from rl_lightning.rollout.hf import HFEngine

            self.engine = HFEngine(pl_module.model, pl_module.tokenizer.pad_token_id)
            return
        if self.engine is None:  # vLLM initialises once per process: a later fit reuses the engine
            self.engine = self._vllm_engine(trainer, pl_module)
        # a fresh fit always pushes its weights first (in adapter mode: the adapter; the engine keeps the base)
        self.weight_sync = WeightSync(c.weight_bucket_mb << 20, adapter=self.adapter_sync)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.generator is not None:  # an in-flight rollout is dropped (it still uses the reward workers)
            self.generator.close()
        if self.env.scorer is not None:  # the reward workers
            self.env.scorer.close()
            self.env.scorer = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def _vllm_engine(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        from rl_lightning.rollout.vllm import VLLMEngine, adapter_sync_rank, check_engine

        c = self.config
        device_type = trainer.strategy.root_device.type
        check_engine(pl_module.model.config, c.engine_tp_size, trainer.world_size, device_type)
        named_weights(pl_module.model)  # fails now on a weight no engine could hold (a LoRA-trained tied head)
        if c.engine == "vllm_process":  # full weights over its own group (adapter sync is refused at start-up)
            from rl_lightning.rollout.engine_process import EngineProcess

            self.adapter_sync = False
            return EngineProcess(model_path=pl_module.model_name, tensor_parallel_size=c.engine_tp_size,
                                 max_model_len=self._max_model_len(trainer, pl_module), device_type=device_type,
                                 gpu_memory_utilization=c.gpu_memory_utilization,
                                 kv_cache_memory_bytes=c.kv_cache_memory_bytes)
        lora_rank = adapter_sync_rank(pl_module.model, c.weight_sync, device_type)
        self.adapter_sync = lora_rank is not None
        return VLLMEngine(pl_module.model_name, c.engine_tp_size, self._max_model_len(trainer, pl_module),
                          device_type, c.gpu_memory_utilization, c.kv_cache_memory_bytes, lora_rank=lora_rank,
                          rank=trainer.global_rank, local_rank=trainer.local_rank, world_size=trainer.world_size)

    def _max_model_len(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        c = self.config
        if c.max_model_len is not None:
            return c.max_model_len
        limit = getattr(pl_module.model.config, "max_position_embeddings", None)
        prompt = getattr(getattr(trainer, "datamodule", None), "hparams", {}).get("max_prompt_length")
        if prompt is None or (c.max_turns > 1 and limit is not None):  # tool messages take room too
            if limit is None:
                raise ConfigError("model.rollout.max_model_len must be set: the model config has no "
                                  "max_position_embeddings and the data module no max_prompt_length")
            return limit
        needed = prompt + c.max_completion_tokens
        return needed if limit is None else min(needed, limit)

    def _prepare_engine(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Push the policy's weights into the engine unless no optimizer step happened since the last push (the HF
        engine samples from the policy itself), then wake it."""
        if self.weight_sync is not None:
            self.weight_sync(self.engine, pl_module.model, trainer.global_step)
        self.engine.wake()

    def sampling_params(self, step: int, prompts: list, stop_id: int, refill_round: int = 0) -> SamplingParams:
        """Per-prompt seeds from the rollout count and each prompt's dataset position, never the rank: a prompt
        samples the same completions whatever the parallel layout (dp=2 == dp=1)."""
        c = self.config
        seeds = None if c.seed is None else [c.seed + 1_000_003 * step + 7_919 * refill_round + p.index
                                             for p in prompts]
        return SamplingParams(n=c.responses_per_prompt, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=c.max_new_tokens, stop_token_ids=[stop_id], seeds=seeds)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, batch_idx: int
                             ) -> None:
        if self.generator is not None:
            self._async_rollout(trainer, pl_module, batch, batch_idx)
            return
        self._prepare_engine(trainer, pl_module)
        trajectories, metrics = self._sample(trainer, pl_module, batch["prompts"], pl_module.rollouts)
        batch["rollout"] = self._finish(trainer, pl_module, trajectories, metrics)
        self.engine.sleep()

    def _sample(self, trainer: L.Trainer, pl_module: L.LightningModule, prompts: list, index: int
                ) -> tuple[list, dict[str, float]]:
        """Rollout `index` of `prompts`, scored (and refilled): no collective, so it may run in the background."""
        start, self.env.reward_seconds = time.perf_counter(), 0.0
        tokenizer = pl_module.tokenizer
        params = self.sampling_params(index, prompts, tokenizer.eos_token_id)
        trajectories = self._generate(prompts, tokenizer, params)
        if self.config.filter_range is not None:
            trajectories = self._refill(trainer, pl_module, prompts, trajectories, index)
        return trajectories, {"rollout/generate_s": time.perf_counter() - start,  # sampling, scoring and refills
                              "rollout/reward_s": self.env.reward_seconds,  # scoring alone
                              "rollout/reward_timeouts": float(self.env.timeouts)}  # since the start

    def _async_rollout(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict, batch_idx: int) -> None:
        """Take rollout k (generated during step k-1), push the current weights, submit rollout k+1; see
        `rl_lightning.rollout.async_rollout`. The engine stays awake: the background generation runs during training."""
        index, prompts = pl_module.rollouts, batch["prompts"]
        finished = self.generator.take((index, *(p.index for p in prompts)))
        self._prepare_engine(trainer, pl_module)  # version `index`: no generation uses the engine now
        if finished is None:  # nothing read ahead (a fit's or an epoch's first batch): sampled now, up to date
            trajectories, metrics = self._sample(trainer, pl_module, prompts, index)
            version, waited = index, 0.0
        else:
            (trajectories, metrics), version, waited = finished.value, finished.version, finished.wait_s
        metrics.update({"rollout/staleness": float(index - version),  # policy updates between sampling and training
                        "rollout/wait_s": waited})  # the trainer's wait for the background rollout
        # the counters in the Rollout are read before the next rollout's generation can move them
        batch["rollout"] = self._finish(trainer, pl_module, trajectories, metrics)
        ahead = read_ahead(trainer, pl_module, batch_idx)
        if ahead is not None:
            self.generator.submit((index + 1, *(p.index for p in ahead)), index,
                                  lambda: self._sample(trainer, pl_module, ahead, index + 1))

    def _finish(self, trainer: L.Trainer, pl_module: L.LightningModule, trajectories: list,
                metrics: dict[str, float]) -> Rollout:
        if self.weight_sync is not None:
            metrics["rollout/weight_sync_s"] = self.weight_sync.seconds  # 0: skipped (no optimizer step)
            metrics["rollout/weight_sync_mb"] = self.weight_sync.stats.bytes / 2**20  # adapter sync: the adapter's
        if self.pareto is not None:
            metrics.update(self._track_pareto(trainer, pl_module, trajectories))
        return Rollout(trajectories, self.config.responses_per_prompt, self.env.component_names, self.env.failures,
                       self.refills, metrics)

    def _track_pareto(self, trainer: L.Trainer, pl_module: L.LightningModule, trajectories: list
                      ) -> dict[str, float]:
        """Offer this rollout's global component means to the Pareto archive; rank 0 rewrites the MLflow table when
        it changed. Every rank runs the same all-reduce and so holds the same archive."""
        names = self.pareto.names
        per_rank = torch.tensor([float(len(trajectories)), *(sum(t.reward_components[n] for t in trajectories)
                                                              for n in names)], dtype=torch.float64)
        count, *sums = data_parallel_sum(trainer, per_rank.to(pl_module.device)).cpu().tolist()
        if count > 0 and self.pareto.add([s / count for s in sums], pl_module.rollouts + 1, trainer.global_step):
            if trainer.is_global_zero:
                from lightning.pytorch.loggers import MLFlowLogger

                self.pareto.log_to([lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)])
        return self.pareto.metrics()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.pareto is None else {"pareto": self.pareto.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.pareto is not None and "pareto" in state_dict:
            self.pareto.load_state_dict(state_dict["pareto"])

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: dict,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        """Held-out prompts: `val_responses_per_prompt` completions each (multi-turn as in training), scored."""
        c = self.config
        if self.generator is not None:  # the background rollout (kept for the next training batch) uses the engine
            self.generator.idle()
        self._prepare_engine(trainer, pl_module)
        sampled = c.val_temperature > 0
        params = SamplingParams(n=c.val_responses_per_prompt, temperature=c.val_temperature,
                                top_p=c.top_p if sampled else 1.0, top_k=c.top_k if sampled else 0,
                                max_new_tokens=c.max_new_tokens, stop_token_ids=[pl_module.tokenizer.eos_token_id],
                                seeds=[(c.seed or 0) + 999_983 + p.index for p in batch["prompts"]])
        trajectories = rollout(self.engine, batch["prompts"], self.env, pl_module.tokenizer, params, c.max_turns)
        batch["rollout"] = Rollout(trajectories, c.val_responses_per_prompt, self.env.component_names,
                                   self.env.failures, self.refills)
        self.engine.sleep()

    def _generate(self, prompts: list, tokenizer: Any, params: SamplingParams) -> list:
        c = self.config
        trajectories = rollout(self.engine, prompts, self.env, tokenizer, params, c.max_turns)
        if c.overlong_cache_length is not None:
            lengths = torch.tensor([t.completion_length for t in trajectories])
            penalties = overlong_penalty(lengths, c.max_completion_tokens, c.overlong_cache_length)
            for t, penalty in zip(trajectories, penalties.tolist(), strict=True):
                t.reward += penalty
        if c.mask_truncated:
            for t in trajectories:
                if not t.finished:
                    t.completion_mask = [0] * len(t.completion_mask)
        return trajectories

    def _refill(self, trainer: L.Trainer, pl_module: L.LightningModule, prompts: list, trajectories: list,
                index: int) -> list:
        """DAPO dynamic sampling: keep informative groups, top up with freshly drawn prompts (a seeded stream per
        data-parallel rank and rollout) until the batch is full or the rounds run out; refill rounds are counted."""
        c = self.config
        group = c.responses_per_prompt
        buffer = GroupRefill(target=len(prompts), max_rounds=c.max_refill_rounds)
        pool = trainer.datamodule.prompts["train"]
        rng = random.Random((c.seed or 0) + 104_729 * index + data_parallel_coords(trainer)[0])
        while True:
            groups = [trajectories[i : i + group] for i in range(0, len(trajectories), group)]
            rewards = torch.tensor([t.reward for t in trajectories])
            buffer.add(groups, keep_groups(rewards, group, *c.filter_range))
            if buffer.exhausted:
                break
            self.refills += 1
            extra = rng.sample(pool, k=min(len(pool), len(prompts)))
            params = self.sampling_params(index, extra, pl_module.tokenizer.eos_token_id, buffer.rounds)
            trajectories = self._generate(extra, pl_module.tokenizer, params)
        return [t for kept in buffer.take() for t in kept]


def _pareto_errors(c: RolloutConfig) -> list[str]:
    names = sorted(c.reward_weights or {})
    if names and c.reward_model is not None:  # the reward model is one more component of the combination
        names = sorted({*names, c.reward_model.name})
    if c.pareto_archive_size is not None and (c.pareto_archive_size < 1 or len(names) < 2):
        return [f"pareto_archive_size={c.pareto_archive_size} needs a size >= 1 and >= 2 reward components in "
                f"reward_weights (got {names}); name the components in model.rollout.reward_weights or set "
                "pareto_archive_size: null"]
    if c.pareto_reference is not None and (sorted(c.pareto_reference) != names or not all(
            math.isfinite(v) for v in c.pareto_reference.values())):
        return [f"pareto_reference={c.pareto_reference} must give a finite value for each component of "
                f"reward_weights {names}"]
    return []


def _vllm_errors(c: RolloutConfig) -> list[str]:
    errors = []
    if c.engine_tp_size < 1 or c.weight_bucket_mb < 1 or (c.max_model_len is not None and c.max_model_len < 1):
        errors.append(f"engine_tp_size, weight_bucket_mb and max_model_len must be >= 1, got {c.engine_tp_size}, "
                      f"{c.weight_bucket_mb}, {c.max_model_len}")
    if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes < 1:
        errors.append(f"kv_cache_memory_bytes must be > 0 or null, got {c.kv_cache_memory_bytes}")
    if not 0 < c.gpu_memory_utilization <= 1:
        errors.append(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
    if c.weight_sync not in WEIGHT_SYNCS or (c.weight_sync == "adapter" and c.engine != "vllm"):  # not the process
        errors.append(f"weight_sync must be one of {', '.join(WEIGHT_SYNCS)} (adapter needs engine: vllm), got "
                      f"'{c.weight_sync}' with engine '{c.engine}'")
    if c.engine == "vllm_process" and c.engine_tp_size > 1:
        errors.append(f"engine=vllm_process runs one engine of engine_tp_size 1 for now, got {c.engine_tp_size}")
    if c.engine in VLLM_ENGINES and not vllm_available():
        errors.append(f"engine={c.engine} needs vllm, which is not installed; {INSTALL_HINT}, or set engine: hf")
    if c.engine == "vllm" and c.engine_tp_size > 1 and (c.max_turns > 1 or c.filter_range is not None):
        # the ranks of an engine generate together, but these loops decide per rank how often to generate
        errors.append(f"engine_tp_size={c.engine_tp_size} does not support multi-turn rollouts "
                      f"(max_turns={c.max_turns}) or dynamic sampling (filter_range={c.filter_range}) yet; use "
                      "engine_tp_size: 1")
    return errors
