"""Learning-rate schedule closed forms and optimizer-argument validation."""

import math

import pytest
import torch

from rl_lightning.errors import ConfigError
from rl_lightning.optim import adamw, check_optim_args, clip_grad_norm, lr_factor


def test_warmup_then_cosine_and_linear():
    # warmup 4: steps 0..3 -> 1/4, 2/4, 3/4, 4/4
    assert [lr_factor(s, 4, 14, "cosine", 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # decay over 10 steps: halfway (step 9) cosine = m + (1 - m) / 2 = 0.55; end (step 14) = m = 0.1
    assert lr_factor(9, 4, 14, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(14, 4, 14, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(100, 4, 14, "cosine", 0.1) == pytest.approx(0.1)
    # linear: 1 - (1 - m) * p with p = 2/10 at step 6
    assert lr_factor(6, 4, 14, "linear", 0.0) == pytest.approx(0.8)
    assert lr_factor(6, 4, 14, "constant", 0.0) == 1.0
    # cosine at a quarter: m + (1 - m) (1 + cos(pi / 4)) / 2
    assert lr_factor(2, 0, 8, "cosine", 0.0) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)


def test_bad_optim_args_are_reported_together():
    with pytest.raises(ConfigError, match=r"model.lr must be > 0, got 0.*lr_schedule must be one of cosine"):
        check_optim_args(0.0, 0, "exp", 0.5)


def test_adamw_skips_decay_on_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    optimizer = adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decays[id(model[0].weight)] == 0.1
    assert decays[id(model[0].bias)] == decays[id(model[1].weight)] == 0.0


def test_clip_grad_norm_returns_norm_and_clips():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([p], 1.0).item() == pytest.approx(5.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]), atol=1e-6)
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([p], 0.0).item() == pytest.approx(5.0)  # disabled: norm reported, gradient untouched
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]))
