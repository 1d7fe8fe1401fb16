"""DAPO dynamic sampling over the data-parallel ranks: keep informative groups, refill from fresh prompts.

The decision is global, so the batch is the one a single process would build from the same global prompt batch:

- each round's extra prompts are one draw of a global batch's worth from the training prompts (a stream seeded by
  the rollout, never the rank), split over the ranks as the data module splits a batch (contiguous shares);
- the ranks sum their kept groups after every round (one all-reduce) and all stop together once the global batch is
  full or the rounds run out, so every rank generates equally often;
- the kept groups are ordered by (round, rank, position), as one process would have kept them, the first global
  batch's worth is taken, and each rank trains on its contiguous share (one ``all_gather_object`` of the kept
  groups at the end).

A rank whose share of a round is empty (fewer training prompts than a global batch) generates a filler under the HF
engine's lockstep (`rl_lightning.engines.lockstep`). Without collectives (``async_steps: 1``, whose rollouts run in
a background thread) each rank refills its own share from its own stream, as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.algorithms.dapo import keep_groups
from rl_lightning.engines.protocol import derive_seed
from rl_lightning.parallel.reductions import Groups, data_parallel_sum
from rl_lightning.rollout.trajectory import Trajectory

__all__ = ["Ranks", "data_parallel_ranks", "refill"]


@dataclass
class Ranks:
    """This rank's place among the data-parallel ranks and their collectives (`total`, `gather`: None on one rank)."""

    rank: int = 0
    size: int = 1
    total: Callable[[int], int] | None = None  # the sum of a count over data-parallel ranks
    gather: Callable[[Any], list[Any]] | None = None  # every data-parallel rank's object, in rank order


def refill(generate: Callable[[list, int], list[Trajectory]], prompts: list, trajectories: list[Trajectory],
           pool: list, group: int, filter_range: tuple[float, float], max_rounds: int, seed: int,
           ranks: Ranks) -> tuple[list[Trajectory], int]:
    """This rank's share of the dynamically sampled batch, and the number of refill rounds taken.

    Args:
        generate: ``generate(prompts, round)``: the scored trajectories of `prompts` (``group`` per prompt) sampled
            in refill round ``round`` (a rank with no prompts generates a filler and gets ``[]``).
        prompts: this rank's share of the rollout's prompt batch (every rank holds as many).
        trajectories: their trajectories (round 0).
        pool: the training prompts refills are drawn from.
        group: completions per prompt.
        filter_range: (low, high): groups whose mean reward lies strictly inside are kept (`keep_groups`).
        max_rounds: generation rounds at most (round 0 included).
        seed: the refill stream's seed (the rollout's; hashed with the rank when several ranks have no collectives).
        ranks: the data-parallel ranks.

    Returns:
        (this rank's trajectories, refill rounds).
    """
    size = ranks.size if ranks.total is not None else 1  # without collectives: a stream and a batch of its own
    rng = random.Random(seed if ranks.total is not None or ranks.size == 1 else derive_seed(seed, ranks.rank))
    target, share = len(prompts) * size, len(prompts)
    kept: list[list[list[Trajectory]]] = []  # per round: this rank's kept groups
    low, high = filter_range
    while True:
        groups = [trajectories[i : i + group] for i in range(0, len(trajectories), group)]
        rewards = torch.tensor([t.reward for t in trajectories])
        mask = keep_groups(rewards, group, low, high).tolist() if groups else []
        kept.append([g for g, k in zip(groups, mask, strict=True) if k])
        count = sum(len(k) for k in kept)
        if (count if ranks.total is None else ranks.total(count)) >= target or len(kept) >= max_rounds:
            break
        draw = rng.sample(pool, k=min(len(pool), target))  # one global draw, split as a batch is
        rank = ranks.rank if ranks.total is not None else 0
        trajectories = generate(draw[rank * share : (rank + 1) * share], len(kept))
    if ranks.gather is None:
        return [t for round_kept in kept for g in round_kept for t in g][: target * group], len(kept) - 1
    every = ranks.gather(kept)  # (rank, round) -> kept groups
    ordered = [g for r in range(len(kept)) for rank_kept in every for g in rank_kept[r]][:target]
    start, end = len(ordered) * ranks.rank // size, len(ordered) * (ranks.rank + 1) // size
    return [t for g in ordered[start:end] for t in g], len(kept) - 1


def data_parallel_ranks(groups: Groups, collectives: bool = True) -> Ranks:
    """This rank's data-parallel coordinates; their collectives when there are several and `collectives` allows them.

    Tensor/context-parallel peers hold the same prompts and agree among themselves: the collectives run over the
    data-parallel group (``groups.dp_group``).
    """
    rank, size = groups.dp_rank, groups.dp_size
    if size == 1 or not collectives:
        return Ranks(rank, size)
    import torch.distributed as dist

    group = groups.dp_group

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * size
        dist.all_gather_object(out, value, group=group)
        return out

    return Ranks(rank, size, lambda count: int(data_parallel_sum(groups, count).item()), gather)
