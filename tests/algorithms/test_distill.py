"""On-policy distillation's pure functions: closed forms, limits, and parity with TRL's GKD loss."""

import math

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms.distill import (
    distillation_advantages,
    generalized_jsd,
    masked_token_mean,
    on_policy_draw,
    reverse_kl_rewards,
    token_kl,
)


def test_reverse_kl_reward_is_teacher_minus_student_per_token():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-1.1, -1.0, -1.0]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    expected = torch.tensor([[0.0, -0.5, 0.0], [-1.0, 2.0, 0.0]])
    assert_close(reverse_kl_rewards(logprobs, teacher, mask), expected)
    advantages = torch.tensor([[0.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    assert_close(distillation_advantages(advantages, logprobs, teacher, mask, coef=2.0),
                 advantages + 2.0 * expected)


def test_the_mean_reward_on_student_samples_estimates_minus_the_reverse_kl():
    """E_{y ~ p_s}[log p_t(y) - log p_s(y)] = -KL(p_s || p_t): checked exactly by enumerating a 3-token vocabulary."""
    p_s, p_t = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    rewards = reverse_kl_rewards(p_s.log()[None], p_t.log()[None], torch.ones(1, 3))[0]
    closed_form = sum(a * math.log(a / b) for a, b in zip(p_s.tolist(), p_t.tolist(), strict=True))
    assert float((p_s * rewards).sum()) == pytest.approx(-closed_form, abs=1e-6)


def test_token_kl_of_known_distributions():
    p, q = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.25, 0.5])
    # KL(p || q) = 0.5 log 2 + 0 + 0.25 log 0.5 = 0.25 log 2
    assert float(token_kl(p.log(), q.log())) == pytest.approx(0.25 * math.log(2), abs=1e-7)
    assert float(token_kl(p.log() + 3.0, p.log())) == pytest.approx(0.0, abs=1e-7)  # logits shift: same p
    # temperature 2: both softmaxes flatten; log p / 2 renormalised is sqrt(p) / sum sqrt(p)
    ps, qs = p.sqrt() / p.sqrt().sum(), q.sqrt() / q.sqrt().sum()
    assert float(token_kl(p.log(), q.log(), temperature=2.0)) == pytest.approx(float((ps * (ps / qs).log()).sum()),
                                                                                abs=1e-7)


def test_jsd_closed_form_and_symmetry_at_one_half():
    p_t, p_s = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    # disjoint supports: JSD_1/2 = log 2 (the Jensen-Shannon divergence's maximum)
    value = generalized_jsd(torch.log(p_s.clamp(min=1e-30)), torch.log(p_t.clamp(min=1e-30)), beta=0.5)
    assert float(value) == pytest.approx(math.log(2), abs=1e-6)
    a, b = torch.randn(4, 7), torch.randn(4, 7)
    assert_close(generalized_jsd(a, b, 0.5), generalized_jsd(b, a, 0.5))  # symmetric at beta = 1/2
    assert_close(generalized_jsd(a, a, 0.3), torch.zeros(4), atol=1e-6)


def test_jsd_beta_limits_are_forward_and_reverse_kl():
    """beta = 0 is KL(p_t || p_s), beta = 1 is KL(p_s || p_t), and they are the limits of JSD_beta / beta and
    JSD_beta / (1 - beta) (first-order expansion of the mixture: the error is O(beta))."""
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11, dtype=torch.float64), torch.randn(3, 5, 11, dtype=torch.float64)
    forward, reverse = token_kl(teacher, student), token_kl(student, teacher)
    assert_close(generalized_jsd(student, teacher, 0.0), forward)
    assert_close(generalized_jsd(student, teacher, 1.0), reverse)
    eps = 1e-6
    # the first-order limit errs by O(eps x chi-square(p, q)), up to ~1e-5 here in float64: 1e-4 with margin
    assert_close(generalized_jsd(student, teacher, eps) / eps, forward, atol=1e-4)
    assert_close(generalized_jsd(student, teacher, 1 - eps) / eps, reverse, atol=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_jsd_matches_trl_generalized_jsd_loss(beta, temperature):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (token mean over labels != -100) equals our per-token JSD averaged
    over the same tokens, within 1e-6."""
    from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(1)
    student, teacher = torch.randn(2, 6, 13) * 3, torch.randn(2, 6, 13) * 3
    labels = torch.randint(0, 13, (2, 6))
    labels[0, :2] = -100
    labels[1, 4:] = -100
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    mask = (labels != -100).float()
    ours = masked_token_mean(generalized_jsd(student, teacher, beta, temperature), mask)
    assert abs(float(ours) - float(theirs)) < 1e-6, (float(ours), float(theirs))
    # the gradients agree too
    s1, s2 = student.clone().requires_grad_(), student.clone().requires_grad_()
    GKDTrainer.generalized_jsd_loss(s1, teacher, labels=labels, beta=beta, temperature=temperature).backward()
    masked_token_mean(generalized_jsd(s2, teacher, beta, temperature), mask).backward()
    assert_close(s2.grad, s1.grad, atol=1e-6)


def test_masked_token_mean_uses_the_global_normaliser_so_shards_add_up():
    values, mask = torch.arange(8.0).reshape(2, 4), torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]]).float()
    whole = masked_token_mean(values, mask)
    assert float(whole) == pytest.approx((0 + 1 + 3 + 5 + 6 + 7) / 6)
    shards = sum(masked_token_mean(values[i:i + 1], mask[i:i + 1], num_tokens=mask.sum()) for i in range(2))
    assert_close(shards, whole)
    assert float(masked_token_mean(values, torch.zeros(2, 4))) == 0.0  # fully masked: 0, not NaN



def test_on_policy_draw_is_a_seeded_bernoulli_of_lambda_that_leaves_the_global_rng_alone():
    """u ~ U[0, 1) per (seed, step): the same call draws the same; 1 is always on-policy, 0 never; over 4000 steps the
    on-policy share is lambda within 4 standard deviations (sqrt(0.25 / 4000) = 0.0079, so 0.032); steps decide
    independently of one another, and the global torch random state does not move."""
    state = torch.get_rng_state()
    draws = [on_policy_draw(7, step, 0.3) for step in range(4000)]
    assert draws == [on_policy_draw(7, step, 0.3) for step in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.032
    assert draws != [on_policy_draw(8, step, 0.3) for step in range(4000)]  # another seed, another sequence
    assert all(on_policy_draw(7, step, 1.0) for step in range(200))
    assert not any(on_policy_draw(7, step, 0.0) for step in range(200))
    # a step's u is one number: lambda thresholds it, so a larger lambda keeps every on-policy step of a smaller one
    assert all(on_policy_draw(7, s, 0.6) for s in range(4000) if draws[s])
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match=r"lmbda must be in \[0, 1\], got 1.5"):
        on_policy_draw(0, 0, 1.5)
