"""A rollout scored before its updates: log-probabilities and values on every packed token, then the advantages.

`score` records, without gradients, the sampling policy's log-probabilities (``old_logprobs``), the frozen
reference's (``ref_logprobs``) and the critic's values (``old_values``); `assign_advantages` turns them and the
rewards into per-token ``advantages`` (and ``returns``) with `rl_lightning.algorithms.advantages.estimate_advantages`,
on this rank's trajectories, with the statistics that must be global summed over data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_lightning.algorithms.advantages import OFF_POLICY_ESTIMATORS, estimate_advantages
from rl_lightning.algorithms.distill import distillation_advantages
from rl_lightning.algorithms.kl import KL_ESTIMATORS, kl_reward_penalty
from rl_lightning.models.logprobs import model_inputs, target_logprobs
from rl_lightning.parallel.reductions import Groups, data_parallel_sum
from rl_lightning.rollout.trajectory import Rollout
from rl_lightning.tasks.ppo.minibatches import MicroBatch, Minibatch, completion_grid, gather, scatter


def critic_values(critic: Any, micro_batch: MicroBatch) -> torch.Tensor:
    """(1, N) critic value of the state at each packed position (before its target token is generated).

    Args:
        critic: a value model (a base model and a ``score`` head).
        micro_batch: the packed micro-batch.

    Returns:
        (1, N) float32 values.
    """
    hidden = critic.base_model(**model_inputs(micro_batch)).last_hidden_state
    return critic.score(hidden).squeeze(-1).float()


@torch.no_grad()
def score(minibatches: list[Minibatch], model: Any, reference: Any, critic: Any, temperature: float,
          first_minibatch: bool, lm_head_chunk: int | None = None, teacher: Any = None) -> None:
    """Record, on this rank's tokens, the sampling policy's and the reference's log-probabilities and the values.

    Nothing has changed the policy since it sampled, so its log-probabilities are ``old_logprobs``. The first
    minibatch's are left to its training forward (`rl_lightning.tasks.ppo.losses.MicroBatchLosses.policy`) unless
    `first_minibatch` says the advantages need them first.

    Args:
        minibatches: the rollout's packed minibatches; their micro-batches receive the values.
        model: the policy.
        reference: the frozen reference, or None.
        critic: the critic, or None.
        temperature: the sampling temperature the log-probabilities are taken at.
        first_minibatch: record ``old_logprobs`` for the first minibatch too (KL as a reward, the off-policy
            estimators).
        lm_head_chunk: positions per chunk of the output head (`target_logprobs`' `chunk_size`); None: full logits.
        teacher: the frozen distillation teacher (``model.distill``), or None: its ``teacher_logprobs``.
    """
    for k, (_, micro_batches) in enumerate(minibatches):
        for mb in micro_batches:
            if k > 0 or first_minibatch:
                mb["old_logprobs"] = target_logprobs(model, mb, temperature, chunk_size=lm_head_chunk)[0]
            if reference is not None:
                mb["ref_logprobs"] = target_logprobs(reference, mb, temperature, chunk_size=lm_head_chunk)[0]
            if teacher is not None:
                mb["teacher_logprobs"] = target_logprobs(teacher, mb, temperature, chunk_size=lm_head_chunk)[0]
            if critic is not None:
                mb["old_values"] = critic_values(critic, mb)


def assign_advantages(groups: Groups, rollout: Rollout, micro_batches: list[MicroBatch], device: torch.device, *,
                      estimator: str, critic: bool, kl_reward_coef: float | None, kl_estimator: str, gamma: float,
                      lam: float, rho_bar: float, c_bar: float, nstep: int, distill_coef: float | None = None
                      ) -> torch.Tensor:
    """Per-token advantages (and returns) of this rank's trajectories, written into the micro-batches.

    ``vtrace`` and ``retrace`` weigh by pi / mu with pi the trainer at score time (``old_logprobs``) and mu the
    engine (``target_engine_logprobs``).

    Args:
        groups: the parallel layout (global sums over data-parallel ranks).
        rollout: the rollout (rewards, group size).
        micro_batches: every packed micro-batch of the rollout, scored.
        device: where the per-trajectory tensors go.
        estimator: ``model.advantage_estimator``.
        critic: whether the task has a critic (its values were recorded).
        kl_reward_coef: the KL coefficient when KL enters as a reward (``model.kl.type: reward``), else None.
        kl_estimator: ``model.kl.estimator``.
        gamma: discount.
        lam: lambda of the estimators that have one.
        rho_bar: ``vtrace``'s rho-bar.
        c_bar: ``vtrace``'s c-bar.
        nstep: ``nstep``'s n.
        distill_coef: ``model.distill.coef`` when the teacher's reverse KL is a per-token reward (``type: reward``):
            coef x (teacher_logprobs - old_logprobs) is added to each completion token's advantage; else None.

    Returns:
        The advantages' (sum, sum of squares, count) over data-parallel ranks, for logging.
    """
    grid = completion_grid(rollout.trajectories, device)  # (B, T)
    kl_penalty = values = logprobs = engine_logprobs = None
    if kl_reward_coef is not None:  # -coef x KL_t of the sampling policy
        kl_penalty = gather(groups, micro_batches, [kl_reward_penalty(
            mb["old_logprobs"], mb["ref_logprobs"], kl_reward_coef, KL_ESTIMATORS[kl_estimator])
            for mb in micro_batches], grid)
    if critic:
        values = gather(groups, micro_batches, [mb["old_values"] for mb in micro_batches], grid)
    if estimator in OFF_POLICY_ESTIMATORS:  # pi: the trainer at score time; mu: the engine
        logprobs = gather(groups, micro_batches, [mb["old_logprobs"] for mb in micro_batches], grid)
        engine_logprobs = gather(groups, micro_batches, [mb["target_engine_logprobs"] for mb in micro_batches],
                                 grid)
    rewards = torch.tensor([t.reward for t in rollout.trajectories], dtype=torch.float32, device=device)
    advantages, returns = estimate_advantages(
        estimator, rewards, grid, rollout.group_size, kl_penalty, values, gamma, lam,
        global_sum=lambda x: data_parallel_sum(groups, x), target_logprobs=logprobs,
        behaviour_logprobs=engine_logprobs, rho_bar=rho_bar, c_bar=c_bar, nstep=nstep)
    if distill_coef is not None:  # the teacher's per-token reverse-KL reward, discount 0
        student, teacher = (gather(groups, micro_batches, [mb[k] for mb in micro_batches], grid)
                            for k in ("old_logprobs", "teacher_logprobs"))
        advantages = distillation_advantages(advantages, student, teacher, grid, distill_coef)
    for mb in micro_batches:
        mb["advantages"] = scatter(mb, advantages)
        if returns is not None:
            mb["returns"] = scatter(mb, returns)
    stats = torch.stack([advantages.sum(), advantages.pow(2).sum(), grid.sum()])
    return data_parallel_sum(groups, stats)
