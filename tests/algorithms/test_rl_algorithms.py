"""PPO-family building blocks against values worked out by hand (each docstring shows the arithmetic)."""

import io
import math
import threading

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms.advantages import (
    discounted_returns,
    estimate_advantages,
    gae,
    group_advantages,
    masked_whiten,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rl_lightning.algorithms.controllers import Controllers
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
    token_mean,
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


# One rollout of 2 prompts x 2 completions, T = 3 completion tokens: row 1 ends after 2 tokens, row 2 has no token left
# (e.g. truncated and masked out), row 3 has one. Masked entries hold 9 so any leak shows.
REWARDS = torch.tensor([1.0, 0.5, 2.0, -1.0])
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]])
KL_PENALTY = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, 9], [9, 9, 9], [-0.6, 9, 9]])


def test_outcome_token_rewards_sit_on_the_last_completion_token():
    """[1, .5, 2, -1] on each row's last completion token; row 2 has none, so its reward goes nowhere."""
    expected = torch.tensor([[0.0, 0, 1], [0, 0.5, 0], [0, 0, 0], [-1, 0, 0]])
    assert torch.equal(outcome_token_rewards(REWARDS, MASK), expected)


@pytest.mark.parametrize(
    ("estimator", "by_hand", "group_function"),
    [
        # groups [1, .5] and [2, -1], means .75 and .5
        ("drgrpo", [0.25, -0.25, 1.5, -1.5], lambda r: group_advantages(r, 2)),
        # unbiased stds sqrt(2) x .25 and sqrt(2) x 1.5: every advantage is +-1 / sqrt(2) (up to eps)
        ("grpo", [2**-0.5, -(2**-0.5), 2**-0.5, -(2**-0.5)], lambda r: group_advantages(r, 2, scale_by_std=True)),
        # G / (G - 1) x (r - mean) = 2 x drgrpo
        ("rloo", [0.5, -0.5, 3.0, -3.0], lambda r: rloo_advantages(r, 2)),
    ],
)
def test_group_estimators_broadcast_over_the_mask_plus_the_kl_reward_to_go(estimator, by_hand, group_function):
    """Without a KL penalty: the group function's (B,) advantages on every completion token, 0 elsewhere. With one,
    plus its reward-to-go: row 0 [-.1 - .2 - .3, -.2 - .3, -.3] = [-.6, -.5, -.3], row 1 [-.9, -.5, 0], row 3 [-.6]."""
    outcome = group_function(REWARDS)
    assert_close(outcome, torch.tensor(by_hand), atol=1e-5)
    advantages, returns = estimate_advantages(estimator, REWARDS, MASK, group_size=2)
    assert returns is None
    assert_close(advantages, outcome[:, None] * MASK)
    reward_to_go = torch.tensor([[-0.6, -0.5, -0.3], [-0.9, -0.5, 0], [0, 0, 0], [-0.6, 0, 0]])
    with_kl, returns = estimate_advantages(estimator, REWARDS, MASK, group_size=2, kl_penalty=KL_PENALTY)
    assert returns is None
    assert_close(with_kl, outcome[:, None] * MASK + reward_to_go)


def test_reinforce_pp_whitens_the_discounted_outcome_plus_kl_penalty():
    """Token rewards (outcome on the last token + penalty): [[-.1, -.2, .7], [-.4, 0, -], [-, -, -], [-1.6, -, -]].
    Reward-to-go at gamma = .5: row 0 [-.1 + .5 (-.2 + .5 x .7), -.2 + .5 x .7, .7] = [-.025, .15, .7], row 1
    [-.4, 0], row 3 [-1.6]; then whitened over those 6 tokens (population std)."""
    advantages, returns = estimate_advantages("reinforce_pp", REWARDS, MASK, group_size=2, kl_penalty=KL_PENALTY,
                                              gamma=0.5)
    assert returns is None
    token_rewards = outcome_token_rewards(REWARDS, MASK) + KL_PENALTY * MASK
    assert_close(advantages, reinforce_pp_advantages(token_rewards, MASK, gamma=0.5))
    to_go = torch.tensor([-0.025, 0.15, 0.7, -0.4, 0.0, -1.6], dtype=torch.float64)
    whitened = (to_go - to_go.mean()) / to_go.var(unbiased=False).sqrt()
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[MASK > 0] = whitened
    assert_close(advantages.double(), expected, atol=1e-6)


