"""Streaming the policy's weights into a rollout engine: gather shards, rename, bucket, skip when unchanged.

An inference engine wants full (unsharded) tensors under Hugging Face checkpoint names; the trainer holds FSDP2/TP
shards (DTensors) under names that wrappers may have prefixed. `stream_weights` turns one into the other lazily:

- **gather** each parameter with ``DTensor.full_tensor()``. That is a collective over the parameter's mesh, so every
  rank walks the parameters in the same (module) order and must consume the whole stream;
- **name** it as the checkpoint does: wrapper prefixes (activation checkpointing, ``torch.compile``, FSDP1) are
  dropped, and a tied output head (``lm_head.weight`` is ``embed_tokens.weight``) is sent once, as the embedding,
  which is how tied checkpoints store it;
- **bucket**: tensors are gathered a bucket at a time (one dtype, at most ``bucket_bytes`` unless a single tensor is
  larger), optionally cast to the engine's dtype, and each is released as soon as the engine has taken it. Beyond
  the engine's own copy, at most one bucket of gathered tensors is alive (plus whatever the engine buffers itself:
  vLLM holds a layer's tensors until the layer is complete). Gathering a bucket back to back lets asynchronous
  all-gathers (NCCL) overlap.

A LoRA policy (a PEFT ``PeftModel``, detected by its ``peft_config``) is streamed in one of two ways:

- **merged** (`named_weights`): each LoRA layer's weight is sent as ``W + scaling * B @ A`` under the base layer's
  checkpoint name (``base_model.model.`` and ``.base_layer`` dropped, ``lora_*`` parameters skipped), so an engine
  without LoRA support serves the current policy. W, A and B are gathered first (DTensor shards), then merged;
- **adapter** (`adapter_weights`): the base weights are sent once (``named_weights(model, merge_lora=False)``),
  then only ``lora_A``/``lora_B`` under the names PEFT saves them with, for the engine to load as an adapter.

`WeightSync` pushes the stream into an engine once per optimizer step and records how long it took and how much it
moved. Nothing here imports an engine: it is tested with plain modules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.compat.torch import compiled_original
from rl_lightning.errors import ConfigError

log = logging.getLogger(__name__)

# Inserted into parameter names by torch's checkpoint_wrapper, torch.compile (OptimizedModule) and FSDP1.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """The Hugging Face checkpoint name of parameter `name`: wrapper prefixes removed wherever they occur."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself, or, for a DTensor (FSDP2/TP shard), the full tensor gathered from its mesh.

    Gathering is a collective: every rank of the mesh must call it, in the same order.
    """
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def is_peft(model: torch.nn.Module) -> bool:
    """Whether `model` is a PEFT model (it carries a ``peft_config``), possibly inside wrappers."""
    return hasattr(model, "peft_config") or hasattr(compiled_original(model), "peft_config")


@dataclass
class LoRAMerge:
    """A LoRA layer's weight as the engine should see it: ``weight + scaling * lora_B @ lora_A``.

    Transposed for ``fan_in_fan_out`` layers such as GPT-2's Conv1D, with DoRA rescaled row-wise to ``magnitude``
    (``magnitude / ||merged row||``, as PEFT's merge); each part may be a DTensor shard.
    """

    weight: torch.Tensor  # (out, in), or (in, out) when fan_in_fan_out
    lora_A: torch.Tensor  # (r, in)
    lora_B: torch.Tensor  # (out, r)
    scaling: float
    fan_in_fan_out: bool = False
    magnitude: torch.Tensor | None = None  # (out,), DoRA only

    def numel(self) -> int:
        """Elements of the merged weight (those of the base weight)."""
        return self.weight.numel()

    @property
    def dtype(self) -> torch.dtype:
        """The base weight's dtype."""
        return self.weight.dtype

    def merged(self, dtype: torch.dtype) -> torch.Tensor:
        """The full merged weight at `dtype` (three gathers, in the same order on every rank; merged in fp32)."""
        weight, lora_a, lora_b = (full_tensor(t.detach()) for t in (self.weight, self.lora_A, self.lora_B))
        delta = self.scaling * (lora_b.float() @ lora_a.float())  # (out, in)
        merged = weight.float() + (delta.T if self.fan_in_fan_out else delta)
        if self.magnitude is not None:  # DoRA: each output row rescaled to its learned norm
            rows = merged.T if self.fan_in_fan_out else merged  # (out, in)
            rows = rows * (full_tensor(self.magnitude.detach()).float() / rows.norm(dim=1))[:, None]
            merged = rows.T if self.fan_in_fan_out else rows
        return merged.to(dtype)


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """Checkpoint name of the base weight -> PEFT LoRA layer, for every layer with an active adapter."""
    layers = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and module.active_adapters:
            adapter = module.active_adapters[0]
            if adapter in module.lora_A:
                layers[_hf_name(f"{name}.base_layer.weight")] = module
    return layers


def _hf_name(name: str) -> str:
    """Checkpoint name of a (possibly PEFT-wrapped) parameter.

    PEFT's ``base_model.model.`` and ``.base_layer`` are dropped, a ``modules_to_save`` copy goes under the original
    module's name.
    """
    name = checkpoint_name(name).removeprefix("base_model.model.").replace(".base_layer.", ".")
    parts = name.split(".")
    if "modules_to_save" in parts:  # X.modules_to_save.<adapter>.weight -> X.weight
        i = parts.index("modules_to_save")
        parts = parts[:i] + parts[i + 2 :]
    return ".".join(parts)


def _skipped(name: str) -> bool:
    """LoRA factors (sent merged or as the adapter) and the frozen original of a ``modules_to_save`` module."""
    return any(part.startswith("lora_") or part == "original_module" for part in checkpoint_name(name).split("."))


def named_weights(model: torch.nn.Module, merge_lora: bool = True) -> list[tuple[str, torch.Tensor | LoRAMerge]]:
    """(checkpoint name, parameter) of every distinct parameter, in module order.

    A parameter shared by several modules (tied embeddings) appears once, under its first name; with
    ``config.tie_word_embeddings`` the output head is never listed (its checkpoint entry is the input embedding).

    For a PEFT model the names are the base model's; a LoRA layer's weight is a `LoRAMerge` with `merge_lora`, or its
    frozen base weight without (the adapter then goes separately: `adapter_weights`).
    """
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    lora = _lora_layers(model) if merge_lora and is_peft(model) else {}
    named: list[tuple[str, torch.Tensor | LoRAMerge]] = []
    seen = set()
    for raw, param in model.named_parameters(remove_duplicate=False):
        name = _hf_name(raw)
        if id(param) in seen or _skipped(raw):
            continue
        if tied and name == "lm_head.weight" and "modules_to_save" in raw:  # PEFT's trained copy of a tied head
            raise ConfigError(f"model.lm.lora.modules_to_save: the policy trains its own output head ({raw}) but the "
                              "model ties it to the input embedding (tie_word_embeddings), so the engine would serve "
                              "the embedding as the head; leave lm_head out of modules_to_save")
        if tied and name == "lm_head.weight":
            continue
        seen.add(id(param))
        layer = lora.get(name)
        if layer is not None:
            adapter = layer.active_adapters[0]
            dora = layer.lora_magnitude_vector[adapter].weight if layer.use_dora.get(adapter) else None
            named.append((name, LoRAMerge(param, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                                          float(layer.scaling[adapter]), bool(getattr(layer, "fan_in_fan_out", 0)),
                                          dora)))
        else:
            named.append((name, param))
    return named


def adapter_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name as PEFT saves it, parameter) of the active adapter's LoRA factors, in module order.

    E.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (wrapper prefixes and the adapter name
    dropped), the layout of ``adapter_model.safetensors``.
    """
    adapter = adapter_name(model)
    marker = f".{adapter}."
    named: list[tuple[str, torch.Tensor]] = []
    for raw, param in model.named_parameters():
        name = checkpoint_name(raw)
        if f".lora_A{marker}" in name or f".lora_B{marker}" in name:
            named.append((name.replace(marker, "."), param))
    return named


def adapter_name(model: torch.nn.Module) -> str:
    """The PEFT model's active adapter (``default`` unless renamed)."""
    peft_model: Any = compiled_original(model)  # a PeftModel: `peft_config` is a dict, not a submodule
    return getattr(peft_model, "active_adapter", None) or next(iter(peft_model.peft_config))


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The active adapter's ``adapter_config.json`` content (what ``save_pretrained`` writes; sets as sorted lists)."""
    peft_model: Any = compiled_original(model)  # a PeftModel: `peft_config` is a dict, not a submodule
    config = peft_model.peft_config[adapter_name(peft_model)].to_dict()
    return {k: sorted(v) if isinstance(v, set) else (v.value if hasattr(v, "value") else v) for k, v in config.items()}


