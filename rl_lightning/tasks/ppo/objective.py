"""One micro-batch's losses, from the forward's outputs and the rollout's recorded tensors.

`PolicyObjective` is composed once, when the task is built, from the parts the run enabled
(`rl_lightning.tasks.ppo.terms`): the surrogate (``policy_loss``, picked by name at construction), the terms that
re-weigh it (the mismatch correction, ``correction``), the optional terms after it in order (the KL to a loaded
reference; the regulariser: the entropy bonus, the KL term and the Lagrangian constraints; the distillation and
policy-lag metrics; the skipped trajectories, ``skip_threshold``) and the reduction (``aggregation``). A plain GRPO
run's objective is its surrogate and its reduction: no micro-batch checks a feature that is off. `value_loss` is the
critic's. Packed tensors are (1, N).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_lightning.algorithms.correction import mismatch_kl
from rl_lightning.algorithms.kl import KL_ESTIMATORS, kl_k3
from rl_lightning.algorithms.policy import clipped_value_loss, sequence_mean, token_mean
from rl_lightning.parallel.reductions import sequence_sums
from rl_lightning.tasks.ppo.config import CorrectionConfig
from rl_lightning.tasks.ppo.minibatches import MicroBatch
from rl_lightning.tasks.ppo.terms import (
    Correction,
    DistillationKL,
    Penalty,
    PolicyLags,
    ReferenceKL,
    Regulariser,
    Skip,
    Step,
    Term,
    sequence_weights,
    surrogate,
    token_weights,
    versioned_weights,
)

Aggregate = Callable[[torch.Tensor, torch.Tensor, MicroBatch, torch.Tensor], torch.Tensor]


def token_aggregate(loss: torch.Tensor, mask: torch.Tensor, mb: MicroBatch, normaliser: torch.Tensor) -> torch.Tensor:
    """``token_mean`` and ``token_sum``: the sum over target tokens / the normaliser."""
    return token_mean(loss, mask, normaliser)


def sequence_aggregate(loss: torch.Tensor, mask: torch.Tensor, mb: MicroBatch, normaliser: torch.Tensor
                       ) -> torch.Tensor:
    """``sequence_mean``: each completion's token mean (over context-parallel shards), summed / the normaliser."""
    return sequence_mean(sequence_sums(loss, mask, mb), sequence_sums(mask, mask, mb), normaliser)


AGGREGATES: dict[str, Aggregate] = {"token_mean": token_aggregate, "sequence_mean": sequence_aggregate,
                                    "token_sum": token_aggregate}


