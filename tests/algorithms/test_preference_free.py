"""SimPO, ORPO and KTO against values worked out by hand and against TRL 1.16's own code on random log-probabilities.

TRL's losses live inside trainer methods; the tests call those methods unbound on a minimal object carrying exactly
the attributes they read (for KTO, a stand-in model that returns the given per-sequence log-probabilities, since
TRL's `_compute_loss` runs the forward itself).
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms import kto_loss, kto_reference_point, orpo_loss, simpo_loss
from rl_lightning.algorithms.preference_free import log1mexp


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def _random_avg_logps(n, seed):
    """(n,) average per-token log-probabilities in (-3, -0.01): both branches of log1mexp are exercised."""
    g = torch.Generator().manual_seed(seed)
    return -(torch.rand(n, generator=g, dtype=torch.float64) * 2.99 + 0.01)


def test_simpo_hand_computed():
    """beta = 2, gamma = 1: beta (a_c - a_r) - gamma = 2 (-0.5 + 1.5) - 1 = 1 -> -ln sigma(1) = ln(1 + e^-1).
    Rewards are beta x average: -1 and -3, a won pair."""
    loss, metrics = simpo_loss(t(-0.5), t(-1.5), 1, beta=2.0, gamma=1.0)
    assert_close(loss, t(math.log(1 + math.exp(-1)))[0], atol=1e-12)
    assert_close(metrics["rewards_chosen"], t(-1.0)[0])
    assert_close(metrics["margin"], t(2.0)[0])
    assert metrics["accuracy"].item() == 1.0


def test_simpo_gamma_zero_is_reference_free_sigmoid_dpo_on_averages():
    from rl_lightning.algorithms import dpo_loss

    chosen, rejected = _random_avg_logps(6, 0), _random_avg_logps(6, 1)
    simpo, _ = simpo_loss(chosen, rejected, 6, beta=2.5, gamma=0.0, label_smoothing=0.1)
    zeros = torch.zeros(6, dtype=torch.float64)
    dpo, _ = dpo_loss(chosen, rejected, zeros, zeros, 6, beta=2.5, label_smoothing=0.1)
    assert_close(simpo, dpo, atol=1e-12)


def test_log1mexp_is_stable_at_both_ends():
    """log(1 - e^x): exact at x = -ln 2 (= -ln 2), near 0 ~ log(-x), near -inf ~ -e^x; no -inf or nan in between."""
    x = t(-math.log(2), -1e-10, -50.0)
    assert_close(log1mexp(x), t(-math.log(2), math.log(1e-10), -math.exp(-50.0)), atol=1e-12, rtol=1e-9)


def test_orpo_hand_computed():
    """a_c = a_r = ln(1/2): odds are both 1, log odds ratio 0, -ln sigma(0) = ln 2; NLL = ln 2; lam = 0.5:
    loss = ln 2 + 0.5 ln 2.  With a_c = ln(2/3), a_r = ln(1/3): odds 2 and 1/2, log odds ratio ln 4,
    -ln sigma(ln 4) = ln(5/4), NLL = ln(3/2)."""
    half = t(math.log(0.5))
    loss, metrics = orpo_loss(half, half, 1, lam=0.5)
    assert_close(loss, t(1.5 * math.log(2))[0], atol=1e-12)
    assert_close(metrics["log_odds_ratio"], t(0.0)[0], atol=1e-12)
    loss, metrics = orpo_loss(t(math.log(2 / 3)), t(math.log(1 / 3)), 1, lam=1.0)
    assert_close(loss, t(math.log(3 / 2) + math.log(5 / 4))[0], atol=1e-12)
    assert_close(metrics["log_odds_ratio"], t(math.log(4))[0], atol=1e-12)
    assert_close(metrics["nll"], t(math.log(3 / 2))[0], atol=1e-12)


def test_kto_hand_computed():
    """beta = 1, z0 = ln 2 (mismatched log-ratios ln 2 + ln 2 over 2), w_d = 2, w_u = 1.
    Desirable r = ln 6: 2 (1 - sigma(ln 3)) = 2 / 4; undesirable r = 0: 1 - sigma(ln 2) = 1 / 3.
    Mean over a global count of 2: (1/2 + 1/3) / 2 = 5 / 12."""
    z0 = kto_reference_point(t(2 * math.log(2))[0], 2)
    assert_close(z0, t(math.log(2))[0])
    loss, metrics = kto_loss(t(math.log(6), -1.0), t(0.0, -1.0), t(1, 0), z0, 2, 1.0, 2.0, 1.0)
    assert_close(loss, t(5 / 12)[0], atol=1e-12)
    assert metrics["accuracy"].item() == 2.0 and metrics["desirable"].item() == 1.0


def test_kto_reference_point_is_clamped_at_zero_and_carries_no_gradient():
    logratio_sum = torch.tensor(-3.0, requires_grad=True)
    z0 = kto_reference_point(logratio_sum, 4)
    assert z0.item() == 0.0 and not z0.requires_grad


# --- parity with TRL 1.16 --------------------------------------------------------------------------------------------

def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_matches_trl_cpo_trainer_simpo(label_smoothing):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    chosen, rejected = _random_avg_logps(16, 2), _random_avg_logps(16, 3)
    trainer = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=label_smoothing,
                              accelerator=_accelerator())
    losses, trl_chosen_rewards, _ = CPOTrainer.cpo_loss(trainer, chosen, rejected)
    ours, metrics = simpo_loss(chosen, rejected, 16, beta=2.0, gamma=0.7, label_smoothing=label_smoothing)
    assert_close(ours, losses.mean())  # CPO's loss with cpo_alpha = 0 (pure SimPO): the mean of these
    assert_close(metrics["rewards_chosen"], trl_chosen_rewards.sum())


def test_orpo_matches_trl_orpo_trainer():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    chosen, rejected = _random_avg_logps(16, 4), _random_avg_logps(16, 5)
    trainer = SimpleNamespace(beta=0.25, accelerator=_accelerator())
    losses, _, _, mean_ratio, mean_log_odds = ORPOTrainer.odds_ratio_loss(trainer, chosen.float(), rejected.float())
    ours, metrics = orpo_loss(chosen.float(), rejected.float(), 16, lam=0.25)
    # TRL's full loss is `policy_nll_loss - losses.mean()`; the NLL here is the chosen completions' (see orpo_loss).
    assert_close(ours, (-chosen.float()).mean() - losses.mean())
    assert_close(metrics["log_odds_ratio"] / 16, mean_log_odds)


class _LogprobsModel:
    """Stands in for the policy in TRL's `KTOTrainer._compute_loss`: returns given summed log-probabilities.

    The batches are 2 tokens wide, so TRL's per-token log-probabilities are (B, 1) and their sum is the value itself.
    """

    training = True

    def __init__(self, batch, logps, mismatched_logps):
        self.by_input = {id(batch["input_ids"]): logps, id(batch["KL_input_ids"]): mismatched_logps}

    def __call__(self, input_ids, **kwargs):
        per_token = self.by_input[id(input_ids)][:, None].float()  # (B, 1)
        return SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                               mean_logits=torch.zeros_like(per_token))


@pytest.mark.parametrize(("weights", "kl_shift"), [((1.0, 1.0), 0.3), ((1.33, 0.7), 0.3), ((1.0, 1.0), -5.0)],
                         ids=["unweighted", "weighted", "kl-clamped"])
def test_kto_matches_trl_kto_trainer(weights, kl_shift):
    from trl.trainer.kto_trainer import KTOTrainer

    g = torch.Generator().manual_seed(6)
    logps, ref_logps = -torch.rand(12, generator=g) * 20, -torch.rand(12, generator=g) * 20
    mismatched, ref_mismatched = -torch.rand(12, generator=g) * 20, -torch.rand(12, generator=g) * 20
    mismatched = ref_mismatched + kl_shift + torch.randn(12, generator=g) * 0.1  # z0 near kl_shift, or clamped
    label = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    ones = torch.ones(12, 2, dtype=torch.long)
    batch = {"input_ids": ones.clone(), "attention_mask": ones.clone(), "completion_mask": ones.clone(),
             "KL_input_ids": ones.clone(), "KL_attention_mask": ones.clone(), "KL_completion_mask": ones.clone(),
             "label": label, "ref_logps": ref_logps, "ref_KL_logps": ref_mismatched}
    model = _LogprobsModel(batch, logps, mismatched)
    trainer = SimpleNamespace(model=model, accelerator=_accelerator(), aux_loss_enabled=False,
                              precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=0.1,
                              desirable_weight=weights[0], undesirable_weight=weights[1],
                              _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    trainer._compute_kl_logps = lambda model, batch: KTOTrainer._compute_kl_logps(trainer, model, batch)
    trl_loss = KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)
    z0 = kto_reference_point((mismatched - ref_mismatched).sum(), 12)
    ours, _ = kto_loss(logps, ref_logps, label.float(), z0, 12, 0.1, *weights)
    assert_close(z0, torch.tensor(trainer._metrics["train"]["kl"][0]))
    assert_close(ours, trl_loss)
    if kl_shift < 0:
        assert z0.item() == 0.0