def test_gae_estimator_puts_the_outcome_on_the_last_completion_token():
    """`gae` of token rewards written by hand: outcome on each row's last completion token (+ penalty). Row 1 (2
    tokens, V = [.2, .3], r = [-.4, .5 - .5 = 0]), gamma .9, lambda .5: delta_1 = 0 - .3 = -.3, delta_0 = -.4 + .9 x .3
    - .2 = -.33, A = [-.33 + .45 x -.3, -.3] = [-.465, -.3]. Row 3 (1 token): A = -1 - .6 - .4 = -2. Row 2: all 0."""
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.3, 9], [9, 9, 9], [0.4, 9, 9]])
    outcome = torch.tensor([[0.0, 0, 1], [0, 0.5, 0], [0, 0, 0], [-1, 0, 0]])
    for kl_penalty, token_rewards in ((None, outcome), (KL_PENALTY, outcome + KL_PENALTY * MASK)):
        advantages, returns = estimate_advantages("gae", REWARDS, MASK, group_size=2, kl_penalty=kl_penalty,
                                                  values=values, gamma=0.9, lam=0.5)
        expected, expected_returns = gae(token_rewards, values, MASK, gamma=0.9, lam=0.5)
        assert_close(advantages, expected)
        assert_close(returns, expected_returns)
        assert not advantages[2].any() and not returns[2].any() and advantages[1, 2] == 0 == returns[1, 2]
    assert_close(advantages[1, :2], torch.tensor([-0.465, -0.3]))
    assert_close(advantages[3, 0], torch.tensor(-2.0))
    with pytest.raises(ValueError, match="the gae estimator needs the critic's values"):
        estimate_advantages("gae", REWARDS, MASK, group_size=2)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; use one of drgrpo, grpo, rloo"):
        estimate_advantages("ppo", REWARDS, MASK, group_size=2)


def _as_processes(fn, shards):
    """``fn(shard, global_sum)`` for each shard in its own thread, like data-parallel ranks: `global_sum` is an
    all-reduce (sum) among them, so a rank calling it more or fewer times than its peers fails (broken barrier)."""
    barrier = threading.Barrier(len(shards), timeout=30)
    posted, results, errors = [None] * len(shards), [None] * len(shards), []

    def rank(i):
        def global_sum(x):
            posted[i] = x.clone()
            barrier.wait()
            total = sum(posted[1:], posted[0].clone())  # the same order on every rank
            barrier.wait()  # every rank has read before any posts again
            return total

        try:
            results[i] = fn(shards[i], global_sum)
        except Exception as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def test_masked_whiten_with_a_global_sum_over_two_processes_whitens_the_whole_batch():
    """A batch split in two halves with different token counts (one row fully masked): each half whitened with the
    other half's statistics summed in equals the whole batch whitened at once; alone, a half would not."""
    torch.manual_seed(0)
    values = torch.randn(5, 4, dtype=torch.float64) * 3 + 1
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    whole = masked_whiten(values, mask)
    halves = [(values[:2], mask[:2]), (values[2:], mask[2:])]
    parts = _as_processes(lambda shard, global_sum: masked_whiten(*shard, global_sum=global_sum), halves)
    assert_close(torch.cat(parts), whole, atol=1e-12)
    assert not torch.allclose(masked_whiten(*halves[0]), whole[:2])  # the global statistics made the difference
    # the same through the estimator: REINFORCE++ over a rollout split across two ranks
    rewards, completion_mask = torch.tensor([1.0, 0, 0.5, 2, -1, 0]), (torch.rand(6, 5) > 0.3).float()
    expected, _ = estimate_advantages("reinforce_pp", rewards, completion_mask, group_size=2, gamma=0.9)
    shards = [(rewards[:2], completion_mask[:2]), (rewards[2:], completion_mask[2:])]
    parts = _as_processes(lambda shard, global_sum: estimate_advantages(
        "reinforce_pp", *shard, group_size=2, gamma=0.9, global_sum=global_sum)[0], shards)
    assert_close(torch.cat(parts), expected, atol=1e-6)