class PolicyObjective:
    """The policy loss of a micro-batch, composed once from PPO's arguments of the same names (see `PPO`).

    Args:
        policy_loss: ``ppo``, ``gspo`` or ``cispo``.
        clip_low: lower ratio clip.
        clip_high: upper ratio clip.
        dual_clip: PPO's dual clip, or None.
        aggregation: ``token_mean``, ``sequence_mean`` or ``token_sum``.
        entropy_coef: entropy bonus weight.
        skip_threshold: skip trajectories whose sequence ratio leaves [1 / it, it], or None.
        correction: the rollout/trainer mismatch correction, or None.
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        kl_in_loss: KL to the reference is a loss term (``model.kl.type: loss``), not a reward.
        entropy_constrained: an entropy floor constraint is set (its penalty needs the entropy's gradient).
        reference: a reference is loaded (``ref_logprobs``): the KL is measured (and logged, and read by the KL
            controller and a KL ceiling).
        kl_constrained: a KL ceiling constraint is set.
        teacher: a distillation teacher is loaded (``teacher_logprobs``): ``distill_reverse_kl`` is logged.
        policy_lags: in-flight weight updates (``target_policy_lags``): token-level corrections weigh each token
            against its own version, and the lags are logged.

    Attributes:
        surrogate: the per-token surrogate.
        reweights: the terms that re-weigh it (the correction), before ``policy_loss`` is recorded.
        terms: the terms after it, in order.
        aggregate: the reduction of the per-token loss.
        entropy_needs_grad: whether the loss differentiates the entropy (an entropy bonus or an entropy floor).
    """

    def __init__(self, policy_loss: str = "ppo", clip_low: float = 0.2, clip_high: float = 0.2,
                 dual_clip: float | None = None, aggregation: str = "token_mean", entropy_coef: float = 0.0,
                 skip_threshold: float | None = None, correction: CorrectionConfig | None = None,
                 kl_estimator: str = "k3", kl_in_loss: bool = True, entropy_constrained: bool = False, *,
                 reference: bool = False, kl_constrained: bool = False, teacher: bool = False,
                 policy_lags: bool = False) -> None:
        if aggregation not in AGGREGATES:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATES)}, got '{aggregation}'")
        self.surrogate = surrogate(policy_loss, clip_low, clip_high, dual_clip)
        self.reweights: tuple[Term, ...] = ()
        if correction is not None:
            weights = (sequence_weights if correction.level != "token" else
                       versioned_weights if policy_lags else token_weights)
            self.reweights = (Correction(correction, weights),)
        kl_in_loss = reference and kl_in_loss
        terms: list[Term] = [ReferenceKL(KL_ESTIMATORS[kl_estimator])] if reference else []
        if entropy_coef != 0 or kl_in_loss or entropy_constrained or kl_constrained:
            terms.append(Regulariser(entropy_coef, kl_in_loss))
        terms += [DistillationKL()] if teacher else []
        terms += [PolicyLags()] if policy_lags else []
        terms += [Skip(skip_threshold)] if skip_threshold is not None else []
        self.terms: tuple[Term, ...] = tuple(terms)
        self.aggregate = AGGREGATES[aggregation]
        self.entropy_needs_grad = entropy_coef != 0 or entropy_constrained

    @property
    def names(self) -> tuple[str, ...]:
        """The surrogate's and the enabled terms' names, in the order they apply."""
        return (self.surrogate.name, *(term.name for term in (*self.reweights, *self.terms)))

    def loss(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch, normaliser: torch.Tensor,
             kl_coef: float, penalty: Penalty) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the minibatch's policy loss, and its metrics' sums over target tokens.

        Always logged: the surrogate's metrics, ``policy_loss`` (the surrogate per token, after the correction and
        before the other terms), the measurements (``entropy``, ``kl``), ``approx_kl`` (k3 estimate of
        KL(pi_old || pi_theta)), ``engine_logprob_diff`` and ``mismatch_kl``; each term adds its own.

        Args:
            logprobs: (1, N) the policy's log-probabilities of the targets (with grad).
            entropy: (1, N) its entropies.
            mb: the packed micro-batch (``old_logprobs``, ``advantages``, ``target_engine_logprobs``, and
                ``ref_logprobs`` with a reference, ``teacher_logprobs`` with a distillation teacher).
            normaliser: the minibatch's global normaliser under `aggregation`, over the gradient-averaging size.
            kl_coef: the KL coefficient of this rollout.
            penalty: the Lagrangian constraint terms of the measured ``entropy`` (and ``kl``).

        Returns:
            The scalar loss and per-metric sums over this micro-batch's target tokens.
        """
        mask, old = mb["target_mask"].float(), mb["old_logprobs"]
        log_ratio = (logprobs - old).detach()
        loss, metrics = self.surrogate(logprobs, log_ratio, mask, mb)
        step = Step(logprobs, log_ratio, mask, mb, loss, kl_coef, penalty, {"entropy": entropy}, metrics)
        for term in self.reweights:
            term(step)
        step.metrics["policy_loss"] = step.loss.detach()  # the surrogate per token, before KL and entropy terms
        for term in self.terms:
            term(step)
        metrics = step.metrics
        metrics.update({k: v.detach() for k, v in step.measured.items()})
        metrics["approx_kl"] = kl_k3(logprobs.detach(), old)  # KL(pi_old || pi_theta), k3
        metrics["engine_logprob_diff"] = (old - mb["target_engine_logprobs"]).abs()
        metrics["mismatch_kl"] = mismatch_kl(old, mb["target_engine_logprobs"])
        total = self.aggregate(step.loss, mask, mb, normaliser)
        return total, {k: (v * mask).sum() for k, v in metrics.items()}


def value_loss(values: torch.Tensor, mb: MicroBatch, normaliser: torch.Tensor, clip: float | None
               ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The micro-batch's share of the minibatch's clipped value loss (a token mean), and its metrics' sums.

    Args:
        values: (1, N) the critic's values (with grad).
        mb: the packed micro-batch (``old_values``, ``returns``).
        normaliser: the minibatch's global count of completion tokens, over the gradient-averaging size.
        clip: ``model.value_clip``.

    Returns:
        The scalar loss and sums of ``value_loss``, ``values`` and ``returns`` over the target tokens.
    """
    mask = mb["target_mask"].float()
    loss = clipped_value_loss(values, mb["old_values"], mb["returns"], clip)
    sums = {"value_loss": (loss.detach() * mask).sum(), "values": (values.detach() * mask).sum(),
            "returns": (mb["returns"] * mask).sum()}
    return token_mean(loss, mask, normaliser), sums
