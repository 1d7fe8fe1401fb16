"""Combining several reward functions into one scalar per trajectory."""

from __future__ import annotations

import torch


def weighted_sum(components: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(B,) sum_k w_k r_k for components (B, K) and weights (K,)."""
    return components @ weights.to(components.dtype)


def tchebycheff(components: torch.Tensor, weights: torch.Tensor, ideal: torch.Tensor) -> torch.Tensor:
    """(B,) weighted Tchebycheff scalarisation, to be maximised: -max_k w_k |z*_k - r_k| with ideal point z*.

    Unlike a weighted sum it can reach every Pareto-optimal trade-off (Miettinen 1999, "Nonlinear Multiobjective
    Optimization", section 3.4); it rewards improving the currently worst-off objective.
    """
    gaps = weights.to(components.dtype) * (ideal.to(components.dtype) - components).abs()  # (B, K)
    return -gaps.max(dim=-1).values