def _controllers(kind="fixed", coef=0.1, **kwargs):
    """Controllers with KL target 1 (6 for the adaptive one), horizon 10000, rate .01, PID gains (.1, .01, .05),
    scheduled to 0 over 4 rollouts."""
    target = 6.0 if kind == "adaptive" else 1.0
    return Controllers(kind, coef, target, 10000.0, 0.01, (0.1, 0.01, 0.05), 0.0, 4, **kwargs)


@pytest.mark.parametrize(
    ("kind", "kl", "expected"),
    [
        ("adaptive", 12.0, 0.1 * (1 + 0.2 * 256 / 10000)),  # e = clip(12 / 6 - 1) = .2, steps = 256 trajectories
        ("fixed", 12.0, 0.1),
        ("linear", 3.0, 0.1 + 0.01 * (3 - 1)),
        ("pid", 2.0, 0.1 + 0.1 * 1 + 0.01 * 1),  # integral of one step, not 256
        ("scheduled", 0.0, 0.1 * 0.5 * (1 + math.cos(math.pi / 4))),  # 1 of 4 rollouts, not the end (0)
    ],
)
def test_only_the_adaptive_kl_controller_steps_by_trajectories(kind, kl, expected):
    controllers = _controllers(kind)
    logged = controllers.update({"kl": kl}, trajectories=256)
    assert logged == {"kl_coef": pytest.approx(expected)} and controllers.kl_coef == pytest.approx(expected)
    assert controllers.update({}, trajectories=256) == {}  # no KL measured (no reference): nothing moves
    assert controllers.kl_coef == pytest.approx(expected)


def test_multipliers_take_dual_ascent_steps_in_closed_form():
    """log lambda <- log lambda + lr x lambda x sign (mean - target), lr .1, lambda_0 = .5. Entropy floor 1 (sign -1)
    measured .4: + .1 x .5 x .6 = +.03; KL ceiling .05 (sign +1) measured .15: + .1 x .5 x .1 = +.005. Then both
    satisfied (entropy 1.5, KL .01): each multiplier falls by lr x lambda_1 x |violation|."""
    controllers = _controllers(entropy_min=1.0, kl_max=0.05, multiplier_lr=0.1, multiplier_init=0.5)
    logged = controllers.update({"kl": 0.15, "entropy": 0.4}, trajectories=8)
    entropy, kl = math.log(0.5) + 0.03, math.log(0.5) + 0.005
    assert controllers.log_multipliers == {"entropy": pytest.approx(entropy, abs=1e-7),
                                           "kl": pytest.approx(kl, abs=1e-7)}
    assert logged == {"kl_coef": 0.1, "entropy_multiplier": pytest.approx(math.exp(entropy), rel=1e-6),
                      "kl_multiplier": pytest.approx(math.exp(kl), rel=1e-6)}
    controllers.update({"kl": 0.01, "entropy": 1.5}, trajectories=8)
    entropy, kl = entropy + 0.1 * math.exp(entropy) * -0.5, kl + 0.1 * math.exp(kl) * -0.04
    assert controllers.log_multipliers == {"entropy": pytest.approx(entropy, abs=1e-6),
                                           "kl": pytest.approx(kl, abs=1e-6)}
    before = dict(controllers.log_multipliers)
    assert controllers.update({"kl": 0.15, "entropy": 0.4}, 8, move_multipliers=False) == {"kl_coef": 0.1}
    assert controllers.log_multipliers == before


