"""The parts a PPO policy objective is composed of: the surrogates and the optional terms.

A `Surrogate` turns a micro-batch's log-probabilities into (1, N) per-token losses; a `Term` reads and changes a
`Step` (the micro-batch's per-token loss, measurements and metrics) once the surrogate has run. Which of them a run
uses is decided once, when `rl_lightning.tasks.ppo.objective.PolicyObjective` is built; each calls pure functions of
`rl_lightning.algorithms`. Per-sequence sums go through `rl_lightning.parallel.reductions.sequence_sums`, which
completes a context-parallel shard's sequences over its group. Packed tensors are (1, N); S is the number of
sequences in the micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from rl_lightning.algorithms.correction import mismatch_weights, sequence_mismatch_weights
from rl_lightning.algorithms.policy import (
    cispo_policy_loss,
    clipped_policy_loss,
    gspo_log_ratios,
    gspo_policy_loss,
    regularised_policy_loss,
    skip_weights,
)
from rl_lightning.algorithms.staleness import lag_shares, versioned_mismatch_weights
from rl_lightning.parallel.reductions import sequence_sums
from rl_lightning.tasks.ppo.config import CorrectionConfig
from rl_lightning.tasks.ppo.minibatches import MicroBatch

Penalty = Callable[[dict[str, torch.Tensor]], torch.Tensor | float]
Metrics = dict[str, torch.Tensor]


@dataclass
class Step:
    """One micro-batch's per-token tensors ((1, N) each) as the objective's terms read and change them.

    Attributes:
        logprobs: the policy's log-probabilities of the targets (with grad).
        log_ratio: detached logprobs - old_logprobs.
        mask: the target tokens (float).
        mb: the packed micro-batch.
        loss: the per-token loss so far.
        kl_coef: the KL coefficient of this rollout.
        penalty: the Lagrangian constraint terms of the `measured` quantities.
        measured: what the controllers and constraints read: ``entropy``, and ``kl`` with a reference.
        metrics: per-token metrics (summed over the target tokens at the end).
    """

    logprobs: torch.Tensor
    log_ratio: torch.Tensor
    mask: torch.Tensor
    mb: MicroBatch
    loss: torch.Tensor
    kl_coef: float
    penalty: Penalty
    measured: Metrics
    metrics: Metrics = field(default_factory=dict)


class Term(Protocol):
    """One enabled part of the policy loss after the surrogate: it reads and changes a `Step`."""

    name: ClassVar[str]

    def __call__(self, step: Step) -> None:
        """Apply the term to `step` (its loss, measurements or metrics)."""
        ...


# ------------------------------------------------------------------------------------------------------- surrogates


@dataclass(frozen=True)
class ClippedSurrogate:
    """``policy_loss: ppo``: PPO's clipped surrogate on token ratios (`clipped_policy_loss`)."""

    clip_low: float
    clip_high: float
    dual_clip: float | None = None
    name: ClassVar[str] = "ppo"

    def __call__(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, mb: MicroBatch
                 ) -> tuple[torch.Tensor, Metrics]:
        """(1, N) per-token losses and metrics of `logprobs` (with grad) on `mb`."""
        return clipped_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], self.clip_low, self.clip_high,
                                   self.dual_clip)


@dataclass(frozen=True)
class GSPOSurrogate:
    """``policy_loss: gspo``: each token gets its sequence's mean log ratio, over context-parallel shards."""

    clip_low: float
    clip_high: float
    name: ClassVar[str] = "gspo"

    def __call__(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, mb: MicroBatch
                 ) -> tuple[torch.Tensor, Metrics]:
        """(1, N) per-token losses and metrics of `logprobs` (with grad) on `mb`."""
        means = gspo_log_ratios(sequence_sums(log_ratio, mask, mb), sequence_sums(mask, mask, mb))  # (S,)
        return gspo_policy_loss(logprobs, means[mb["seq_index"].clamp(min=0)], mb["advantages"], self.clip_low,
                                self.clip_high)


@dataclass(frozen=True)
class CISPOSurrogate:
    """``policy_loss: cispo``: REINFORCE weighted by the clipped, stop-gradient token ratio."""

    clip_low: float
    clip_high: float
    name: ClassVar[str] = "cispo"

    def __call__(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, mb: MicroBatch
                 ) -> tuple[torch.Tensor, Metrics]:
        """(1, N) per-token losses and metrics of `logprobs` (with grad) on `mb`."""
        return cispo_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], self.clip_low, self.clip_high)


Surrogate = ClippedSurrogate | GSPOSurrogate | CISPOSurrogate


def surrogate(policy_loss: str, clip_low: float, clip_high: float, dual_clip: float | None) -> Surrogate:
    """The surrogate named ``model.policy_loss`` (``ppo``, ``gspo``, ``cispo``) with its clip range."""
    if policy_loss == "ppo":
        return ClippedSurrogate(clip_low, clip_high, dual_clip)
    if policy_loss == "gspo":
        return GSPOSurrogate(clip_low, clip_high)
    if policy_loss == "cispo":
        return CISPOSurrogate(clip_low, clip_high)
    raise ValueError(f"policy_loss must be one of ppo, gspo, cispo, got '{policy_loss}'")


