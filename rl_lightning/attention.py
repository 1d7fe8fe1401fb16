"""``rl_varlen``: exact attention for packed sequences in pure PyTorch, on any device.

With a packed micro-batch (one row, position ids restarting per sequence, no attention mask) transformers' stock SDPA
path builds an N x N block-diagonal mask and attends over the whole row: O(N^2) work for O(sum l_i^2) useful work.
``rl_varlen`` instead runs causal SDPA on each sequence separately (the CPU/any-device counterpart of flash-attn's
varlen kernel), and defers to stock SDPA with its mask for padded batches and cached generation. When the forward
carries a ``cp_layout`` (a context-parallel shard), it runs zigzag ring attention over the context-parallel group
(`rl_lightning.parallel.ring_attention`). Installed by an explicit `register_varlen_attention()` call (in
`rl_lightning.models`), never at import.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "rl_varlen"


def sequence_starts(position_ids: torch.Tensor) -> list[int] | None:
    """Start offsets of the packed sequences of one row, or None if the row is not a packed training row."""
    row = position_ids[0]
    if row[0].item() != 0:
        return None
    return (row == 0).nonzero().flatten().tolist()


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
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    bounds = starts + [query.shape[2]]
    dropout = dropout if module.training else 0.0
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=dropout, is_causal=True, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
        )  # (1, H, l, D)
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None  # (1, N, H, D)


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
