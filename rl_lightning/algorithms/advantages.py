"""Advantage estimators: GAE with a critic, and critic-free group baselines (Dr. GRPO, GRPO, RLOO, REINFORCE++).

`estimate_advantages` also dispatches to the critic estimators of `rl_lightning.algorithms.offpolicy` (V-trace,
Retrace, TD(lambda), n-step).

Shapes: B trajectories, T completion tokens, G completions per prompt (trajectories of a group are contiguous:
``rewards.view(-1, G)``). Outcome rewards are per trajectory (B,); token-level tensors are (B, T) with a
``completion_mask`` that is 1 on completion tokens the loss covers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl_lightning.algorithms.offpolicy import nstep_returns, retrace, td_lambda_returns, vtrace


def gae(
    rewards: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over completion tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t   (V past the last completion token is 0: the episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t

    Paper: Schulman et al. 2016, https://arxiv.org/abs/1506.02438, eq. 16.

    Args:
        rewards: (B, T) per-token rewards (outcome reward on the last token, plus any per-token KL penalty).
        values: (B, T) critic values V(s_t).
        completion_mask: (B, T) 1 on valid completion tokens (one contiguous run per row; rows may be fully
            masked).
        gamma: discount.
        lam: GAE lambda.

    Returns:
        advantages (B, T) and returns (B, T), both zero where the mask is 0.
    """
    mask = completion_mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])  # (B,)
    for t in reversed(range(values.shape[1])):
        next_mask = mask[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        next_value = values[:, t + 1] * next_mask if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running * next_mask) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = False, eps: float = 1e-6
                     ) -> torch.Tensor:
    """Group-mean baseline: A_i = r_i - mean_group(r), with `scale_by_std` (GRPO) divided by the group's std + eps.

    The standard deviation is the unbiased one. Groups whose rewards are all equal get A = 0 either way.

    Without the std division this is Dr. GRPO's estimator (Liu et al. 2025, https://arxiv.org/abs/2503.20783,
    section 3.2), which removes GRPO's difficulty bias; with it, GRPO (Shao et al. 2024,
    https://arxiv.org/abs/2402.03300, eq. 3's outcome supervision).

    Args:
        rewards: (B,) outcome rewards, B = prompts x `group_size`, groups contiguous.
        group_size: G, completions per prompt.
        scale_by_std: divide by the group's standard deviation (GRPO).
        eps: added to the standard deviation.

    Returns:
        (B,) advantages.
    """
    grouped = rewards.view(-1, group_size)  # (B / G, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r)).

    Paper: Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740, eq. 6 (Kool et al. 2019's estimator).

    Args:
        rewards: (B,) outcome rewards, groups of `group_size` >= 2 contiguous.
        group_size: G, completions per prompt.

    Returns:
        (B,) advantages.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 completions per prompt, got {group_size}")
    grouped = rewards.view(-1, group_size)  # (B / G, G)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def discounted_returns(rewards: torch.Tensor, completion_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """(B, T) reward-to-go G_t = sum_{k >= t} gamma^(k - t) r_k over completion tokens (0 where masked).

    Args:
        rewards: (B, T) per-token rewards.
        completion_mask: (B, T).
        gamma: discount.

    Returns:
        (B, T) returns.
    """
    mask = completion_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8,
                  global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(values - mean) / (std + eps) over the masked entries (population std); zero where the mask is 0.

    Args:
        values: (B, T).
        mask: (B, T) 1 on the entries the statistics cover.
        eps: added to the standard deviation.
        global_sum: (default: none) sums a small statistics tensor over every process that holds part of the batch,
            so the mean and std are the whole batch's; it is the only communication, injected by the caller.

    Returns:
        (B, T) whitened values.
    """
    total = global_sum or (lambda x: x)
    m = mask.to(values.dtype)
    stats = total(torch.stack([(values * m).sum(), m.sum()]))
    mean = stats[0] / stats[1].clamp(min=1)
    var = total(((values - mean) * m).pow(2).sum()) / stats[1].clamp(min=1)
    return (values - mean) / (var.sqrt() + eps) * m


def moments_from_sums(total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Population mean and standard deviation of a set from its sums (global sums: the whole set's).

    mean = S1 / n,   std = sqrt(max(S2 / n - mean^2, 0)),   n = max(count, 1)

    The clamps keep an empty set (mean 0, std 0) and rounding (a tiny negative variance) finite.

    Args:
        total: () S1, the sum of the values.
        total_sq: () S2, the sum of their squares.
        count: () how many values.

    Returns:
        () mean and () standard deviation.
    """
    n = count.clamp(min=1)
    mean = total / n
    return mean, (total_sq / n - mean**2).clamp(min=0).sqrt()


def reinforce_pp_advantages(rewards: torch.Tensor, completion_mask: torch.Tensor, gamma: float = 1.0,
                            global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """REINFORCE++: token reward-to-go normalised over the whole (global) batch of completion tokens.

    A_t = whiten_batch(sum_{k >= t} gamma^(k - t) r_k). Paper: Hu 2025, https://arxiv.org/abs/2501.03262, eq. 7-8.

    Args:
        rewards: (B, T) per-token rewards.
        completion_mask: (B, T).
        gamma: discount.
        global_sum: makes the whitening statistics global (see `masked_whiten`).

    Returns:
        (B, T) advantages.
    """
    return masked_whiten(discounted_returns(rewards, completion_mask, gamma), completion_mask, global_sum=global_sum)


def outcome_token_rewards(rewards: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) outcome rewards -> (B, T) per-token rewards, each on its completion's last token.

    A completion with no token left (e.g. a truncated one masked out) gets none.

    Args:
        rewards: (B,) outcome rewards.
        completion_mask: (B, T).

    Returns:
        (B, T) per-token rewards.
    """
    mask = completion_mask.to(torch.float32)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).amax(dim=1)  # (B,)
    token_rewards = torch.zeros_like(mask)
    has_tokens = last >= 0
    token_rewards[has_tokens, last[has_tokens]] = rewards[has_tokens].to(torch.float32)
    return token_rewards


ESTIMATORS = ("drgrpo", "grpo", "rloo", "reinforce_pp", "gae", "vtrace", "retrace", "td_lambda", "nstep")
GROUP_ESTIMATORS = ("drgrpo", "grpo", "rloo")
CRITIC_ESTIMATORS = ("gae", "vtrace", "retrace", "td_lambda", "nstep")  # need the critic's values
OFF_POLICY_ESTIMATORS = ("vtrace", "retrace")  # need target and behaviour log-probs

OutcomeEstimator = Callable[[torch.Tensor, int], torch.Tensor]
"""``estimator(rewards, group_size)``: (B,) outcome rewards (groups of G contiguous) -> (B,) sequence advantages."""

OUTCOME_ESTIMATORS: dict[str, OutcomeEstimator] = {}  # registered critic-free estimators (`register_estimator`)


def register_estimator(name: str, estimator: OutcomeEstimator) -> None:
    """Make `name` a choice of ``model.advantage_estimator``: a critic-free estimator of outcome rewards.

    `estimate_advantages` puts its (B,) advantages on every completion token (plus the reward-to-go of a KL reward),
    as it does for the group estimators; the PPO task takes the name as it takes ``rloo``. Register before the task
    is built (e.g. in the module that defines the estimator, imported by your recipe's callback or script).
    """
    if name in ESTIMATORS:
        raise ValueError(f"advantage estimator '{name}' is built in; register another name")
    OUTCOME_ESTIMATORS[name] = estimator


def estimator_names() -> tuple[str, ...]:
    """Every ``model.advantage_estimator`` choice: the built-in `ESTIMATORS`, then the registered ones."""
    return (*ESTIMATORS, *OUTCOME_ESTIMATORS)


def estimate_advantages(
    estimator: str,
    rewards: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
    kl_penalty: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    target_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    nstep: int = 5,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages (and returns, for the critic) of one rollout, by estimator name.

    - ``drgrpo`` / ``grpo`` / ``rloo``: the outcome reward against its group's baseline (`group_advantages`,
      `rloo_advantages`) on every completion token, plus the reward-to-go of `kl_penalty`;
    - ``reinforce_pp``: `reinforce_pp_advantages` of the outcome reward (on the last token) plus `kl_penalty`,
      whitened over every completion token of the rollout (`global_sum` makes that the global rollout);
    - ``gae``: `gae` of the same token rewards with the critic's `values`;
    - ``vtrace`` / ``retrace`` / ``td_lambda`` / ``nstep``: `vtrace` (`rho_bar`, `c_bar`, `lam`), `retrace` (`lam`),
      `td_lambda_returns` (`lam`), `nstep_returns` (`nstep`) of the same token rewards and `values`; the first two
      weigh by pi / mu = exp(`target_logprobs` - `behaviour_logprobs`).

    Args:
        estimator: one of `ESTIMATORS` or a name given to `register_estimator`.
        rewards: (B,) outcome rewards, groups of `group_size` contiguous.
        completion_mask: (B, T) 1 on each trajectory's completion tokens, in order (T: completion tokens only, so a
            multi-turn trajectory's tool tokens in between are not there).
        group_size: G, completions per prompt.
        kl_penalty: (B, T) per-token reward -coef x KL_t to the reference (KL as a reward), or None.
        values: (B, T) critic values V(s_t) (the critic estimators).
        gamma: discount.
        lam: lambda of ``gae``, ``vtrace``, ``retrace``, ``td_lambda``.
        global_sum: sums a statistics tensor over the processes holding the rollout (``reinforce_pp``).
        target_logprobs: (B, T) log pi (the policy evaluated) of the sampled tokens (``vtrace``, ``retrace``).
        behaviour_logprobs: (B, T) log mu (the sampler) of the sampled tokens (``vtrace``, ``retrace``).
        rho_bar: ``vtrace``'s clip of the TD-error weights.
        c_bar: ``vtrace``'s clip of the traces.
        nstep: steps of ``nstep`` returns.

    Returns:
        advantages (B, T) and returns (B, T) (the critic estimators; None otherwise), zero where the mask is 0.
    """
    if estimator not in estimator_names():
        raise ValueError(f"unknown advantage estimator '{estimator}'; use one of {', '.join(estimator_names())}")
    mask = completion_mask.to(torch.float32)
    if estimator in GROUP_ESTIMATORS or estimator in OUTCOME_ESTIMATORS:
        if estimator in OUTCOME_ESTIMATORS:
            outcome = OUTCOME_ESTIMATORS[estimator](rewards, group_size)
        elif estimator == "rloo":
            outcome = rloo_advantages(rewards, group_size)
        else:
            outcome = group_advantages(rewards, group_size, scale_by_std=estimator == "grpo")
        advantages = broadcast_to_tokens(outcome, mask)
        if kl_penalty is not None:
            advantages = advantages + discounted_returns(kl_penalty, mask)
        return advantages, None
    token_rewards = outcome_token_rewards(rewards, mask)
    if kl_penalty is not None:
        token_rewards = token_rewards + kl_penalty * mask
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(token_rewards, mask, gamma, global_sum), None
    if values is None:
        raise ValueError(f"the {estimator} estimator needs the critic's values")
    if estimator == "gae":
        return gae(token_rewards, values, mask, gamma, lam)
    if estimator == "td_lambda":
        return td_lambda_returns(token_rewards, values, mask, gamma, lam)
    if estimator == "nstep":
        return nstep_returns(token_rewards, values, mask, nstep, gamma)
    if target_logprobs is None or behaviour_logprobs is None:
        raise ValueError(f"the {estimator} estimator needs target and behaviour log-probabilities")
    if estimator == "vtrace":
        return vtrace(token_rewards, values, mask, target_logprobs, behaviour_logprobs, gamma, lam, rho_bar, c_bar)
    return retrace(token_rewards, values, mask, target_logprobs, behaviour_logprobs, gamma, lam)


def broadcast_to_tokens(sequence_values: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-trajectory values -> (B, T) on the completion tokens.

    Args:
        sequence_values: (B,).
        completion_mask: (B, T).

    Returns:
        (B, T) values, 0 off the mask.
    """
    return sequence_values[:, None].to(torch.float32) * completion_mask.to(torch.float32)
