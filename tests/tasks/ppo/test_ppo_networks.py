"""`rl_lightning.tasks.ppo.networks`: `configure` loads and returns the networks and writes nothing on the task; the
task assigns them (the frozen reference outside its submodules, so out of the optimizer and the checkpoints)."""

import torch
from helpers import ppo_task

from rl_lightning.tasks.ppo import networks


def test_configure_returns_the_networks_and_the_task_assigns_them(parity_env):
    task = ppo_task(parity_env, kl={"coef": 0.1})  # a KL term: a frozen reference is loaded
    nets = networks.configure(task)
    assert (task.model, task.critic, task._reference, task._teacher) == (None, None, None, None)  # nothing written
    assert nets.critic is None and nets.teacher is None
    assert nets.reference is not nets.model and not any(p.requires_grad for p in nets.reference.parameters())
    for ours, theirs in zip(nets.model.parameters(), nets.reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)  # the policy's weights, frozen
    task.configure_model()  # the task assigns what configure returns
    assert task._reference is not None and task.model is not None
    assert not any(name.startswith("_reference") for name, _ in task.named_modules())  # not a submodule
