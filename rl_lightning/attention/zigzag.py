"""The zigzag layout of packed micro-batches over the context-parallel group, and its inverse.

Layout (as RL2 and ring-flash-attn's zigzag varlen kernel expect): every packed sequence is padded to a multiple of
``2 * cp`` tokens and cut into ``2 * cp`` equal chunks; context-parallel rank r keeps chunks r and ``2cp - 1 - r``, so
each rank holds the same share of early (cheap) and late (expensive) causal queries. `shard_micro_batch` applies it
to every per-token tensor of a micro-batch (targets already sit at the token that predicts them, so slicing is
exact); `gather_tokens` undoes it for per-token outputs. `rl_lightning.attention.ring` attends over it, with
the row sets of `zigzag_blocks` (made once per micro-batch and carried by the layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ZigzagBlocks:
    """Row sets of a rank's zigzag share, the same on every rank.

    Sequence s is local rows ``cu[s]:cu[s+1]``, its early chunk first, then its late chunk, each `chunk_cu`-sized.
    """

    cu: torch.Tensor  # (S + 1,) int32
    chunk_cu: torch.Tensor  # (S + 1,) int32: half of `cu`
    max_len: int
    max_chunk: int
    early: torch.Tensor  # (n / 2,) rows of the early chunks
    late: torch.Tensor  # (n / 2,) rows of the late chunks


def zigzag_blocks(local_cu_seqlens: torch.Tensor, device: torch.device | str = "cpu") -> ZigzagBlocks:
    """The row sets from ``layout.local_cu_seqlens`` (S + 1,), indices on `device`.

    The varlen kernels want int32 offsets, maximum lengths as Python ints so no kernel call waits on the GPU.
    """
    cu = local_cu_seqlens.to(torch.int32).cpu()
    starts, lengths = cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()
    early = [torch.arange(s, s + n // 2) for s, n in zip(starts, lengths, strict=True)]
    late = [torch.arange(s + n // 2, s + n) for s, n in zip(starts, lengths, strict=True)]
    return ZigzagBlocks(cu.to(device), (cu // 2).to(device), max(lengths), max(lengths) // 2,
                        torch.cat(early).to(device), torch.cat(late).to(device))


@dataclass
class ZigzagLayout:
    """Where each local token of this rank comes from.

    `local_index` (n,) indexes the padded row; `source` (N',) maps the padded row to the original row (-1 = padding);
    `local_cu_seqlens` (S + 1,) are this rank's sequence offsets (each sequence contributes ``padded_length / cp``
    tokens).
    """

    local_index: torch.Tensor
    source: torch.Tensor
    local_cu_seqlens: torch.Tensor
    padded_lengths: list[int]
    rank: int
    size: int
    group: Any
    blocks: ZigzagBlocks | None = None  # the ring's row sets, made once per micro-batch on its device


class _AllGather(torch.autograd.Function):
    """For `gather_tokens`. All-gather over `group` -> (size, *shape).

    The backward sums every rank's gradient for this rank's piece (a reduce-scatter, done as all-reduce + slice, which
    gloo supports). torch.distributed.nn's version breaks on sub-groups under gloo (its backward scatters with group
    ranks taken as global ranks).
    """

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
    """The zigzag layout of a packed row with sequence offsets `cu_seqlens` (S + 1,) for rank `rank` of `size`."""
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
    layout.blocks = zigzag_blocks(local_cu)
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
    """This context-parallel rank's zigzag share of a packed micro-batch (per-token tensors sliced, scalars kept).

    It also carries ``cp_layout`` for the attention and for `gather_tokens`, with the ring's row sets (`blocks`)
    already on the micro-batch's device, so that no layer's attention copies or syncs for them.
    """
    layout = zigzag_layout(micro_batch["cu_seqlens"].cpu(), rank, size, group)
    local = dict(micro_batch)
    length = micro_batch["input_ids"].shape[1]
    token_keys = [k for k, v in micro_batch.items() if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == length]
    for key in token_keys:
        row = micro_batch[key]
        padded = _pad_row(row, layout.source.to(row.device), key, layout.padded_lengths)
        local[key] = padded[:, layout.local_index.to(row.device)]
    device = micro_batch["input_ids"].device
    if device.type != "cpu":  # once per micro-batch, not per layer (zigzag_layout made them on the host)
        layout.blocks = zigzag_blocks(layout.local_cu_seqlens, device)
    local["cp_layout"] = layout
    return local


def gather_tokens(local: torch.Tensor, layout: ZigzagLayout) -> torch.Tensor:
    """(1, n, ...) per-token values of this rank -> (1, N, ...) for the whole original row, in order.

    Differentiable, but meant for outputs every rank then uses differently or not at all (e.g. logging, rollout
    logprobs): a loss computed identically on every rank from the gathered row would count each gradient `size` times.
    """
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


def shard_tokens(tensor: torch.Tensor, layout: ZigzagLayout, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of a per-token tensor whose `dim` is the original row (N), padding as zeros."""
    real = (layout.source >= 0).to(tensor.device)
    padded = tensor.index_select(dim, layout.source.clamp(min=0).to(tensor.device))  # N -> N' along dim
    padded = padded * real.view([-1 if i == dim else 1 for i in range(tensor.dim())])
    return padded.index_select(dim, layout.local_index.to(tensor.device))  # N' -> n
