"""Bradley–Terry and DPO-family losses against values worked out by hand."""

import math

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms import DPO_LOSSES, bradley_terry_loss, dpo_logits, dpo_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_bradley_terry_hand_computed():
    """Reward differences d = [ln 3, 0, -ln 3]: sigma(ln 3) = 3/4, sigma(0) = 1/2, sigma(-ln 3) = 1/4, so
    loss = -(ln 3/4 + ln 1/2 + ln 1/4) / 3 = (ln 4/3 + ln 2 + ln 4) / 3 = ln(32/3) / 3; accuracy counts d > 0: 1.
    With margins [ln 3, 0, 0] the first pair's term becomes -ln sigma(0) = ln 2."""
    chosen, rejected = t(math.log(3), 1.0, 0.0), t(0.0, 1.0, math.log(3))
    loss, metrics = bradley_terry_loss(chosen, rejected, 3)
    assert_close(loss, t(math.log(32 / 3) / 3)[0])
    assert metrics["accuracy"].item() == 1.0
    assert_close(metrics["margin"], t(0.0)[0])
    loss, _ = bradley_terry_loss(chosen, rejected, 3, margins=t(math.log(3), 0.0, 0.0))
    assert_close(loss, t((math.log(2) + math.log(2) + math.log(4)) / 3)[0])


def test_dpo_logits():
    """h = (-1 - -3) - (-2 - -2) = 2."""
    assert_close(dpo_logits(t(-1.0), t(-3.0), t(-2.0), t(-2.0)), t(2.0))


@pytest.mark.parametrize(
    ("variant", "smoothing", "expected"),
    [
        # beta h = 0.5 * 2 ln 3 = ln 3: -ln sigma(ln 3) = ln(4/3)
        ("sigmoid", 0.0, math.log(4 / 3)),
        # cDPO eps = 0.25: 0.75 ln(4/3) + 0.25 (-ln sigma(-ln 3)) = 0.75 ln(4/3) + 0.25 ln 4
        ("sigmoid", 0.25, 0.75 * math.log(4 / 3) + 0.25 * math.log(4)),
        # rDPO eps = 0.25: (0.75 ln(4/3) - 0.25 ln 4) / (1 - 0.5)
        ("robust", 0.25, (0.75 * math.log(4 / 3) - 0.25 * math.log(4)) / 0.5),
        # IPO: (h - 1 / (2 beta))^2 = (2 ln 3 - 1)^2
        ("ipo", 0.0, (2 * math.log(3) - 1) ** 2),
        # hinge: max(0, 1 - beta h) = max(0, 1 - ln 3) = 0 since ln 3 > 1
        ("hinge", 0.0, 0.0),
    ],
)
def test_dpo_variants_hand_computed(variant, smoothing, expected):
    # policy: chosen -1, rejected -1 - 2 ln 3; reference: both -1 -> h = 2 ln 3, beta = 0.5
    policy_chosen, policy_rejected = t(-1.0), t(-1.0 - 2 * math.log(3))
    loss, metrics = dpo_loss(policy_chosen, policy_rejected, t(-1.0), t(-1.0), 1, 0.5, DPO_LOSSES[variant], smoothing)
    assert_close(loss, t(expected)[0], atol=1e-12)
    assert_close(metrics["rewards_chosen"], t(0.0)[0])
    assert_close(metrics["rewards_rejected"], t(-math.log(3))[0])
    assert metrics["accuracy"].item() == 1.0


def test_hinge_is_linear_below_the_margin():
    """beta h = 0.1 * 2 = 0.2 < 1: loss = 1 - 0.2 = 0.8."""
    loss, _ = dpo_loss(t(0.0), t(-2.0), t(0.0), t(0.0), 1, 0.1, DPO_LOSSES["hinge"])
    assert_close(loss, t(0.8)[0], atol=1e-12)


def test_dpo_at_the_reference_is_log_two_and_normalised_globally():
    """Policy == reference: h = 0, -ln sigma(0) = ln 2 per pair; 3 pairs over a global count of 6 -> ln 2 / 2."""
    logps = t(-1.0, -2.0, -3.0)
    loss, metrics = dpo_loss(logps, logps - 1, logps, logps - 1, 6, 0.1)
    assert_close(loss, t(math.log(2) / 2)[0], atol=1e-12)
    assert metrics["accuracy"].item() == 0.0  # a zero margin is not a win
