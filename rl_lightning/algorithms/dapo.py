"""DAPO's sampling-side pieces (group filtering, soft overlong punishment, truncation masks) and a shaping gate.

Paper: Yu et al. 2025, DAPO, https://arxiv.org/abs/2503.14476 (section 3.2 dynamic sampling, 3.4 overlong shaping).
Their settings are PPO's ``model.dapo`` group (`rl_lightning.rollout.config.DAPOConfig`); each is off by default.
The gate (`gated_shaping`, ``model.rollout.gate_shaping``) is not DAPO's: when correct samples are rare, shaping
terms are most of a group's reward differences, and the policy learns them instead of the task (issue 40).
"""

from __future__ import annotations

import torch


def keep_groups(rewards: torch.Tensor, group_size: int, low: float, high: float) -> torch.Tensor:
    """(B / G,) bool: prompt groups whose mean reward is strictly inside (low, high).

    With (0, 1) and 0/1 rewards this drops groups that are all correct or all wrong, whose group-baseline advantages
    are all zero.

    Args:
        rewards: (B,) outcome rewards, groups of `group_size` contiguous.
        group_size: G, completions per prompt.
        low: exclusive lower bound of a kept group's mean.
        high: exclusive upper bound.

    Returns:
        (B / G,) bool.
    """
    means = rewards.view(-1, group_size).mean(dim=1)
    return (means > low) & (means < high)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, cache_length: int) -> torch.Tensor:
    """(B,) soft overlong punishment added to the reward (DAPO eq. 13).

    With L_max = `max_new_tokens` and L_cache = `cache_length`:

    0 if |y| <= L_max - L_cache;  (L_max - L_cache - |y|) / L_cache if L_max - L_cache < |y| <= L_max;  -1 beyond.

    Args:
        lengths: (B,) completion lengths |y|.
        max_new_tokens: L_max.
        cache_length: L_cache.

    Returns:
        (B,) penalties in [-1, 0].
    """
    lengths = lengths.to(torch.float32)
    start = max_new_tokens - cache_length
    ramp = (start - lengths) / cache_length
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_new_tokens, torch.full_like(lengths, -1.0), penalty)


def overlong_shaped(rewards: list[float], lengths: list[int], max_new_tokens: int, cache_length: int) -> list[float]:
    """Each reward plus its `overlong_penalty` (DAPO's soft overlong punishment), in float64 as the rewards are.

    Args:
        rewards: (B,) rewards.
        lengths: (B,) completion lengths.
        max_new_tokens: L_max.
        cache_length: L_cache.

    Returns:
        (B,) shaped rewards.
    """
    penalties = overlong_penalty(torch.tensor(lengths), max_new_tokens, cache_length)
    return [reward + penalty for reward, penalty in zip(rewards, penalties.tolist(), strict=True)]


def truncation_masked(completion_mask: list[int], finished: bool) -> list[int]:
    """One completion's mask after `mask_truncated`: all zeros when it was cut (no stop token), else unchanged."""
    return mask_truncated(torch.tensor([completion_mask]), torch.tensor([finished]))[0].tolist()


def mask_truncated(completion_mask: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
    """(B, T) completion mask with the rows of truncated completions zeroed (DAPO's overlong filtering).

    A truncated completion (no stop token, `finished` False) then does not contribute to the loss.

    Args:
        completion_mask: (B, T).
        finished: (B,) bool, the completion ended with a stop token.

    Returns:
        (B, T) mask.
    """
    return completion_mask * finished.to(completion_mask.dtype)[:, None]


class GroupRefill:
    """Dynamic-sampling buffer: the kept prompt groups of successive generation rounds, up to `target` groups.

    Rounds go on until `target` groups are collected or `max_rounds` rounds were tried.

    ``add(groups, keep)`` takes a list of per-group items and the `keep_groups` mask; ``full`` says whether the batch
    is complete; ``take()`` returns exactly `target` groups (or all collected when rounds ran out) and resets.
    """

    def __init__(self, target: int, max_rounds: int) -> None:
        if target < 1 or max_rounds < 1:
            raise ValueError(f"target and max_rounds must be >= 1, got {target}, {max_rounds}")
        self.target, self.max_rounds = target, max_rounds
        self.groups: list = []
        self.rounds = 0
        self.dropped = 0

    def add(self, groups: list, keep: torch.Tensor) -> None:
        """Count one round and keep the `groups` that `keep` ((B / G,) bool) marks."""
        self.rounds += 1
        kept = [g for g, k in zip(groups, keep.tolist(), strict=True) if k]
        self.dropped += len(groups) - len(kept)
        self.groups.extend(kept)

    @property
    def full(self) -> bool:
        """Whether `target` groups are collected."""
        return len(self.groups) >= self.target

    @property
    def exhausted(self) -> bool:
        """Whether the batch is full or the rounds ran out."""
        return self.full or self.rounds >= self.max_rounds

    def take(self) -> list:
        """The first `target` groups collected (all of them if fewer), and a reset."""
        batch, self.groups = self.groups[: self.target], []
        self.rounds = 0
        return batch


def gated_shaping(rewards: list[float], correct: list[float], group_size: int, correct_weight: float) -> list[float]:
    """(B,) rewards where shaping counts only in prompt groups with at least one correct completion.

    In a group where no completion's correctness is > 0, each reward becomes its weighted correctness
    (``correct_weight * correct``): the shaping terms (other components, a length punishment) are dropped, so a
    group of wrong answers no longer teaches the policy to win the shaping instead. Other groups are unchanged.

    Args:
        rewards: (B,) total rewards (components weighted and summed, plus any length punishment).
        correct: (B,) each completion's correctness component.
        group_size: G, completions per prompt, groups contiguous.
        correct_weight: the correctness component's weight in the reward.

    Returns:
        (B,) rewards.
    """
    if len(rewards) != len(correct) or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards and {len(correct)} correctness values in groups of {group_size}")
    gated = list(rewards)
    for start in range(0, len(rewards), group_size):
        group = correct[start:start + group_size]
        if max(group) <= 0.0:
            gated[start:start + group_size] = [correct_weight * value for value in group]
    return gated