@dataclass
class StreamStats:
    """What a stream moved: tensors, bytes (at the sent dtype), buckets and the largest bucket in bytes."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0


def gather_buckets(named: Iterable[tuple[str, torch.Tensor | LoRAMerge]], bucket_bytes: int,
                   dtype: torch.dtype | None = None,
                   stats: StreamStats | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full tensors of `named`, in order, grouped into buckets of one dtype and at most `bucket_bytes`.

    A tensor larger than that is a bucket of its own. A bucket is gathered only once the previous one was handed out.

    Args:
        named: (name, tensor, DTensor or `LoRAMerge`) pairs; the same order on every rank.
        bucket_bytes: bucket capacity in bytes (> 0).
        dtype: cast every tensor to this dtype (the engine's) before bucketing; None keeps each tensor's dtype.
        stats: filled with the counts as the stream advances.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    stats = stats if stats is not None else StreamStats()
    bucket: list[tuple[str, torch.Tensor]] = []
    size, bucket_dtype = 0, None
    for name, tensor in named:
        target = dtype or tensor.dtype
        nbytes = tensor.numel() * target.itemsize  # a DTensor's numel is the full (global) size
        if bucket and (target != bucket_dtype or size + nbytes > bucket_bytes):
            stats.buckets, stats.max_bucket_bytes = stats.buckets + 1, max(stats.max_bucket_bytes, size)
            yield bucket
            bucket, size = [], 0
        if isinstance(tensor, LoRAMerge):
            gathered = tensor.merged(target)
        else:
            gathered = full_tensor(tensor.detach().to(target))  # cast the shard first: gather (and hold) fewer bytes
        bucket.append((name, gathered))
        del gathered
        size, bucket_dtype = size + nbytes, target
        stats.tensors, stats.bytes = stats.tensors + 1, stats.bytes + nbytes
    if bucket:
        stats.buckets, stats.max_bucket_bytes = stats.buckets + 1, max(stats.max_bucket_bytes, size)
        yield bucket


def stream_weights(model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None,
                   stats: StreamStats | None = None, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for every weight of `model` (`named_weights`), gathered bucket by bucket."""
    return stream_named(named_weights(model, merge_lora), bucket_bytes, dtype, stats)


