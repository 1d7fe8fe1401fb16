"""PPO's updates on one rollout: an actor (and critic) optimizer step per minibatch, with the out-of-memory back-off.

Each minibatch's micro-batches run forward and backward (gradients accumulate) against global normalisers
(`loss_counts`), then the optimizers step. In a single process a micro-batch that runs out of memory drops the
failed attempt's gradients (the optimizer has not stepped on it), halves the token budget for the rest of the run
(down to the minibatch's longest trajectory), re-packs the minibatch and redoes it (`rl_lightning.memory.backoff`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from rl_lightning.algorithms.policy import policy_loss_normaliser
from rl_lightning.memory.backoff import free_after_oom, oom_backoff_supported, smaller_budget
from rl_lightning.memory.phases import phase
from rl_lightning.models.optim import optimizer_step
from rl_lightning.parallel.reductions import Groups, data_parallel_sum
from rl_lightning.rollout.trajectory import Rollout, Trajectory
from rl_lightning.tasks.ppo.minibatches import MicroBatch, Minibatch, repack

log = logging.getLogger(__name__)


class Learner(Protocol):
    """What the update loop uses of its task (`rl_lightning.tasks.ppo.PPO`)."""

    model: Any  # the policy
    critic: Any  # the critic, or None
    tokenizer: Any
    optim: Any  # OptimConfig: max_grad_norm, max_skipped_steps
    max_length_per_device: int  # the token budget in use; the back-off lowers it
    device: torch.device
    groups: Groups  # the parallel layout

    def optimizers(self) -> Any:
        """The actor's (and the critic's) optimizers."""
        ...

    def lr_schedulers(self) -> Any:
        """The actor's (and the critic's) learning-rate schedules."""
        ...

    @property
    def skip_counter(self) -> Any:
        """The task's skipped-step counts (`rl_lightning.models.optim.SkippedSteps`)."""
        ...

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Backward through the strategy."""
        ...

    def policy_loss(self, mb: MicroBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's policy loss and metric sums."""
        ...

    def value_loss(self, mb: MicroBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's value loss and metric sums."""
        ...


def update(task: Learner, rollout: Rollout, minibatches: list[Minibatch], train_actor: bool, aggregation: str,
           max_completion_tokens: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One actor (and critic) optimizer step per minibatch.

    Args:
        task: the PPO task.
        rollout: the rollout the minibatches pack.
        minibatches: [(trajectory indices, micro-batches)], scored and with advantages.
        train_actor: step the actor too (past ``model.freeze_steps``); the critic always steps.
        aggregation: ``model.aggregation``.
        max_completion_tokens: the generation budget of one trajectory.

    Returns:
        This rank's per-token metric sums (with ``tokens``, the target tokens they cover) and the values to log
        (grad norms, learning rate, back-off counters).
    """
    sums: dict[str, torch.Tensor] = {"tokens": torch.zeros((), device=task.device)}
    optimizers, schedules = task.optimizers(), task.lr_schedulers()
    optimizers, schedules = (list(x) if isinstance(x, list) else [x] for x in (optimizers, schedules))
    logged: dict[str, Any] = {"train/lr": schedules[0].get_last_lr()[0]}  # this rollout's first actor step
    packed_at, retries = task.max_length_per_device, 0  # the minibatches were packed at this budget
    for part, micro_batches in minibatches:
        tokens, policy_count = loss_counts(task.groups, rollout.trajectories, part, aggregation,
                                           max_completion_tokens)
        while True:  # out of memory: the minibatch is re-packed smaller and redone (single process only)
            if task.max_length_per_device < packed_at:
                micro_batches = repack(rollout.trajectories, part, micro_batches, task.max_length_per_device,
                                       task.tokenizer.pad_token_id, task.groups, task.device)
                packed_at = task.max_length_per_device
            try:
                part_sums = minibatch_backward(task, micro_batches, tokens, policy_count, train_actor)
                break
            except torch.OutOfMemoryError:
                if not oom_backoff_supported(task.groups.world_size):
                    raise
            # out of the handler, so the failed attempt's frames (activations) are released
            retries += 1
            back_off(task, rollout.trajectories, part)
        for k, v in part_sums.items():
            sums[k] = sums.get(k, 0) + v
        if train_actor:
            logged["train/grad_norm"], step_metrics = optimizer_step(
                optimizers[0], schedules[0], task.model.parameters(), task.optim, task.skip_counter,
                None if task.critic is None else 0)
            logged.update(step_metrics)
        if task.critic is not None:
            logged["train/critic_grad_norm"], step_metrics = optimizer_step(
                optimizers[1], schedules[1], task.critic.parameters(), task.optim, task.skip_counter, 1)
            logged.update(step_metrics)
    logged.update({"train/oom_retries": float(retries), "train/max_length_per_device": float(packed_at)})
    return sums, logged


def minibatch_backward(task: Learner, micro_batches: list[MicroBatch], tokens: torch.Tensor,
                       policy_count: torch.Tensor, train_actor: bool) -> dict[str, torch.Tensor]:
    """Forward and backward of one minibatch's micro-batches (gradients accumulate).

    Args:
        task: the PPO task.
        micro_batches: the minibatch's packed micro-batches.
        tokens: the minibatch's global count of completion tokens (the value loss's normaliser).
        policy_count: the policy loss's global normaliser.
        train_actor: run the policy loss too.

    Returns:
        The minibatch's metric sums on this rank.
    """
    size = task.groups.grad_average_size
    sums: dict[str, torch.Tensor] = {}
    for mb in micro_batches:
        metric_sums: dict[str, torch.Tensor] = {}
        if train_actor:
            with phase("train/forward"):
                loss, metric_sums = task.policy_loss(mb, policy_count / size)
            with phase("train/backward"):
                task.manual_backward(loss)
        if task.critic is not None:
            with phase("train/forward"):
                value_loss, value_sums = task.value_loss(mb, tokens / size)
            with phase("train/backward"):
                task.manual_backward(value_loss)
            metric_sums.update(value_sums)
        metric_sums["tokens"] = mb["target_mask"].sum().float()
        for k, v in metric_sums.items():
            sums[k] = sums.get(k, 0) + v.detach()
    return sums


def back_off(task: Learner, trajectories: list[Trajectory], part: list[int]) -> None:
    """After an out-of-memory error in minibatch `part`: drop its failed attempt's gradients, halve the budget.

    The optimizer has not stepped on the failed attempt; the budget stays halved for the rest of the run, down to
    the minibatch's longest trajectory.

    Args:
        task: the PPO task.
        trajectories: this rank's trajectories.
        part: the indices of the minibatch's trajectories.
    """
    free_after_oom((task.model, task.critic), task.device)
    longest = max((len(trajectories[i].input_ids) for i in part), default=1)
    budget = smaller_budget(task.max_length_per_device, longest)
    log.warning(f"out of memory at model.max_length_per_device={task.max_length_per_device}: retrying the "
                f"minibatch with {budget} tokens per micro-batch, kept for the rest of the run")
    task.max_length_per_device = budget


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
    tokens = float(sum(trajectories[i].completion_length for i in part))
    policy = policy_loss_normaliser(aggregation, completions, tokens, max_completion_tokens)
    # clamp: a minibatch whose completions were all masked out (truncated) has nothing to learn, not a NaN
    counts = data_parallel_sum(groups, torch.tensor([tokens, policy], device=groups.device)).clamp(min=1)
    return counts[0], counts[1]
