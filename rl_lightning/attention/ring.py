"""Zigzag ring attention over the context-parallel group, for packed micro-batches.

Layout: the zigzag share of `rl_lightning.attention.zigzag` (as RL2 and ring-flash-attn's zigzag varlen kernel
expect): context-parallel rank r keeps chunks r and ``2cp - 1 - r`` of every packed sequence, so each rank holds the
same share of early (cheap) and late (expensive) causal queries.

Attention is a P2P ring. On CUDA with fp16/bf16 q, k, v (inside autocast they are first cast to its dtype) of a
head size flash supports, and ring-flash-attn and flash-attn that really import (`flash_attn_status`; an unusable
install is one warning line and a fallback), it is their ``zigzag_ring_flash_attn_varlen_func``; otherwise it is this
module's ring (`ring_attention`). Either way the offsets come from the layout's row sets, made once per micro-batch:

- Forward: each rank keeps its local K/V and passes it round the ring (``batch_isend_irecv`` to rank r + 1, from
  rank r - 1, sub-group ranks translated with ``get_global_rank``). At step i it attends its queries to the block
  of rank ``j = (r - i) mod cp``, the next block already in flight, and merges the partial (out, lse) pairs exactly
  (`rl_lightning.attention.kernels.merge_partials`, fp32). Zigzag makes every step one unmasked or plainly causal call
  (`step_kind`): j = r is causal in local order; j < r: all local queries see only j's early chunk of each
  sequence; j > r: only the local late chunk of each sequence sees both of j's chunks, and the early one sees none.
- Backward (`_RingAttention`, which saves only local q, k, v, out, lse: O(N / cp) memory): a second ring pass in
  which the K/V blocks travel again, each followed by its fp32 dK/dV accumulator, which after cp hops lands back
  on its owner; dQ stays local. Each step is flash's backward from the final out and lse.
- Block kernels (`rl_lightning.attention.kernels.block_forward`): torch's aten flash kernels on CUDA fp16/bf16, exact fp32
  maths elsewhere (the CPU/gloo path the tests prove equal to full attention).

The ring loop works on a stack of ranks: one (this rank) in training, all of them in `ring_attention_emulated`,
which runs the same loop in one process so one GPU can check the kernels and the merge against full attention.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from rl_lightning.attention import kernels
from rl_lightning.attention.kernels import block_backward, block_forward, merge_partials

# The layout lives in `rl_lightning.attention.zigzag`; its names stay importable from here (explicit re-exports).
from rl_lightning.attention.zigzag import ZigzagBlocks as ZigzagBlocks
from rl_lightning.attention.zigzag import ZigzagLayout as ZigzagLayout
from rl_lightning.attention.zigzag import gather_tokens as gather_tokens
from rl_lightning.attention.zigzag import shard_micro_batch as shard_micro_batch
from rl_lightning.attention.zigzag import shard_tokens as shard_tokens
from rl_lightning.attention.zigzag import zigzag_blocks as zigzag_blocks
from rl_lightning.attention.zigzag import zigzag_layout as zigzag_layout
from rl_lightning.compat.transformers import restore_flash_attn_helper

log = logging.getLogger(__name__)

# module -> (pip name, how to install it): flash-attn is compiled against the installed torch (docs/gpu.md)
_FLASH_PACKAGES = {
    "flash_attn": ("flash-attn", 'pip install --no-build-isolation --no-cache-dir "flash-attn>=2.8,<2.9"'),
    "ring_flash_attn": ("ring-flash-attn", "pip install ring-flash-attn==0.1.8"),
}


@functools.cache
def flash_attn_status() -> tuple[bool, str]:
    """Whether ring-flash-attn's kernel can run here: (usable, why not), from a real import of both packages.

    Installed is not enough: a flash-attn wheel built for another torch or CUDA fails at import (``undefined
    symbol``: ImportError; a missing CUDA library: OSError; RuntimeError, ...). A package that is installed but
    does not import is logged once, as one warning line naming it, the error and the fix; context parallelism then
    runs the exact torch ring (`ring_attention`), so nothing fails mid-forward. A start-up check can call this to
    warn, or to stop when flash kernels are a requirement. Cached: the probe imports once per process.
    """
    for module, (package, install) in _FLASH_PACKAGES.items():
        if importlib.util.find_spec(module) is None:
            return False, f"{package} is not installed ({install})"
        try:
            if module == "ring_flash_attn":
                restore_flash_attn_helper()  # ring-flash-attn 0.1.8 imports a helper transformers 5 moved
            importlib.import_module(module)
        except Exception as error:  # any failure of a compiled extension's import means unusable
            message = " ".join(f"{type(error).__name__}: {error}".split())  # one line
            reason = (f"{package} is installed but cannot be imported ({message}); fix: reinstall it for torch "
                      f"{torch.__version__} (CUDA {torch.version.cuda}): {install} --force-reinstall, "
                      f"or pip uninstall {package}")
            log.warning("%s; context-parallel attention falls back to the exact torch ring (slower)", reason)
            return False, reason
    return True, "flash-attn and ring-flash-attn import"


def _flash_ring_available(query: torch.Tensor) -> bool:
    """Flash kernels take `query` (CUDA, fp16/bf16, head size % 8 and <= 256) and both libraries import."""
    return kernels.flash_inputs_supported(query) and flash_attn_status()[0]


def _flash_ring(query, key, value, blocks: ZigzagBlocks, layout: ZigzagLayout, scaling: float | None) -> torch.Tensor:
    restore_flash_attn_helper()  # ring-flash-attn 0.1.8 imports a helper transformers 5 moved
    from ring_flash_attn import zigzag_ring_flash_attn_varlen_func

    out = zigzag_ring_flash_attn_varlen_func(  # offsets and longest length from the layout: no host sync here
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),  # (n, H, D)
        blocks.cu, blocks.max_len, softmax_scale=scaling, causal=True, group=layout.group,
    )
    return out.unsqueeze(0)  # (1, n, H, D)


def step_kind(rank: int, source: int) -> str:
    """Which block call rank `rank` makes against the K/V of rank `source` (see the module docstring)."""
    if source == rank:
        return "causal"
    return "early_keys" if source < rank else "late_queries"


def step_forward(q: torch.Tensor, kv: torch.Tensor, kind: str, blocks: ZigzagBlocks, scale: float
                 ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One ring step: q (n, H, D), kv (2, n, H_kv, D) -> (rows, out, lse).

    The partial attention of the local query `rows` (None: all) over the part of `kv` they may see; out (m, H, D),
    lse (H, m).
    """
    b = blocks
    if kind == "causal":
        return None, *block_forward(q, kv[0], kv[1], b.cu, b.cu, b.max_len, b.max_len, True, scale)
    if kind == "early_keys":
        k, v = kv[:, b.early]  # (n / 2, H_kv, D) each
        return None, *block_forward(q, k, v, b.cu, b.chunk_cu, b.max_len, b.max_chunk, False, scale)
    return b.late, *block_forward(q[b.late], kv[0], kv[1], b.chunk_cu, b.cu, b.max_chunk, b.max_len, False, scale)


