"""Zigzag ring attention over the context-parallel group, for packed micro-batches.

Layout (as RL2 and ring-flash-attn's zigzag varlen kernel expect): every packed sequence is padded to a multiple of
``2 * cp`` tokens and cut into ``2 * cp`` equal chunks; context-parallel rank r keeps chunks r and ``2cp - 1 - r``, so
each rank holds the same share of early (cheap) and late (expensive) causal queries. `shard_micro_batch` applies it
to every per-token tensor of a micro-batch (targets already sit at the token that predicts them, so slicing is
exact); `gather_tokens` undoes it for per-token outputs.

Attention itself has two backends, chosen per call:

- CUDA with ring-flash-attn importable: ``zigzag_ring_flash_attn_varlen_func`` (P2P ring, flash kernels).
- otherwise (CPU/gloo, or GPUs without flash-attn): all-gather K and V over the group with autograd (so the
  backward reduce-scatters dK and dV) and run exact causal SDPA per sequence, the local zigzag queries against the
  sequence's full keys. Communication is the same volume as a ring pass; memory holds one sequence's K/V at a time
  plus the gathered row. This is the path the CPU tests prove equal to full attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class ZigzagLayout:
    """Where each local token of this rank comes from. `local_index` (n,) indexes the padded row; `source` (N',)
    maps the padded row to the original row (-1 = padding); `local_cu_seqlens` (S + 1,) are this rank's sequence
    offsets (each sequence contributes ``padded_length / cp`` tokens)."""

    local_index: torch.Tensor
    source: torch.Tensor
    local_cu_seqlens: torch.Tensor
    padded_lengths: list[int]
    rank: int
    size: int
    group: Any


class _AllGather(torch.autograd.Function):
    """All-gather over `group` -> (size, *shape); the backward sums every rank's gradient for this rank's piece
    (a reduce-scatter, done as all-reduce + slice, which gloo supports). torch.distributed.nn's version breaks on
    sub-groups under gloo (its backward scatters with group ranks taken as global ranks)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def all_gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable all-gather: (size, *tensor.shape)."""
    return _AllGather.apply(tensor, group)


def zigzag_layout(cu_seqlens: torch.Tensor, rank: int, size: int, group: Any = None) -> ZigzagLayout:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    sources, padded_lengths = [], []
    for start, length in zip(cu_seqlens[:-1].tolist(), lengths, strict=True):
        padded = -(-length // (2 * size)) * 2 * size
        src = torch.full((padded,), -1, dtype=torch.long)
        src[:length] = torch.arange(start, start + length)
        sources.append(src)
        padded_lengths.append(padded)
    local_cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    local_cu[1:] = torch.tensor(padded_lengths).cumsum(0) // size
    layout = ZigzagLayout(torch.empty(0, dtype=torch.long), torch.cat(sources), local_cu, padded_lengths, rank, size,
                          group)
    layout.local_index = _local_index(layout, rank)
    return layout


def _pad_row(row: torch.Tensor, source: torch.Tensor, key: str, padded_lengths: list[int]) -> torch.Tensor:
    """(1, N) -> (1, N') with each sequence padded; padding is never a target or a last token."""
    out = row[:, source.clamp(min=0)].clone()
    pad = source < 0
    if key == "position_ids":  # continue counting so rotary embeddings stay defined for the padding
        positions = torch.cat([torch.arange(n) for n in padded_lengths]).to(out.device)
        out[0] = positions
    elif key != "seq_index":  # padding joins its sequence (seq_index) but is never a target or last token
        out[:, pad] = 0
    return out


def shard_micro_batch(micro_batch: dict[str, Any], rank: int, size: int, group: Any) -> dict[str, Any]:
    """This context-parallel rank's zigzag share of a packed micro-batch (per-token tensors sliced, scalars kept),
    plus ``cp_layout`` for the attention and for `gather_tokens`."""
    layout = zigzag_layout(micro_batch["cu_seqlens"].cpu(), rank, size, group)
    local = dict(micro_batch)
    length = micro_batch["input_ids"].shape[1]
    token_keys = [k for k, v in micro_batch.items() if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == length]
    for key in token_keys:
        row = micro_batch[key]
        padded = _pad_row(row, layout.source.to(row.device), key, layout.padded_lengths)
        local[key] = padded[:, layout.local_index.to(row.device)]
    local["cp_layout"] = layout
    return local


def gather_tokens(local: torch.Tensor, layout: ZigzagLayout) -> torch.Tensor:
    """(1, n, ...) per-token values of this rank -> (1, N, ...) for the whole original row, in order. Differentiable,
    but meant for outputs every rank then uses differently or not at all (e.g. logging, rollout logprobs): a loss
    computed identically on every rank from the gathered row would count each gradient `size` times."""
    parts = all_gather(local, layout.group)  # (size, 1, n, ...)
    padded = torch.zeros((1, len(layout.source), *local.shape[2:]), dtype=local.dtype, device=local.device)
    for r, part in enumerate(parts):
        index = _local_index(layout, r).to(local.device)
        padded = padded.index_copy(1, index, part)
    keep = (layout.source >= 0).nonzero().flatten().to(local.device)
    order = layout.source[layout.source >= 0].to(local.device)
    out = torch.zeros_like(padded[:, : len(order)])
    return out.index_copy(1, order, padded[:, keep])


def _local_index(layout: ZigzagLayout, rank: int) -> torch.Tensor:
    """The padded-row positions held by `rank` (its zigzag chunks, sequence by sequence)."""
    index, offset = [], 0
    for padded in layout.padded_lengths:
        chunk = padded // (2 * layout.size)
        for j in (rank, 2 * layout.size - 1 - rank):
            index.append(torch.arange(offset + j * chunk, offset + (j + 1) * chunk))
        offset += padded
    return torch.cat(index)


def _flash_ring_available(query: torch.Tensor) -> bool:
    """CUDA, a dtype flash-attn supports (fp16/bf16; fp32 falls back to the exact torch path) and both libraries."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("flash_attn", "ring_flash_attn"))


def _flash_ring(query, key, value, layout: ZigzagLayout, scaling: float | None) -> torch.Tensor:
    # ring-flash-attn 0.1.8 imports a helper transformers 5 moved (shared/reference apis.md §3.1); shim it first.
    import transformers.modeling_flash_attention_utils as flash_utils
    import transformers.utils

    if not hasattr(flash_utils, "is_flash_attn_greater_or_equal_2_10"):
        flash_utils.is_flash_attn_greater_or_equal_2_10 = transformers.utils.is_flash_attn_greater_or_equal_2_10
    from ring_flash_attn import zigzag_ring_flash_attn_varlen_func

    cu = layout.local_cu_seqlens.to(query.device)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    out = zigzag_ring_flash_attn_varlen_func(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),  # (n, H, D)
        cu, max_seqlen, softmax_scale=scaling, causal=True, group=layout.group,
    )
    return out.unsqueeze(0)  # (1, n, H, D)


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: ZigzagLayout, scaling: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries over each sequence's full keys.

    Args:
        query: (1, H, n, D) local queries; key, value: (1, H_kv, n, D) local keys/values.
        layout: from `shard_micro_batch`.

    Returns:
        (1, n, H, D) attention output for the local tokens.
    """
    if _flash_ring_available(query):
        return _flash_ring(query, key, value, layout, scaling)
    size, rank = layout.size, layout.rank
    keys = all_gather(key, layout.group)  # (size, 1, H_kv, n, D)
    values = all_gather(value, layout.group)
    cu = layout.local_cu_seqlens.tolist()
    outputs = []
    for s, padded in enumerate(layout.padded_lengths):
        chunk, start = padded // (2 * size), cu[s]
        # chunk j of the sequence lives on rank j (j < size) or 2size-1-j, first or second half of its local share
        pieces = [(j if j < size else 2 * size - 1 - j, 0 if j < size else chunk) for j in range(2 * size)]
        k_full = torch.cat([keys[r][:, :, start + o : start + o + chunk] for r, o in pieces], dim=2)  # (1,Hkv,L,D)
        v_full = torch.cat([values[r][:, :, start + o : start + o + chunk] for r, o in pieces], dim=2)
        q_pos = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                           torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])
        mask = torch.arange(padded)[None, :] <= q_pos[:, None]  # (2 chunk, L): causal by global position
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, start : start + 2 * chunk], k_full, v_full, attn_mask=mask.to(query.device), scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        ))  # (1, H, 2 chunk, D)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()
