"""Rollout/trainer mismatch correction: importance weights pi_old / pi_engine, truncated or masked.

Weights are per token or per sequence. The inference engine (vLLM) samples from mu = pi_engine, which differs from
the trainer's pi_old = pi_theta_old on the same weights (kernels, precision, a lagging weight sync). With
r_t = pi_old(y_t) / mu(y_t) (``old_logprobs - engine_logprobs`` in log space), the per-token policy loss is
multiplied by a detached weight w:

==========  ===========================================  ==================================================
level       ratio                                        shared by the tokens of
==========  ===========================================  ==================================================
token       r_t                                          itself
sequence    prod_t r_t = exp(sum_t log r_t)              its sequence (the exact sequence IS weight)
geometric   exp(mean_t log r_t)                          its sequence (length-normalised, biased, bounded)
==========  ===========================================  ==================================================

- ``truncate`` (TIS): w = clamp(ratio, low, high) (no lower clamp when low is None);
- ``mask`` (MIS, rejection): w = ratio inside [low, high], 0 outside. Token level = IcePop (Ling team 2025, "small
  leak can sink a great ship", https://ringtech.notion.site/icepop, M(k) = k for k in [alpha, beta], else 0);
  geometric level = OpenRLHF's/NeMo-RL's ``seq-mask-tis`` criterion.

Papers: truncated IS for the engine/trainer mismatch, Yao et al. 2025, https://fengyao.notion.site/off-policy-rl;
masked IS and the token/sequence/geometric levels, Liu et al. 2025, "When speed kills stability",
https://yingru.notion.site/When-Speed-Kills-Stability-271211a558b7808d8b12d403fd15edda (the analysis behind verl's
Rollout Correction). TRL 1.16's ``vllm_importance_sampling_mode`` offers token/sequence x truncate/mask, with
sequence = the sum of log ratios as here.
"""

from __future__ import annotations

import math

import torch

CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "mask")


def sequence_log_ratios(log_ratio_sums: torch.Tensor, token_counts: torch.Tensor, level: str) -> torch.Tensor:
    """(S,) per-sequence log ratios for `level` ``sequence`` (the sums) or ``geometric`` (the means).

    Args:
        log_ratio_sums: (S,) per-sequence sums of (old_logprobs - engine_logprobs) over completion tokens.
        token_counts: (S,) completion tokens per sequence (a sequence without any gets log ratio 0).
        level: ``sequence`` (log prod_t r_t) or ``geometric`` (mean_t log r_t).

    Returns:
        (S,) log ratios.
    """
    if level == "sequence":
        return log_ratio_sums
    if level == "geometric":
        return log_ratio_sums / token_counts.clamp(min=1)
    raise ValueError(f"sequence level must be 'sequence' or 'geometric', got '{level}'")


def mismatch_weights(log_ratio: torch.Tensor, mode: str, low: float | None, high: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached importance weights from log ratios log(pi_old / pi_engine), and the indicator of the masked entries.

    truncate: w = clamp(exp(log_ratio), low, high), nothing masked;
    mask:     w = exp(log_ratio) if low <= exp(log_ratio) <= high else 0 (low None: 0), masked = 1 outside.

    Comparisons are made in log space (log ratios of hundreds of tokens overflow exp), and a weight is at most
    `high`.

    Args:
        log_ratio: log ratios, any shape ((B, T) tokens or (S,) sequences).
        mode: ``truncate`` or ``mask``.
        low: lower bound, or None (none).
        high: upper bound.

    Returns:
        Weights and float masked indicators, both shaped like `log_ratio`.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode must be one of {', '.join(CORRECTION_MODES)}, got '{mode}'")
    log_ratio = log_ratio.detach()
    log_low = -math.inf if low is None or low <= 0 else math.log(low)
    clamped = log_ratio.clamp(min=log_low, max=math.log(high))
    if mode == "truncate":
        return clamped.exp(), torch.zeros_like(log_ratio)
    inside = (log_ratio >= log_low) & (log_ratio <= math.log(high))
    return torch.where(inside, clamped.exp(), torch.zeros_like(log_ratio)), (~inside).to(log_ratio.dtype)


def sequence_mismatch_weights(log_ratio_sums: torch.Tensor, token_counts: torch.Tensor, level: str, mode: str,
                              low: float | None, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence weights at level ``sequence`` or ``geometric``, and each sequence's per-token share of a mask count.

    w_i = `mismatch_weights` of `sequence_log_ratios` (sum_t log r_it, or its mean); every token of sequence i is
    weighed by w_i. The share is masked_i / |y_i| (1 / its completion tokens where masked, else 0), so that summed
    over a sequence's tokens it counts masked sequences.

    Args:
        log_ratio_sums: (S,) per-sequence sums of (old_logprobs - engine_logprobs) over completion tokens (whole
            sequences: a context-parallel caller completes them over its group first).
        token_counts: (S,) completion tokens per sequence.
        level: ``sequence`` or ``geometric``.
        mode: ``truncate`` or ``mask``.
        low: lower bound, or None.
        high: upper bound.

    Returns:
        (S,) detached weights and (S,) per-token shares of the masked count.
    """
    weights, masked = mismatch_weights(sequence_log_ratios(log_ratio_sums, token_counts, level), mode, low, high)
    return weights, masked / token_counts.clamp(min=1)


def mismatch_kl(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi_engine || pi_old) on the engine's samples.

    Schulman's k3, r - 1 - log r with r = pi_old / pi_engine (unbiased, >= 0; http://joschu.net/blog/kl-approx.html).

    Args:
        old_logprobs: (B, T) the trainer's log-probabilities of the sampled tokens.
        engine_logprobs: (B, T) the engine's.

    Returns:
        (B, T) detached estimates.
    """
    log_ratio = (old_logprobs - engine_logprobs).detach()
    return torch.expm1(log_ratio) - log_ratio
