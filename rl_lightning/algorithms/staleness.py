"""Mismatch correction for trajectories whose tokens were sampled by several policy versions (in-flight updates).

With in-flight weight updates (partial rollouts) a completion's tokens come from the engine at different policy
versions: the first ones from version v, the rest, after a weight load mid-generation, from v + 1. Token t was
sampled from mu_{v_t}, the engine's policy at its version v_t, so the importance ratio that corrects it is

    r_t = pi_old(y_t | y_<t) / mu_{v_t}(y_t | y_<t),   log r_t = old_logprobs_t - engine_logprobs_t,

where ``engine_logprobs_t`` must be the log-probability that version v_t reported when it sampled the token (not a
later version's re-score of it): the behaviour policy of a partial rollout is the sequence of versions that sampled
it, and each factor of the sequence's probability is that token's own version's (decoupled PPO, Hilton et al. 2021,
https://arxiv.org/abs/2110.00641, with a per-token behaviour policy as in AReaL, Fu et al. 2025,
https://arxiv.org/abs/2505.24298, and PipelineRL, Piche et al. 2025, https://arxiv.org/abs/2509.19128). The lag
l_t = (trained version) - v_t counts the policy updates between sampling and training: 0 for tokens sampled in flight
by the policy being trained (r_t then measures only the engine/trainer numerics), >= 1 for older ones.

`versioned_mismatch_weights` applies `rl_lightning.algorithms.correction.mismatch_weights` (truncate or mask) to each
token's own ratio and drops tokens lagging more than ``max_lag`` updates (weight 0, counted as masked).
"""

from __future__ import annotations

import torch

from rl_lightning.algorithms.correction import mismatch_weights


def versioned_mismatch_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, policy_lags: torch.Tensor,
                               mode: str, low: float | None, high: float, max_lag: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token detached weights w_t = f(pi_old(y_t) / mu_{v_t}(y_t)), 0 where l_t > `max_lag`; masked indicators.

    f is ``truncate`` (clamp to [low, high]) or ``mask`` (0 outside [low, high]), as in `mismatch_weights`.

    Args:
        old_logprobs: (B, T) the trainer's log-probabilities of the sampled tokens (the proximal policy pi_old).
        engine_logprobs: (B, T) each token's log-probability as reported by the engine version that sampled it.
        policy_lags: (B, T) trained version - the token's version (>= 0 on completion tokens).
        mode: ``truncate`` or ``mask``.
        low: lower bound, or None.
        high: upper bound.
        max_lag: tokens lagging more updates get weight 0; None: no limit.

    Returns:
        (B, T) weights and (B, T) float indicators of the tokens masked (by the ratio or by the lag).

    Raises:
        ValueError: a negative lag (a token sampled by a newer policy than the one trained).
    """
    if bool((policy_lags < 0).any()):
        raise ValueError(f"policy_lags must be >= 0 (trained version - sampling version), got {policy_lags.min()}")
    log_ratio = (old_logprobs - engine_logprobs).float()  # log r_t against the token's own version
    weights, masked = mismatch_weights(log_ratio, mode, low, high)
    if max_lag is None:
        return weights, masked
    too_old = policy_lags > max_lag
    return weights.masked_fill(too_old, 0.0), torch.maximum(masked, too_old.to(masked.dtype))


def lag_shares(policy_lags: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token metrics of the lags: ``policy_lag`` (the lag) and ``stale_tokens`` (1 where the lag is >= 1).

    Args:
        policy_lags: (B, T) lags (sum them over completion tokens and divide by their count for means).

    Returns:
        (B, T) float tensors by metric name.
    """
    lags = policy_lags.float()
    return {"policy_lag": lags, "stale_tokens": (lags >= 1).float()}
