"""Engine kinds: the names ``model.rollout.engine`` takes, each with its settings, its builder and what it can do.

An engine kind is an `EngineSpec`: its settings dataclass (a ``kind`` field and the keys the kind takes, with their
defaults and their own checks), a builder ``(settings, EngineContext) -> engine`` and its traits, which the rest of
the code asks instead of comparing names (`needs_vllm`, `own_process`, `on_policy`, `adapter_sync`,
`tensor_parallel`, `async_rollout`, `inflight`, `memory`). Adding an engine is one module (its settings and its
builder) and one line, ``register(EngineSpec(...))``, here for the built-in kinds (`_BUILT_IN`) or in the user's
own module (``tests/engines/test_registry.py`` registers a toy engine and trains a GRPO step with it).

How the group is parsed: ``model.rollout.engine`` is typed ``EngineConfig | str``. `EngineConfig` is one flat
dataclass, ``kind`` plus every key a built-in kind takes, each unset (None) by default, so jsonargparse parses
``engine: {kind: vllm, tp_size: 2}``, ``--model.rollout.engine.kind vllm`` and overrides of one key after a config
file as it parses any dataclass (``--model.rollout.engine.help`` lists the keys and the kinds that take each), and the
string covers the shorthand ``engine: vllm``. `resolve` then turns any of these (or a checkpoint's dict, or a kind's
settings given in Python) into the kind's own settings, refusing a key the kind does not take in one line naming
the key, the kind and the kinds that take it. A union of one dataclass per kind was not used: jsonargparse rebuilds a
union member from its defaults when one of its keys is overridden on the command line after a config file set the
group, silently dropping the file's other keys. A kind registered outside the package takes the keys of
`EngineConfig` its settings declare; keys of its own are given in Python (``RolloutConfig(engine=ToySettings(...))``).

Nothing here imports an engine: builders import theirs when called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rl_lightning.errors import ConfigError

KEY = "model.rollout.engine"


@dataclass(frozen=True)
class EngineConfig:
    """The ``model.rollout.engine`` group: a kind and its keys (a key the kind does not take is refused).

    Args:
        kind: ``hf`` (transformers generate on the policy itself: simple, slow), ``vllm`` (vLLM colocated in the
            training processes, fed the policy's weights after every optimizer step) or ``vllm_process`` (vLLM in a
            process of its own, fed full weights over a group of its own; several trainer ranks share the one
            global rank 0 starts), or a kind registered with `rl_lightning.engines.registry.register`. The
            shorthand ``engine: vllm`` is the kind with its defaults. Unset: ``hf``.
        tp_size: ``vllm``, ``vllm_process``: tensor-parallel size of each engine (independent of the trainer's
            parallelism; must divide the number of processes; consecutive ranks share an engine). Default 1.
        max_model_len: ``vllm``, ``vllm_process``: longest prompt + completion in tokens; default: the data's
            ``max_prompt_length`` + the completion budget (single turn) or the model's ``max_position_embeddings``.
        kv_cache_memory_bytes: ``vllm``, ``vllm_process``: KV-cache size in bytes; on CPU it is always explicit
            (default 1 GiB), on GPU it overrides `gpu_memory_utilization` when set.
        gpu_memory_utilization: ``vllm``, ``vllm_process`` on GPU: share of GPU memory the engine takes while awake
            (the colocated one sleeps while the trainer trains). Default 0.3 for ``vllm`` (it shares the trainer's
            GPU), 0.9 for ``vllm_process`` (vLLM's own default: the engine owns its GPU).
        weight_bucket_mb: ``vllm``, ``vllm_process``: weights are gathered and sent in buckets of this many MiB.
            Default 512.
        weight_sync: ``vllm``: what reaches the engine after each optimizer step: ``full`` (every weight; a LoRA
            policy's merged weights), ``adapter`` (a LoRA policy: the base once, then only the adapter) or ``auto``
            (``adapter`` on GPU for a LoRA policy vLLM can serve, else ``full``). Default ``auto``.
        devices: ``vllm_process`` on GPU: the engine process's GPUs, numbered as the trainer sees them (one per
            `tp_size` rank). Default: the first GPUs the trainer does not use.
        timeout_s: ``vllm_process``: the longest wait for the engine process (start, a generate, a weight load,
            its close) before it is stopped with a one-line error. Default 600.
        restarts: ``vllm_process``: how many times a lost engine process is replaced by a fresh one (given the
            weights the lost one held) before the run stops. Default 2.
    """

    kind: str | None = None
    tp_size: int | None = None
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    weight_bucket_mb: int | None = None
    weight_sync: str | None = None
    devices: list[int] | None = None
    timeout_s: float | None = None
    restarts: int | None = None


@dataclass(frozen=True)
class EngineContext:
    """What a builder gets: the policy and where the trainer runs, as plain values (no Trainer, no task).

    Args:
        model: the policy (a transformers causal LM, possibly LoRA-wrapped and sharded).
        model_name: where the policy was loaded from (an engine of its own loads it too).
        pad_token_id: the tokenizer's padding id.
        device: the strategy's root device (where the policy computes).
        rank: this process's global rank.
        local_rank: its rank on its node.
        world_size: the training processes.
        max_model_len: the longest prompt + completion (resolved from ``max_model_len`` or derived; None where
            nothing says and the kind needs no limit).
        devices: the engine process's GPUs (kinds with `EngineSpec.own_process`; None off CUDA).
    """

    model: Any
    model_name: str
    pad_token_id: int
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    max_model_len: int | None = None
    devices: list[int] | None = None


@dataclass(frozen=True)
class EngineSpec:
    """One engine kind.

    Args:
        kind: its ``model.rollout.engine`` name.
        config: its settings dataclass (a ``kind`` field defaulting to `kind`, then the keys it takes).
        build: ``(settings, EngineContext) -> engine`` (a `rl_lightning.engines.protocol.RolloutEngine`; one that
            takes adapter-only weight syncs says so with an ``adapter_sync = True`` attribute).
        needs_vllm: the kind needs vLLM installed (checked at start-up, not for a replay).
        own_process: it runs in a process of its own: GPUs of its own, nothing on the trainer's devices; several
            trainer ranks share it, so they generate in lockstep over its ``group``.
        on_policy: it samples with the policy module itself: no weight push, and under a sharded policy its forwards
            are collectives (every rank generates equally often).
        adapter_sync: it can take adapter-only weight syncs (``weight_sync: adapter``).
        tensor_parallel: it can run with ``tp_size`` > 1.
        async_rollout: it can generate in the background (``async_steps: 1``): no collective in its generate.
        inflight: it can take new weights between segments of a generation (``inflight_segment_tokens``).
        memory: what the trainer's memory plan counts for it: ``policy`` (the policy's KV cache), ``vllm`` (a
            colocated vLLM engine), ``process`` (an engine process: a bucket of gathered weights being sent) or
            ``none`` (nothing on the trainer's devices).
    """

    kind: str
    config: type
    build: Callable[[Any, EngineContext], Any]
    needs_vllm: bool = False
    own_process: bool = False
    on_policy: bool = False
    adapter_sync: bool = False
    tensor_parallel: bool = False
    async_rollout: bool = False
    inflight: bool = False
    memory: Literal["policy", "vllm", "process", "none"] = "none"


_SPECS: dict[str, EngineSpec] = {}


def register(spec: EngineSpec) -> EngineSpec:
    """Make `spec.kind` a name ``model.rollout.engine`` takes (registering a name again replaces it)."""
    names = [f.name for f in dataclasses.fields(spec.config)] if dataclasses.is_dataclass(spec.config) else []
    if not names or names[0] != "kind":
        raise TypeError(f"engine kind {spec.kind!r}: its config must be a dataclass whose first field is kind")
    _SPECS[spec.kind] = spec
    return spec


def kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order."""
    return tuple(_SPECS)


def kinds_with(trait: str) -> str:
    """The registered kinds whose spec has `trait` (``"async_rollout"``), comma-separated: for messages."""
    return ", ".join(k for k, spec in _SPECS.items() if getattr(spec, trait))


def engine_spec(kind: str) -> EngineSpec:
    """The spec of `kind`, or a one-line `ConfigError` naming the kinds there are."""
    if kind not in _SPECS:
        raise ConfigError(f"{KEY}.kind={kind!r} is not an engine kind; use one of {', '.join(_SPECS)} (or register "
                          "yours with rl_lightning.engines.registry.register)")
    return _SPECS[kind]


def keys_of(kind: str) -> tuple[str, ...]:
    """The keys `kind` takes (its settings' fields but ``kind``)."""
    return tuple(f.name for f in dataclasses.fields(engine_spec(kind).config))[1:]


def resolve(value: Any) -> Any:
    """The settings of the kind `value` names, with that kind's defaults for what it leaves unset.

    Args:
        value: a kind's name (the shorthand), an `EngineConfig`, a mapping (a checkpoint's hyperparameters, a
            mapping given in Python) or a registered kind's settings (kept as they are).

    Raises:
        ConfigError: one line: an unknown kind, a key the kind does not take (naming the kinds that take it), a
            group with keys but no kind, or a bad value the kind's settings refuse.
    """
    if isinstance(value, str):
        return engine_spec(value).config()
    if isinstance(value, EngineConfig):
        value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    elif dataclasses.is_dataclass(value) and isinstance(kind := getattr(value, "kind", None), str):
        if not isinstance(value, engine_spec(kind).config):
            raise ConfigError(f"{KEY}: {type(value).__name__} is not the settings of kind {kind!r} "
                              f"({engine_spec(kind).config.__name__})")
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{KEY}={value!r} must be a kind ({', '.join(_SPECS)}) or a group {{kind: ..., ...}}")
    settings = {k: v for k, v in value.items() if v is not None}  # None: unset (the kind's default)
    kind = settings.pop("kind", None)
    if kind is None:
        if settings:
            raise ConfigError(f"{KEY} sets {', '.join(sorted(settings))} but no kind: name it ({KEY}.kind: "
                              f"{'|'.join(_SPECS)}); a shorthand '{KEY}: <kind>' is replaced as a whole when a key of "
                              "the group is set on its own")
        kind = "hf"
    takes = keys_of(kind)
    foreign = [k for k in settings if k not in takes]
    if foreign:
        raise ConfigError("; ".join(_foreign(key, kind) for key in foreign))
    return engine_spec(kind).config(**settings)


def _foreign(key: str, kind: str) -> str:
    others = [k for k in _SPECS if key in keys_of(k)]
    where = f"the kinds that take it: {', '.join(others)}" if others else "no engine kind takes it"
    return f"{KEY}.{key} does not apply to engine kind {kind!r} ({where}); remove it or change the kind"


def _build_hf(settings: Any, context: EngineContext) -> Any:
    from rl_lightning.engines.hf import HFEngine

    return HFEngine(context.model, context.pad_token_id, context.device)


@dataclass(frozen=True)
class HFEngineConfig:
    """``engine: hf``: no keys (the policy samples itself)."""

    kind: str = "hf"


def _built_in() -> None:
    from rl_lightning.engines.vllm_kinds import VLLMEngineConfig, VLLMProcessEngineConfig, build_process, build_vllm

    register(EngineSpec("hf", HFEngineConfig, _build_hf, on_policy=True, memory="policy"))
    register(EngineSpec("vllm", VLLMEngineConfig, build_vllm, needs_vllm=True, adapter_sync=True,
                        tensor_parallel=True, async_rollout=True, inflight=True, memory="vllm"))
    register(EngineSpec("vllm_process", VLLMProcessEngineConfig, build_process, needs_vllm=True, own_process=True,
                        async_rollout=True, memory="process"))


_built_in()
