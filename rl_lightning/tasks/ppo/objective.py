"""One micro-batch's losses, from the forward's outputs and the rollout's recorded tensors.

`PolicyObjective` holds the arguments of `rl_lightning.tasks.ppo.PPO` that shape the policy loss and assembles it
from `rl_lightning.algorithms`: the surrogate (``policy_loss``), the mismatch-correction weights (``correction``),
the KL and entropy terms and the Lagrangian constraints, the skipped trajectories (``skip_threshold``) and the
reduction (``aggregation``); `value_loss` is the critic's. Per-sequence sums go through
`rl_lightning.parallel.reductions.sequence_sums`, which completes a context-parallel shard's sequences over its
group. Packed tensors are (1, N); S is the number of sequences in the micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.algorithms.correction import mismatch_kl, mismatch_weights, sequence_mismatch_weights
from rl_lightning.algorithms.kl import KL_ESTIMATORS, kl_k3
from rl_lightning.algorithms.policy import (
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_value_loss,
    gspo_log_ratios,
    gspo_policy_loss,
    regularised_policy_loss,
    sequence_mean,
    skip_weights,
    token_mean,
)
from rl_lightning.algorithms.staleness import lag_shares, versioned_mismatch_weights
from rl_lightning.parallel.reductions import sequence_sums
from rl_lightning.tasks.ppo.config import CorrectionConfig
from rl_lightning.tasks.ppo.minibatches import MicroBatch

Penalty = Callable[[dict[str, torch.Tensor]], torch.Tensor | float]


@dataclass(frozen=True)
class PolicyObjective:
    """The policy loss of a micro-batch, as PPO's arguments of the same names say (see `PPO`).

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
    """

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    entropy_coef: float = 0.0
    skip_threshold: float | None = None
    correction: CorrectionConfig | None = None
    kl_estimator: str = "k3"
    kl_in_loss: bool = True
    entropy_constrained: bool = False

    @property
    def entropy_needs_grad(self) -> bool:
        """Whether the loss differentiates the entropy (an entropy bonus or an entropy floor)."""
        return self.entropy_coef != 0 or self.entropy_constrained

    def loss(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch, normaliser: torch.Tensor,
             kl_coef: float, penalty: Penalty) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the minibatch's policy loss, and its metrics' sums over target tokens.

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
        mask = mb["target_mask"].float()
        log_ratio = (logprobs - mb["old_logprobs"]).detach()
        loss, metrics = self.surrogate(logprobs, log_ratio, mask, mb)
        if self.correction is not None:  # rollout/trainer mismatch: detached weights from pi_old / pi_engine
            weights, metrics["mismatch_masked"] = self.mismatch_weights(self.correction, mask, mb)
            loss = loss * weights
        metrics["policy_loss"] = loss.detach()  # the surrogate per token, before KL and entropy terms
        measured = {"entropy": entropy}
        if "ref_logprobs" in mb:  # a reference is loaded
            measured["kl"] = KL_ESTIMATORS[self.kl_estimator](logprobs, mb["ref_logprobs"])
        kl_term = measured.get("kl") if self.kl_in_loss else None
        loss = regularised_policy_loss(loss, entropy, self.entropy_coef, kl_term, kl_coef, penalty(measured))
        metrics.update({k: v.detach() for k, v in measured.items()})
        metrics["approx_kl"] = kl_k3(logprobs.detach(), mb["old_logprobs"])  # KL(pi_old || pi_theta), k3
        if "teacher_logprobs" in mb:  # distillation: k1 estimate of KL(sampling policy || teacher) per token
            metrics["distill_reverse_kl"] = mb["old_logprobs"] - mb["teacher_logprobs"]
        metrics["engine_logprob_diff"] = (mb["old_logprobs"] - mb["target_engine_logprobs"]).abs()
        metrics["mismatch_kl"] = mismatch_kl(mb["old_logprobs"], mb["target_engine_logprobs"])
        if "target_policy_lags" in mb:  # in-flight weight updates: each token's versions behind the trained policy
            metrics.update(lag_shares(mb["target_policy_lags"]))
        if self.skip_threshold is not None:  # skipped trajectories keep their share of the normaliser: weight 0
            loss, metrics["skipped"] = self.skip(self.skip_threshold, loss, log_ratio, mask, mb)
        if self.aggregation == "sequence_mean":  # each completion's token mean, summed over completions
            total = sequence_mean(sequence_sums(loss, mask, mb), sequence_sums(mask, mask, mb), normaliser)
        else:
            total = token_mean(loss, mask, normaliser)
        return total, {k: (v * mask).sum() for k, v in metrics.items()}

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, mb: MicroBatch
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The (1, N) per-token surrogate of `policy_loss` and its per-token metrics.

        Args:
            logprobs: (1, N) with grad.
            log_ratio: (1, N) detached logprobs - old_logprobs.
            mask: (1, N) the target tokens.
            mb: the packed micro-batch.

        Returns:
            (1, N) losses and per-token metrics.
        """
        if self.policy_loss == "gspo":  # each token gets its sequence's mean log ratio (over context-parallel shards)
            means = gspo_log_ratios(sequence_sums(log_ratio, mask, mb), sequence_sums(mask, mask, mb))  # (S,)
            return gspo_policy_loss(logprobs, means[mb["seq_index"].clamp(min=0)], mb["advantages"], self.clip_low,
                                    self.clip_high)
        if self.policy_loss == "cispo":
            return cispo_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], self.clip_low, self.clip_high)
        return clipped_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], self.clip_low, self.clip_high,
                                   self.dual_clip)

    @staticmethod
    def mismatch_weights(correction: CorrectionConfig, mask: torch.Tensor, mb: MicroBatch
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, N) correction weights and masked indicators of this micro-batch's tokens.

        At the sequence levels the indicator is 1 / (its trajectory's completion tokens) where masked, so its sum
        counts masked trajectories.

        Args:
            correction: the correction's settings.
            mask: (1, N) the target tokens.
            mb: the packed micro-batch.

        Returns:
            (1, N) weights and (1, N) indicators.
        """
        c = correction
        log_ratio = (mb["old_logprobs"] - mb["target_engine_logprobs"]).float()  # log pi_old / pi_engine
        if c.level == "token" and "target_policy_lags" in mb:  # tokens of several versions (in-flight updates)
            return versioned_mismatch_weights(mb["old_logprobs"], mb["target_engine_logprobs"],
                                              mb["target_policy_lags"] * mask, c.mode, c.low, c.high)
        if c.level == "token":
            return mismatch_weights(log_ratio, c.mode, c.low, c.high)
        counts = sequence_sums(mask, mask, mb)  # (S,) whole trajectories, over context-parallel shards
        weights, masked = sequence_mismatch_weights(sequence_sums(log_ratio, mask, mb), counts, c.level, c.mode,
                                                    c.low, c.high)  # (S,)
        index = mb["seq_index"].clamp(min=0)  # (1, N); padding (-1) is off the mask
        return weights[index], masked[index]

    @staticmethod
    def skip(threshold: float, loss: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, mb: MicroBatch
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rl_lightning.algorithms.policy.skip_weights` on this micro-batch's sequences.

        Args:
            threshold: ``model.skip_threshold``.
            loss: (1, N) per-token losses.
            log_ratio: (1, N) detached logprobs - old_logprobs.
            mask: (1, N) the target tokens.
            mb: the packed micro-batch.

        Returns:
            The (1, N) loss with skipped trajectories' tokens zeroed, and per token 1 / (its trajectory's completion
            tokens) where skipped, so its sum counts skipped trajectories.
        """
        counts = sequence_sums(mask, mask, mb)  # (S,) whole trajectories, over context-parallel shards
        weights, shares = skip_weights(sequence_sums(log_ratio, mask, mb), counts, threshold)  # (S,)
        index = mb["seq_index"].clamp(min=0)  # (1, N); padding (-1) is off the mask
        return loss * weights[index], shares[index]


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
