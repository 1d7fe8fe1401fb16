"""Attention kernels with the log-sum-exp: the blocks zigzag ring attention is built from; which kernel a tensor gets.

`block_forward` / `block_backward` return and consume the log-sum-exp that `merge_partials` needs to combine partial
attention outputs exactly: torch's aten flash kernels on CUDA fp16/bf16 (`uses_flash_kernels`), explicit fp32 maths
anywhere else. Imports nothing of ours: `rl_lightning.attention.packed` and `rl_lightning.attention.ring`
both build on it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rl_lightning.compat.torch import flash_attention_backward, flash_attention_forward

_HALF = (torch.float16, torch.bfloat16)
_TILE = 1024  # query rows per score tile of the fp32 kernels: (H, 1024, l) scores instead of (H, l, l)


def flash_varlen_available(device: torch.device) -> bool:
    """Torch's varlen flash kernels run on CUDA `device`.

    The module is torch >= 2.10, the kernels need a CUDA build with flash and an Ampere or newer GPU.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def flash_inputs_supported(query: torch.Tensor) -> bool:
    """Whether a flash kernel (torch's or flash-attn's) takes `query`: CUDA, fp16/bf16 (no fp32), head size % 8, <= 256.

    Whether the kernels are there is another question (`flash_varlen_available`, and for ring-flash-attn
    `rl_lightning.attention.ring.flash_attn_status`).
    """
    head_dim = query.shape[-1]
    return query.device.type == "cuda" and query.dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256


def uses_flash_kernels(query: torch.Tensor) -> bool:
    """Whether torch's flash kernels can take `query`: `flash_inputs_supported` and `flash_varlen_available`.

    Never true on CPU, whatever `flash_varlen_available` says.
    """
    return flash_inputs_supported(query) and flash_varlen_available(query.device)


def autocast_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value in one dtype, before a kernel is chosen from query's dtype.

    Inside autocast (``precision: bf16-mixed``) that is the autocast dtype: with fp32 parameters transformers' rotary
    embedding hands back fp32 q and k next to a bf16 v, which would keep every flash kernel away. Outside autocast
    it is the three dtypes' promotion (a no-op when they agree). As autocast, fp64 is left alone.
    """
    device_type = query.device.type
    dtype = None
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    elif not query.dtype == key.dtype == value.dtype:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    if dtype is None:
        return query, key, value
    q, k, v = (t.to(dtype) if t.dtype != dtype and t.dtype != torch.float64 else t for t in (query, key, value))
    return q, k, v


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
    """Gradients of one block given the FINAL out and lse of its queries (over all keys, not just this block's).

    So P = exp(S - lse) are the true attention probabilities: -> dq (n_q, H, D), dk, dv (n_k, H_kv, D).
    """
    if block_backend(q) == "flash":
        return _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)
    with torch.autocast(q.device.type, enabled=False):
        return _math_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B together from attention over A and over B alone, exactly.

    The softmax over A + B re-weights each part by exp(lse_part - lse). out (m, H, D), lse (H, m) -> fp32 out (m, H, D),
    lse (H, m). Rows must have a key in A or B (two empty parts give NaN).
    """
    lse = torch.logaddexp(lse_a.float(), lse_b.float())  # (H, m)
    weight_a = (lse_a - lse).exp().T.unsqueeze(-1)  # (m, H, 1)
    weight_b = (lse_b - lse).exp().T.unsqueeze(-1)
    return out_a.float() * weight_a + out_b.float() * weight_b, lse


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    # The call torch.nn.attention.varlen makes (dropout 0, no debug mask); causal also as window (-1, 0) as it does.
    out, lse, _rng_state, _unused, _debug = flash_attention_forward(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        window_size_left=-1, window_size_right=0 if causal else -1,
    )
    return out, lse  # (n_q, H, D), (H, n_q) fp32


def _flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout 0: the philox state is never read
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
        window_size_left=-1, window_size_right=0 if causal else -1,
    )
    return dq, dk, dv  # GQA: the kernel already sums dk, dv over each group's query heads


def _tiles(cu_q: torch.Tensor, cu_k: torch.Tensor) -> Iterator[tuple[int, int, int, int, int]]:
    """(q_start, q_end, k_start, k_end, diagonal) per query tile of each sequence.

    Query row t of the tile may see key j of its sequence iff ``j <= t + diagonal`` (when causal).
    """
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
