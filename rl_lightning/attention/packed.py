"""``rl_varlen``: exact attention for packed sequences (the kernels ring attention is built from: `kernels`).

With a packed micro-batch (one row, position ids restarting per sequence, no attention mask) transformers' stock SDPA
path builds an N x N block-diagonal mask and attends over the whole row: O(N^2) work for O(sum l_i^2) useful work.
``rl_varlen`` attends within each sequence instead, with one of two kernels chosen per call by `packed_backend`:

- CUDA with fp16/bf16 and torch's Flash-Attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``,
  torch >= 2.10): one kernel call for the whole row, sequences delimited by ``cu_seqlens``;
- anywhere else (CPU, fp32, older torch, attention dropout): causal SDPA on each sequence in a Python loop.

The kernel is chosen from the query's dtype, so q, k and v are first brought to one dtype
(`kernels.autocast_inputs`: under bf16-mixed the rotary embedding hands back fp32 q and k). Where the sequences are
(`packed_row`: offsets on the host and on the device, the longest length) is worked out once per forward, at the
first layer, and reused by the others: the later layers make no host syncs and no host-to-device copies.

Padded batches and cached generation go to SDPA with their mask: transformers' own path on CUDA, and off CUDA
`padded_sdpa`, which keeps grouped K/V heads as they are instead of copying them per query head. When the forward
carries a ``cp_layout`` (a context-parallel shard), it runs zigzag ring attention over the context-parallel group
(`rl_lightning.attention.ring`), whose per-step kernels are in `rl_lightning.attention.kernels`. Installed by an
explicit `register_varlen_attention()` call (in `rl_lightning.models.loading`), never at import.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rl_lightning.attention import kernels
from rl_lightning.compat.torch import tensor_version

NAME = "rl_varlen"


@dataclass(frozen=True)
class PackedRow:
    """Where the sequences of a packed row are: ``bounds`` (S + 1 offsets) on the host and on the row's device."""

    bounds: tuple[int, ...]
    cu_seqlens: torch.Tensor  # (S + 1,) int32, on the row's device
    max_len: int


class PackedRowCache:
    """The last packed row's metadata, for the later layers of the same forward (`packed_row`).

    Owned by the attention function `register_varlen_attention` registers (one per registration).
    """

    def __init__(self) -> None:
        # (weak reference to the row's position_ids, their version counter, the metadata)
        self.last: tuple[weakref.ref, int | None, PackedRow | None] | None = None


def packed_row(position_ids: torch.Tensor, layer_idx: int | None = None,
               cache: PackedRowCache | None = None) -> PackedRow | None:
    """The sequences of a packed training row (one row, position ids restarting at 0), or None for any other row.

    With a `cache`, computed once per forward, at layer 0, and reused by the other layers (which see the same
    position_ids tensor): the two host syncs it takes (``nonzero``, one ``tolist``) are the forward's, not every
    layer's. A row whose tensor or version changed, or a module without ``layer_idx``, is computed afresh.
    """
    cache = cache if cache is not None else PackedRowCache()
    version = None if position_ids.is_inference() else tensor_version(position_ids)
    cached = cache.last
    if (cached is not None and layer_idx not in (None, 0) and cached[0]() is position_ids
            and cached[1] == version):
        return cached[2]
    row = position_ids[0]
    starts = (row == 0).nonzero().flatten()  # (S,) on the row's device
    bounds = torch.cat([starts, starts.new_full((1,), row.shape[0])])  # (S + 1,) no host-to-device copy
    first, *host = torch.cat([row[:1], bounds]).tolist()
    metadata = None
    if first == 0:
        metadata = PackedRow(tuple(host), bounds.to(torch.int32),
                             max(e - s for s, e in zip(host[:-1], host[1:], strict=True)))
    cache.last = (weakref.ref(position_ids), version, metadata)
    return metadata


def packed_backend(query: torch.Tensor, dropout: float = 0.0) -> str:
    """``"varlen_attn"`` or ``"sdpa"`` for a packed row; varlen_attn has no dropout, so dropout keeps SDPA."""
    return "varlen_attn" if dropout == 0.0 and kernels.uses_flash_kernels(query) else "sdpa"


