r"""Pareto dominance, exact hypervolume and a size-bounded non-dominated archive; every objective is maximised.

Definitions (K objectives, points are rows of an (N, K) tensor):

- ``a`` *dominates* ``b`` when ``a_k >= b_k`` for every k and ``a_k > b_k`` for at least one k (Deb et al. 2002,
  "A fast and elitist multiobjective genetic algorithm: NSGA-II", section III-A). Equal points do not dominate each
  other, so duplicates are both non-dominated.
- The *hypervolume* of a set P against a reference point r is the Lebesgue measure of the region the set dominates
  and that dominates r: ``HV(P, r) = vol( union_{p in P} [r_1, p_1] x ... x [r_K, p_K] )`` (Zitzler & Thiele 1998,
  "Multiobjective optimization using evolutionary algorithms - a comparative case study", PPSN V; the "size of the
  dominated space"). A point with ``p_k <= r_k`` for some k spans an empty box and adds nothing; dominated points and
  duplicates add nothing either.
- The *exclusive contribution* of p in P is ``HV(P, r) - HV(P \ {p}, r)``: the volume only p dominates (Emmerich et
  al. 2005, "An EMO algorithm using the hypervolume measure as selection criterion", SMS-EMOA).

The exact hypervolume is a 2-D sweep for K = 2 (O(N log N)) and, for K >= 3, the hypervolume-by-slicing-objectives
recursion (HSO; While et al. 2006, "A faster algorithm for calculating hypervolume", IEEE TEC 10(1)): slice along the
last objective and sum slab thickness x the (K-1)-dimensional hypervolume of the points above the slab, which costs
O(N^(K-1) log N) here. That is exponential in K, acceptable for the small bounded archives it is meant for.
"""

from __future__ import annotations

import torch


def dominates(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether point `a` (K,) Pareto-dominates point `b` (K,): no worse in every objective, better in one."""
    return bool((a >= b).all() and (a > b).any())


def non_dominated(points: torch.Tensor) -> torch.Tensor:
    """(N,) bool mask of the points (N, K) no other point dominates (duplicates of a non-dominated point all kept).

    Pairwise comparison, O(N^2 K): ``dominated_j = any_i (all_k P_ik >= P_jk and any_k P_ik > P_jk)``.
    """
    if points.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    no_worse = (points[:, None, :] >= points[None, :, :]).all(dim=-1)  # (N, N): row i >= row j everywhere
    better = (points[:, None, :] > points[None, :, :]).any(dim=-1)  # (N, N): row i > row j somewhere
    return ~(no_worse & better).any(dim=0)


def hypervolume(points: torch.Tensor, reference: torch.Tensor) -> float:
    """Exact hypervolume (Zitzler & Thiele 1998) of `points` (N, K) against `reference` (K,), all maximised.

    ``HV = vol( union_i prod_k [r_k, p_ik] )``; points not strictly above the reference in every objective span an
    empty box and are dropped first. Computed in float64: a 2-D sweep for K <= 2, the HSO slicing recursion (While et
    al. 2006) for K >= 3 (see the module docstring for the cost). Returns 0.0 for an empty set.
    """
    points, reference = points.to(torch.float64), reference.to(torch.float64)
    if points.shape[-1] != reference.shape[0]:
        raise ValueError(f"points have {points.shape[-1]} objectives but the reference has {reference.shape[0]}")
    kept = points[(points > reference).all(dim=-1)] if points.shape[0] else points
    return _hypervolume([tuple(p) for p in (kept - reference).tolist()])


def _hypervolume(points: list[tuple[float, ...]]) -> float:
    """HV against the origin of points with every coordinate > 0."""
    if not points:
        return 0.0
    if len(points[0]) == 1:
        return max(p[0] for p in points)
    if len(points[0]) == 2:  # sweep x from high to low, adding each new strip of height y - (best y so far)
        volume, best_y = 0.0, 0.0
        for x, y in sorted(points, reverse=True):
            if y > best_y:
                volume, best_y = volume + x * (y - best_y), y
        return volume
    # HSO: sort by the last objective, high to low; the slab between the i-th and the (i+1)-th value of it is covered
    # by the (K-1)-dimensional projection of the first i points
    ordered = sorted(points, key=lambda p: p[-1], reverse=True)
    volume = 0.0
    for i, p in enumerate(ordered):
        below = ordered[i + 1][-1] if i + 1 < len(ordered) else 0.0
        if p[-1] > below:
            volume += (p[-1] - below) * _hypervolume([q[:-1] for q in ordered[: i + 1]])
    return volume


def exclusive_contributions(points: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    r"""(N,) float64 exclusive hypervolume contribution of each of `points` (N, K): ``HV(P) - HV(P \ {p_i})``.

    Dominated points, duplicates and points not above the reference contribute 0.
    """
    total = hypervolume(points, reference)
    keep = torch.ones(points.shape[0], dtype=torch.bool)
    contributions = []
    for i in range(points.shape[0]):
        keep[i] = False
        contributions.append(total - hypervolume(points[keep], reference))
        keep[i] = True
    return torch.tensor(contributions, dtype=torch.float64).clamp(min=0)  # rounding can leave -1e-17


def update_archive(points: torch.Tensor, reference: torch.Tensor, max_size: int) -> torch.Tensor:
    """Indices (ascending) of the rows of `points` (N, K), oldest first, that form the bounded Pareto archive.

    1. Non-domination: a row dominated by another row leaves; of equal rows only the first (oldest) stays.
    2. Size bound: while more than `max_size` rows are left, the one with the smallest exclusive hypervolume
       contribution against `reference` (K,) leaves (greedily, one at a time, contributions recomputed after each
       removal; SMS-EMOA's selection, Emmerich et al. 2005). Ties (contributions within 1e-12 of the total
       hypervolume, e.g. several points not above the reference, which all contribute 0) drop the newest row, so
       a newcomer must add strictly more than an incumbent to take its place.

    Typical use: ``points = cat([archive, new])``, then keep ``archive_entries[i]`` for the returned indices.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    n = points.shape[0]
    first = torch.ones(n, dtype=torch.bool)
    for j in range(n):  # O(N^2): duplicates of an earlier row
        first[j] = not any(bool((points[i] == points[j]).all()) for i in range(j))
    kept = torch.nonzero(non_dominated(points) & first).flatten()
    while kept.numel() > max_size:
        subset = points[kept]
        contributions = exclusive_contributions(subset, reference)
        tolerance = 1e-12 * max(hypervolume(subset, reference), 1.0)
        tied = torch.nonzero(contributions <= contributions.min() + tolerance).flatten()
        drop = int(tied[-1])  # the newest of the least-contributing rows
        kept = torch.cat([kept[:drop], kept[drop + 1 :]])
    return kept