def step_backward(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  kind: str, blocks: ZigzagBlocks, scale: float
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Gradients of `step_forward`'s call from the final dout, out (n, H, D) and lse (H, n).

    Returns (rows, dq (m, H, D), dkv (2, n, H_kv, D) fp32 for the whole block).
    """
    b = blocks
    if kind == "causal":
        dq, dk, dv = block_backward(dout, q, kv[0], kv[1], out, lse, b.cu, b.cu, b.max_len, b.max_len, True, scale)
        return None, dq, torch.stack([dk, dv]).float()
    if kind == "early_keys":
        k, v = kv[:, b.early]
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, b.cu, b.chunk_cu, b.max_len, b.max_chunk, False, scale)
        dkv = kv.new_zeros(kv.shape, dtype=torch.float32).index_copy_(1, b.early, torch.stack([dk, dv]).float())
        return None, dq, dkv
    late = b.late
    dq, dk, dv = block_backward(dout[late], q[late], kv[0], kv[1], out[late], lse[:, late], b.chunk_cu, b.cu,
                                b.max_chunk, b.max_len, False, scale)
    return late, dq, torch.stack([dk, dv]).float()


class _LocalRing:
    """All `size` ranks in this process (`ring_attention_emulated`): a hop is a roll of the rank stack."""

    def __init__(self, size: int):
        self.ranks, self.size = list(range(size)), size

    def shift(self, stacked: torch.Tensor) -> Callable[[], torch.Tensor]:
        rolled = stacked.roll(1, dims=0)  # rank r receives rank r - 1's piece
        return lambda: rolled


class _P2PRing:
    """This rank of a process group (`ranks` = [its group rank]).

    A hop is a send to r + 1 and a receive from r - 1, started at once and awaited by the returned call so the next
    block moves while this one computes.
    """

    def __init__(self, rank: int, size: int, group: Any):
        self.ranks, self.size, self.group = [rank], size, group

    def shift(self, stacked: torch.Tensor) -> Callable[[], torch.Tensor]:
        import torch.distributed as dist

        if self.size == 1:
            return lambda: stacked
        group = self.group if self.group is not None else dist.group.WORLD
        rank, stacked = self.ranks[0], stacked.contiguous()
        # P2POp peers are global ranks, even on a sub-group.
        send_to = dist.get_global_rank(group, (rank + 1) % self.size)
        receive_from = dist.get_global_rank(group, (rank - 1) % self.size)
        received = torch.empty_like(stacked)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, stacked, send_to, group),
                                           dist.P2POp(dist.irecv, received, receive_from, group)])

        def wait() -> torch.Tensor:
            for request in requests:
                request.wait()
            return received

        return wait


def _ring_forward(q, kv, blocks, ring, scale):
    """Q (R, n, H, D), kv (R, 2, n, H_kv, D) for the R ranks of `ring` in this process -> fp32 out, lse.

    out is (R, n, H, D), lse (R, H, n). Step i uses the K/V of rank (r - i) mod size; step 0 (causal) gives every
    row a finite lse.
    """
    outs, lses = [], []
    for step in range(ring.size):
        incoming = ring.shift(kv) if step + 1 < ring.size else None
        for i, rank in enumerate(ring.ranks):
            rows, out, lse = step_forward(q[i], kv[i], step_kind(rank, (rank - step) % ring.size), blocks, scale)
            if step == 0:
                outs.append(out.float())
                lses.append(lse)
            elif rows is None:
                outs[i], lses[i] = merge_partials(outs[i], lses[i], out, lse)
            else:
                outs[i][rows], lses[i][:, rows] = merge_partials(outs[i][rows], lses[i][:, rows], out, lse)
        kv = incoming() if incoming is not None else kv
    return torch.stack(outs), torch.stack(lses)


def _ring_backward(dout, q, kv, out, lse, blocks, ring, scale):
    """-> fp32 dq (R, n, H, D), dkv (R, 2, n, H_kv, D).

    A block's dK/dV accumulator hops right behind it and, after the last step's hop, arrives at the block's owner.
    """
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    arriving = None
    for step in range(ring.size):
        incoming = ring.shift(kv) if step + 1 < ring.size else None
        contributions = []
        for i, rank in enumerate(ring.ranks):
            kind = step_kind(rank, (rank - step) % ring.size)
            rows, dq_part, dkv_part = step_backward(dout[i], q[i], kv[i], out[i], lse[i], kind, blocks, scale)
            if rows is None:
                dq[i] += dq_part
            else:
                dq[i].index_add_(0, rows, dq_part.float())
            contributions.append(dkv_part)
        dkv = torch.stack(contributions)  # (R, 2, n, H_kv, D)
        arriving = ring.shift(dkv if arriving is None else arriving() + dkv)
        kv = incoming() if incoming is not None else kv
    return dq, arriving()


class _RingAttention(torch.autograd.Function):
    """Saves only the local q, k, v, out and lse; the backward is a second ring pass (`_ring_backward`)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: ZigzagBlocks, ring: Any,
                scale: float) -> torch.Tensor:
        kv = torch.stack([k, v], dim=1)  # (R, 2, n, H_kv, D): one message per hop
        out, lse = _ring_forward(q.contiguous(), kv, blocks, ring, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.blocks, ctx.ring, ctx.scale = blocks, ring, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = _ring_backward(dout.contiguous(), q.contiguous(), kv, out, lse, ctx.blocks, ctx.ring, ctx.scale)
        return dq.to(q.dtype), dkv[:, 0].to(kv.dtype), dkv[:, 1].to(kv.dtype), None, None, None


def ring_attention_emulated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            local_cu_seqlens: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """The ring of `ring_attention` for all cp ranks in one process (same loop, same kernels; hops are rolls).

    Args:
        query: (cp, n, H, D), rank r's zigzag queries in row r.
        key: (cp, n, H_kv, D).
        value: (cp, n, H_kv, D).
        local_cu_seqlens: (S + 1,) any rank's ``layout.local_cu_seqlens`` (the same on every rank).
        scaling: softmax scale (None: ``D ** -0.5``).

    Returns:
        (cp, n, H, D), differentiable.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    blocks = zigzag_blocks(local_cu_seqlens, query.device)
    return _RingAttention.apply(query, key, value, blocks, _LocalRing(query.shape[0]), scale)


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: ZigzagLayout, scaling: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries over each sequence's full keys.

    Args:
        query: (1, H, n, D) local queries.
        key: (1, H_kv, n, D) local keys.
        value: (1, H_kv, n, D) local values.
        layout: from `shard_micro_batch`.
        scaling: softmax scale (None: ``D ** -0.5``).

    Returns:
        (1, n, H, D) attention output for the local tokens.
    """
    query, key, value = kernels.autocast_inputs(query, key, value)  # before the kernel is chosen from their dtype
    blocks = layout.blocks  # made once per micro-batch (`shard_micro_batch`)
    if blocks is None or blocks.cu.device != query.device:
        blocks = zigzag_blocks(layout.local_cu_seqlens, query.device)
    if _flash_ring_available(query):
        return _flash_ring(query, key, value, blocks, layout, scaling)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (1, n, H, D), (1, n, H_kv, D)
    return _RingAttention.apply(q, k, v, blocks, _P2PRing(layout.rank, layout.size, layout.group), scale)
