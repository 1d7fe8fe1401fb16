"""``rl_varlen``: exact attention for packed sequences, plus the block kernels ring attention is built from.

With a packed micro-batch (one row, position ids restarting per sequence, no attention mask) transformers' stock SDPA
path builds an N x N block-diagonal mask and attends over the whole row: O(N^2) work for O(sum l_i^2) useful work.
``rl_varlen`` attends within each sequence instead, with one of two kernels chosen per call by `packed_backend`:

- CUDA with fp16/bf16 and torch's Flash-Attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``,
  torch >= 2.10): one kernel call for the whole row, sequences delimited by ``cu_seqlens``;
- anywhere else (CPU, fp32, older torch, attention dropout): causal SDPA on each sequence in a Python loop.

Padded batches and cached generation go to SDPA with their mask: transformers' own path on CUDA, and off CUDA
`padded_sdpa`, which keeps grouped K/V heads as they are instead of copying them per query head. When the forward carries a ``cp_layout`` (a
context-parallel shard), it runs zigzag ring attention over the context-parallel group
(`rl_lightning.parallel.ring_attention`), whose per-step kernels live here too: `block_forward` / `block_backward`
return and consume the log-sum-exp that `merge_partials` needs, through torch's flash kernels on CUDA fp16/bf16 or
explicit fp32 maths elsewhere. Installed by an explicit `register_varlen_attention()` call (in
`rl_lightning.models`), never at import.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

NAME = "rl_varlen"
_HALF = (torch.float16, torch.bfloat16)
_TILE = 1024  # query rows per score tile of the fp32 kernels: (H, 1024, l) scores instead of (H, l, l)


def sequence_starts(position_ids: torch.Tensor) -> list[int] | None:
    """Start offsets of the packed sequences of one row, or None if the row is not a packed training row."""
    row = position_ids[0]
    if row[0].item() != 0:
        return None
    return (row == 0).nonzero().flatten().tolist()


def flash_varlen_available(device: torch.device) -> bool:
    """torch's varlen flash kernels run on CUDA `device`: the module is torch >= 2.10, the kernels need a CUDA build
    with flash and an Ampere or newer GPU."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def uses_flash_kernels(query: torch.Tensor) -> bool:
    """Whether torch's flash kernels can take `query`: CUDA, fp16/bf16 (flash has no fp32), a head size they
    support. Never true on CPU, whatever `flash_varlen_available` says."""
    head_dim = query.shape[-1]
    return (query.device.type == "cuda" and query.dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256
            and flash_varlen_available(query.device))


def packed_backend(query: torch.Tensor, dropout: float = 0.0) -> str:
    """``"varlen_attn"`` or ``"sdpa"`` for a packed row; varlen_attn has no dropout, so dropout keeps SDPA."""
    return "varlen_attn" if dropout == 0.0 and uses_flash_kernels(query) else "sdpa"


def packed_varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                       scaling: float | None) -> torch.Tensor:
    """One flash call for the whole packed row: query (1, H, N, D), key/value (1, H_kv, N, D), `bounds` the S + 1
    sequence offsets -> (1, N, H, D). Causal is ``window_size=(-1, 0)`` in varlen_attn's API."""
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
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


def packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int],
                scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal SDPA per sequence (any device, dtype, dropout): shapes as `packed_varlen_attn`. The row is cut with
    ``split``, whose backward is one concatenation; slicing would give every sequence's gradient its own zero-filled
    row-sized buffer in the backward (O(sequences x N) memory traffic per layer: a fifth of a GRPO update here)."""
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                       enable_gqa=key.shape[1] != query.shape[1])  # (1, H, l, D)
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()  # (1, N, H, D)


def padded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                dropout: float, scaling: float | None) -> torch.Tensor:
    """Padded batches and cached decoding off CUDA: SDPA with grouped K/V heads as they are. transformers' SDPA path
    copies K/V to every query head when there is a mask (its CUDA kernels need that); on CPU that copy of the whole
    KV cache, every layer and decoding step, made masked attention ~10x slower than ``enable_gqa``."""
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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (B, H, N, D), key/value (B, H_kv, N, D) -> output (B, N, H, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = kwargs.get("cp_layout")
    if layout is not None:  # a context-parallel shard of a packed row (rl_lightning.parallel.ring_attention)
        from rl_lightning.parallel.ring_attention import ring_attention

        return ring_attention(query, key, value, layout, scaling), None
    position_ids = kwargs.get("position_ids")
    packed = (
        attention_mask is None and position_ids is not None and query.shape[0] == 1
        and query.shape[2] == key.shape[2] > 1
    )
    starts = sequence_starts(position_ids) if packed else None
    if starts is None:
        if query.is_cuda:  # masked GQA would fall back to SDPA's math kernel: transformers repeats K/V instead
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        return padded_sdpa(query, key, value, attention_mask, dropout if module.training else 0.0, scaling), None
    bounds = starts + [query.shape[2]]
    dropout = dropout if module.training else 0.0
    if packed_backend(query, dropout) == "varlen_attn":
        return packed_varlen_attn(query, key, value, bounds, scaling), None
    return packed_sdpa(query, key, value, bounds, scaling, dropout), None


def varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask when there is no padding (packed rows: `varlen_attention` isolates the sequences itself, so the
    O(N^2) block-diagonal mask is never built); SDPA's mask for padded batches."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> None:
    """Make ``attn_implementation="rl_varlen"`` available to transformers models (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)