def test_constraint_penalty_is_lambda_times_the_violation_per_token():
    """lambda = .5 each; entropy [.4, 1.2] against floor 1: .5 x [.6, -.2]; KL [.15, 0] against ceiling .05:
    .5 x [.1, -.05]; sum [.35, -.125]. Gradients: -lambda per entropy token, +lambda per KL token."""
    controllers = _controllers(entropy_min=1.0, kl_max=0.05, multiplier_init=0.5)
    entropy = torch.tensor([[0.4, 1.2]], requires_grad=True)
    kl = torch.tensor([[0.15, 0.0]], requires_grad=True)
    penalty = controllers.penalty({"entropy": entropy, "kl": kl})
    assert_close(penalty, torch.tensor([[0.35, -0.125]]))
    penalty.sum().backward()
    assert_close(entropy.grad, torch.tensor([[-0.5, -0.5]]))
    assert_close(kl.grad, torch.tensor([[0.5, 0.5]]))
    assert _controllers().penalty({"entropy": entropy}) == 0.0  # no constraints


@pytest.mark.parametrize("kind", ["adaptive", "pid", "scheduled"])
def test_controllers_state_dict_round_trip_restores_coefficient_and_multipliers(kind):
    """Through a checkpoint (torch.save, then a weights-only load), a fresh Controllers resumes exactly."""
    args = {"entropy_min": 1.0, "kl_max": 0.05, "multiplier_lr": 0.1}
    trained = _controllers(kind, **args)
    for kl, entropy in ((12.0, 0.4), (0.5, 1.5), (3.0, 0.9)):
        trained.update({"kl": kl, "entropy": entropy}, trajectories=64)
    buffer = io.BytesIO()
    torch.save({"controllers": trained.state_dict()}, buffer)
    buffer.seek(0)
    resumed = _controllers(kind, **args)
    resumed.load_state_dict(torch.load(buffer, weights_only=True)["controllers"])
    assert resumed.kl_coef == trained.kl_coef != 0.1
    assert resumed.log_multipliers == trained.log_multipliers != _controllers(kind, **args).log_multipliers
    assert resumed.update({"kl": 2.0, "entropy": 0.7}, 64) == trained.update({"kl": 2.0, "entropy": 0.7}, 64)
    fresh = _controllers(kind, **args)
    fresh.load_state_dict({})  # a checkpoint from before the controllers were saved: initial state kept
    assert fresh.kl_coef == 0.1 and fresh.log_multipliers == {"entropy": math.log(0.1), "kl": math.log(0.1)}


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


def test_token_mean_aggregation():
    """values [[1, 2, 3], [4, -, -]]: token mean (1 + 2 + 3 + 4) / 4 = 2.5; with a global normaliser of 8 tokens
    10 / 8."""
    values, mask = t([1, 2, 3], [4, 9, 9]), t([1, 1, 1], [1, 0, 0])
    assert token_mean(values, mask, 4).item() == 2.5
    assert token_mean(values, mask, 8).item() == 1.25


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


def test_overlong_shaping_and_truncation_masking_of_trajectory_lists():
    """What the rollout applies (it holds no shaping arithmetic of its own): each reward plus its penalty in float64
    (0.1 - 0.5 exactly as Python adds), and a cut completion's mask all zeros, a finished one's unchanged."""
    from rl_lightning.algorithms.dapo import overlong_shaped, truncation_masked

    assert overlong_shaped([0.1, 1.0, 2.0], [18, 10, 21], max_new_tokens=20, cache_length=4) == [0.1 - 0.5, 1.0, 1.0]
    assert truncation_masked([0, 1, 1], finished=False) == [0, 0, 0]
    assert truncation_masked([0, 1, 1], finished=True) == [0, 1, 1]


def test_reward_combination():
    """Components [[1, 0], [.5, .5]]: weighted sum with w = [2, 1] -> [2, 1.5]; Tchebycheff with w = [1, 1] and ideal
    [1, 1] -> [-max(0, 1), -max(.5, .5)] = [-1, -.5] (prefers the balanced trajectory)."""
    components = t([1, 0], [0.5, 0.5])
    assert weighted_sum(components, t(2, 1)).tolist() == [2.0, 1.5]
    assert tchebycheff(components, t(1, 1), t(1, 1)).tolist() == [-1.0, -0.5]
