"""The networks of a PPO run: the policy (with LoRA adapters), the critic, the frozen reference and teacher.

`configure` loads and shards them inside ``configure_model`` (once: a model that is already there is only re-sharded,
which is what Lightning's restore path expects). The frozen ones are no submodules of the task (out of the optimizer
and the checkpoints); `place_frozen` moves them to the device at the start of a fit, unless FSDP2 offloads them.
"""

from __future__ import annotations

from typing import Any

from rl_lightning.algorithms.advantages import CRITIC_ESTIMATORS
from rl_lightning.models.loading import load_causal_lm, load_reward_model
from rl_lightning.models.lora import AdaptersDisabled, apply_lora
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.strategy import ParallelStrategy
from rl_lightning.tasks.ppo import distill as distillation


def configure(task: Any) -> None:
    """Load (first call) and shard `task`'s policy, critic, reference and teacher (a `rl_lightning.tasks.PPO`).

    The reference is the policy with its adapters disabled under LoRA (no second model), else a frozen copy of the
    policy's weights; it is loaded only when a KL term or ceiling needs it (``task.needs_reference``). The critic
    exists for the critic estimators only.
    """
    hp, lm = task.hparams, task.lm
    if task.model is None:
        task.model = load_causal_lm(lm.name, attn_implementation=lm.attn_implementation,
                                    gradient_checkpointing=lm.gradient_checkpointing,
                                    lean_activations=lm.lean_activations)
        if lm.lora is not None:
            task.model = apply_lora(task.model, lm.lora)
    task.model = parallelize_for(task, task.model)
    if hp.advantage_estimator in CRITIC_ESTIMATORS:
        if task.critic is None:
            task.critic = load_reward_model(lm.name, attn_implementation=lm.attn_implementation,
                                            gradient_checkpointing=lm.gradient_checkpointing,
                                            lean_activations=lm.lean_activations)
        task.critic = parallelize_for(task, task.critic)
    if lm.lora is not None and task.needs_reference:  # the base model: the policy with its adapters disabled
        object.__setattr__(task, "_reference", AdaptersDisabled(task.model))
    if task._reference is None and task.needs_reference:
        reference = load_causal_lm(lm.name, attn_implementation=lm.attn_implementation)
        object.__setattr__(task, "_reference", parallelize_for(task, reference.eval().requires_grad_(False),
                                                               trainable=False))
    if task._teacher is None and task.distill is not None:
        object.__setattr__(task, "_teacher", distillation.load_teacher(task, task.distill))


def place_frozen(task: Any) -> None:
    """Move `task`'s frozen reference and teacher to its device (FSDP2's CPU offload keeps them where they are)."""
    strategy = task.trainer.strategy
    if isinstance(strategy, ParallelStrategy) and strategy.cpu_offload:
        return  # FSDP2 keeps the offloaded reference's shards on the CPU and streams them in
    for frozen in (task._reference, task._teacher):
        if frozen is not None:
            frozen.to(task.device)
