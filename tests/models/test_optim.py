"""Learning-rate schedule closed forms, `model.lm.optim` validation and the run length a schedule spans."""

import math

import pytest
import torch

from rl_lightning.errors import ConfigError
from rl_lightning.models.optim import OptimConfig, adamw, clip_grad_norm, configure_adamw, lr_factor, run_length


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


def test_bad_optim_args_are_reported_together_in_one_line():
    with pytest.raises(ConfigError) as error:
        OptimConfig(lr=0.0, warmup_steps=-1, lr_schedule="exp", min_lr_ratio=1.5)
    assert str(error.value) == (
        "model.lm.optim.lr must be > 0, got 0.0; model.lm.optim.warmup_steps must be >= 0, got -1; "
        "model.lm.optim.lr_schedule must be one of cosine, linear, constant, got 'exp'; "
        "model.lm.optim.min_lr_ratio must be in [0, 1], got 1.5"
    )


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"lr": -1e-3}, "model.lm.optim.lr must be > 0, got -0.001"),
        ({"warmup_steps": -2}, "model.lm.optim.warmup_steps must be >= 0, got -2"),
        ({"lr_schedule": "step"}, "model.lm.optim.lr_schedule must be one of cosine, linear, constant, got 'step'"),
        ({"min_lr_ratio": -0.1}, "model.lm.optim.min_lr_ratio must be in [0, 1], got -0.1"),
    ],
    ids=["lr", "warmup_steps", "lr_schedule", "min_lr_ratio"],
)
def test_each_bad_optim_arg_names_its_key(kwargs, expected):
    with pytest.raises(ConfigError) as error:
        OptimConfig(**kwargs)
    assert str(error.value) == expected


def test_optim_defaults_and_frozen():
    optim = OptimConfig()
    # lr and lr_schedule null: the task's own (SFT 1e-5 cosine ... PPO 1e-6 constant), resolved by the task
    assert (optim.lr, optim.lr_schedule, optim.warmup_steps, optim.min_lr_ratio, optim.max_grad_norm) == (
        None, None, 0, 0.1, 1.0)
    with pytest.raises(AttributeError):
        optim.lr = 1.0  # frozen: a task's typed config cannot drift from its saved hyper-parameters


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_run_length_of_a_bounded_run_is_the_trainers_estimate(schedule):
    """Bounded by trainer.max_steps or trainer.max_epochs, Lightning estimates the optimizer steps (an int)."""
    assert run_length(37, OptimConfig(lr_schedule=schedule)) == 37


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_unbounded_run_refuses_a_decaying_schedule_in_one_line(schedule):
    """max_epochs=-1 and max_steps=-1: Lightning's estimate is infinite, so a decay has no end to reach."""
    with pytest.raises(ConfigError) as error:
        run_length(float("inf"), OptimConfig(lr_schedule=schedule))
    message = str(error.value)
    assert "\n" not in message
    assert message == (f"model.lm.optim.lr_schedule={schedule} decays over the run, but the run is unbounded "
                       "(trainer.max_steps=-1 and trainer.max_epochs=-1): set trainer.max_steps or "
                       "trainer.max_epochs, or model.lm.optim.lr_schedule: constant")


def test_unbounded_run_with_a_constant_schedule_has_no_length():
    assert run_length(float("inf"), OptimConfig(lr_schedule="constant")) == 0


def test_configure_adamw_schedules_over_the_run_and_overrides_lr():
    """warmup 2, cosine over 6 steps to m = .1: the scheduler's factors are lr_factor's; `lr` overrides optim.lr."""
    model = torch.nn.Linear(2, 2)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6, warmup_steps=2, lr_schedule="cosine")
    optimizer, schedule = configure_adamw(model, optim, total_steps=6)
    assert schedule["interval"] == "step"
    assert optimizer.defaults["betas"] == (0.8, 0.9) and optimizer.defaults["eps"] == 1e-6
    factors = []
    for _ in range(7):
        factors.append(optimizer.param_groups[0]["lr"] / 1e-2)
        optimizer.step()
        schedule["scheduler"].step()
    assert factors == pytest.approx([lr_factor(s, 2, 6, "cosine", 0.1) for s in range(7)])
    overridden, _ = configure_adamw(model, optim, total_steps=6, lr=3e-4)
    assert overridden.defaults["lr"] == 3e-4
    with pytest.raises(ValueError, match="resolved lr and lr_schedule"):  # null would decay linearly, unasked
        configure_adamw(model, OptimConfig(lr=1e-2), total_steps=6)


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