def stream_named(named: Iterable[tuple[str, torch.Tensor | LoRAMerge]], bucket_bytes: int,
                 dtype: torch.dtype | None = None, stats: StreamStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` gathered bucket by bucket (`gather_buckets`).

    Each tensor is dropped from the bucket as it is handed out, so the consumer's reference is the last one.
    """
    for bucket in gather_buckets(named, bucket_bytes, dtype, stats):
        bucket.reverse()
        while bucket:
            yield bucket.pop()


class WeightSync:
    """Push a model's current weights into an engine, once per optimizer step.

    The push is skipped when `step` (e.g. ``trainer.global_step``, which counts optimizer steps) equals that of
    the last push and the engine still holds those weights (``engine.needs_weights`` false: a vLLM engine that slept
    at level 2 has discarded them). Skipping depends only on values equal on every rank, so all ranks skip together.

    With `adapter` (a PEFT model and an engine with ``update_adapter``), the base weights are pushed only while the
    engine needs them (the first push), and every push hands over the adapter's LoRA factors and config.

    Args:
        bucket_bytes: gather granularity (`gather_buckets`).
        adapter: adapter-only sync instead of merged full weights.

    Attributes:
        seconds: duration of the last call (0 when skipped).
        stats: `StreamStats` of the last push (zeros when skipped), base weights and adapter together.
        pushes: number of pushes so far.
    """

    def __init__(self, bucket_bytes: int, adapter: bool = False) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.bucket_bytes, self.adapter = bucket_bytes, adapter
        self.synced_step: int | None = None
        self.seconds, self.stats, self.pushes = 0.0, StreamStats(), 0

    def __call__(self, engine: Any, model: torch.nn.Module, step: int) -> bool:
        """Push unless nothing changed since the last push; returns whether it pushed."""
        if step == self.synced_step and not getattr(engine, "needs_weights", False):
            self.seconds, self.stats = 0.0, StreamStats()
            return False
        start, self.stats = time.perf_counter(), StreamStats()
        dtype = getattr(engine, "dtype", None)
        if not self.adapter or getattr(engine, "needs_weights", True):
            stream = stream_weights(model, self.bucket_bytes, dtype, self.stats, merge_lora=not self.adapter)
            engine.update_weights(stream)
            for _ in stream:  # an engine that stopped early must not leave this rank behind in the gathers
                pass
        if self.adapter:
            tensors = list(stream_named(adapter_weights(model), self.bucket_bytes, dtype, self.stats))
            engine.update_adapter(tensors, adapter_config(model))
        self.seconds = time.perf_counter() - start
        self.synced_step, self.pushes = step, self.pushes + 1
        log.info("%s sync at step %d: %.3f s, %.1f MB in %d buckets", "adapter" if self.adapter else "weight", step,
                 self.seconds, self.stats.bytes / 2**20, self.stats.buckets)
        return True
