"""What PPO logs: a rollout's global means (``train/*``) and the held-out reward means (``val/*``).

Every value is global: per-rank sums are reduced over the data-parallel ranks (and the context-parallel ones for
per-token sums) before dividing, so the logs do not depend on the parallel layout.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_lightning.algorithms.advantages import moments_from_sums
from rl_lightning.parallel.reductions import Groups, data_parallel_sum, shard_sum_dict
from rl_lightning.rollout.trajectory import Rollout


def global_means(groups: Groups, sums: dict[str, torch.Tensor], trajectories: int, per_trajectory: list[str]
                 ) -> tuple[dict[str, torch.Tensor], int]:
    """Global per-token means of an update's metric sums, and the rollout's global trajectory count.

    Args:
        groups: the parallel layout.
        sums: this rank's metric sums, with ``tokens`` (the target tokens they cover).
        trajectories: this rank's trajectories in the rollout.
        per_trajectory: metrics whose sums count trajectories, divided by the trajectories instead of the tokens.

    Returns:
        The means by metric name, and the global number of trajectories.
    """
    totals = shard_sum_dict(groups, sums)  # measured on this rank's tokens: over data x context ranks
    means = {k: v / totals["tokens"].clamp(min=1) for k, v in totals.items()}
    count = int(data_parallel_sum(groups, torch.tensor(float(trajectories), device=groups.device)))
    for k in per_trajectory:
        if k in totals:
            means[k] = totals[k] / max(1, count)
    return means, count


def rollout_metrics(groups: Groups, rollout: Rollout, means: dict[str, torch.Tensor], advantage_sums: torch.Tensor
                    ) -> dict[str, Any]:
    """The ``train/*`` metrics of a rollout: the update's means, rewards, lengths and advantages.

    Args:
        groups: the parallel layout.
        rollout: the rollout (this rank's trajectories).
        means: the update's global means (`global_means`).
        advantage_sums: the advantages' global (sum, sum of squares, count).

    Returns:
        Metrics by logged name (the caller adds its counters).
    """
    trajectories, names, device = rollout.trajectories, rollout.reward_names, groups.device
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=device)
    lengths = torch.tensor([float(t.completion_length) for t in trajectories], device=device)
    per_rank = torch.stack([rewards.sum(), (rewards**2).sum(), lengths.sum(),
                            torch.tensor(float(len(rewards)), device=device),
                            *(torch.tensor(sum(t.reward_components[c] for t in trajectories), dtype=torch.float32,
                                           device=device) for c in names)])
    reward_sum, reward_sq, length_sum, count, *component_sums = data_parallel_sum(groups, per_rank)
    n = count.clamp(min=1)  # dynamic sampling may keep no trajectory at all
    reward_mean, reward_std = moments_from_sums(reward_sum, reward_sq, count)
    advantage_mean, advantage_std = moments_from_sums(*advantage_sums)
    metrics: dict[str, Any] = {f"train/{k}": v for k, v in means.items() if k != "tokens"}
    metrics.update({f"train/reward/{c}": component_sums[i] / n for i, c in enumerate(names)})
    metrics.update({"train/reward": reward_mean, "train/reward_std": reward_std,
                    "train/completion_length": length_sum / n,
                    "train/advantage_mean": advantage_mean, "train/advantage_std": advantage_std,
                    "train/refills": float(rollout.refills), "train/reward_failures": float(rollout.reward_failures),
                    "train/trajectories": count})
    return metrics


def validation_record(rollout: Rollout) -> torch.Tensor:
    """(3 + components,) float64 sums of a held-out batch: reward, completion length, trajectories, components.

    Args:
        rollout: the validation rollout.

    Returns:
        The sums, in that order.
    """
    trajectories = rollout.trajectories
    return torch.tensor([sum(t.reward for t in trajectories), sum(t.completion_length for t in trajectories),
                         len(trajectories), *(sum(t.reward_components[c] for t in trajectories)
                                              for c in rollout.reward_names)], dtype=torch.float64)


def validation_means(groups: Groups, sums: dict[int, torch.Tensor], component_names: list[str], set_names: list[str],
                     device: torch.device) -> dict[str, torch.Tensor]:
    """``val/reward``, ``val/completion_length``, ``val/reward/<component>`` and per named set ``val/<name>/...``.

    Means over every held-out trajectory (of all sets together: a set weighs by its trajectories), and over each
    named set's.

    Args:
        groups: the parallel layout.
        sums: this rank's `validation_record` sums per validation dataloader.
        component_names: the reward components.
        set_names: one name per dataloader ("" for the single unnamed set).
        device: where the reduction runs.

    Returns:
        Metrics by logged name.
    """
    width = len(next(iter(sums.values())))
    per_set = torch.zeros(len(set_names), width, dtype=torch.float64)  # (S, 3 + components), all ranks alike
    for i, record in sums.items():
        per_set[i] = record
    per_set = data_parallel_sum(groups, per_set.to(device))
    metrics = {}
    for prefix, totals in [("val/", per_set.sum(0))] + [
            (f"val/{name}/", per_set[i]) for i, name in enumerate(set_names) if name]:
        reward, length, *components = totals[[0, 1, *range(3, len(totals))]] / totals[2].clamp(min=1)
        metrics.update({f"{prefix}reward": reward, f"{prefix}completion_length": length,
                        **{f"{prefix}reward/{c}": v for c, v in zip(component_names, components, strict=True)}})
    return metrics
