"""Building the rollout callback's engine, its context length, its placement checks and its weight push.

The engine is the kind ``model.rollout.engine`` names (`rl_lightning.engines.registry`): this module turns the
Trainer and the task into the plain `EngineContext` its builder takes. The
`rl_lightning.rollout.callback.RolloutCallback` calls these with what they need (its config, the Trainer, the task);
nothing here keeps state.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from rl_lightning.engines.registry import EngineContext
from rl_lightning.engines.weights import WeightSync
from rl_lightning.errors import ConfigError
from rl_lightning.memory.phases import phase
from rl_lightning.rollout.config import RolloutConfig, engine_process_devices


def engine_process_placement(config: RolloutConfig, trainer: L.Trainer) -> list[int] | None:
    """Start-up checks of an engine in a process of its own (before any model loads): its GPUs, a layout it serves.

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
    settings = c.engine_settings
    return engine_process_devices(getattr(settings, "devices", None), device_type, count, trainer.device_ids,
                                  getattr(settings, "tp_size", 1))


def build_engine(config: RolloutConfig, trainer: L.Trainer, task: Any, device: torch.device,
                 devices: list[int] | None) -> tuple[Any, bool]:
    """The engine `config` names, for `task`'s policy, by its kind's builder.

    Args:
        config: the rollout settings.
        trainer: the fit's Trainer (device, ranks, the data module's prompt length).
        task: the PPO task (``model``, ``model_name``, ``tokenizer``).
        device: the strategy's root device (where the policy computes; under ``strategy.cpu_offload`` not the
            parameters' device).
        devices: the engine process's GPUs (`engine_process_placement`; kinds of their own process).

    Returns:
        The engine, and whether it takes adapter-only weight syncs (its ``adapter_sync`` attribute).
    """
    c, datamodule = config, getattr(trainer, "datamodule", None)
    length = (max_model_len(c, task.model.config, datamodule) if hasattr(c.engine_settings, "max_model_len")
              else context_limit(c, task.model.config, datamodule))
    context = EngineContext(task.model, task.model_name, task.tokenizer.pad_token_id, device,
                            trainer.global_rank, trainer.local_rank, trainer.world_size, length, devices)
    engine = c.engine_spec.build(c.engine_settings, context)
    return engine, bool(getattr(engine, "adapter_sync", False))


def max_model_len(config: RolloutConfig, model_config: Any, datamodule: Any) -> int:
    """The engine's longest prompt + completion: ``model.rollout.engine.max_model_len``, else derived.

    Single turn: the data module's ``max_prompt_length`` + the completion budget (capped by the model's
    ``max_position_embeddings``); multi-turn or no prompt length: the model's limit.
    """
    c = config
    given: int | None = getattr(c.engine_settings, "max_model_len", None)
    if given is not None:
        return given
    limit: int | None = getattr(model_config, "max_position_embeddings", None)
    prompt: int | None = getattr(datamodule, "hparams", {}).get("max_prompt_length")
    if prompt is None or (c.max_turns > 1 and limit is not None):  # tool messages take room too
        if limit is None:
            raise ConfigError("model.rollout.engine.max_model_len must be set: the model config has no "
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

    The push is skipped when no optimizer step happened since the last one (and with an engine that samples from the
    policy itself, ``hf``: no `weight_sync`).
    """
    with phase("rollout/weight_sync"):
        if weight_sync is not None:
            weight_sync(engine, model, step)
        engine.wake()