def packed_varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: Sequence[int],
                       scaling: float | None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """One flash call for the whole packed row.

    Query (1, H, N, D), key/value (1, H_kv, N, D), `bounds` the S + 1 sequence offsets -> (1, N, H, D). Causal is
    ``window_size=(-1, 0)`` in varlen_attn's API. `cu_seqlens`: `bounds` as int32 on the device already (`PackedRow`);
    without it they are copied there.
    """
    from torch.nn.attention.varlen import varlen_attn

    cu = cu_seqlens if cu_seqlens is not None else torch.tensor(bounds, dtype=torch.int32, device=query.device)
    max_len = max(e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True))
    gqa = {}
    if key.shape[1] != query.shape[1]:
        if _varlen_has_gqa():
            gqa["enable_gqa"] = True
        else:  # torch 2.11 has no enable_gqa (and may pick cuDNN kernels): give every query head its K/V
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = varlen_attn(
        query[0].transpose(0, 1).contiguous(), key[0].transpose(0, 1).contiguous(),  # (N, H, D), (N, H_kv, D)
        value[0].transpose(0, 1).contiguous(), cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0), **gqa,
    )  # (N, H, D)
    return out.unsqueeze(0)


@functools.cache
def _varlen_has_gqa() -> bool:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: Sequence[int],
                scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal SDPA per sequence (any device, dtype, dropout): shapes as `packed_varlen_attn`.

    The row is cut with ``split``, whose backward is one concatenation; slicing would give every sequence's gradient its
    own zero-filled row-sized buffer in the backward (O(sequences x N) memory traffic per layer: a fifth of a GRPO
    update here).
    """
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                       enable_gqa=key.shape[1] != query.shape[1])  # (1, H, l, D)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # (1, N, H, D)


def padded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                dropout: float, scaling: float | None) -> torch.Tensor:
    """Padded batches and cached decoding off CUDA: SDPA with grouped K/V heads as they are.

    transformers' SDPA path copies K/V to every query head when there is a mask (its CUDA kernels need that); on CPU
    that copy of the whole KV cache, every layer and decoding step, made masked attention ~10x slower than
    ``enable_gqa``.
    """
    causal = attention_mask is None and query.shape[2] > 1
    if causal and key.shape[2] > query.shape[2]:  # SDPA's causal mask is upper-left: never cached here, but be exact
        raise ValueError("causal attention over a longer key needs an attention mask")
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    ).transpose(1, 2).contiguous()  # (B, N, H, D)


def varlen_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_cache: PackedRowCache | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function: query (B, H, N, D), key/value (B, H_kv, N, D) -> output (B, N, H, D).

    `row_cache` keeps a packed row's offsets for the forward's later layers (`packed_row`).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value = kernels.autocast_inputs(query, key, value)  # before any kernel is chosen from their dtype
    layout = kwargs.get("cp_layout")
    if layout is not None:  # a context-parallel shard of a packed row (rl_lightning.attention.ring)
        from rl_lightning.attention.ring import ring_attention

        return ring_attention(query, key, value, layout, scaling), None
    position_ids = kwargs.get("position_ids")
    packed = (
        attention_mask is None and position_ids is not None and query.shape[0] == 1
        and query.shape[2] == key.shape[2] > 1
    )
    row = packed_row(position_ids, getattr(module, "layer_idx", None), row_cache) if packed else None
    if row is None:
        if query.is_cuda:  # masked GQA would fall back to SDPA's math kernel: transformers repeats K/V instead
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        return padded_sdpa(query, key, value, attention_mask, dropout if module.training else 0.0, scaling), None
    dropout = dropout if module.training else 0.0
    if packed_backend(query, dropout) == "varlen_attn":
        return packed_varlen_attn(query, key, value, row.bounds, scaling, row.cu_seqlens), None
    return packed_sdpa(query, key, value, row.bounds, scaling, dropout), None


def varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask when there is no padding; SDPA's mask for padded batches.

    Packed rows need none: `varlen_attention` isolates the sequences itself, so the O(N^2) block-diagonal mask is
    never built.
    """
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> None:
    """Make ``attn_implementation="rl_varlen"`` available to transformers models (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # Under torch.compile (strategy.compile) attention runs eagerly: its packed-row bookkeeping (host offsets, a
    # cache keyed on layer_idx) would break the graph anyway and recompile once per layer.
    attention = functools.partial(varlen_attention, row_cache=PackedRowCache())
    AttentionInterface.register(NAME, torch.compiler.disable(functools.update_wrapper(attention, varlen_attention)))
    AttentionMaskInterface.register(NAME, varlen_mask)
