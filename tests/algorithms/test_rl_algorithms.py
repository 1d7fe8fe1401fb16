"""PPO-family building blocks against values worked out by hand (each docstring shows the arithmetic)."""

import math

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms.advantages import (
    discounted_returns,
    gae,
    group_advantages,
    packed_gae,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rl_lightning.algorithms.dapo import GroupRefill, keep_groups, mask_truncated, overlong_penalty
from rl_lightning.algorithms.kl import (
    AdaptiveKLController,
    LinearKLController,
    PIDKLController,
    ScheduledKLController,
    kl_k1,
    kl_k2,
    kl_k3,
)
from rl_lightning.algorithms.policy import (
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    lagrangian_terms,
    sequence_mean,
    token_mean,
    truncated_importance_weights,
)
from rl_lightning.algorithms.reward_combination import tchebycheff, weighted_sum


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_hand_worked_four_steps():
    """r = [0, 0, 0, 1], V = [.5, .6, .7, .8], gamma = .9, lambda = .5 (gamma lambda = .45):
    delta_3 = 1 - .8 = .2; delta_2 = .9 * .8 - .7 = .02; delta_1 = .9 * .7 - .6 = .03; delta_0 = .9 * .6 - .5 = .04
    A_3 = .2; A_2 = .02 + .45 * .2 = .11; A_1 = .03 + .45 * .11 = .0795; A_0 = .04 + .45 * .0795 = .075775.
    Row 2 ends after 2 tokens (r = [0, 1]): delta_1 = 1 - .5 = .5, delta_0 = .9 * .5 - .5 = -.05, A_0 = -.05 + .45 * .5
    = .175. Row 3 is fully masked. With gamma = lambda = 1, A_t = (sum of future rewards) - V_t."""
    rewards = t([0, 0, 0, 1], [0, 1, 0, 0], [5, 5, 5, 5])
    values = t([0.5, 0.6, 0.7, 0.8], [0.5, 0.5, 9, 9], [1, 1, 1, 1])
    mask = t([1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert_close(advantages, t([0.075775, 0.0795, 0.11, 0.2], [0.175, 0.5, 0, 0], [0, 0, 0, 0]), atol=1e-12)
    assert_close(returns, (advantages + values) * mask, atol=1e-12)
    monte_carlo, _ = gae(rewards[:1], values[:1], mask[:1], gamma=1.0, lam=1.0)
    assert_close(monte_carlo, t([0.5, 0.4, 0.3, 0.2]), atol=1e-12)


def test_packed_gae_equals_gae_per_sequence():
    """Two sequences packed in one row, with a masked (tool) token inside the first: each sequence's completion
    tokens give exactly `gae` on that sequence alone (gaps skipped), and nothing outside the completion tokens."""
    rewards = t([0, 0, 9, 0, 1, 7, 0, 2])
    values = t([0.5, 0.6, 9, 0.7, 0.8, 9, 0.4, 0.3])
    mask = t([1, 1, 0, 1, 1, 0, 1, 1])
    seq_index = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    advantages, returns = packed_gae(rewards, values, mask, seq_index, 2, gamma=0.9, lam=0.5)
    first, first_returns = gae(t([0, 0, 0, 1]), t([0.5, 0.6, 0.7, 0.8]), t([1, 1, 1, 1]), 0.9, 0.5)
    second, _ = gae(t([0, 2]), t([0.4, 0.3]), t([1, 1]), 0.9, 0.5)
    assert_close(advantages[0, [0, 1, 3, 4]], first[0], atol=1e-12)
    assert_close(advantages[0, [6, 7]], second[0], atol=1e-12)
    assert_close(returns[0, [0, 1, 3, 4]], first_returns[0], atol=1e-12)
    assert advantages[0, 2] == 0 and advantages[0, 5] == 0


def test_group_advantages_dr_grpo_grpo_and_zero_variance():
    """Group [1, 0, 1, 1]: mean .75 -> [.25, -.75, .25, .25]; unbiased std = sqrt((3 * .0625 + .5625) / 3) = .5 ->
    GRPO [.5, -1.5, .5, .5]. Group [0, 0, 0, 0] has zero variance: advantages 0, not NaN."""
    rewards = torch.tensor([1.0, 0, 1, 1, 0, 0, 0, 0], dtype=torch.float64)
    assert_close(group_advantages(rewards, 4), t(0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0), atol=1e-12)
    grpo = group_advantages(rewards, 4, scale_by_std=True, eps=0.0)
    assert_close(grpo[:4], torch.tensor([0.5, -1.5, 0.5, 0.5], dtype=torch.float64), atol=1e-12)
    assert torch.equal(group_advantages(rewards, 4, scale_by_std=True)[4:], torch.zeros(4, dtype=torch.float64))


def test_rloo_leave_one_out():
    """[1, 0, 1, 1]: A_0 = 1 - (0 + 1 + 1) / 3 = 1/3, A_1 = 0 - 1 = -1; equals G / (G - 1) * (r - mean)."""
    rewards = torch.tensor([1.0, 0, 1, 1], dtype=torch.float64)
    assert_close(rloo_advantages(rewards, 4), torch.tensor([1 / 3, -1, 1 / 3, 1 / 3], dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 completions"):
        rloo_advantages(rewards, 1)


def test_reinforce_pp_whitens_reward_to_go_over_the_batch():
    """Reward-to-go of r = [[0, 1], [0, 0]] with mask [[1, 1], [1, 0]] is [[1, 1], [0, -]]: over the 3 tokens mean 2/3,
    population std sqrt(2/9), so whitened values (1 - 2/3) / sqrt(2/9) = 1/sqrt(2) and -2/3 / sqrt(2/9) = -sqrt(2)."""
    rewards, mask = t([0, 1], [0, 0]), t([1, 1], [1, 0])
    assert_close(discounted_returns(rewards, mask), t([1, 1], [0, 0]))
    expected = t([1 / math.sqrt(2), 1 / math.sqrt(2)], [-math.sqrt(2), 0])
    assert_close(reinforce_pp_advantages(rewards, mask), expected, atol=1e-7)


def test_kl_estimators():
    """p = .5, p_ref = .25, so r = p_ref / p = .5: k1 = ln 2, k2 = (ln 2)^2 / 2, k3 = .5 - 1 + ln 2."""
    logp, ref = t(math.log(0.5)), t(math.log(0.25))
    assert_close(kl_k1(logp, ref), t(math.log(2)))
    assert_close(kl_k2(logp, ref), t(math.log(2) ** 2 / 2))
    assert_close(kl_k3(logp, ref), t(-0.5 + math.log(2)))
    assert kl_k3(ref, logp).item() > 0  # k3 >= 0 in both directions


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "clipped"),
    [
        (1.5, 1.0, -1.28, True),   # above 1 + clip_high = 1.28 with A > 0: clipped at 1.28
        (1.2, 1.0, -1.2, False),   # inside the asymmetric range
        (0.5, 1.0, -0.5, False),   # below 1 - clip_low with A > 0: pessimistic min keeps the unclipped term
        (0.5, -1.0, 0.8, True),    # below 1 - clip_low = .8 with A < 0: clipped at .8
        (1.5, -1.0, 1.5, False),   # above with A < 0: unclipped term is the larger loss
    ],
)
def test_clip_low_high_boundaries(ratio, advantage, expected_loss, clipped):
    loss, metrics = clipped_policy_loss(t(math.log(ratio)), t(0.0), t(advantage), clip_low=0.2, clip_high=0.28)
    assert_close(loss, t(expected_loss), atol=1e-12)
    assert bool(metrics["clipped"].item()) is clipped


def test_dual_clip_bounds_negative_advantage_losses():
    """ratio 5, A = -1: PPO loss max(5, 1.28) = 5; dual clip c = 3 bounds it at -c * A = 3. A > 0 rows unaffected."""
    loss, metrics = clipped_policy_loss(t(math.log(5.0), math.log(5.0)), t(0.0, 0.0), t(-1.0, 1.0),
                                        clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert_close(loss, t(3.0, -1.28), atol=1e-12)
    assert metrics["dual_clipped"].tolist() == [1.0, 0.0]


def test_token_versus_sequence_aggregation():
    """values [[1, 2, 3], [4, -, -]]: token mean (1 + 2 + 3 + 4) / 4 = 2.5; sequence mean (2 + 4) / 2 = 3; with
    global normalisers of 8 tokens / 4 sequences: 10 / 8 and 6 / 4."""
    values, mask = t([1, 2, 3], [4, 9, 9]), t([1, 1, 1], [1, 0, 0])
    assert token_mean(values, mask, 4).item() == 2.5 and sequence_mean(values, mask, 2).item() == 3.0
    assert token_mean(values, mask, 8).item() == 1.25 and sequence_mean(values, mask, 4).item() == 1.5


def test_truncated_importance_weights():
    """pi_old / pi_engine = e^(ln 3) = 3 capped at 2; e^(ln .5) = .5 kept."""
    weights = truncated_importance_weights(t(math.log(3), math.log(0.5)), t(0.0, 0.0), cap=2.0)
    assert_close(weights, t(2.0, 0.5), atol=1e-12)


def test_clipped_value_loss():
    """V_old = 1, V = 2, R = 3, clip .5: unclipped .5 (2 - 3)^2 = .5, clipped V = 1.5 -> .5 (1.5 - 3)^2 = 1.125."""
    assert_close(clipped_value_loss(t(2.0), t(1.0), t(3.0), clip=0.5), t(1.125))
    assert_close(clipped_value_loss(t(2.0), t(1.0), t(3.0), clip=None), t(0.5))


def test_entropy_and_lagrangian():
    """Uniform logits over 4 tokens: H = ln 4. Entropy floor 1 with measured .5 and lambda = 2: violation
    g = -(.5 - 1) = .5, policy term lambda * g = 1, multiplier loss -lambda * g = -1 whose gradient wrt log lambda is -1
    (descent raises lambda while the floor is violated)."""
    assert_close(entropy_from_logits(torch.zeros(1, 1, 4)), torch.tensor([[math.log(4)]]))
    log_multiplier = torch.tensor(math.log(2.0), requires_grad=True)
    measured = torch.tensor(0.5, requires_grad=True)
    penalty, multiplier_loss = lagrangian_terms(log_multiplier, measured, target=1.0, sign=-1.0)
    assert abs(penalty.item() - 1.0) < 1e-6 and abs(multiplier_loss.item() + 1.0) < 1e-6
    multiplier_loss.backward()
    penalty.backward()
    assert abs(log_multiplier.grad.item() + 1.0) < 1e-6
    assert abs(measured.grad.item() + 2.0) < 1e-6  # d(lambda * -(m - 1))/dm = -lambda: raising entropy lowers it


def test_kl_controllers_update_rules():
    """Adaptive: KL 12 vs target 6 -> e = clip(1, -.2, .2) = .2, coef .1 (1 + .2 * 256 / 10000).
    Linear: .1 + .01 (3 - 1) = .12. PID (base .1, kp .1, ki .01, kd .05) on errors 1, 2: .1 + .1 + .01 = .21, then
    .1 + .2 + .01 * 3 + .05 * 1 = .38. Cosine schedule 1 -> 0 over 4 steps is .5 after 2."""
    adaptive = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert adaptive.update(12.0, steps=256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    assert LinearKLController(0.1, target=1.0, rate=0.01).update(3.0) == pytest.approx(0.12)
    pid = PIDKLController(0.1, target=1.0, kp=0.1, ki=0.01, kd=0.05)
    assert pid.update(2.0) == pytest.approx(0.21) and pid.update(3.0) == pytest.approx(0.38)
    scheduled = ScheduledKLController(1.0, 0.0, total_steps=4, schedule="cosine")
    scheduled.update(0.0)
    assert scheduled.update(0.0) == pytest.approx(0.5)
    assert ScheduledKLController(1.0, 0.0, 4, "linear").update(0.0, steps=3) == pytest.approx(0.25)


def test_dynamic_sampling_filter_and_refill():
    """Groups of 2 with means 1, .5, 0: (0, 1) keeps only the middle one. Refill to 3 groups: round 1 keeps a, c;
    round 2 keeps e; take() returns exactly [a, c, e] and 2 groups were dropped."""
    keep = keep_groups(torch.tensor([1.0, 1, 1, 0, 0, 0]), 2, 0.0, 1.0)
    assert keep.tolist() == [False, True, False]
    refill = GroupRefill(target=3, max_rounds=4)
    refill.add(["a", "b", "c"], torch.tensor([True, False, True]))
    assert not refill.full and not refill.exhausted
    refill.add(["d", "e", "f"], torch.tensor([False, True, True]))
    assert refill.full and refill.take() == ["a", "c", "e"] and refill.dropped == 2


def test_overlong_penalty_and_truncation_mask():
    """L_max 20, L_cache 4: lengths 10, 16 -> 0; 18 -> (16 - 18) / 4 = -.5; 20 -> -1; 21 -> -1."""
    penalty = overlong_penalty(torch.tensor([10, 16, 18, 20, 21]), max_new_tokens=20, cache_length=4)
    assert penalty.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    masked = mask_truncated(torch.ones(2, 3), torch.tensor([True, False]))
    assert masked.tolist() == [[1, 1, 1], [0, 0, 0]]


def test_reward_combination():
    """Components [[1, 0], [.5, .5]]: weighted sum with w = [2, 1] -> [2, 1.5]; Tchebycheff with w = [1, 1] and ideal
    [1, 1] -> [-max(0, 1), -max(.5, .5)] = [-1, -.5] (prefers the balanced trajectory)."""
    components = t([1, 0], [0.5, 0.5])
    assert weighted_sum(components, t(2, 1)).tolist() == [2.0, 1.5]
    assert tchebycheff(components, t(1, 1), t(1, 1)).tolist() == [-1.0, -0.5]
