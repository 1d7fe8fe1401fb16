"""Off-policy and bootstrapped estimators against values worked out by hand (each docstring shows the arithmetic), and
their invariances: on-policy V-trace / Retrace are GAE, TD(1) and long n-step are Monte-Carlo, TD(0) and 1-step
are one-step targets.

The hand-worked row (T = 3, gamma = 0.9): r = [0, 0, 1], V = [0.5, 0.4, 0.8], so V_{t+1} = [0.4, 0.8, 0] and the
TD errors r_t + gamma V_{t+1} - V_t = [-0.14, 0.32, 0.2]; log pi - log mu = [log 2, log 0.5, 0], rho = [2, 0.5, 1].
"""

import math

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms.advantages import discounted_returns, estimate_advantages, gae
from rl_lightning.algorithms.offpolicy import (
    clipped_importance_weights,
    nstep_returns,
    retrace,
    td_lambda_returns,
    vtrace,
)

GAMMA = 0.9
# row 0: the hand-worked row; row 1: two tokens (garbage past them); row 2: fully masked (garbage everywhere)
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0], [7.0, 7.0, 7.0]])
VALUES = torch.tensor([[0.5, 0.4, 0.8], [0.5, 0.6, 9.0], [3.0, 3.0, 3.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
TARGET = torch.tensor([[math.log(2.0), math.log(0.5), 0.0], [-1.0, -2.0, 4.0], [5.0, 5.0, 5.0]])
BEHAVIOUR = torch.tensor([[0.0, 0.0, 0.0], [-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]])  # row 1: rho = 1 on its tokens


def test_clipped_importance_weights():
    """min(rho, 1.5) = [1.5, 0.5, 1] on row 0; rho = 1 on row 1's tokens; 0 where masked."""
    weights = clipped_importance_weights(TARGET, BEHAVIOUR, MASK, cap=1.5)
    assert_close(weights, torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_vtrace_hand_worked():
    """rho-bar = c-bar = 1, lam = 1: rho_t = c_t = [1, 0.5, 1], delta = rho * TD = [-0.14, 0.16, 0.2].
    v - V: s=2: 0.2; s=1: 0.16 + 0.9 * 0.5 * 0.2 = 0.25; s=0: -0.14 + 0.9 * 1 * 0.25 = 0.085 -> v = [0.585, 0.65, 1].
    A_s = rho_s (r_s + 0.9 v_{s+1} - V_s): [0.9 * 0.65 - 0.5, 0.5 (0.9 * 1 - 0.4), 1 - 0.8] = [0.085, 0.25, 0.2].
    Row 1 (rho = 1): TD = [0 + 0.9 * 0.6 - 0.5, 1 - 0.6] = [0.04, 0.4]; v - V = [0.04 + 0.9 * 0.4, 0.4] = [0.4, 0.4],
    v = [0.9, 1]; A = [0.9 * 1 - 0.5, 1 - 0.6] = [0.4, 0.4]. Row 2: all 0.
    rho-bar = 1.5 on row 0: rho = [1.5, 0.5, 1], delta_0 = -0.21, v_0 = 0.5 - 0.21 + 0.225 = 0.515,
    A_0 = 1.5 * (0.585 - 0.5) = 0.1275 (the traces, c-bar = 1, are unchanged)."""
    advantages, targets = vtrace(REWARDS, VALUES, MASK, TARGET, BEHAVIOUR, gamma=GAMMA, lam=1.0)
    assert_close(targets, torch.tensor([[0.585, 0.65, 1.0], [0.9, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(advantages, torch.tensor([[0.085, 0.25, 0.2], [0.4, 0.4, 0.0], [0.0, 0.0, 0.0]]))
    advantages, targets = vtrace(REWARDS[:1], VALUES[:1], MASK[:1], TARGET[:1], BEHAVIOUR[:1], gamma=GAMMA,
                                 rho_bar=1.5)
    assert_close(targets, torch.tensor([[0.515, 0.65, 1.0]]))
    assert_close(advantages, torch.tensor([[0.1275, 0.25, 0.2]]))


def test_retrace_hand_worked():
    """lam = 0.5: c = 0.5 min(1, rho) = [0.5, 0.25, 0.5], c_{s+1} = [0.25, 0.5, 0]; delta = TD = [-0.14, 0.32, 0.2]
    (no importance weight on the first token). G - V: s=2: 0.2; s=1: 0.32 + 0.9 * 0.5 * 0.2 = 0.41;
    s=0: -0.14 + 0.9 * 0.25 * 0.41 = -0.04775 -> G = [0.45225, 0.81, 1]. Row 1 (rho = 1, lam = 0.5) is GAE(0.5):
    A = [0.04 + 0.45 * 0.4, 0.4] = [0.22, 0.4], G = [0.72, 1]."""
    advantages, returns = retrace(REWARDS, VALUES, MASK, TARGET, BEHAVIOUR, gamma=GAMMA, lam=0.5)
    assert_close(advantages, torch.tensor([[-0.04775, 0.41, 0.2], [0.22, 0.4, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(returns, torch.tensor([[0.45225, 0.81, 1.0], [0.72, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_td_lambda_hand_worked():
    """lam = 0.5: G_2 = 1; G_1 = 0.9 (0.5 * 0.8 + 0.5 * 1) = 0.81; G_0 = 0.9 (0.5 * 0.4 + 0.5 * 0.81) = 0.5445;
    A = G - V = [0.0445, 0.41, 0.2] (GAE(0.5): A_1 = 0.32 + 0.45 * 0.2, A_0 = -0.14 + 0.45 * 0.41). Row 1:
    G_1 = 1, G_0 = 0.9 (0.5 * 0.6 + 0.5 * 1) = 0.72."""
    advantages, returns = td_lambda_returns(REWARDS, VALUES, MASK, gamma=GAMMA, lam=0.5)
    assert_close(returns, torch.tensor([[0.5445, 0.81, 1.0], [0.72, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(advantages, torch.tensor([[0.0445, 0.41, 0.2], [0.22, 0.4, 0.0], [0.0, 0.0, 0.0]]))


def test_nstep_hand_worked():
    """n = 2: G_0 = r_0 + 0.9 r_1 + 0.81 V_2 = 0.648; G_1 = r_1 + 0.9 r_2 = 0.9 (V_3 is past the end); G_2 = 1.
    Row 1: G_0 = 0 + 0.9 * 1 + 0.81 * 0 (V_2 is past its end, its 9.0 ignored) = 0.9, G_1 = 1."""
    advantages, returns = nstep_returns(REWARDS, VALUES, MASK, n=2, gamma=GAMMA)
    assert_close(returns, torch.tensor([[0.648, 0.9, 1.0], [0.9, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(advantages, torch.tensor([[0.148, 0.5, 0.2], [0.4, 0.4, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="n-step returns need n >= 1, got 0"):
        nstep_returns(REWARDS, VALUES, MASK, n=0)


def _random_batch(seed=0):
    """Rows of lengths 6, 4, 1, 0 (random garbage past each row's end)."""
    generator = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator)
    mask = (torch.arange(6)[None] < torch.tensor([6, 4, 1, 0])[:, None]).float()
    logprobs = -torch.rand(4, 6, generator=generator)
    return rewards, values, mask, logprobs


def _one_step(rewards, values, mask, gamma):
    """r_t + gamma V_{t+1}, V past the end 0."""
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    return (rewards + gamma * next_values) * mask


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_on_policy_vtrace_is_gae(lam):
    """pi = mu (rho = 1) and rho-bar = c-bar = 1: v_s - V_s = delta_s + gamma lam (v_{s+1} - V_{s+1}), GAE's
    recursion, so the V-trace targets are GAE's returns; the advantage r_s + gamma v_{s+1} - V_s =
    delta_s + gamma A^GAE_{s+1} (A^GAE at the next token), which is A^GAE_s itself at lam = 1. Holds as well when
    pi > mu everywhere (rho clipped to 1)."""
    rewards, values, mask, logprobs = _random_batch()
    gae_advantages, gae_returns = gae(rewards * mask, values * mask, mask, GAMMA, lam)
    next_gae = torch.cat([gae_advantages[:, 1:], torch.zeros_like(gae_advantages[:, :1])], dim=1)
    deltas = (_one_step(rewards, values, mask, GAMMA) - values) * mask
    for behaviour in (logprobs, logprobs - 0.3):  # equal policies; pi / mu = e^0.3 > 1, clipped to 1
        advantages, targets = vtrace(rewards, values, mask, logprobs, behaviour, GAMMA, lam)
        assert_close(targets, gae_returns)
        assert_close(advantages, (deltas + GAMMA * next_gae) * mask)
        if lam == 1.0:
            assert_close(advantages, gae_advantages)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_on_policy_retrace_and_td_lambda_are_gae(lam):
    rewards, values, mask, logprobs = _random_batch(1)
    expected = gae(rewards * mask, values * mask, mask, GAMMA, lam)
    for actual in (retrace(rewards, values, mask, logprobs, logprobs, GAMMA, lam),
                   td_lambda_returns(rewards, values, mask, GAMMA, lam)):
        assert_close(actual[0], expected[0])
        assert_close(actual[1], expected[1])


def test_monte_carlo_limits():
    """TD(1), n-step with n >= T and on-policy Retrace(1) are the Monte-Carlo return (reward-to-go); TD(0) and
    1-step are the one-step target r_t + gamma V_{t+1}."""
    rewards, values, mask, logprobs = _random_batch(2)
    monte_carlo = discounted_returns(rewards, mask, GAMMA)
    assert_close(td_lambda_returns(rewards, values, mask, GAMMA, lam=1.0)[1], monte_carlo)
    for n in (6, 7, 50):
        assert_close(nstep_returns(rewards, values, mask, n, GAMMA)[1], monte_carlo)
    assert_close(retrace(rewards, values, mask, logprobs, logprobs, GAMMA, lam=1.0)[1], monte_carlo)
    one_step = _one_step(rewards, values, mask, GAMMA)
    assert_close(td_lambda_returns(rewards, values, mask, GAMMA, lam=0.0)[1], one_step)
    assert_close(nstep_returns(rewards, values, mask, 1, GAMMA)[1], one_step)


def test_masked_positions_do_not_leak():
    """Garbage past a row's end changes nothing; fully masked rows are 0."""
    rewards, values, mask, logprobs = _random_batch(3)
    noise = torch.randn_like(rewards) * (1 - mask) * 100
    runs = [lambda r, v, p: vtrace(r, v, mask, p, logprobs, GAMMA, 0.7, 1.5, 0.8),
            lambda r, v, p: retrace(r, v, mask, p, logprobs, GAMMA, 0.7),
            lambda r, v, p: td_lambda_returns(r, v, mask, GAMMA, 0.7),
            lambda r, v, p: nstep_returns(r, v, mask, 3, GAMMA)]
    for run in runs:
        clean, noisy = run(rewards, values, logprobs - 0.5), run(rewards + noise, values + noise, logprobs - 0.5 + noise)
        for a, b in zip(clean, noisy, strict=True):
            assert_close(a, b)
            assert (b[3] == 0).all() and (b * (1 - mask) == 0).all()


def test_estimate_advantages_dispatches_with_the_outcome_on_the_last_token():
    """Outcome rewards (B,) go on each row's last completion token, as for ``gae``."""
    _, values, mask, logprobs = _random_batch(4)
    outcome = torch.tensor([1.0, -1.0, 0.5, 2.0])
    token_rewards = torch.zeros(4, 6)
    token_rewards[0, 5], token_rewards[1, 3], token_rewards[2, 0] = 1.0, -1.0, 0.5
    behaviour = logprobs + 0.2 * torch.randn(4, 6)
    cases = {
        "vtrace": vtrace(token_rewards, values, mask, logprobs, behaviour, GAMMA, 0.9, 1.2, 0.8),
        "retrace": retrace(token_rewards, values, mask, logprobs, behaviour, GAMMA, 0.9),
        "td_lambda": td_lambda_returns(token_rewards, values, mask, GAMMA, 0.9),
        "nstep": nstep_returns(token_rewards, values, mask, 3, GAMMA),
    }
    for name, expected in cases.items():
        actual = estimate_advantages(name, outcome, mask, group_size=2, values=values, gamma=GAMMA, lam=0.9,
                                     target_logprobs=logprobs, behaviour_logprobs=behaviour, rho_bar=1.2, c_bar=0.8,
                                     nstep=3)
        assert_close(actual[0], expected[0])
        assert_close(actual[1], expected[1])
    with pytest.raises(ValueError, match="the vtrace estimator needs target and behaviour log-probabilities"):
        estimate_advantages("vtrace", outcome, mask, group_size=2, values=values)
    with pytest.raises(ValueError, match="the nstep estimator needs the critic's values"):
        estimate_advantages("nstep", outcome, mask, group_size=2)