def test_optimizer_step_returns_its_metrics_and_writes_nothing_on_the_module():
    """Optimizer, schedule and parameters in, the pre-clip norm and ``train/skipped_steps`` out; a NaN gradient skips
    the step (parameters and schedule untouched) and counts in the caller's `SkippedSteps`."""
    from rl_lightning.models.optim import SkippedSteps, optimizer_step

    module = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(module.weight)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    attributes, skipped = set(vars(module)), SkippedSteps()
    module.weight.grad = torch.tensor([[3.0, 4.0]])
    norm, metrics = optimizer_step(optimizer, schedule, module.parameters(), OptimConfig(max_grad_norm=0.0), skipped)
    assert float(norm) == 5.0 and metrics == {"train/skipped_steps": 0.0, "train/empty_steps": 0.0}
    assert module.weight.tolist() == [[-0.5, -1.0]] and schedule.last_epoch == 1  # 1 - 0.5 * (3, 4)
    module.weight.grad = torch.tensor([[float("nan"), 1.0]])
    norm, metrics = optimizer_step(optimizer, schedule, module.parameters(), OptimConfig(), skipped, index=0)
    assert metrics == {"train/skipped_steps": 1.0, "train/empty_steps": 0.0} and (skipped.total, skipped.streaks) == (1, {None: 0, 0: 1})
    assert module.weight.tolist() == [[-0.5, -1.0]] and schedule.last_epoch == 1 and module.weight.grad is None
    assert set(vars(module)) == attributes  # no state left on the module


def test_a_zero_gradient_moves_no_weight_and_no_moment_but_advances_the_schedule():
    """A rollout in which every advantage is zero gives a gradient of exact zeros. AdamW stepped on it would go on
    moving the weights with its momentum (the control below); `optimizer_step` drops the gradients first, so the
    parameters and both moments stay bit-equal, the schedule advances and ``train/empty_steps`` counts it."""
    from rl_lightning.models.optim import SkippedSteps, adamw, optimizer_step

    def step_twice(skip: bool):
        torch.manual_seed(0)
        module = torch.nn.Linear(3, 2)
        optimizer = adamw(module, 1e-2, 0.1, (0.9, 0.999), 1e-8)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        skipped = SkippedSteps()
        for grad_scale in (1.0, 0.0):  # a rollout with signal, then one without
            for p in module.parameters():
                p.grad = torch.full_like(p, 0.5) * grad_scale
            if grad_scale == 0.0:
                before = [t.clone() for t in [*module.parameters(), *(v for s in optimizer.state.values()
                                                                      for v in s.values())]]
            if skip:
                _, metrics = optimizer_step(optimizer, schedule, module.parameters(), OptimConfig(), skipped)
            else:
                optimizer.step()
                schedule.step()
        after = [*module.parameters(), *(v for s in optimizer.state.values() for v in s.values())]
        return before, after, schedule.last_epoch, (metrics if skip else None)

    before, after, epoch, _ = step_twice(skip=False)
    assert not torch.equal(before[0], after[0])  # control: plain AdamW moves the weights on a zero gradient
    before, after, epoch, metrics = step_twice(skip=True)
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert epoch == 2 and metrics == {"train/skipped_steps": 0.0, "train/empty_steps": 1.0}


def test_a_checkpoint_before_the_first_real_step_does_not_count_a_step():
    """An optimizer that has not stepped yet (every step so far had an all-zero gradient) has no state. torch's
    ``get_optimizer_state_dict`` (a sharded checkpoint's save) makes it by stepping at lr 0, which counts a step and
    shrinks the next real update (the control); `materialize_adam_state` (ParallelStrategy.optimizer_state) makes the
    state AdamW's first step would, so the next real update is bit-equal to that of a run that never saved."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from rl_lightning.models.optim import materialize_adam_state

    def first_update(save: str):
        torch.manual_seed(0)
        module = torch.nn.Linear(3, 2)
        optimizer = adamw(module, 1e-2, 0.1, (0.9, 0.999), 1e-8)
        if save == "materialized":
            assert materialize_adam_state(optimizer) and not materialize_adam_state(optimizer)  # once
        if save != "none":
            get_optimizer_state_dict(module, optimizer)
        for p in module.parameters():
            p.grad = torch.full_like(p, 0.5)
        optimizer.step()
        return [p.detach().clone() for p in module.parameters()], optimizer

    never, _ = first_update("none")
    counted, optimizer = first_update("torch")
    assert float(next(iter(optimizer.state.values()))["step"]) == 2  # the save counted a step
    assert not torch.equal(never[0], counted[0])
    materialized, optimizer = first_update("materialized")
    assert float(next(iter(optimizer.state.values()))["step"]) == 1
    assert all(torch.equal(a, b) for a, b in zip(never, materialized, strict=True))
