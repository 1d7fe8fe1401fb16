"""The networks of a PPO run: the policy (with LoRA adapters), the critic, the frozen reference and teacher.

`configure` loads and shards them inside ``configure_model`` and returns them (once: a model that is already there is
only re-sharded, which is what Lightning's restore path expects); the task assigns them. The frozen ones are no submodules of the task (out of the optimizer
and the checkpoints); `place_frozen` moves them to the device at the start of a fit, unless FSDP2 offloads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_lightning.algorithms.advantages import CRITIC_ESTIMATORS
from rl_lightning.models.loading import load_causal_lm, load_reward_model
from rl_lightning.models.lora import AdaptersDisabled, apply_lora
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.strategy import ParallelStrategy
from rl_lightning.tasks.ppo import distill as distillation


@dataclass(frozen=True)
class Networks:
    """A PPO run's networks: the policy, the critic (or None), the frozen reference and teacher (or None)."""

    model: Any
    critic: Any = None
    reference: Any = None
    teacher: Any = None


def configure(task: Any) -> Networks:
    """Load (first call) and shard `task`'s policy, critic, reference and teacher (a `rl_lightning.tasks.PPO`).

    Reads the task's settings and the networks it already holds; returns them all and sets nothing (the task assigns
    them). The reference is the policy with its adapters disabled under LoRA (no second model), else a frozen copy of
    the policy's weights; it is loaded only when a KL term or ceiling needs it (``task.needs_reference``). The critic
    exists for the critic estimators only.
    """
    hp, lm = task.hparams, task.lm
    model, critic, reference, teacher = task.model, task.critic, task._reference, task._teacher
    if model is None:
        model = load_causal_lm(lm.name, attn_implementation=lm.attn_implementation,
                               gradient_checkpointing=lm.gradient_checkpointing, lean_activations=lm.lean_activations)
        if lm.lora is not None:
            model = apply_lora(model, lm.lora)
    model = parallelize_for(task, model)
    if hp.advantage_estimator in CRITIC_ESTIMATORS:
        if critic is None:
            critic = load_reward_model(lm.name, attn_implementation=lm.attn_implementation,
                                       gradient_checkpointing=lm.gradient_checkpointing,
                                       lean_activations=lm.lean_activations)
        critic = parallelize_for(task, critic)
    if lm.lora is not None and task.needs_reference:  # the base model: the policy with its adapters disabled
        reference = AdaptersDisabled(model)
    if reference is None and task.needs_reference:
        reference = load_causal_lm(lm.name, attn_implementation=lm.attn_implementation)
        reference = parallelize_for(task, reference.eval().requires_grad_(False), trainable=False)
    if teacher is None and task.distill is not None:
        teacher = distillation.load_teacher(task, task.distill, model)
    return Networks(model, critic, reference, teacher)


def place_frozen(frozen: tuple[Any, ...], device: Any, strategy: Any) -> None:
    """Move the frozen networks (reference, teacher; None skipped) to `device`, unless FSDP2 offloads them."""
    if isinstance(strategy, ParallelStrategy) and strategy.cpu_offload:
        return  # FSDP2 keeps the offloaded reference's shards on the CPU and streams them in
    for network in frozen:
        if network is not None:
            network.to(device)
