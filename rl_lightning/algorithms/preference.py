"""Pairwise preference losses: Bradley–Terry reward modelling and the DPO family.

Every loss returns ``(loss, metrics)``: the loss is the *sum* over pairs divided by the caller's `num_pairs` (the
global pair count of the optimizer step, for invariance to packing and data parallelism); metrics are detached
*sums* over the pairs given, for the caller to reduce globally and divide.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    num_pairs: float | torch.Tensor,
    margins: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry loss for a reward model: ``-(1 / num_pairs) * sum_p log sigma(r_c - r_r - m_p)``.

    Paper: Ouyang et al. 2022 (InstructGPT), https://arxiv.org/abs/2203.02155, eq. 1; the per-pair margin ``m`` is
    Llama 2's (Touvron et al. 2023, https://arxiv.org/abs/2307.09288, eq. 2).

    Args:
        chosen_rewards: (P,) scalar rewards of the chosen completions.
        rejected_rewards: (P,) rewards of the rejected completions.
        num_pairs: normaliser (global pair count).
        margins: (P,) optional margins by which the chosen reward should exceed the rejected one.
    """
    diff = chosen_rewards - rejected_rewards  # (P,)
    if margins is not None:
        diff = diff - margins
    loss = -F.logsigmoid(diff).sum() / num_pairs
    raw = (chosen_rewards - rejected_rewards).detach()
    metrics = {
        "accuracy": (raw > 0).float().sum(),
        "rewards_chosen": chosen_rewards.detach().sum(),
        "rewards_rejected": rejected_rewards.detach().sum(),
        "margin": raw.sum(),
    }
    return loss, metrics


def dpo_logits(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
) -> torch.Tensor:
    """(P,) implicit reward difference h = (log pi(y_c) - log pi(y_r)) - (log pi_ref(y_c) - log pi_ref(y_r))."""
    return (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)


def sigmoid_dpo(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """(P,) DPO loss ``-log sigma(beta h)``, optionally label-smoothed (conservative DPO, cDPO).

    With label smoothing eps the preference label is flipped with probability eps:
    ``-(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``.

    Papers: Rafailov et al. 2023, https://arxiv.org/abs/2305.18290, eq. 7; cDPO: Mitchell 2023,
    https://ericmitchell.ai/cdpo.pdf.
    """
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def robust_dpo(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """(P,) robust DPO (rDPO), an unbiased loss under label-flip rate eps < 1/2.

    ``(-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)``.

    Paper: Chowdhury et al. 2024, https://arxiv.org/abs/2403.00409, eq. 8.
    """
    return (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) / (
        1 - 2 * label_smoothing
    )


def ipo(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """(P,) IPO loss ``(h - 1 / (2 beta))^2``.

    Here beta plays the role of the paper's tau; `label_smoothing` is unused. Paper: Azar et al. 2023,
    https://arxiv.org/abs/2310.12036, eq. 17, on summed log-probabilities.
    """
    return (h - 1 / (2 * beta)) ** 2


def hinge(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """(P,) hinge (SLiC) loss ``max(0, 1 - beta h)``.

    Paper: Zhao et al. 2023, https://arxiv.org/abs/2305.10425, eq. 3 (calibration loss with delta = 1 / beta).
    """
    return torch.relu(1 - beta * h)


DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": sigmoid_dpo,
    "robust": robust_dpo,
    "ipo": ipo,
    "hinge": hinge,
}


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    num_pairs: float | torch.Tensor,
    beta: float,
    variant: Callable[[torch.Tensor, float, float], torch.Tensor] = sigmoid_dpo,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A DPO-family loss averaged over `num_pairs`, with DPO's implicit-reward metrics.

    Args:
        chosen_logps: (P,) summed completion log-probabilities of the chosen completions under the policy.
        rejected_logps: (P,) the same for the rejected completions.
        ref_chosen_logps: (P,) `chosen_logps` under the frozen reference (zeros = reference-free).
        ref_rejected_logps: (P,) `rejected_logps` under the frozen reference.
        num_pairs: normaliser (global pair count).
        beta: inverse temperature of the implicit reward ``beta * (log pi - log pi_ref)``.
        variant: one of `DPO_LOSSES`.
        label_smoothing: label-flip probability for `sigmoid_dpo` / `robust_dpo`.

    Metrics (sums over the P pairs): ``rewards_chosen``, ``rewards_rejected``, ``margin`` (their difference),
    ``accuracy`` (pairs with a positive margin), ``logps_chosen``, ``logps_rejected``.
    """
    h = dpo_logits(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)  # (P,)
    loss = variant(h, beta, label_smoothing).sum() / num_pairs
    rewards_chosen = beta * (chosen_logps - ref_chosen_logps).detach()
    rewards_rejected = beta * (rejected_logps - ref_rejected_logps).detach()
    metrics = {
        "rewards_chosen": rewards_chosen.sum(),
        "rewards_rejected": rewards_rejected.sum(),
        "margin": (rewards_chosen - rewards_rejected).sum(),
        "accuracy": (rewards_chosen > rewards_rejected).float().sum(),
        "logps_chosen": chosen_logps.detach().sum(),
        "logps_rejected": rejected_logps.detach().sum(),
    }
    return loss, metrics
