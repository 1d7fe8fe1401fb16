"""Closed-form tests of the pieces PPO's per-token objective is assembled and reduced with: the ``sequence_mean``
aggregation (GRPO) and the normalisers of every aggregation, GSPO's per-sequence log ratios, the mismatch-correction
weights at the sequence levels, the skip weights, the loss assembly (KL, entropy, constraints), KL as a reward, and
the logged moments from global sums. Each expected value is worked by hand in the test's docstring."""

import math

import pytest
import torch

from rl_lightning.algorithms.advantages import moments_from_sums
from rl_lightning.algorithms.correction import sequence_mismatch_weights
from rl_lightning.algorithms.kl import kl_k1, kl_k3, kl_reward_penalty
from rl_lightning.algorithms.policy import (
    gspo_log_ratios,
    policy_loss_normaliser,
    regularised_policy_loss,
    sequence_mean,
    sequence_token_means,
    skip_weights,
    token_mean,
)


def s(*values):
    return torch.tensor(values, dtype=torch.float64)


def _sums(per_token, seq_index, num_sequences):
    """(S,) per-sequence sums of a (N,) per-token tensor, differentiable (what `sequence_sums` does on one rank)."""
    return torch.zeros(num_sequences, dtype=per_token.dtype).index_add(0, seq_index, per_token)


def test_sequence_mean_is_each_completions_token_mean_averaged():
    """Packed tokens, losses (1, 1, 1 | 0.25, 0.75): sequence 0 has 3 tokens (sum 3, mean 1), sequence 1 has 2 (sum 1,
    mean 0.5). sequence_mean = (1 + 0.5) / 2 = 0.75, where the token mean is 4 / 5 = 0.8. Gradient: each token of
    sequence i gets 1 / (|o_i| x 2): 1/6 for sequence 0, 1/4 for sequence 1."""
    loss = s(1.0, 1.0, 1.0, 0.25, 0.75).requires_grad_()
    seq_index = torch.tensor([0, 0, 0, 1, 1])
    counts = s(3.0, 2.0)
    total = sequence_mean(_sums(loss, seq_index, 2), counts, 2)
    torch.testing.assert_close(total, torch.tensor(0.75, dtype=torch.float64))
    torch.testing.assert_close(token_mean(loss.detach(), torch.ones(5, dtype=torch.float64), 5),
                               torch.tensor(0.8, dtype=torch.float64))
    total.backward()
    torch.testing.assert_close(loss.grad, s(1 / 6, 1 / 6, 1 / 6, 1 / 4, 1 / 4))


