"""Supervised fine-tuning loss (negative log-likelihood of target tokens)."""

from __future__ import annotations

import torch


def sft_loss(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float | torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level NLL normalised by a caller-supplied token count.

    loss = -(1 / num_tokens) * sum_{b,t} loss_mask[b, t] * logprobs[b, t]

    Passing the *global* number of target tokens in the optimizer step (summed over micro-batches and data-parallel
    ranks, divided by the gradient-averaging factor) makes the gradient independent of how the step is split into
    micro-batches and ranks; passing ``loss_mask.sum()`` gives the per-batch mean.

    Args:
        logprobs: (B, T) log-probabilities of the target tokens.
        loss_mask: (B, T) 1 for target tokens, 0 elsewhere.
        num_tokens: the normaliser (> 0).

    Returns:
        The scalar loss and ``{"nll_sum": sum of masked NLL, "num_tokens": masked token count}`` (both detached).
    """
    mask = loss_mask.to(logprobs.dtype)
    nll_sum = -(logprobs * mask).sum()
    metrics = {"nll_sum": nll_sum.detach(), "num_tokens": mask.sum().detach()}
    return nll_sum / num_tokens, metrics