# ------------------------------------------------------------------------------------------------------------ terms

Weights = Callable[[CorrectionConfig, torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor]]


def token_weights(c: CorrectionConfig, mask: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, N) token-level weights from log pi_old / pi_engine, and the masked indicators."""
    return mismatch_weights((mb["old_logprobs"] - mb["target_engine_logprobs"]).float(), c.mode, c.low, c.high)


def versioned_weights(c: CorrectionConfig, mask: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level weights against each token's own policy version (in-flight updates; `token_weights` without)."""
    if "target_policy_lags" not in mb:  # no token of this micro-batch recorded its version
        return token_weights(c, mask, mb)
    return versioned_mismatch_weights(mb["old_logprobs"], mb["target_engine_logprobs"],
                                      mb["target_policy_lags"] * mask, c.mode, c.low, c.high)


def sequence_weights(c: CorrectionConfig, mask: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level weights per token; the indicator is 1 / (its trajectory's completion tokens) where masked."""
    log_ratio = (mb["old_logprobs"] - mb["target_engine_logprobs"]).float()  # log pi_old / pi_engine
    counts = sequence_sums(mask, mask, mb)  # (S,) whole trajectories, over context-parallel shards
    weights, masked = sequence_mismatch_weights(sequence_sums(log_ratio, mask, mb), counts, c.level, c.mode,
                                                c.low, c.high)  # (S,)
    index = mb["seq_index"].clamp(min=0)  # (1, N); padding (-1) is off the mask
    return weights[index], masked[index]


@dataclass(frozen=True)
class Correction:
    """``model.correction``: the surrogate times detached rollout/trainer mismatch weights (``mismatch_masked``)."""

    config: CorrectionConfig
    weights: Weights
    name: ClassVar[str] = "correction"

    def __call__(self, step: Step) -> None:
        """Re-weigh `step`'s loss."""
        weights, step.metrics["mismatch_masked"] = self.weights(self.config, step.mask, step.mb)
        step.loss = step.loss * weights


@dataclass(frozen=True)
class ReferenceKL:
    """A loaded reference: the per-token KL(policy || reference) estimate, measured (``kl``) with gradient."""

    estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    name: ClassVar[str] = "kl"

    def __call__(self, step: Step) -> None:
        """Measure ``kl`` on `step`."""
        step.measured["kl"] = self.estimator(step.logprobs, step.mb["ref_logprobs"])


@dataclass(frozen=True)
class Regulariser:
    """`regularised_policy_loss`: + kl_coef x KL (in the loss), - entropy_coef x entropy, + the constraint terms."""

    entropy_coef: float
    kl_in_loss: bool
    name: ClassVar[str] = "regulariser"

    def __call__(self, step: Step) -> None:
        """Regularise `step`'s loss."""
        measured = step.measured
        step.loss = regularised_policy_loss(step.loss, measured["entropy"], self.entropy_coef,
                                            measured["kl"] if self.kl_in_loss else None, step.kl_coef,
                                            step.penalty(measured))


class DistillationKL:
    """A distillation teacher: ``distill_reverse_kl``, the k1 estimate of KL(sampling policy || teacher) per token."""

    name: ClassVar[str] = "distill_reverse_kl"

    def __call__(self, step: Step) -> None:
        """Record the metric."""
        step.metrics["distill_reverse_kl"] = step.mb["old_logprobs"] - step.mb["teacher_logprobs"]


class PolicyLags:
    """In-flight weight updates: each token's versions behind the trained policy (``policy_lag``, ``stale_tokens``)."""

    name: ClassVar[str] = "policy_lags"

    def __call__(self, step: Step) -> None:
        """Record the metrics (of the micro-batches whose tokens recorded their versions)."""
        if "target_policy_lags" in step.mb:
            step.metrics.update(lag_shares(step.mb["target_policy_lags"]))


@dataclass(frozen=True)
class Skip:
    """``model.skip_threshold``: `skip_weights` on the micro-batch's sequences (``skipped`` counts trajectories).

    Skipped trajectories keep their share of the normaliser: their tokens' loss is zeroed. The metric is per token
    1 / (its trajectory's completion tokens) where skipped, so its sum counts skipped trajectories.
    """

    threshold: float
    name: ClassVar[str] = "skip"

    def __call__(self, step: Step) -> None:
        """Zero the skipped trajectories' tokens of `step`'s loss."""
        mask, mb = step.mask, step.mb
        counts = sequence_sums(mask, mask, mb)  # (S,) whole trajectories, over context-parallel shards
        weights, shares = skip_weights(sequence_sums(step.log_ratio, mask, mb), counts, self.threshold)  # (S,)
        index = mb["seq_index"].clamp(min=0)  # (1, N); padding (-1) is off the mask
        step.loss, step.metrics["skipped"] = step.loss * weights[index], shares[index]
