"""Closed-form tests of the policy-loss variants (GSPO-token, CISPO) and the rollout/trainer mismatch correction
(TIS, MIS, IcePop, sequence and geometric-mean levels), with the values worked by hand in each docstring."""

import math

import pytest
import torch

from rl_lightning.algorithms.correction import mismatch_kl, mismatch_weights, sequence_log_ratios
from rl_lightning.algorithms.policy import cispo_policy_loss, clipped_policy_loss, gspo_policy_loss


def t(*values):
    return torch.tensor([values], dtype=torch.float64)


def s(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_gspo_value_and_gradient_per_sequence():
    """Two sequences packed in one row: seq 0 = tokens 0-1, log ratios (0.1, 0.3) -> mean 0.2, s_0 = e^0.2 = 1.2214
    (outside [0.8, 1.2]); seq 1 = tokens 2-4, log ratios (0.0, 0.06, -0.03) -> mean 0.01, s_1 = e^0.01 (inside).
    A = +1 everywhere. Loss per token = -min(s, clip(s)) = -1.2 (seq 0, clipped), -e^0.01 (seq 1).
    With each sequence's token mean (GSPO's objective), the gradient w.r.t. logprobs_t is 0 for seq 0 (clipped: the
    whole sequence stops) and -s_1 / 3 for each token of seq 1 (= -A * d s_1 / d logprobs_t)."""
    old = t(0.0, 0.0, 0.0, 0.0, 0.0)
    logprobs = t(0.1, 0.3, 0.0, 0.06, -0.03).requires_grad_()
    seq = torch.tensor([[0, 0, 1, 1, 1]])
    log_ratio = (logprobs - old).detach()
    means = torch.stack([log_ratio[seq == k].mean() for k in (0, 1)])  # (S,)
    loss, metrics = gspo_policy_loss(logprobs, means[seq], torch.ones_like(old), 0.2, 0.2)
    s1 = math.exp(0.01)
    torch.testing.assert_close(loss, t(-1.2, -1.2, -s1, -s1, -s1))
    assert metrics["clipped"].tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]
    (loss[seq == 0].mean() + loss[seq == 1].mean()).backward()
    torch.testing.assert_close(logprobs.grad, t(0.0, 0.0, -s1 / 3, -s1 / 3, -s1 / 3))


def test_gspo_clips_a_whole_sequence_not_its_tokens():
    """One token far off (log ratio 1.0) in a sequence whose mean log ratio is 1e-4 (tokens 1.0 and -0.9998): PPO
    clips that token (e^1 > 1.2), GSPO with the paper's (3e-4, 4e-4) range keeps both, s = e^1e-4 < 1 + 4e-4."""
    logprobs, old, adv = t(1.0, -0.9998), t(0.0, 0.0), t(1.0, 1.0)
    mean = (logprobs - old).mean()
    _, gspo = gspo_policy_loss(logprobs, mean.expand_as(logprobs), adv, 3e-4, 4e-4)
    _, ppo = clipped_policy_loss(logprobs, old, adv, 0.2, 0.2)
    assert gspo["clipped"].sum() == 0 and ppo["clipped"].tolist() == [[1.0, 0.0]]


def test_gspo_with_one_token_per_sequence_is_ppo():
    """A one-token sequence's geometric-mean ratio is its token ratio: GSPO == PPO in value and gradient."""
    old, adv = t(-1.0, -2.0, -0.5), t(1.0, -2.0, 0.5)
    grads = []
    for variant in ("gspo", "ppo"):
        logprobs = t(-0.7, -2.4, -0.5).requires_grad_()
        if variant == "gspo":
            loss, _ = gspo_policy_loss(logprobs, (logprobs - old).detach(), adv, 0.2, 0.3)
        else:
            loss, _ = clipped_policy_loss(logprobs, old, adv, 0.2, 0.3)
        loss.sum().backward()
        grads.append((loss.detach(), logprobs.grad))
    torch.testing.assert_close(grads[0], grads[1])


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    """r = (e^0.5 = 1.6487, e^-0.5 = 0.6065, e^0.1 = 1.1052), range [0.8, 1.28], A = (2, -1, 1):
    weights sg(clip(r)) = (1.28, 0.8, e^0.1); loss = -w * A * logprobs; gradient -w * A (every token keeps one,
    clipped or not): (-2.56, 0.8, -e^0.1)."""
    old = t(-1.0, -1.0, -1.0)
    logprobs = t(-0.5, -1.5, -0.9).requires_grad_()
    adv = t(2.0, -1.0, 1.0)
    loss, metrics = cispo_policy_loss(logprobs, old, adv, 0.2, 0.28)
    e = math.exp(0.1)
    torch.testing.assert_close(loss.detach(), t(-1.28 * 2 * -0.5, -0.8 * -1 * -1.5, -e * -0.9))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, t(-2.56, 0.8, -e))
    assert metrics["clipped"].tolist() == [[1.0, 1.0, 0.0]]


def test_cispo_on_policy_gradient_equals_ppo():
    """At r = 1 (the first minibatch) CISPO's and PPO's gradients are both -A * grad logprobs."""
    old, adv = t(-1.0, -0.3), t(0.7, -1.3)
    grads = []
    for loss_fn in (cispo_policy_loss, clipped_policy_loss):
        logprobs = old.clone().requires_grad_()
        loss_fn(logprobs, old, adv, 0.2, 0.2)[0].sum().backward()
        grads.append(logprobs.grad)
    torch.testing.assert_close(grads[0], -adv)
    torch.testing.assert_close(grads[1], -adv)


