"""`PolicyObjective` is composed once from the terms a run enabled: a plain GRPO objective is its surrogate and its
reduction, each option adds its term, and the loss equals its closed form."""

import math

import pytest
import torch
from conftest import assert_close

from rl_lightning.tasks.ppo import CorrectionConfig
from rl_lightning.tasks.ppo.objective import PolicyObjective, sequence_aggregate, token_aggregate
from rl_lightning.tasks.ppo.terms import CISPOSurrogate, ClippedSurrogate, GSPOSurrogate

OLD = [0.0, -1.0, -2.0, -0.5]
STEP = [0.0, 0.1, -0.5, 0.3]  # logprobs - old_logprobs: ratios 1, e^0.1 (inside), e^-0.5 (below), e^0.3 (above)
ADVANTAGES = [0.0, 1.0, 2.0, -1.0]


def _micro_batch(**extra):
    """One packed sequence: a prompt token (off the mask), then three completion tokens."""
    old = torch.tensor([OLD])
    return {"target_mask": torch.tensor([[0, 1, 1, 1]]), "old_logprobs": old, "target_engine_logprobs": old.clone(),
            "advantages": torch.tensor([ADVANTAGES]), "seq_index": torch.tensor([[0, 0, 0, 0]]), "num_sequences": 1,
            **extra}


def _clipped(step, advantage, clip=0.2):
    """PPO's clipped surrogate of one token, closed form: -min(r A, clip(r, 1 - clip, 1 + clip) A)."""
    ratio = math.exp(step)
    return -min(ratio * advantage, min(max(ratio, 1 - clip), 1 + clip) * advantage)


def _loss(objective, mb, normaliser=3.0, entropy=None, kl_coef=0.0):
    logprobs = (torch.tensor([OLD]) + torch.tensor([STEP])).requires_grad_()
    entropy = torch.zeros(1, 4) if entropy is None else entropy
    return objective.loss(logprobs, entropy, mb, torch.tensor(normaliser), kl_coef, lambda measured: 0.0)


def test_plain_grpo_objective_is_its_surrogate_and_reduction():
    """No option on: the clipped surrogate, no term, the token mean; the loss is the closed form's token mean."""
    objective = PolicyObjective()
    assert objective.names == ("ppo",) and objective.terms == () and objective.reweights == ()
    assert objective.surrogate == ClippedSurrogate(0.2, 0.2, None) and objective.aggregate is token_aggregate
    assert not objective.entropy_needs_grad
    total, sums = _loss(objective, _micro_batch())
    expected = sum(_clipped(s, a) for s, a in zip(STEP[1:], ADVANTAGES[1:], strict=True)) / 3.0
    assert_close(total.detach(), torch.tensor(expected))
    assert_close(sums["policy_loss"], torch.tensor(expected * 3.0))
    assert {"policy_loss", "entropy", "approx_kl", "engine_logprob_diff", "mismatch_kl"} <= set(sums)
    assert not {"kl", "mismatch_masked", "skipped", "distill_reverse_kl", "policy_lag"} & set(sums)


@pytest.mark.parametrize(("options", "names"), [
    ({"correction": CorrectionConfig()}, ("ppo", "correction")),
    ({"reference": True}, ("ppo", "kl", "regulariser")),
    ({"reference": True, "kl_in_loss": False}, ("ppo", "kl")),
    ({"reference": True, "kl_in_loss": False, "kl_constrained": True}, ("ppo", "kl", "regulariser")),
    ({"entropy_coef": 0.01}, ("ppo", "regulariser")),
    ({"entropy_constrained": True}, ("ppo", "regulariser")),
    ({"teacher": True}, ("ppo", "distill_reverse_kl")),
    ({"policy_lags": True}, ("ppo", "policy_lags")),
    ({"skip_threshold": 2.0}, ("ppo", "skip")),
    ({"policy_loss": "gspo"}, ("gspo",)),
    ({"policy_loss": "cispo"}, ("cispo",)),
    ({"correction": CorrectionConfig(), "reference": True, "teacher": True, "policy_lags": True, "skip_threshold": 2.0},
     ("ppo", "correction", "kl", "regulariser", "distill_reverse_kl", "policy_lags", "skip")),
])
def test_each_enabled_option_adds_its_term(options, names):
    assert PolicyObjective(**options).names == names


def test_the_surrogate_and_the_reduction_are_picked_at_construction():
    assert PolicyObjective("gspo", 3e-4, 4e-4).surrogate == GSPOSurrogate(3e-4, 4e-4)
    assert PolicyObjective("cispo", 1.0, 4.0).surrogate == CISPOSurrogate(1.0, 4.0)
    assert PolicyObjective(aggregation="sequence_mean").aggregate is sequence_aggregate
    with pytest.raises(ValueError, match="policy_loss must be one of ppo, gspo, cispo, got 'ppo2'"):
        PolicyObjective("ppo2")
    with pytest.raises(ValueError, match="aggregation must be one of .*, got 'mean'"):
        PolicyObjective(aggregation="mean")


def test_kl_and_entropy_terms_add_their_closed_forms():
    """With a reference and an entropy bonus: loss_t = surrogate_t + kl_coef x k3_t - entropy_coef x H_t, whose
    token mean is the total; ``kl`` and ``entropy`` are logged as measured."""
    ref = torch.tensor([[0.0, -1.2, -1.5, -0.5]])
    entropy = torch.tensor([[0.0, 0.5, 1.0, 1.5]])
    objective = PolicyObjective(entropy_coef=0.1, reference=True)
    total, sums = _loss(objective, _micro_batch(ref_logprobs=ref), entropy=entropy, kl_coef=0.5)
    expected, kl_sum = 0.0, 0.0
    for t in range(1, 4):
        logprob = OLD[t] + STEP[t]
        k3 = math.exp(ref[0, t].item() - logprob) - (ref[0, t].item() - logprob) - 1
        expected += _clipped(STEP[t], ADVANTAGES[t]) + 0.5 * k3 - 0.1 * entropy[0, t].item()
        kl_sum += k3
    assert_close(total.detach(), torch.tensor(expected / 3.0))
    assert_close(sums["kl"], torch.tensor(kl_sum))
    assert_close(sums["entropy"], torch.tensor(3.0))


def test_skip_zeroes_a_trajectory_out_of_its_ratio_range():
    """The sequence's ratio exp(mean(STEP on the completion)) = e^(-0.1/3) is inside [1 / t, t] only if
    |mean| <= log(t): at t = 1.01 it is not (0.033 > 0.00995), so the loss is 0 and one trajectory is skipped."""
    total, sums = _loss(PolicyObjective(skip_threshold=1.01), _micro_batch())
    assert total.item() == 0.0 and sums["skipped"].item() == pytest.approx(1.0)
    total, sums = _loss(PolicyObjective(skip_threshold=2.0), _micro_batch())
    assert total.item() != 0.0 and sums["skipped"].item() == 0.0
