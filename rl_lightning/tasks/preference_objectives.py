"""Which preference loss the DPO task runs (``model.loss_type``), what each needs, and its start-up checks.

- the DPO family (``sigmoid``, ``robust``, ``ipo``, ``hinge``): summed log-probabilities of a pair against the
  reference (or none with ``reference_free``);
- ``simpo`` and ``orpo``: average per-token log-probabilities of a pair, no reference model (``reference_free: true``);
- ``kto``: unpaired examples against the reference, with a reference point from mismatched pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_lightning.algorithms import (
    DPO_LOSSES,
    dpo_loss,
    kto_loss,
    orpo_loss,
    per_token_average,
    simpo_loss,
)
from rl_lightning.tasks.pairwise import pair_slices

REFERENCE_FREE_LOSSES = ("simpo", "orpo")
UNPAIRED_LOSSES = ("kto",)
LOSS_TYPES = (*DPO_LOSSES, *REFERENCE_FREE_LOSSES, *UNPAIRED_LOSSES)
SIMPO_GAMMA = 0.5  # model.simpo_gamma unset (TRL's CPOConfig default)
SMOOTHED_LOSSES = ("sigmoid", "robust", "simpo")


def loss_config_errors(loss_type: str, reference_free: bool, label_smoothing: float, simpo_gamma: float | None,
                       desirable_weight: float, undesirable_weight: float) -> list[str]:
    """One line per inconsistent ``model.*`` loss setting, each naming the key, the value and the fix."""
    if loss_type not in LOSS_TYPES:
        return [f"model.loss_type must be one of {', '.join(LOSS_TYPES)}, got '{loss_type}'"]
    errors = []
    if loss_type in REFERENCE_FREE_LOSSES and not reference_free:
        errors.append(f"model.loss_type={loss_type} is reference-free (it compares the policy's own average "
                      "log-probabilities); set model.reference_free: true so no reference model is loaded")
    if loss_type in UNPAIRED_LOSSES and reference_free:
        errors.append(f"model.loss_type={loss_type} needs the reference model (its rewards are log-ratios against "
                      "it); set model.reference_free: false")
    if simpo_gamma is not None and (loss_type != "simpo" or not reference_free):
        errors.append(f"model.simpo_gamma={simpo_gamma} is SimPO's target margin, for the reference-free loss only; "
                      "set model.loss_type: simpo and model.reference_free: true, or unset model.simpo_gamma")
    for key, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if weight <= 0:
            errors.append(f"model.{key} must be > 0, got {weight}; it scales KTO's loss on those examples (1.0: "
                          "balanced data; raise the weight of the rarer kind)")
        elif weight != 1.0 and loss_type not in UNPAIRED_LOSSES:
            errors.append(f"model.{key}={weight} only applies to model.loss_type: kto (got {loss_type}); unset it")
    if label_smoothing and loss_type in ("orpo", *UNPAIRED_LOSSES):
        errors.append(f"model.label_smoothing={label_smoothing} applies to loss_type "
                      f"{', '.join(SMOOTHED_LOSSES)}, not {loss_type}; set it to 0")
    return errors


def preference_objective(hp: Any, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, num_tokens: torch.Tensor | None,
                         micro_batch: dict[str, Any], normaliser: Any,
                         reference_point: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured loss of one micro-batch and its metric sums.

    Args:
        hp: the task's hyper-parameters (``loss_type``, ``beta``, ...).
        logprobs: (S,) summed completion log-probabilities of the micro-batch's sequences under the policy.
        ref_logprobs: (S,) the same under the reference (zeros when reference-free).
        num_tokens: (S,) completion token counts (``simpo``/``orpo``), else None.
        micro_batch: the micro-batch (``num_units``, KTO's ``label``).
        normaliser: global pair (KTO: example) count of the step, over the gradient-averaging ranks.
        reference_point: () KTO's z0, else None.
    """
    num_units = int(micro_batch["num_units"])
    first, second = pair_slices(logprobs, num_units)  # (U,) chosen and rejected; KTO: example and mismatched
    if hp.loss_type in UNPAIRED_LOSSES:
        ref_examples, _ = pair_slices(ref_logprobs, num_units)
        assert reference_point is not None  # the task computes it for kto
        loss, metrics = kto_loss(first, ref_examples, micro_batch["label"], reference_point, normaliser, hp.beta,
                                 hp.desirable_weight, hp.undesirable_weight)
        return loss, {**metrics, "kl": reference_point * num_units}  # logged as a mean per example: z0
    if hp.loss_type in REFERENCE_FREE_LOSSES:
        assert num_tokens is not None  # the task counts them for simpo/orpo
        chosen_tokens, rejected_tokens = pair_slices(num_tokens, num_units)
        chosen, rejected = per_token_average(first, chosen_tokens), per_token_average(second, rejected_tokens)
        if hp.loss_type == "simpo":
            gamma = SIMPO_GAMMA if hp.simpo_gamma is None else hp.simpo_gamma
            return simpo_loss(chosen, rejected, normaliser, hp.beta, gamma, hp.label_smoothing)
        return orpo_loss(chosen, rejected, normaliser, hp.beta)
    ref_chosen, ref_rejected = pair_slices(ref_logprobs, num_units)
    return dpo_loss(first, second, ref_chosen, ref_rejected, normaliser, hp.beta, DPO_LOSSES[hp.loss_type],
                    hp.label_smoothing)
