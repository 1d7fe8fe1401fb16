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

log = logging.getLogger(__name__)

# Inserted into parameter names by torch's checkpoint_wrapper, torch.compile (OptimizedModule) and FSDP1.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """The Hugging Face checkpoint name of parameter `name`: wrapper prefixes removed wherever they occur."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself, or, for a DTensor (FSDP2/TP shard), the full tensor gathered from its mesh (a collective:
    every rank of the mesh must call it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) of every distinct parameter, in module order. A parameter shared by several
    modules (tied embeddings) appears once, under its first name; with ``config.tie_word_embeddings`` the output
    head is never listed (its checkpoint entry is the input embedding)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    named, seen = [], set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = checkpoint_name(name)
        if id(param) in seen or (tied and name == "lm_head.weight"):
            continue
        seen.add(id(param))
        named.append((name, param))
    return named


@dataclass
class StreamStats:
    """What a stream moved: tensors, bytes (at the sent dtype), buckets and the largest bucket in bytes."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    max_bucket_bytes: int = 0


def gather_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None,
                   stats: StreamStats | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full tensors of `named`, in order, grouped into buckets of one dtype and at most `bucket_bytes` (a tensor
    larger than that is a bucket of its own). A bucket is gathered only once the previous one was handed out.

    Args:
        named: (name, tensor or DTensor) pairs; the same order on every rank.
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
        gathered = full_tensor(tensor.detach().to(target))  # cast the shard first: gather (and hold) fewer bytes
        bucket.append((name, gathered))
        del gathered
        size, bucket_dtype = size + nbytes, target
        stats.tensors, stats.bytes = stats.tensors + 1, stats.bytes + nbytes
    if bucket:
        stats.buckets, stats.max_bucket_bytes = stats.buckets + 1, max(stats.max_bucket_bytes, size)
        yield bucket


def stream_weights(model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None,
                   stats: StreamStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) for every weight of `model`, gathered bucket by bucket (`gather_buckets`); each
    tensor is dropped from the bucket as it is handed out, so the consumer's reference is the last one."""
    for bucket in gather_buckets(named_weights(model), bucket_bytes, dtype, stats):
        bucket.reverse()
        while bucket:
            yield bucket.pop()


class WeightSync:
    """Push a model's current weights into an engine, once per optimizer step.

    The push is skipped when `step` (e.g. ``trainer.global_step``, which counts optimizer steps) equals that of
    the last push and the engine still holds those weights (``engine.needs_weights`` false: a vLLM engine that slept
    at level 2 has discarded them). Skipping depends only on values equal on every rank, so all ranks skip together.

    Args:
        bucket_bytes: gather granularity (`gather_buckets`).

    Attributes:
        seconds: duration of the last call (0 when skipped).
        stats: `StreamStats` of the last push (zeros when skipped).
        pushes: number of pushes so far.
    """

    def __init__(self, bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.synced_step: int | None = None
        self.seconds, self.stats, self.pushes = 0.0, StreamStats(), 0

    def __call__(self, engine: Any, model: torch.nn.Module, step: int) -> bool:
        """Push unless nothing changed since the last push; returns whether it pushed."""
        if step == self.synced_step and not getattr(engine, "needs_weights", False):
            self.seconds, self.stats = 0.0, StreamStats()
            return False
        start, self.stats = time.perf_counter(), StreamStats()
        stream = stream_weights(model, self.bucket_bytes, getattr(engine, "dtype", None), self.stats)
        engine.update_weights(stream)
        for _ in stream:  # an engine that stopped early must not leave this rank behind in the gathers
            pass
        self.seconds = time.perf_counter() - start
        self.synced_step, self.pushes = step, self.pushes + 1
        log.info("weight sync at step %d: %.3f s, %.1f MB in %d buckets", step, self.seconds,
                 self.stats.bytes / 2**20, self.stats.buckets)
        return True
