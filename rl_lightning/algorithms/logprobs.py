"""Per-token log-probabilities from logits."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities log p(labels | logits / temperature), computed in fp32.

    Uses ``logit[label] - logsumexp(logits)`` instead of materialising ``log_softmax`` over the vocabulary twice.

    Args:
        logits: (B, T, V) or (N, V) next-token logits.
        labels: (B, T) or (N,) token ids aligned with `logits` (already shifted by the caller).
        temperature: sampling temperature the logprobs should correspond to.

    Returns:
        (B, T) or (N,) fp32 log-probabilities.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)
