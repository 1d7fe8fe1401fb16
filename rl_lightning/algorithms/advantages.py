"""Advantage estimators: GAE with a critic, and critic-free group baselines (Dr. GRPO, GRPO, RLOO, REINFORCE++).

Shapes: B trajectories, T completion tokens, G completions per prompt (trajectories of a group are contiguous:
``rewards.view(-1, G)``). Outcome rewards are per trajectory (B,); token-level tensors are (B, T) with a
``completion_mask`` that is 1 on completion tokens the loss covers.
"""

from __future__ import annotations

import torch


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
        completion_mask: (B, T) 1 on valid completion tokens (a right-aligned run; rows may be fully masked).
        gamma: discount; lam: GAE lambda.

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


def packed_gae(rewards: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor, seq_index: torch.Tensor,
               num_sequences: int, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` on a packed row: each sequence's completion tokens (mask 1, in order; gaps such as tool tokens are
    skipped) form one episode.

    Args:
        rewards, values, completion_mask, seq_index: (1, N) packed-row tensors (`seq_index` names each token's
            sequence).

    Returns:
        advantages (1, N) and returns (1, N), zero outside the completion tokens.
    """
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    is_completion = completion_mask[0] > 0
    for s in range(num_sequences):
        idx = ((seq_index[0] == s) & is_completion).nonzero().flatten()  # (L,)
        if len(idx):
            a, r = gae(rewards[:, idx], values[:, idx], torch.ones_like(values[:, idx]), gamma, lam)  # (1, L)
            advantages[:, idx], returns[:, idx] = a, r
    return advantages, returns


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = False, eps: float = 1e-6
                     ) -> torch.Tensor:
    """Group-mean baseline: A_i = r_i - mean_group(r); with `scale_by_std` (GRPO) divided by the group's standard
    deviation (unbiased) + eps. Groups whose rewards are all equal get A = 0 either way.

    Without the std division this is Dr. GRPO's estimator (Liu et al. 2025, https://arxiv.org/abs/2503.20783,
    section 3.2), which removes GRPO's difficulty bias; with it, GRPO (Shao et al. 2024,
    https://arxiv.org/abs/2402.03300, eq. 3's outcome supervision).

    Args:
        rewards: (B,) outcome rewards, B = prompts x `group_size`, groups contiguous.

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
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 completions per prompt, got {group_size}")
    grouped = rewards.view(-1, group_size)  # (B / G, G)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def discounted_returns(rewards: torch.Tensor, completion_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """(B, T) reward-to-go G_t = sum_{k >= t} gamma^(k - t) r_k over completion tokens (0 where masked)."""
    mask = completion_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / (std + eps) over the masked entries (population std); zero where the mask is 0."""
    m = mask.to(values.dtype)
    count = m.sum().clamp(min=1)
    mean = (values * m).sum() / count
    var = (((values - mean) * m) ** 2).sum() / count
    return (values - mean) / (var.sqrt() + eps) * m


def reinforce_pp_advantages(rewards: torch.Tensor, completion_mask: torch.Tensor, gamma: float = 1.0
                            ) -> torch.Tensor:
    """REINFORCE++: token reward-to-go normalised over the whole (global) batch of completion tokens.

    A_t = whiten_batch(sum_{k >= t} gamma^(k - t) r_k). Paper: Hu 2025, https://arxiv.org/abs/2501.03262, eq. 7-8.
    The caller passes the global batch (all ranks) or accepts per-rank statistics.

    Args:
        rewards: (B, T) per-token rewards; completion_mask: (B, T).
    """
    return masked_whiten(discounted_returns(rewards, completion_mask, gamma), completion_mask)


def broadcast_to_tokens(sequence_values: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-trajectory values -> (B, T) on the completion tokens."""
    return sequence_values[:, None].to(torch.float32) * completion_mask.to(torch.float32)
