"""Off-policy (and bootstrapped) return and advantage estimators with a critic.

V-trace, Retrace(lambda) for state values, TD(lambda) returns, n-step returns, clipped importance sampling weights.

Conventions are `rl_lightning.algorithms.advantages.gae`'s: B trajectories, T completion tokens; ``rewards`` (B, T)
are per-token (the outcome reward on the last completion token, plus any per-token KL penalty); ``values`` (B, T)
are the critic's V(s_t); ``completion_mask`` (B, T) is 1 on one contiguous run of completion tokens per row (rows
may be fully masked). The episode ends after the last completion token, so V there is 0 (no bootstrap past it).
Every output is zero where the mask is 0. ``target_logprobs`` / ``behaviour_logprobs`` (B, T) are the log-probs of
the sampled tokens under the policy being evaluated (pi) and under the policy that sampled them (mu);
rho_t = pi(a_t | s_t) / mu(a_t | s_t).

When each applies (in the PPO task, ``model.advantage_estimator``):

- ``vtrace`` / ``retrace``: the tokens were sampled by a policy mu other than the one whose advantages PPO needs.
  In the PPO task mu is the inference engine (``target_engine_logprobs``) and pi is the trainer at score time
  (``old_logprobs``): they differ through engine/trainer numerics (vLLM kernels, bf16, quantisation), an engine whose
  weights lag the trainer's (asynchronous or off-policy reuse of trajectories). Both reduce to the on-policy
  lambda-return (GAE) when rho = 1. They do *not* correct the staleness of later minibatches within a rollout
  (``update_per_rollout`` > 1): advantages are computed once, against the score-time policy, and PPO's clipped ratio
  pi_theta / pi_old handles that drift.
- ``td_lambda``: on-policy lambda-returns (the same targets as ``gae``, written as returns); no correction.
- ``nstep``: on-policy n-step bootstrapped returns: lower variance than Monte-Carlo with a short horizon, more bias
  from the critic; no correction.
- `clipped_importance_weights`: min(rho_t, cap), the building block of the truncations above (and of truncated
  importance sampling of the loss).
"""

from __future__ import annotations

import torch