def test_token_truncate_is_tis_and_mask_is_icepop():
    """r = (3, 0.25, 1, 0.5, 2) against [0.5, 2]: TIS (truncate) -> (2, 0.5, 1, 0.5, 2), nothing masked; IcePop
    (mask) -> (0, 0, 1, 0.5, 2), masked (1, 1, 0, 0, 0) (the bounds themselves are kept); mask with no lower bound
    -> (0, 0.25, 1, 0.5, 2)."""
    log_ratio = torch.log(t(3.0, 0.25, 1.0, 0.5, 2.0))
    weights, masked = mismatch_weights(log_ratio, "truncate", 0.5, 2.0)
    torch.testing.assert_close(weights, t(2.0, 0.5, 1.0, 0.5, 2.0))
    assert masked.sum() == 0
    weights, masked = mismatch_weights(log_ratio, "mask", 0.5, 2.0)
    torch.testing.assert_close(weights, t(0.0, 0.0, 1.0, 0.5, 2.0))
    torch.testing.assert_close(masked, t(1.0, 1.0, 0.0, 0.0, 0.0))
    weights, _ = mismatch_weights(log_ratio, "mask", None, 2.0)
    torch.testing.assert_close(weights, t(0.0, 0.25, 1.0, 0.5, 2.0))


def test_truncate_without_lower_bound_is_the_former_tis_cap():
    """low=None, high=cap: min(r, cap), the former `tis_cap` weights."""
    log_ratio = torch.log(t(3.0, 0.5))
    torch.testing.assert_close(mismatch_weights(log_ratio, "truncate", None, 2.0)[0], t(2.0, 0.5))


def test_sequence_and_geometric_levels():
    """Two sequences: seq 0 has token ratios (2, 2) -> product 4 (log 1.386), geometric mean 2 (log 0.693); seq 1
    has (0.8, 1.0, 1.25) -> product 1, geometric mean 1. Against [0.5, 3]: sequence mask drops seq 0 (4 > 3) and
    keeps seq 1 with weight 1; geometric mask keeps both, weights (2, 1); sequence truncate gives (3, 1)."""
    seq_sums = torch.tensor([2 * math.log(2.0), math.log(0.8) + math.log(1.25)], dtype=torch.float64)
    counts = torch.tensor([2.0, 3.0], dtype=torch.float64)
    sequence = sequence_log_ratios(seq_sums, counts, "sequence")
    geometric = sequence_log_ratios(seq_sums, counts, "geometric")
    torch.testing.assert_close(geometric, torch.tensor([math.log(2.0), 0.0], dtype=torch.float64))
    weights, masked = mismatch_weights(sequence, "mask", 0.5, 3.0)
    torch.testing.assert_close(weights, s(0.0, 1.0))
    torch.testing.assert_close(masked, s(1.0, 0.0))
    weights, masked = mismatch_weights(geometric, "mask", 0.5, 3.0)
    torch.testing.assert_close(weights, s(2.0, 1.0))
    assert masked.sum() == 0
    torch.testing.assert_close(mismatch_weights(sequence, "truncate", 0.5, 3.0)[0], s(3.0, 1.0))


def test_a_sequence_without_completion_tokens_has_ratio_one():
    assert sequence_log_ratios(torch.zeros(1), torch.zeros(1), "geometric").item() == 0.0


def test_long_sequences_do_not_overflow():
    """A sequence log ratio of +-1000 (hundreds of tokens): exp overflows float32, the weights do not."""
    log_ratio = torch.tensor([1000.0, -1000.0])
    weights, masked = mismatch_weights(log_ratio, "mask", 0.5, 3.0)
    assert weights.tolist() == [0.0, 0.0] and masked.tolist() == [1.0, 1.0]
    torch.testing.assert_close(mismatch_weights(log_ratio, "truncate", 0.5, 3.0)[0], torch.tensor([3.0, 0.5]))


def test_weights_carry_no_gradient():
    log_ratio = torch.tensor([0.3], requires_grad=True)
    assert not mismatch_weights(log_ratio, "truncate", None, 2.0)[0].requires_grad


def test_mismatch_kl_is_k3_of_engine_over_trainer():
    """r = pi_old / pi_engine = 2, 1, 0.5: k3 = r - 1 - log r = (1 - log 2, 0, log 2 - 0.5) = (0.3069, 0, 0.1931)."""
    kl = mismatch_kl(torch.log(t(2.0, 1.0, 0.5)), t(0.0, 0.0, 0.0))
    torch.testing.assert_close(kl, t(1 - math.log(2), 0.0, math.log(2) - 0.5))


def test_mismatch_kl_is_an_unbiased_estimate():
    """E_mu[r - 1 - log r] = KL(mu || pi) on samples from mu: two categorical distributions, the expectation taken
    exactly over the support (no sampling)."""
    mu, pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    per_token = mismatch_kl(pi.log(), mu.log())
    torch.testing.assert_close((mu * per_token).sum(), (mu * (mu / pi).log()).sum())


def test_unknown_mode_and_level_raise():
    with pytest.raises(ValueError, match="mode must be one of truncate, mask"):
        mismatch_weights(torch.zeros(1), "clip", None, 2.0)
    with pytest.raises(ValueError, match="sequence level must be"):
        sequence_log_ratios(torch.zeros(1), torch.ones(1), "token")
