"""The vLLM engine kinds' settings and builders: ``engine: {kind: vllm, ...}`` and ``{kind: vllm_process, ...}``.

`VLLMEngineConfig` is the colocated engine (`rl_lightning.engines.vllm.VLLMEngine`), `VLLMProcessEngineConfig` the
engine process (`rl_lightning.engines.process`, restarted by `rl_lightning.engines.restart`, shared across ranks by
`rl_lightning.engines.shared`); `rl_lightning.engines.registry` registers both. Each checks its own values at
construction, in one line naming ``model.rollout.engine.<key>``; the builders take the registry's `EngineContext` and
import vLLM when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_lightning.engines.process import DEFAULT_TIMEOUT_S
from rl_lightning.errors import ConfigError

KEY = "model.rollout.engine"  # as `rl_lightning.engines.registry.KEY` (the registry imports this module)
WEIGHT_SYNCS = ("auto", "full", "adapter")


def _memory_errors(c: Any) -> list[str]:
    """The checks of the keys both vLLM kinds take."""
    errors = []
    if c.weight_bucket_mb < 1 or (c.max_model_len is not None and c.max_model_len < 1):
        errors.append(f"{KEY}.weight_bucket_mb and max_model_len must be >= 1, got {c.weight_bucket_mb}, "
                      f"{c.max_model_len}")
    if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes < 1:
        errors.append(f"{KEY}.kv_cache_memory_bytes must be > 0 or null, got {c.kv_cache_memory_bytes}")
    if not 0 < c.gpu_memory_utilization <= 1:
        errors.append(f"{KEY}.gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
    return errors


@dataclass(frozen=True)
class VLLMEngineConfig:
    """``engine: {kind: vllm}``: vLLM colocated in the training processes (the keys: `EngineConfig`'s)."""

    kind: str = "vllm"
    tp_size: int = 1
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.3
    weight_bucket_mb: int = 512
    weight_sync: str = "auto"

    def __post_init__(self) -> None:
        errors = _memory_errors(self)
        if self.tp_size < 1:
            errors.append(f"{KEY}.tp_size must be >= 1, got {self.tp_size}")
        if self.weight_sync not in WEIGHT_SYNCS:
            errors.append(f"{KEY}.weight_sync must be one of {', '.join(WEIGHT_SYNCS)}, got {self.weight_sync!r}")
        if errors:
            raise ConfigError("; ".join(errors))


@dataclass(frozen=True)
class VLLMProcessEngineConfig:
    """``engine: {kind: vllm_process}``: vLLM in a process of its own (one engine, tensor-parallel size 1 for now)."""

    kind: str = "vllm_process"
    devices: list[int] | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    restarts: int = 2
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # vLLM's own default: the engine owns its GPU (nothing to share it with)
    weight_bucket_mb: int = 512

    def __post_init__(self) -> None:
        errors = _memory_errors(self)
        devices = self.devices
        if devices is not None and (len(devices) != 1 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)):
            errors.append(f"{KEY}.devices={devices} must list 1 GPU index >= 0 (e.g. [1]), or be null (the first GPU "
                          "the trainer does not use)")
        if not self.timeout_s > 0:
            errors.append(f"{KEY}.timeout_s must be > 0 (seconds), got {self.timeout_s}")
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, int) or self.restarts < 0:
            errors.append(f"{KEY}.restarts must be an integer >= 0 (0: a lost engine process stops the run), got "
                          f"{self.restarts!r}")
        if errors:
            raise ConfigError("; ".join(errors))


def build_vllm(settings: VLLMEngineConfig, context: Any) -> Any:
    """The colocated engine (with LoRA support when ``weight_sync`` resolves to adapter-only sync)."""
    from rl_lightning.engines.vllm import VLLMEngine, adapter_sync_rank, check_engine
    from rl_lightning.engines.weights import named_weights

    s, device_type = settings, context.device.type
    check_engine(context.model.config, s.tp_size, context.world_size, device_type)
    named_weights(context.model)  # fails now on a weight no engine could hold (a LoRA-trained tied head)
    lora_rank = adapter_sync_rank(context.model, s.weight_sync, device_type)
    return VLLMEngine(context.model_name, s.tp_size, _length(context), device_type, s.gpu_memory_utilization,
                      s.kv_cache_memory_bytes, lora_rank=lora_rank, rank=context.rank, local_rank=context.local_rank,
                      world_size=context.world_size)


def build_process(settings: VLLMProcessEngineConfig, context: Any) -> Any:
    """The engine process; with several trainer ranks, rank 0's, shared by all (`start_shared_engine`)."""
    from rl_lightning.engines.restart import RestartingEngine
    from rl_lightning.engines.vllm import check_engine
    from rl_lightning.engines.weights import named_weights

    s = settings
    check_engine(context.model.config, 1, context.world_size, context.device.type)
    named_weights(context.model)
    kwargs = dict(devices=context.devices, timeout_s=s.timeout_s, bucket_bytes=s.weight_bucket_mb << 20,
                  model_path=context.model_name, tensor_parallel_size=1, max_model_len=_length(context),
                  device_type=context.device.type, gpu_memory_utilization=s.gpu_memory_utilization,
                  kv_cache_memory_bytes=s.kv_cache_memory_bytes)
    if context.world_size == 1:
        return RestartingEngine(s.restarts, **kwargs)
    from rl_lightning.engines.shared import start_shared_engine

    # a peer waits for rank 0 through every restart rank 0 may take (each bounded by timeout_s)
    return start_shared_engine(lambda: RestartingEngine(s.restarts, **kwargs), s.timeout_s * (s.restarts + 2))


def _length(context: Any) -> int:
    if context.max_model_len is None:  # the rollout resolves it (or refuses the run) before building a vLLM kind
        raise ConfigError(f"{KEY}.max_model_len must be set: nothing derives it")
    return context.max_model_len
