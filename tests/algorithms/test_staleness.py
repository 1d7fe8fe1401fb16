"""`versioned_mismatch_weights`: each token's weight is its own version's ratio pi_old / mu_{v_t}, worked by hand."""

import math

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms.staleness import lag_shares, versioned_mismatch_weights


def test_each_token_is_weighed_against_its_own_versions_logprob():
    """One completion of 4 tokens, the first two sampled by version 3, the last two (after an in-flight load) by
    version 4; trained at version 4: lags 1, 1, 0, 0. Engine log-probs are each version's own; pi_old is version 4's.

    token  old     engine  log r   r        truncate [-, 2]   mask [0.5, 2]
    0      -1.0    -1.5    0.5     1.6487   1.6487            1.6487
    1      -2.0    -1.0    -1.0    0.3679   0.3679            0 (masked)
    2      -0.5    -0.5    0.0     1        1                 1
    3      -0.2    -1.2    1.0     2.7183   2                 0 (masked)
    """
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.2]])
    engine = torch.tensor([[-1.5, -1.0, -0.5, -1.2]])
    lags = torch.tensor([[1, 1, 0, 0]])
    weights, masked = versioned_mismatch_weights(old, engine, lags, "truncate", None, 2.0)
    assert_close(weights, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, 2.0]]))
    assert_close(masked, torch.zeros(1, 4))
    weights, masked = versioned_mismatch_weights(old, engine, lags, "mask", 0.5, 2.0)
    assert_close(weights, torch.tensor([[math.exp(0.5), 0.0, 1.0, 0.0]]))
    assert_close(masked, torch.tensor([[0.0, 1.0, 0.0, 1.0]]))
    # max_lag 0: only the tokens sampled in flight by the trained version keep a weight
    weights, masked = versioned_mismatch_weights(old, engine, lags, "truncate", None, 2.0, max_lag=0)
    assert_close(weights, torch.tensor([[0.0, 0.0, 1.0, 2.0]]))
    assert_close(masked, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert not weights.requires_grad


def test_a_token_newer_than_the_trained_policy_is_refused():
    with pytest.raises(ValueError, match=r"policy_lags must be >= 0 .*got -1"):
        versioned_mismatch_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[0, -1]]), "truncate", None, 2.0)


def test_lag_shares():
    shares = lag_shares(torch.tensor([[0, 1, 2, 0]]))
    assert_close(shares["policy_lag"], torch.tensor([[0.0, 1.0, 2.0, 0.0]]))
    assert_close(shares["stale_tokens"], torch.tensor([[0.0, 1.0, 1.0, 0.0]]))


def test_ppo_objective_weighs_each_token_with_its_versions_ratio():
    """The PPO task's loss on a packed micro-batch of the completion above (plus a prompt token, off the mask): the
    policy equals pi_old (ratio 1, surrogate -A_t), so the token-mean loss is -sum_t A_t w_t / N with w_t the
    truncated ratio against each token's own version; the lag sums are logged."""
    from rl_lightning.tasks.ppo import CorrectionConfig
    from rl_lightning.tasks.ppo.objective import PolicyObjective

    old = torch.tensor([[0.0, -1.0, -2.0, -0.5, -0.2]])
    mb = {"target_mask": torch.tensor([[0, 1, 1, 1, 1]]), "old_logprobs": old,
          "target_engine_logprobs": torch.tensor([[0.0, -1.5, -1.0, -0.5, -1.2]]),
          "advantages": torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]),
          "target_policy_lags": torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]])}
    objective = PolicyObjective(correction=CorrectionConfig(mode="truncate", high=2.0), policy_lags=True)
    total, sums = objective.loss(old.clone().requires_grad_(), torch.zeros(1, 5), mb, torch.tensor(4.0), 0.0,
                                 lambda measured: 0.0)
    weights = [math.exp(0.5), math.exp(-1.0), 1.0, 2.0]
    expected = -(1.0 * weights[0] + 2.0 * weights[1] - 1.0 * weights[2] + 0.5 * weights[3]) / 4
    assert_close(total.detach(), torch.tensor(expected))
    assert sums["policy_lag"].item() == 2.0 and sums["stale_tokens"].item() == 2.0
