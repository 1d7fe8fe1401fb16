"""Preference losses beyond DPO's paired, reference-anchored form: SimPO, ORPO (reference-free) and KTO (unpaired).

Same contract as `rl_lightning.algorithms.preference`: the loss is the *sum* over pairs (KTO: examples) divided by
the caller's global count; metrics are detached *sums* over the units given, for the caller to reduce globally.

SimPO and ORPO read the *average* per-token log-probability of each completion (sum / completion tokens), KTO the
summed one, as their papers do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rl_lightning.algorithms.preference import sigmoid_dpo


def simpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    num_pairs: float | torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO: a reference-free DPO on length-normalised log-probabilities with a target reward margin gamma.

    ``-log sigma(beta * avg log pi(y_c) - beta * avg log pi(y_r) - gamma)`` per pair, label-smoothed like cDPO
    (`sigmoid_dpo` applied to ``h - gamma / beta``).

    Paper: Meng et al. 2024, https://arxiv.org/abs/2405.14734, eq. 6.

    Args:
        chosen_avg_logps: (P,) mean per-token log-probability of each chosen completion under the policy.
        rejected_avg_logps: (P,) the same for the rejected completions.
        num_pairs: normaliser (global pair count).
        beta: reward scale (the paper uses 2 to 10).
        gamma: target reward margin (the paper's gamma; gamma / beta of 0.5 is a common start).
        label_smoothing: label-flip probability, as in cDPO.

    Metrics (sums over the P pairs): ``rewards_chosen`` / ``rewards_rejected`` (beta x average log-probability),
    ``margin``, ``accuracy`` (pairs with a positive margin), ``logps_chosen``, ``logps_rejected`` (averages).
    """
    h = chosen_avg_logps - rejected_avg_logps  # (P,)
    loss = sigmoid_dpo(h - gamma / beta, beta, label_smoothing).sum() / num_pairs
    return loss, _reward_metrics(chosen_avg_logps, rejected_avg_logps, beta)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x < 0, stable at both ends (Maechler 2012: log1p near -inf, expm1 near 0)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    num_pairs: float | torch.Tensor,
    lam: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO: the chosen completion's NLL plus lambda x the odds-ratio loss, reference-free.

    With ``a_c``, ``a_r`` the average per-token log-probabilities and ``odds(y) = P(y) / (1 - P(y))``,
    ``P(y) = exp(a)``: ``log odds ratio = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r))`` and per pair
    ``loss = -a_c - lam * log sigma(log odds ratio)``.

    Paper: Hong et al. 2024, https://arxiv.org/abs/2403.07691, eqs. 2, 6 and 7. The NLL term is the paper's: the
    chosen completion's tokens, averaged per sequence, then per pair (TRL's ORPOTrainer averages over all chosen tokens
    of the batch, prompt tokens included).

    Args:
        chosen_avg_logps: (P,) mean per-token log-probability of each chosen completion under the policy (< 0).
        rejected_avg_logps: (P,) the same for the rejected completions.
        num_pairs: normaliser (global pair count).
        lam: weight of the odds-ratio term (the paper's lambda, 0.1 to 1).

    Metrics (sums over the P pairs): as `simpo_loss` with beta = lam, plus ``nll`` (the chosen completions' average
    NLL) and ``log_odds_ratio``.
    """
    log_odds = (chosen_avg_logps - rejected_avg_logps) - (log1mexp(chosen_avg_logps) - log1mexp(rejected_avg_logps))
    nll = -chosen_avg_logps  # (P,)
    loss = (nll - lam * F.logsigmoid(log_odds)).sum() / num_pairs
    metrics = _reward_metrics(chosen_avg_logps, rejected_avg_logps, lam)
    metrics.update(nll=nll.detach().sum(), log_odds_ratio=log_odds.detach().sum())
    return loss, metrics


def _reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    rewards_chosen, rewards_rejected = scale * chosen.detach(), scale * rejected.detach()
    return {
        "rewards_chosen": rewards_chosen.sum(),
        "rewards_rejected": rewards_rejected.sum(),
        "margin": (rewards_chosen - rewards_rejected).sum(),
        "accuracy": (rewards_chosen > rewards_rejected).float().sum(),
        "logps_chosen": chosen.detach().sum(),
        "logps_rejected": rejected.detach().sum(),
    }


def kto_reference_point(mismatched_logratio_sum: torch.Tensor, num_examples: float | torch.Tensor) -> torch.Tensor:
    """KTO's reference point z0: the mean log-ratio of mismatched (prompt, completion) pairs, clamped at 0, detached.

    ``z0 = max(0, (1 / n) sum_i log pi(y'_i | x_i) - log pi_ref(y'_i | x_i))``, a biased but cheap estimate of
    KL(pi || pi_ref) (paper section 4.1, "in practice"); no gradient flows through it.

    Args:
        mismatched_logratio_sum: () sum over the step's mismatched pairs of the policy minus reference summed
            completion log-probabilities (summed over data-parallel ranks by the caller).
        num_examples: the global number of mismatched pairs (one per example).
    """
    return (mismatched_logratio_sum.detach() / num_examples).clamp(min=0)


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    num_examples: float | torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO: each example's implicit reward pushed above (desirable) or below (undesirable) the reference point.

    With ``r = log pi(y|x) - log pi_ref(y|x)`` and z0 = `reference_point`, per example
    ``w_d (1 - sigma(beta (r - z0)))`` if desirable, else ``w_u (1 - sigma(beta (z0 - r)))``.

    Paper: Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306, eq. 7 (the value function v(x, y) there; the
    constant lambda_y of the loss is dropped, so the loss is in [0, max(w_d, w_u)]).

    Args:
        logps: (E,) summed completion log-probabilities under the policy.
        ref_logps: (E,) the same under the frozen reference.
        desirable: (E,) 1 for desirable examples, 0 for undesirable ones.
        reference_point: () z0 from `kto_reference_point`.
        num_examples: normaliser (global example count).
        beta: implicit-reward inverse temperature.
        desirable_weight: w_d (raise it when desirable examples are rarer, paper eq. 8).
        undesirable_weight: w_u.

    Metrics (sums over the E examples): ``rewards`` (beta r), ``desirable`` (count), ``accuracy`` (examples on their
    side of z0: desirable with r > z0, undesirable with r < z0), ``logps``.
    """
    logratios = logps - ref_logps  # (E,)
    is_desirable = desirable > 0.5
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - reference_point)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (reference_point - logratios)))
    loss = torch.where(is_desirable, desirable_losses, undesirable_losses).sum() / num_examples
    detached = logratios.detach()
    right_side = torch.where(is_desirable, detached > reference_point, detached < reference_point)
    metrics = {
        "rewards": beta * detached.sum(),
        "desirable": is_desirable.float().sum(),
        "accuracy": right_side.float().sum(),
        "logps": logps.detach().sum(),
    }
    return loss, metrics


def per_token_average(logps: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """(P,) average per-token log-probabilities from (P,) summed ones and (P,) completion token counts (>= 1)."""
    return logps / num_tokens.clamp(min=1)
