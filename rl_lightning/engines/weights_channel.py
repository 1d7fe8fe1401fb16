"""How a weight push travels from the trainer to an engine process: a two-member group of its own, in buckets.

The trainer (rank 0) and the engine process (rank 1) meet on a ``FileStore`` of their own (`rl_lightning.engines.
process`). On CUDA, with NCCL, the group is a ``ProcessGroupNCCL`` and the buckets stay on the GPUs: the trainer's
gathered tensors are broadcast from its device into a buffer on the engine's (no host copy in the push). On the
CPU it is a loopback gloo group over host memory. vLLM 0.32's own weight-transfer API (``WeightTransferConfig``)
has no CPU transport, so this one serves both with the same code. NCCL's bootstrap listens where the trainer's own
NCCL does (``NCCL_SOCKET_IFNAME``); the engine process's side binds loopback.

A push: per bucket (`buckets`, about ``model.rollout.engine.weight_bucket_mb``), its names, shapes and dtypes go by
pipe and its data in one flat byte broadcast; the engine side (`received`) hands vLLM views of that buffer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rl_lightning.engines.local_channels import loopback_gloo


def weights_device(device_type: str) -> torch.device:
    """Where a weight push's buckets live on this side: the current GPU (NCCL) on CUDA, else the host (gloo)."""
    if device_type == "cuda" and dist.is_nccl_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def weights_group(store: Any, rank: int, timeout_s: float, device: torch.device) -> Any:
    """The trainer (rank 0) and engine (rank 1) pair a weight push travels over: NCCL for CUDA buckets, else gloo."""
    store, timeout = dist.PrefixStore("rl_lightning-weights", store), timedelta(seconds=timeout_s)
    if device.type == "cuda":
        from rl_lightning.compat.torch import nccl_options

        return dist.ProcessGroupNCCL(store, rank, 2, nccl_options(timeout))
    return loopback_gloo(store, rank, 2, timeout)


def close_group(group: Any, device: torch.device, abort: bool) -> None:
    """Release a NCCL pair's communicator: ``abort`` when the other side died or hangs, else ``shutdown``.

    A dead peer's pending work would never finish; a gloo pair needs nothing (its sockets close with the object).
    """
    if device.type != "cuda":
        return
    release = getattr(group, "abort" if abort else "shutdown", None)
    if release is not None:
        with contextlib.suppress(RuntimeError):
            release()


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype,
             device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`named_tensors` as contiguous tensors of `dtype` on `device` (the group's), in buckets of ~`bucket_bytes`."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        moved = tensor.detach().to(device, dtype).contiguous()
        if bucket and size + moved.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, moved))
        size += moved.nbytes
    if bucket:
        yield bucket


def received(connection: Any, group: Any, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one weight push, a bucket at a time.

    A bucket's names, shapes and dtypes come by pipe, its data in one flat byte broadcast; each tensor is a view of
    that buffer (one bucket alive, plus whatever vLLM keeps until a layer is complete).
    """
    while True:
        kind, payload = connection.recv()
        if kind == "end":
            return
        sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in payload]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        group.broadcast(flat, 0).wait()
        offset = 0
        for (name, shape, dtype), size in zip(payload, sizes, strict=True):
            yield name, flat[offset : offset + size].view(dtype).reshape(shape)
            offset += size
