"""Policy-gradient and value losses (PPO family) with their reductions.

Per-token tensors are (B, T) over completion tokens; `completion_mask` marks the tokens the loss covers. Reductions
take the global normaliser as an argument (tokens or sequences summed over micro-batches and ranks), so results do
not depend on how a step is split.
"""

from __future__ import annotations

import math

import torch


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate loss, with asymmetric clipping and optional dual clip.

    ratio = exp(logprobs - old_logprobs)
    loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    dual clip (A < 0 only): loss = min(loss, -dual_clip * A), bounding the loss when the ratio explodes.

    Papers: PPO, Schulman et al. 2017, https://arxiv.org/abs/1707.06347, eq. 7; clip-higher (clip_high > clip_low),
    DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476, eq. 10; dual clip, Ye et al. 2020,
    https://arxiv.org/abs/1912.09729, eq. 5.

    Args:
        logprobs: (B, T) current policy log-probabilities (with grad).
        old_logprobs: (B, T) log-probabilities of the policy that sampled (detached).
        advantages: (B, T).
        clip_low: the ratio's lower clip is 1 - clip_low.
        clip_high: the ratio's upper clip is 1 + clip_high.
        dual_clip: c > 1, or None.

    Returns:
        (B, T) per-token losses and per-token float indicators ``clipped`` (the clip term was active) and
        ``dual_clipped``, for the caller to average over the mask.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clipped": (clipped > unclipped).float()}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clipped"] = dual.float()
    return loss, metrics


def gspo_policy_loss(
    logprobs: torch.Tensor,
    sequence_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO-token loss: the PPO clipped surrogate on the sequence-level importance ratio.

    s_i    = exp(mean_t (logprobs_it - old_logprobs_it))     (geometric mean of the token ratios, GSPO eq. 7)
    s_it   = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))   (value s_i, gradient s_i * grad logprobs_it)
    loss_t = -min(s_it * A_it, clip(s_it, 1 - clip_low, 1 + clip_high) * A_it)

    A whole sequence is clipped or not (its tokens share s_i). With the advantage constant over a sequence and its
    token mean (``sequence_mean`` aggregation), the per-sequence gradient is -A_i * grad s_i inside the clip range
    and 0 outside: GSPO's sequence objective. Works on packed tensors: the caller supplies each token's
    sequence log ratio. The paper's clip range is tiny (3e-4 left, 4e-4 right, in its experiments) because s_i is a
    per-token geometric mean; PPO's 0.2 hardly ever clips it.

    Paper: GSPO, Zheng et al. 2025, https://arxiv.org/abs/2507.18071 (GSPO and its GSPO-token variant).

    Args:
        logprobs: (B, T) current policy log-probabilities (with grad).
        sequence_log_ratio: (B, T) each token's sequence mean of (logprobs - old_logprobs) (detached here; see
            `gspo_log_ratios`).
        advantages: (B, T).
        clip_low: s_it's lower clip is 1 - clip_low.
        clip_high: s_it's upper clip is 1 + clip_high.

    Returns:
        (B, T) per-token losses and the per-token float indicator ``clipped``.
    """
    ratio = torch.exp(sequence_log_ratio.detach() + logprobs - logprobs.detach())  # value s_i, grad s_i * dlogp
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), {"clipped": (clipped > unclipped).float()}


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token CISPO loss: REINFORCE weighted by the clipped, stop-gradient importance ratio.

    r_t    = exp(logprobs_t - old_logprobs_t)
    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logprobs_t
    gradient = -sg(clip(r_t)) * A_t * grad logprobs_t: every token keeps a gradient (PPO's clip zeroes the
    clipped tokens' gradient), only its weight is bounded.

    MiniMax-M1 sets no lower bound (clip_low >= 1 here) and tunes only the upper one; ScaleRL uses an upper
    bound of 5 (clip_high = 4); TRL's ``epsilon_high`` for ``cispo`` is that bound itself, not 1 + it.

    Paper: CISPO, MiniMax-M1, MiniMax 2025, https://arxiv.org/abs/2506.13585; ScaleRL, Khatri et al. 2025,
    https://arxiv.org/abs/2510.13786.

    Args:
        logprobs: (B, T) current policy log-probabilities (with grad).
        old_logprobs: (B, T) log-probabilities of the policy that sampled (detached).
        advantages: (B, T).
        clip_low: the weight's lower clip is 1 - clip_low (>= 1: none).
        clip_high: the weight's upper clip is 1 + clip_high.

    Returns:
        (B, T) per-token losses and the per-token float indicator ``clipped`` (the weight was clipped).
    """
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, {"clipped": (weight != ratio).float()}


AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum")


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float | torch.Tensor) -> torch.Tensor:
    """Sum over every masked token / `num_tokens`.

    With the global token count, DAPO's token-level mean (long and short completions weigh by their length; Yu et al.
    2025, https://arxiv.org/abs/2503.14476, section 3.3); with completions x the generation budget, Dr. GRPO's constant
    (Liu et al. 2025, https://arxiv.org/abs/2503.20783, section 3.2).

    Args:
        values: (B, T) per-token losses (packed: (1, N)).
        mask: (B, T) 1 on the tokens the loss covers.
        num_tokens: the global normaliser (see `policy_loss_normaliser`).

    Returns:
        The scalar loss.
    """
    return (values * mask).sum() / num_tokens


def sequence_token_means(sums: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean over its completion tokens, sums_i / max(token_counts_i, 1).

    A sequence without completion tokens has sum 0 and mean 0.

    Args:
        sums: (S,) per-sequence sums over completion tokens.
        token_counts: (S,) completion tokens per sequence.

    Returns:
        (S,) per-sequence means.
    """
    return sums / token_counts.clamp(min=1)


def sequence_mean(loss_sums: torch.Tensor, token_counts: torch.Tensor, num_sequences: float | torch.Tensor
                  ) -> torch.Tensor:
    """GRPO's aggregation: each completion's token mean, summed over completions / `num_sequences`.

    loss = (1 / num_sequences) * sum_i (1 / |o_i|) * sum_t loss_it

    (GRPO, Shao et al. 2024, https://arxiv.org/abs/2402.03300, eq. 3). `num_sequences` is the global number of
    completions (over micro-batches and ranks), so summing this over micro-batches gives the minibatch's mean.

    Args:
        loss_sums: (S,) per-sequence sums of the per-token loss over completion tokens (whole sequences: a
            context-parallel caller completes them over its group first).
        token_counts: (S,) completion tokens per sequence.
        num_sequences: the global normaliser.

    Returns:
        The scalar loss.
    """
    return sequence_token_means(loss_sums, token_counts).sum() / num_sequences


def policy_loss_normaliser(aggregation: str, completions: float, tokens: float, max_completion_tokens: int) -> float:
    """The normaliser of `aggregation` for a minibatch of `completions` with `tokens` completion tokens in all.

    - ``token_mean``: `tokens` (DAPO's token-level mean);
    - ``sequence_mean``: `completions` (GRPO: each completion's token mean, averaged, see `sequence_mean`);
    - ``token_sum``: `completions` x `max_completion_tokens` (Dr. GRPO's constant, independent of the lengths).

    Args:
        aggregation: one of `AGGREGATIONS`.
        completions: completions in the minibatch (global).
        tokens: completion tokens in the minibatch (global).
        max_completion_tokens: the generation budget of one completion.

    Returns:
        The number to divide the summed per-token (or per-sequence) losses by.
    """
    if aggregation == "token_mean":
        return tokens
    if aggregation == "sequence_mean":
        return completions
    if aggregation == "token_sum":
        return completions * max_completion_tokens
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got '{aggregation}'")


def gspo_log_ratios(log_ratio_sums: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """GSPO's per-sequence log importance ratio, log s_i = (1 / |y_i|) * sum_t (logprobs_it - old_logprobs_it).

    s_i is the geometric mean of the sequence's token ratios (GSPO, Zheng et al. 2025,
    https://arxiv.org/abs/2507.18071, eq. 7); `gspo_policy_loss` takes it per token and `skip_mask` judges it.

    Args:
        log_ratio_sums: (S,) per-sequence sums of (logprobs - old_logprobs) over completion tokens.
        token_counts: (S,) completion tokens per sequence (a sequence without any gets log s_i = 0).

    Returns:
        (S,) detached log s_i.
    """
    return sequence_token_means(log_ratio_sums.detach(), token_counts)


def regularised_policy_loss(
    surrogate: torch.Tensor,
    entropy: torch.Tensor,
    entropy_coef: float,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    constraint_penalty: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """The per-token policy loss: the surrogate, plus the KL term, minus the entropy bonus, plus the constraints.

    loss_t = surrogate_t + kl_coef * KL_t - entropy_coef * H_t + penalty_t

    The entropy bonus is PPO's (Schulman et al. 2017, https://arxiv.org/abs/1707.06347, eq. 9), the KL term GRPO's
    (Shao et al. 2024, https://arxiv.org/abs/2402.03300, eq. 3), the penalty `lagrangian_terms`' policy terms.

    Args:
        surrogate: (B, T) per-token surrogate loss (after any mismatch-correction weights).
        entropy: (B, T) per-token entropy of the policy.
        entropy_coef: weight of the entropy bonus.
        kl: (B, T) per-token KL(policy || reference) estimate, or None (KL not in the loss).
        kl_coef: weight of the KL term.
        constraint_penalty: (B, T) sum of the Lagrangian policy terms, or 0.

    Returns:
        (B, T) per-token losses.
    """
    loss = surrogate
    if kl is not None:
        loss = loss + kl_coef * kl
    return loss - entropy_coef * entropy + constraint_penalty


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """Per-token clipped value loss, 0.5 * max((V - R)^2, (V_clipped - R)^2).

    V_clipped = V_old + clip(V - V_old, -clip, clip); plain 0.5 (V - R)^2 when `clip` is None (PPO's value clipping
    as in OpenAI baselines' ppo2).

    Args:
        values: (B, T) the critic's values V (with grad).
        old_values: (B, T) the values at rollout time V_old.
        returns: (B, T) the targets R.
        clip: the clip range, or None.

    Returns:
        (B, T) per-token losses.
    """
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T) entropy of the next-token distribution, H = logsumexp(z) - sum softmax(z) * z, in fp32.

    Args:
        logits: (B, T, V).

    Returns:
        (B, T) entropies.
    """
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def lagrangian_terms(
    log_multiplier: torch.Tensor, measured: torch.Tensor, target: float, sign: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learned Lagrange multiplier keeping a measured quantity on one side of a target.

    The constraint is ``sign * (measured - target) <= 0`` (sign = +1: keep KL below a target; sign = -1: keep entropy
    above a floor). With lambda = exp(log_multiplier) >= 0 and violation g = sign * (measured - target):

    - policy term ``lambda.detach() * g`` (added to the policy loss; gradient flows into `measured`),
    - multiplier loss ``-lambda * g.detach()`` (minimising it raises lambda while the constraint is violated and
      lowers it otherwise: dual gradient ascent).

    Reference: constrained policy optimisation via Lagrangian relaxation, e.g. Stooke et al. 2020,
    https://arxiv.org/abs/2007.03964, eq. 3-4.

    Args:
        log_multiplier: () log lambda.
        measured: the measured quantity, any shape ((B, T) per token, or a scalar mean).
        target: the bound.
        sign: +1 (an upper bound) or -1 (a lower bound).

    Returns:
        The policy term (shaped like `measured`) and the multiplier loss.
    """
    violation = sign * (measured - target)
    multiplier = log_multiplier.exp()
    return multiplier.detach() * violation, -multiplier * violation.detach()


def skip_mask(log_ratio_sums: torch.Tensor, token_counts: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B,) True for the trajectories to skip, whose sequence-level importance ratio leaves [1 / threshold, threshold].

    ratio_i = exp(sum_t m_it (logprobs_it - old_logprobs_it) / sum_t m_it)   (the geometric mean of the per-token
    ratios pi_theta / pi_old, GSPO's sequence ratio); skip_i = |log ratio_i| > log(threshold). A trajectory without
    completion tokens is never skipped (it carries no loss anyway).

    ColossalChat's GRPO ``PolicyLoss`` (``coati/distributed/loss.py``, ``skip_threshold=20``) skips a whole
    micro-batch when the mean of its per-token ratios exceeds the threshold; here each trajectory is judged on its
    own, in both directions, so one stale trajectory does not silence the rest. GSPO: Zheng et al. 2025,
    https://arxiv.org/abs/2507.18071, eq. 7.

    Args:
        log_ratio_sums: (B,) per-trajectory sums of (logprobs - old_logprobs) over completion tokens (detached).
        token_counts: (B,) completion tokens per trajectory.
        threshold: > 1.

    Returns:
        (B,) bool.
    """
    if threshold <= 1.0:
        raise ValueError(f"skip threshold must be > 1, got {threshold}")
    return (gspo_log_ratios(log_ratio_sums, token_counts).abs() > math.log(threshold)) & (token_counts > 0)


def skip_weights(log_ratio_sums: torch.Tensor, token_counts: torch.Tensor, threshold: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`skip_mask` as loss weights: 0 for a skipped trajectory, 1 otherwise, and its share of a skip count.

    A skipped trajectory keeps its share of the loss normaliser (weight 0, not removed). The share is
    1 / (its completion tokens) where skipped, 0 elsewhere, so that summed over a trajectory's tokens it counts
    skipped trajectories.

    Args:
        log_ratio_sums: (B,) per-trajectory sums of (logprobs - old_logprobs) over completion tokens (detached).
        token_counts: (B,) completion tokens per trajectory.
        threshold: > 1.

    Returns:
        (B,) weights and (B,) per-token shares of the skip count.
    """
    skipped = skip_mask(log_ratio_sums, token_counts, threshold).to(token_counts.dtype)
    return 1 - skipped, skipped / token_counts.clamp(min=1)