def test_sequence_mean_summed_over_micro_batches_with_the_global_count_is_the_whole_mean():
    """Three completions, token means 1, 0.5 and 0 (an empty one: sum 0, count 0). Whole: (1 + 0.5 + 0) / 3 = 0.5.
    Split into micro-batches {0, 2} and {1}, each normalised by the global count 3: 1/3 + 0.5/3 = 0.5."""
    sums, counts = s(3.0, 1.0, 0.0), s(3.0, 2.0, 0.0)
    torch.testing.assert_close(sequence_token_means(sums, counts), s(1.0, 0.5, 0.0))
    whole = sequence_mean(sums, counts, 3)
    split = sequence_mean(sums[[0, 2]], counts[[0, 2]], 3) + sequence_mean(sums[[1]], counts[[1]], 3)
    torch.testing.assert_close(whole, torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(split, whole)


def test_policy_loss_normaliser_of_each_aggregation():
    """4 completions with 30 completion tokens, a budget of 16 tokens each: token_mean 30, sequence_mean 4,
    token_sum 4 x 16 = 64."""
    assert policy_loss_normaliser("token_mean", 4.0, 30.0, 16) == 30.0
    assert policy_loss_normaliser("sequence_mean", 4.0, 30.0, 16) == 4.0
    assert policy_loss_normaliser("token_sum", 4.0, 30.0, 16) == 64.0
    with pytest.raises(ValueError, match="aggregation must be one of token_mean, sequence_mean, token_sum, got 'max'"):
        policy_loss_normaliser("max", 4.0, 30.0, 16)


def test_gspo_log_ratios_are_each_sequences_mean_log_ratio_detached():
    """Sequence 0: token log ratios (0.1, 0.3), sum 0.4 over 2 tokens -> log s_0 = 0.2; sequence 1: (0.0, 0.06,
    -0.03), sum 0.03 over 3 -> 0.01; sequence 2 has no completion token -> 0 (s = 1)."""
    log_ratio = s(0.1, 0.3, 0.0, 0.06, -0.03).requires_grad_()
    sums = _sums(log_ratio, torch.tensor([0, 0, 1, 1, 1]), 3)
    got = gspo_log_ratios(sums, s(2.0, 3.0, 0.0))
    torch.testing.assert_close(got, s(0.2, 0.01, 0.0))
    assert not got.requires_grad


def test_sequence_mismatch_weights_and_mask_shares():
    """Sequence 0: token ratios (2, 2), log sum 2 log 2 over 2 tokens; sequence 1: (0.8, 1.0, 1.25), log sum 0 over
    3. Bounds [0.5, 3]. ``sequence`` mask: ratio 4 > 3 drops sequence 0 (weight 0, share 1/2 on each of its 2 tokens,
    so its tokens sum to 1 masked sequence), sequence 1 keeps weight 1. ``geometric`` mask: ratios 2 and 1, both
    inside: weights (2, 1), nothing masked. ``sequence`` truncate: (min(4, 3), 1) = (3, 1), nothing masked."""
    sums, counts = s(2 * math.log(2.0), math.log(0.8) + math.log(1.25)), s(2.0, 3.0)
    weights, shares = sequence_mismatch_weights(sums, counts, "sequence", "mask", 0.5, 3.0)
    torch.testing.assert_close(weights, s(0.0, 1.0))
    torch.testing.assert_close(shares, s(0.5, 0.0))
    weights, shares = sequence_mismatch_weights(sums, counts, "geometric", "mask", 0.5, 3.0)
    torch.testing.assert_close(weights, s(2.0, 1.0))
    torch.testing.assert_close(shares, s(0.0, 0.0))
    weights, shares = sequence_mismatch_weights(sums, counts, "sequence", "truncate", 0.5, 3.0)
    torch.testing.assert_close(weights, s(3.0, 1.0))
    torch.testing.assert_close(shares, s(0.0, 0.0))
    with pytest.raises(ValueError, match="sequence level must be 'sequence' or 'geometric', got 'token'"):
        sequence_mismatch_weights(sums, counts, "token", "mask", 0.5, 3.0)


def test_skip_weights_zero_skipped_trajectories_and_count_them():
    """Threshold 2 (log 2 = 0.693). Mean log ratios: 1.2 / 2 = 0.6 (kept), 1.6 / 2 = 0.8 (skipped), -3.0 / 4 = -0.75
    (skipped), no token (kept). Weights (1, 0, 0, 1); shares (0, 1/2, 1/4, 0): summed over each trajectory's tokens,
    2 skipped trajectories."""
    weights, shares = skip_weights(s(1.2, 1.6, -3.0, 0.0), s(2.0, 2.0, 4.0, 0.0), 2.0)
    torch.testing.assert_close(weights, s(1.0, 0.0, 0.0, 1.0))
    torch.testing.assert_close(shares, s(0.0, 0.5, 0.25, 0.0))
    assert float((shares * s(2.0, 2.0, 4.0, 0.0)).sum()) == 2.0


def test_regularised_policy_loss_adds_kl_subtracts_entropy_adds_the_penalty():
    """surrogate (1, -2), entropy (0.5, 1), KL (0.2, 0.4), penalty (0.01, 0.02), entropy_coef 0.1, kl_coef 0.5:
    1 + 0.5 x 0.2 - 0.1 x 0.5 + 0.01 = 1.06 and -2 + 0.5 x 0.4 - 0.1 x 1 + 0.02 = -1.88. Without the KL term
    (KL as a reward): 1 - 0.05 = 0.95, -2 - 0.1 = -2.1. The entropy's gradient is -entropy_coef = -0.1."""
    surrogate, kl, penalty = s(1.0, -2.0), s(0.2, 0.4), s(0.01, 0.02)
    entropy = s(0.5, 1.0).requires_grad_()
    loss = regularised_policy_loss(surrogate, entropy, 0.1, kl, 0.5, penalty)
    torch.testing.assert_close(loss, s(1.06, -1.88))
    torch.testing.assert_close(regularised_policy_loss(surrogate, entropy, 0.1).detach(), s(0.95, -2.1))
    loss.sum().backward()
    torch.testing.assert_close(entropy.grad, s(-0.1, -0.1))


def test_kl_reward_penalty_is_minus_coef_times_the_estimate():
    """logprobs (-1, -2), reference (-1.5, -2), coef 0.2. k1 = logprobs - ref = (0.5, 0) -> penalty (-0.1, 0).
    k3 with log r = ref - logprobs = (-0.5, 0): e^-0.5 + 0.5 - 1 = 0.106531 -> penalty (-0.0213061, 0)."""
    logprobs, ref = s(-1.0, -2.0), s(-1.5, -2.0)
    torch.testing.assert_close(kl_reward_penalty(logprobs, ref, 0.2, kl_k1), s(-0.1, 0.0))
    k3 = math.exp(-0.5) + 0.5 - 1
    torch.testing.assert_close(kl_reward_penalty(logprobs, ref, 0.2, kl_k3), s(-0.2 * k3, 0.0))
    torch.testing.assert_close(kl_reward_penalty(logprobs, ref, 0.2), s(-0.2 * k3, 0.0))  # k3 by default


def test_moments_from_sums_match_the_population_moments_and_add_over_shards():
    """Values (1, 2, 3, 6): S1 = 12, S2 = 50, n = 4 -> mean 3, variance 50 / 4 - 9 = 3.5. Sums of the shards (1, 2)
    and (3, 6) add up to the same; an empty set gives mean 0 and std 0."""
    mean, std = moments_from_sums(s(12.0)[0], s(50.0)[0], s(4.0)[0])
    torch.testing.assert_close((mean, std), (s(3.0)[0], s(math.sqrt(3.5))[0]))
    shards = s(1.0, 2.0), s(3.0, 6.0)
    total = sum(x.sum() for x in shards), sum((x**2).sum() for x in shards), s(4.0)[0]
    torch.testing.assert_close(moments_from_sums(*total), (mean, std))
    values = s(1.0, 2.0, 3.0, 6.0)
    torch.testing.assert_close(std, values.std(unbiased=False))
    assert moments_from_sums(s(0.0)[0], s(0.0)[0], s(0.0)[0]) == (0.0, 0.0)
