"""Balanced sequence packing: split one optimizer step's sequences into per-rank micro-batches under a token budget.

Two levels of Karmarkar–Karp (largest differencing) partitioning, as RL2/verl balance sequence lengths:

1. the step's sequences into `dp_size` groups with near-equal token sums (one per data-parallel rank);
2. each group into `num_micro_batches` micro-batches, the same number on every rank (FSDP collectives need every rank
   to run the same number of forward/backward passes), each at most `max_tokens` tokens; the number grows until every
   micro-batch fits.

Packed micro-batches concatenate sequences into one row; position ids restart at 0 for each sequence, which is what
makes the attention block-diagonal (transformers derives the mask from the resets when ``attention_mask`` is None and
``use_cache=False``; flash-attn varlen and ring attention use ``cu_seqlens``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from rl_lightning.errors import ConfigError


def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:
    """Partition item indices into `k` subsets with near-equal weight sums (largest differencing method).

    Every item starts as a partial solution (itself in one subset, k-1 empty subsets). The two partial solutions with
    the largest spread are merged by pairing the heaviest subset of one with the lightest of the other, which
    cancels their differences; this repeats until one solution is left. Karmarkar & Karp (1982),
    "The differencing method of set partitioning"; k-way version: Korf (1998).

    Returns:
        k lists of indices (each sorted); some are empty when there are fewer than k items.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for index, weight in enumerate(weights):
        subsets = [(weight, [index])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-weight, index, subsets))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, tie, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        heavy_first = sorted(first, key=lambda s: -s[0])
        light_second = sorted(second, key=lambda s: s[0])
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(heavy_first, light_second, strict=True)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie, merged))
    subsets = heap[0][2]
    return [sorted(indices) for _, indices in sorted(subsets, key=lambda s: -s[0])]


def plan_micro_batches(lengths: Sequence[int], dp_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Assign sequences to data-parallel ranks and micro-batches.

    Args:
        lengths: token count of each packing unit (a sequence, or a chosen+rejected pair).
        dp_size: number of data-parallel ranks.
        max_tokens: token budget of one micro-batch (``max_length_per_device``).

    Returns:
        ``plan[rank][micro_batch]`` = indices into `lengths`; every rank has the same number of micro-batches and
        every micro-batch sums to at most `max_tokens` (a micro-batch may be empty when a rank has few units).
    """
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ConfigError(
            f"a packing unit has {longest} tokens but max_length_per_device is {max_tokens}; "
            "raise data.max_length_per_device or lower data.max_length"
        )
    groups = karmarkar_karp(lengths, dp_size)
    num = max(1, max(math.ceil(sum(lengths[i] for i in g) / max_tokens) for g in groups))
    while True:
        plan = []
        for group in groups:
            parts = karmarkar_karp([lengths[i] for i in group], num)
            plan.append([[group[j] for j in part] for part in parts])
        if all(sum(lengths[i] for i in mb) <= max_tokens for rank in plan for mb in rank):
            return plan
        num += 1
