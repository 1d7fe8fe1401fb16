"""PPO's updates on one rollout: an actor (and critic) optimizer step per minibatch, with the out-of-memory back-off.

Each minibatch's micro-batches run forward and backward (gradients accumulate) against global normalisers
(`loss_counts`), then the optimizers step. In a single process a micro-batch that runs out of memory drops the
failed attempt's gradients (the optimizer has not stepped on it), halves the token budget for the rest of the run
(down to the minibatch's longest trajectory), re-packs the minibatch and redoes it (`rl_lightning.memory.backoff`).

The loop drives the parts the task hands it (`Learner`): the micro-batch losses, the optimizers and their schedules,
the backward, the token budget, the parallel layout; it never calls back into the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.algorithms.policy import policy_loss_normaliser
from rl_lightning.memory.backoff import TokenBudget, free_after_oom, oom_backoff_supported, smaller_budget
from rl_lightning.memory.phases import phase
from rl_lightning.models.optim import OptimConfig, SkippedSteps, optimizer_step
from rl_lightning.parallel.reductions import Groups, data_parallel_sum
from rl_lightning.rollout.trajectory import Rollout, Trajectory
from rl_lightning.tasks.ppo.losses import MicroBatchLosses
from rl_lightning.tasks.ppo.minibatches import MicroBatch, Minibatch, repack

log = logging.getLogger(__name__)


@dataclass
class Learner:
    """What the update loop drives: plain parts, no LightningModule.

    Args:
        losses: the micro-batch losses (the policy, the critic or None, the objective).
        optimizers: the actor's optimizer, then the critic's.
        schedules: their learning-rate schedules, in the same order.
        backward: runs the backward of a loss (``loss.backward``, or the strategy's).
        optim: ``model.lm.optim`` (``max_grad_norm``, ``max_skipped_steps``).
        skipped: the run's skipped-step counts.
        budget: the token budget of a packed micro-batch; the back-off lowers it.
        pad_token_id: the filler micro-batch's token (re-packing).
        groups: the parallel layout.
        device: where the packed tensors and the sums live.
    """

    losses: MicroBatchLosses
    optimizers: list[Any]
    schedules: list[Any]
    backward: Callable[[torch.Tensor], Any]
    optim: OptimConfig
    skipped: SkippedSteps
    budget: TokenBudget
    pad_token_id: int
    groups: Groups
    device: torch.device


def update(learner: Learner, rollout: Rollout, minibatches: list[Minibatch], train_actor: bool, aggregation: str,
           max_completion_tokens: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One actor (and critic) optimizer step per minibatch.

    Args:
        learner: the parts the loop drives.
        rollout: the rollout the minibatches pack.
        minibatches: [(trajectory indices, micro-batches)], scored and with advantages.
        train_actor: step the actor too (past ``model.freeze_steps``); the critic always steps.
        aggregation: ``model.aggregation``.
        max_completion_tokens: the generation budget of one trajectory.

    Returns:
        This rank's per-token metric sums (with ``tokens``, the target tokens they cover) and the values to log
        (grad norms, learning rate, back-off counters).
    """
    sums: dict[str, torch.Tensor] = {"tokens": torch.zeros((), device=learner.device)}
    optimizers, schedules, losses, budget = learner.optimizers, learner.schedules, learner.losses, learner.budget
    logged: dict[str, Any] = {"train/lr": schedules[0].get_last_lr()[0]}  # this rollout's first actor step
    packed_at, retries = budget.tokens, 0  # the minibatches were packed at this budget
    for part, micro_batches in minibatches:
        tokens, policy_count = loss_counts(learner.groups, rollout.trajectories, part, aggregation,
                                           max_completion_tokens)
        while True:  # out of memory: the minibatch is re-packed smaller and redone (single process only)
            if budget.tokens < packed_at:
                micro_batches = repack(rollout.trajectories, part, micro_batches, budget.tokens,
                                       learner.pad_token_id, learner.groups, learner.device)
                packed_at = budget.tokens
            try:
                part_sums = minibatch_backward(learner, micro_batches, tokens, policy_count, train_actor)
                break
            except torch.OutOfMemoryError:
                if not oom_backoff_supported(learner.groups.world_size):
                    raise
            # out of the handler, so the failed attempt's frames (activations) are released
            retries += 1
            back_off(learner, rollout.trajectories, part)
        for k, v in part_sums.items():
            sums[k] = sums.get(k, 0) + v
        if train_actor:
            logged["train/grad_norm"], step_metrics = optimizer_step(
                optimizers[0], schedules[0], losses.model.parameters(), learner.optim, learner.skipped,
                None if losses.critic is None else 0)
            logged.update(step_metrics)
        if losses.critic is not None:
            logged["train/critic_grad_norm"], step_metrics = optimizer_step(
                optimizers[1], schedules[1], losses.critic.parameters(), learner.optim, learner.skipped, 1)
            logged.update(step_metrics)
    logged.update({"train/oom_retries": float(retries), "train/max_length_per_device": float(packed_at)})
    return sums, logged


def minibatch_backward(learner: Learner, micro_batches: list[MicroBatch], tokens: torch.Tensor,
                       policy_count: torch.Tensor, train_actor: bool) -> dict[str, torch.Tensor]:
    """Forward and backward of one minibatch's micro-batches (gradients accumulate).

    Args:
        learner: the parts the loop drives.
        micro_batches: the minibatch's packed micro-batches.
        tokens: the minibatch's global count of completion tokens (the value loss's normaliser).
        policy_count: the policy loss's global normaliser.
        train_actor: run the policy loss too.

    Returns:
        The minibatch's metric sums on this rank.
    """
    size, losses = learner.groups.grad_average_size, learner.losses
    sums: dict[str, torch.Tensor] = {}
    for mb in micro_batches:
        metric_sums: dict[str, torch.Tensor] = {}
        if train_actor:
            with phase("train/forward"):
                loss, metric_sums = losses.policy(mb, policy_count / size)
            with phase("train/backward"):
                learner.backward(loss)
        if losses.critic is not None:
            with phase("train/forward"):
                value_loss, value_sums = losses.value(mb, tokens / size)
            with phase("train/backward"):
                learner.backward(value_loss)
            metric_sums.update(value_sums)
        metric_sums["tokens"] = mb["target_mask"].sum().float()
        for k, v in metric_sums.items():
            sums[k] = sums.get(k, 0) + v.detach()
    return sums


def back_off(learner: Learner, trajectories: list[Trajectory], part: list[int]) -> None:
    """After an out-of-memory error in minibatch `part`: drop its failed attempt's gradients, halve the budget.

    The optimizer has not stepped on the failed attempt; the budget stays halved for the rest of the run, down to
    the minibatch's longest trajectory.

    Args:
        learner: the parts the loop drives (its budget is lowered).
        trajectories: this rank's trajectories.
        part: the indices of the minibatch's trajectories.
    """
    free_after_oom((learner.losses.model, learner.losses.critic), learner.device)
    longest = max((len(trajectories[i].input_ids) for i in part), default=1)
    budget = smaller_budget(learner.budget.tokens, longest)
    log.warning(f"out of memory at model.max_length_per_device={learner.budget.tokens}: retrying the "
                f"minibatch with {budget} tokens per micro-batch, kept for the rest of the run")
    learner.budget.tokens = budget


def loss_counts(groups: Groups, trajectories: list[Trajectory], part: list[int], aggregation: str,
                max_completion_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global counts of one minibatch, from whole trajectories (context-parallel shards hold parts of each).

    Args:
        groups: the parallel layout (sums over data-parallel ranks).
        trajectories: this rank's trajectories.
        part: the indices of the minibatch's trajectories.
        aggregation: ``model.aggregation``.
        max_completion_tokens: the generation budget of one trajectory.

    Returns:
        The completion tokens, and the policy loss's normaliser under `aggregation`.
    """
    completions = float(len(part))
    tokens = float(sum(trajectories[i].loss_tokens for i in part))
    policy = policy_loss_normaliser(aggregation, completions, tokens, max_completion_tokens)
    # clamp: a minibatch whose completions were all masked out (truncated) has nothing to learn, not a NaN
    counts = data_parallel_sum(groups, torch.tensor([tokens, policy], device=groups.device)).clamp(min=1)
    return counts[0], counts[1]