def clipped_importance_weights(target_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                               completion_mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Clipped per-token importance weights min(rho_t, cap), rho_t = exp(log pi(a_t|s_t) - log mu(a_t|s_t)).

    Clipping at `cap` bounds the variance at the price of bias (Espeholt et al. 2018, https://arxiv.org/abs/1802.01561,
    section 4.1: rho-bar and c-bar; Munos et al. 2016, https://arxiv.org/abs/1606.02647, with cap 1).

    Args:
        target_logprobs: (B, T) log pi of the sampled tokens.
        behaviour_logprobs: (B, T) log mu of the same tokens.
        completion_mask: (B, T).
        cap: > 0.

    Returns:
        (B, T) detached weights, 0 where the mask is 0.
    """
    mask = completion_mask.to(torch.float32)
    rho = torch.exp(target_logprobs.float() - behaviour_logprobs.float())
    return (rho.clamp(max=cap) * mask).detach()


def _next(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T) the value at t + 1, 0 past the last completion token (the episode ends there)."""
    shifted = torch.zeros_like(x)
    shifted[:, :-1] = x[:, 1:] * mask[:, 1:]
    return shifted


def vtrace(rewards: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor, target_logprobs: torch.Tensor,
           behaviour_logprobs: torch.Tensor, gamma: float = 1.0, lam: float = 1.0, rho_bar: float = 1.0,
           c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets v_s and policy-gradient advantages.

    IMPALA, Espeholt et al. 2018, https://arxiv.org/abs/1802.01561, eq. 1 and section 4.2; eq. 1 is lam = 1, lam < 1
    scales the traces as in Retrace. The paper assumes rho-bar >= c-bar.

    rho_t   = min(rho-bar, pi_t / mu_t),   c_t = lam * min(c-bar, pi_t / mu_t)
    delta_t = rho_t * (r_t + gamma * V_{t+1} - V_t)
    v_s     = V_s + sum_{t >= s} gamma^(t - s) (prod_{i=s}^{t-1} c_i) delta_t
            = V_s + delta_s + gamma * c_s * (v_{s+1} - V_{s+1})           (the recursion computed here)
    A_s     = rho_s * (r_s + gamma * v_{s+1} - V_s)                         (the policy-gradient advantage)

    with V and v past the last completion token 0. With pi = mu and rho-bar = c-bar = 1, v_s is the on-policy
    lambda-return, i.e. `gae`'s returns, and A_s = delta_s + gamma * A^GAE_{s+1} (= A^GAE_s at lam = 1).

    Args:
        rewards: (B, T) per-token rewards, see the module docstring.
        values: (B, T) the critic's V(s_t).
        completion_mask: (B, T) one contiguous run of completion tokens per row.
        target_logprobs: (B, T) log pi of the sampled tokens.
        behaviour_logprobs: (B, T) log mu of the same tokens.
        gamma: discount.
        lam: trace lambda.
        rho_bar: clip of the TD-error weights (the fixed point's policy).
        c_bar: clip of the traces (the contraction speed).

    Returns:
        advantages (B, T) and targets v_s (B, T) (the critic's returns), both 0 where the mask is 0.
    """
    mask = completion_mask.to(torch.float32)
    values, rewards = values.float() * mask, rewards.float() * mask
    rho = clipped_importance_weights(target_logprobs, behaviour_logprobs, mask, rho_bar)
    traces = lam * clipped_importance_weights(target_logprobs, behaviour_logprobs, mask, c_bar)
    next_values = _next(values, mask)
    deltas = rho * (rewards + gamma * next_values - values)
    corrections = torch.zeros_like(values)  # v_s - V_s
    running = torch.zeros_like(values[:, 0])  # (B,) v_{s+1} - V_{s+1}
    for s in reversed(range(values.shape[1])):
        running = (deltas[:, s] + gamma * traces[:, s] * running) * mask[:, s]
        corrections[:, s] = running
    targets = (values + corrections) * mask
    advantages = rho * (rewards + gamma * _next(targets, mask) - values) * mask
    return advantages, targets


def retrace(rewards: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor, target_logprobs: torch.Tensor,
            behaviour_logprobs: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrace(lambda) with a state-value critic.

    Munos et al. 2016, https://arxiv.org/abs/1606.02647, eq. 3, traces c_t = lam * min(1, rho_t); recursive form as
    in ACER, Wang et al. 2017, https://arxiv.org/abs/1611.01224, eq. 5.

    What is estimated: Retrace estimates Q^pi(s_t, a_t), the value of the *sampled* token a_t followed by pi. It
    needs Q(s, a) and E_pi Q(s, .) = V(s); with only V available, both are taken from the critic: Q(s_t, a_t) ~ V_t
    (the critic's value stands in for the action value) and E_pi Q(s_{t+1}, .) = V_{t+1}. Eq. 3 becomes

    delta_t = r_t + gamma * V_{t+1} - V_t
    G_s     = V_s + sum_{t >= s} gamma^(t - s) (prod_{i=s+1}^{t} c_i) delta_t
            = V_s + delta_s + gamma * c_{s+1} * (G_{s+1} - V_{s+1})        (the recursion computed here)
    A_s     = G_s - V_s

    with V and G past the last completion token 0. How it differs from `vtrace`: the first token a_s is not
    corrected (Q is conditioned on it), so delta_s has no importance weight and the trace product starts at s + 1;
    V-trace estimates V^pi(s_s) instead, weighting delta_s by rho_s and the traces from c_s. Traces are never
    above lam (c-bar = 1), and there is no rho-bar. With rho = 1, G is the on-policy lambda-return (`gae`'s
    returns) and A is GAE's; with rho = 1 and lam = 1, G is the Monte-Carlo return.

    Args:
        rewards: (B, T) per-token rewards, see the module docstring.
        values: (B, T) the critic's V(s_t).
        completion_mask: (B, T) one contiguous run of completion tokens per row.
        target_logprobs: (B, T) log pi of the sampled tokens.
        behaviour_logprobs: (B, T) log mu of the same tokens.
        gamma: discount.
        lam: trace lambda.

    Returns:
        advantages (B, T) and returns G (B, T), both 0 where the mask is 0.
    """
    mask = completion_mask.to(torch.float32)
    values, rewards = values.float() * mask, rewards.float() * mask
    traces = lam * clipped_importance_weights(target_logprobs, behaviour_logprobs, mask, 1.0)
    deltas = rewards + gamma * _next(values, mask) - values
    next_traces = _next(traces, mask)  # c_{s+1}
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])  # (B,) G_{s+1} - V_{s+1}
    for s in reversed(range(values.shape[1])):
        running = (deltas[:, s] + gamma * next_traces[:, s] * running) * mask[:, s]
        advantages[:, s] = running
    return advantages, (advantages + values) * mask


def td_lambda_returns(rewards: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor, gamma: float = 1.0,
                      lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """TD(lambda) returns (lambda-returns), recursively.

    Sutton & Barto 2018, http://incompleteideas.net/book/the-book-2nd.html, eq. 12.2-12.3; the recursive form of
    Schulman et al. 2016, https://arxiv.org/abs/1506.02438, section 5.

    G^lam_t = r_t + gamma * ((1 - lam) * V_{t+1} + lam * G^lam_{t+1}),   A_t = G^lam_t - V_t

    with V and G past the last completion token 0. lam = 1: Monte-Carlo returns; lam = 0: one-step targets
    r_t + gamma * V_{t+1}. On-policy: no importance correction (A equals `gae`'s advantages).

    Args:
        rewards: (B, T) per-token rewards, see the module docstring.
        values: (B, T) the critic's V(s_t).
        completion_mask: (B, T) one contiguous run of completion tokens per row.
        gamma: discount.
        lam: lambda.

    Returns:
        advantages (B, T) and returns G^lam (B, T), both 0 where the mask is 0.
    """
    mask = completion_mask.to(torch.float32)
    values, rewards = values.float() * mask, rewards.float() * mask
    next_values = _next(values, mask)
    returns = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])  # (B,) G^lam_{t+1}
    for t in reversed(range(values.shape[1])):
        running = (rewards[:, t] + gamma * ((1 - lam) * next_values[:, t] + lam * running)) * mask[:, t]
        returns[:, t] = running
    return (returns - values) * mask, returns


def nstep_returns(rewards: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor, n: int,
                  gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """N-step bootstrapped returns.

    Sutton & Barto 2018, http://incompleteideas.net/book/the-book-2nd.html, eq. 7.1; Mnih et al. 2016,
    https://arxiv.org/abs/1602.01783, A3C's n-step targets.

    G^(n)_t = sum_{k=0}^{n-1} gamma^k r_{t+k} + gamma^n V_{t+n},   A_t = G^(n)_t - V_t

    with r and V past the last completion token 0 (a window that reaches the end is the Monte-Carlo return; n >= T
    always is). On-policy: no importance correction.

    Args:
        rewards: (B, T) per-token rewards, see the module docstring.
        values: (B, T) the critic's V(s_t).
        completion_mask: (B, T) one contiguous run of completion tokens per row.
        n: >= 1 steps.
        gamma: discount.

    Returns:
        advantages (B, T) and returns G^(n) (B, T), both 0 where the mask is 0.
    """
    if n < 1:
        raise ValueError(f"n-step returns need n >= 1, got {n}")
    mask = completion_mask.to(torch.float32)
    values, rewards = values.float() * mask, rewards.float() * mask
    width = values.shape[1]
    padded_rewards = torch.nn.functional.pad(rewards, (0, n))  # (B, T + n), 0 past the end
    padded_values = torch.nn.functional.pad(values, (0, n))  # (B, T + n)
    returns = sum(gamma**k * padded_rewards[:, k:k + width] for k in range(min(n, width)))
    returns = (returns + gamma**n * padded_values[:, n:n + width]) * mask
    return (returns - values) * mask, returns
