"""Building the rollout callback's vLLM engine, its context length, its placement checks and its weight push.

The engine is the colocated one (``engine: vllm``) or the engine process (``engine: vllm_process``).

The `rl_lightning.rollout.callback.RolloutCallback` calls these with what they need (its config, the Trainer, the
task); nothing here keeps state.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from rl_lightning.engines.weights import WeightSync, named_weights
from rl_lightning.errors import ConfigError
from rl_lightning.memory.phases import phase
from rl_lightning.rollout.config import RolloutConfig, engine_process_devices


def engine_process_placement(config: RolloutConfig, trainer: L.Trainer) -> list[int] | None:
    """Start-up checks of ``engine: vllm_process`` (before any model loads): GPUs of its own, a layout it can serve.

    Several trainer ranks share the one engine process global rank 0 starts (`rl_lightning.engines.shared`):
    its GPUs are checked against rank 0's node.

    Returns:
        The engine process's GPUs (None off CUDA).

    Raises:
        ConfigError: one line naming the key, its value and the fix.
    """
    c = config
    device_type = trainer.strategy.root_device.type
    count = torch.cuda.device_count() if device_type == "cuda" else 0
    return engine_process_devices(c.engine_devices, device_type, count, trainer.device_ids, c.engine_tp_size)


def build_vllm_engine(config: RolloutConfig, trainer: L.Trainer, task: Any, engine_devices: list[int] | None
                      ) -> tuple[Any, bool]:
    """The vLLM engine `config` names, for `task`'s policy.

    Args:
        config: the rollout settings.
        trainer: the fit's Trainer (device type, ranks, the data module's prompt length).
        task: the PPO task (``model``, ``model_name``).
        engine_devices: the engine process's GPUs (`engine_process_placement`).

    Returns:
        The engine, and whether it takes adapter-only weight syncs (a LoRA policy on a colocated engine).
    """
    from rl_lightning.engines.vllm import VLLMEngine, adapter_sync_rank, check_engine

    c = config
    device_type = trainer.strategy.root_device.type
    check_engine(task.model.config, c.engine_tp_size, trainer.world_size, device_type)
    named_weights(task.model)  # fails now on a weight no engine could hold (a LoRA-trained tied head)
    length = max_model_len(c, task.model.config, getattr(trainer, "datamodule", None))
    if c.engine == "vllm_process":  # full weights over its own group (adapter sync is refused at start-up)
        return _engine_process(c, trainer, task.model_name, length, engine_devices), False
    lora_rank = adapter_sync_rank(task.model, c.weight_sync, device_type)
    return VLLMEngine(task.model_name, c.engine_tp_size, length, device_type, c.gpu_memory_utilization,
                      c.kv_cache_memory_bytes, lora_rank=lora_rank, rank=trainer.global_rank,
                      local_rank=trainer.local_rank, world_size=trainer.world_size), lora_rank is not None


def _engine_process(config: RolloutConfig, trainer: L.Trainer, model_path: str, length: int,
                    devices: list[int] | None) -> Any:
    """The engine process; with several trainer ranks, rank 0's, shared by all (`start_shared_engine`)."""
    from rl_lightning.engines.restart import RestartingEngine

    c = config
    kwargs = dict(devices=devices, timeout_s=c.engine_timeout_s, bucket_bytes=c.weight_bucket_mb << 20,
                  model_path=model_path, tensor_parallel_size=c.engine_tp_size, max_model_len=length,
                  device_type=trainer.strategy.root_device.type, gpu_memory_utilization=c.gpu_memory_utilization,
                  kv_cache_memory_bytes=c.kv_cache_memory_bytes)
    if trainer.world_size == 1:
        return RestartingEngine(c.engine_restarts, **kwargs)
    from rl_lightning.engines.shared import start_shared_engine

    # a peer waits for rank 0 through every restart rank 0 may take (each bounded by engine_timeout_s)
    return start_shared_engine(lambda: RestartingEngine(c.engine_restarts, **kwargs),
                               c.engine_timeout_s * (c.engine_restarts + 2))


def max_model_len(config: RolloutConfig, model_config: Any, datamodule: Any) -> int:
    """The engine's longest prompt + completion: ``model.rollout.max_model_len``, else derived.

    Single turn: the data module's ``max_prompt_length`` + the completion budget (capped by the model's
    ``max_position_embeddings``); multi-turn or no prompt length: the model's limit.
    """
    c = config
    if c.max_model_len is not None:
        return c.max_model_len
    limit: int | None = getattr(model_config, "max_position_embeddings", None)
    prompt: int | None = getattr(datamodule, "hparams", {}).get("max_prompt_length")
    if prompt is None or (c.max_turns > 1 and limit is not None):  # tool messages take room too
        if limit is None:
            raise ConfigError("model.rollout.max_model_len must be set: the model config has no "
                              "max_position_embeddings and the data module no max_prompt_length")
        return limit
    needed = prompt + c.max_completion_tokens
    return needed if limit is None else min(needed, limit)


def context_limit(config: RolloutConfig, model_config: Any, datamodule: Any) -> int | None:
    """The tokens a multi-turn conversation may reach (`max_model_len`); None for one turn or where nothing says."""
    if config.max_turns == 1:
        return None
    try:
        return max_model_len(config, model_config, datamodule)
    except ConfigError:  # the HF engine has no hard limit; a vLLM engine has refused this at start-up already
        return None


def prepare_engine(engine: Any, weight_sync: WeightSync | None, model: torch.nn.Module, step: int) -> None:
    """Push the policy's weights into the engine, then wake it.

    The push is skipped when no optimizer step happened since the last one (and with the HF engine, which samples
    from the policy itself: no `weight_sync`).
    """
    with phase("rollout/weight_sync"):
        if weight_sync is not None:
            weight_sync(engine, model, step)
        engine.wake()