# Block kernels with log-sum-exp, for ring attention. Layout is varlen's: q (n_q, H, D), k/v (n_k, H_kv, D),
# sequence s of the block is rows cu_q[s]:cu_q[s+1] of q against rows cu_k[s]:cu_k[s+1] of k; lse is (H, n_q) fp32.
# Causal blocks align the last query with the last key (flash's convention; ring attention only uses n_q == n_k).


def block_backend(query: torch.Tensor) -> str:
    """``"flash"`` (torch's aten flash kernels) or ``"math"`` (exact fp32, any device) for a ring-attention step."""
    return "flash" if uses_flash_kernels(query) else "math"


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block -> out (n_q, H, D) (q's dtype on flash, fp32 on math), lse (H, n_q) fp32."""
    if block_backend(q) == "flash":
        return _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    with torch.autocast(q.device.type, enabled=False):  # fp32 even inside a bf16-mixed forward
        return _math_forward(q, k, v, cu_q, cu_k, causal, scale)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL out and lse of its queries (over all keys, not just this block's), so
    that P = exp(S - lse) are the true attention probabilities: -> dq (n_q, H, D), dk, dv (n_k, H_kv, D)."""
    if block_backend(q) == "flash":
        return _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    with torch.autocast(q.device.type, enabled=False):
        return _math_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B together from attention over A and over B alone, exactly: the softmax over A + B
    re-weights each part by exp(lse_part - lse). out (m, H, D), lse (H, m) -> fp32 out (m, H, D), lse (H, m).
    Rows must have a key in A or B (two empty parts give NaN)."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())  # (H, m)
    weight_a = (lse_a - lse).exp().T.unsqueeze(-1)  # (m, H, 1)
    weight_b = (lse_b - lse).exp().T.unsqueeze(-1)
    return out_a.float() * weight_a + out_b.float() * weight_b, lse


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    # The call torch.nn.attention.varlen makes (dropout 0, no debug mask); causal also as window (-1, 0) as it does.
    out, lse, _rng_state, _unused, _debug = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        window_size_left=-1, window_size_right=0 if causal else -1,
    )
    return out, lse  # (n_q, H, D), (H, n_q) fp32


def _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: the philox state is never read
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
        window_size_left=-1, window_size_right=0 if causal else -1,
    )
    return dq, dk, dv  # GQA: the kernel already sums dk, dv over each group's query heads


def _tiles(cu_q: torch.Tensor, cu_k: torch.Tensor) -> Iterator[tuple[int, int, int, int, int]]:
    """(q_start, q_end, k_start, k_end, diagonal) per query tile of each sequence; query row t of the tile may see
    key j of its sequence iff ``j <= t + diagonal`` (when causal)."""
    for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(),
                              strict=True):
        for ts in range(qs, qe, _TILE):
            yield ts, min(ts + _TILE, qe), ks, ke, (ts - qs) + (ke - ks) - (qe - qs)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, diagonal: int) -> torch.Tensor:
    """fp32 q (t, H, D), k (l, H, D) -> scaled scores (H, t, l), -inf where causality hides the key."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        hidden = torch.arange(k.shape[0], device=q.device)[None, :] > rows + diagonal  # (t, l)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _math_forward(q, k, v, cu_q, cu_k, causal, scale):
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))  # (n_k, H, D): SDPA's GQA head order
    out = q.new_zeros(q.shape, dtype=torch.float32)  # (n_q, H, D)
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)  # (H, n_q)
    for qs, qe, ks, ke, diagonal in _tiles(cu_q, cu_k):
        scores = _scores(q[qs:qe].float(), k[ks:ke], scale, causal, diagonal)  # (H, t, l)
        lse[:, qs:qe] = scores.logsumexp(-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", (scores - lse[:, qs:qe, None]).exp(), v[ks:ke])
    return out, lse


def _math_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    # Flash backward: D = rowsum(dout * out), P = exp(S - lse), dS = P (dout V^T - D), dQ = scale dS K,
    # dK = scale dS^T Q, dV = P^T dout.
    heads, kv_heads = q.shape[1], k.shape[1]
    k_full, v_full = (t.float().repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # (n_k, H, D)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(k_full), torch.zeros_like(v_full)  # (n_k, H, D) until the group sum
    delta = (dout.float() * out.float()).sum(-1).T  # (H, n_q)
    for qs, qe, ks, ke, diagonal in _tiles(cu_q, cu_k):
        q_tile, dout_tile = q[qs:qe].float(), dout[qs:qe].float()  # (t, H, D)
        probs = (_scores(q_tile, k_full[ks:ke], scale, causal, diagonal) - lse[:, qs:qe, None]).exp()  # (H, t, l)
        dprobs = torch.einsum("qhd,khd->hqk", dout_tile, v_full[ks:ke])
        dscores = probs * (dprobs - delta[:, qs:qe, None])  # (H, t, l)
        dq[qs:qe] = torch.einsum("hqk,khd->qhd", dscores, k_full[ks:ke]) * scale
        dk[ks:ke] += torch.einsum("hqk,qhd->khd", dscores, q_tile) * scale
        dv[ks:ke] += torch.einsum("hqk,qhd->khd", probs, dout_tile)
    # (n_k, H, D) -> (n_k, H_kv, H / H_kv, D) -> sum over each group's query heads
    dk, dv = (t.view(t.shape[0], kv_heads, heads // kv_heads, t.shape[-1]).sum(2) for t in (dk, dv))
    return dq, dk, dv
