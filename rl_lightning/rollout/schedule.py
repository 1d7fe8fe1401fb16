"""Rollout scheduling policies: when the engine samples a batch's rollout relative to the trainer's updates.

The `rl_lightning.rollout.callback.RolloutCallback` holds one policy, chosen from ``model.rollout`` by
`rl_lightning.rollout.callback.scheduling_policy`:

- `Synchronous` (``async_steps: 0``): push the weights, sample, score, sleep the engine, in the training thread;
- `OneStepOff` (``async_steps: 1``): rollout k+1 is generated on the rank's engine thread while the trainer updates on
  rollout k (`rl_lightning.rollout.async_rollout`);
- `rl_lightning.rollout.inflight.InFlight` (``inflight_segment_tokens: N``): one-step-off, and the weights load in
  flight between segments of N tokens.

A policy drives the callback through its public steps (`RolloutSteps`: ``prepare_engine``, ``sample``, ``finish``)
and implements `SchedulingPolicy`. Every engine call of a policy that generates off the training thread (the first
synchronous rollout and the weight pushes included) runs on that rank's engine thread, which selected the rank's
device and made a stream of its own current before its first call (`rl_lightning.rollout.engine_thread`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from rl_lightning.memory.phases import release_host_memory
from rl_lightning.rollout.async_rollout import ThreadGenerator, pending_state, read_ahead, restore_pending
from rl_lightning.rollout.trajectory import Rollout, Trajectory

T = TypeVar("T")

__all__ = ["OneStepOff", "RolloutSteps", "SchedulingPolicy", "Synchronous"]


class RolloutSteps(Protocol):
    """The callback's steps a policy composes (`rl_lightning.rollout.callback.RolloutCallback`)."""

    engine: Any

    def prepare_engine(self, trainer: Any, task: Any) -> None:
        """Push the current policy's weights into the engine (if it stepped since the last push) and wake it."""

    def sample(self, trainer: Any, task: Any, prompts: list, index: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Rollout `index` of `prompts`, scored (and refilled); issues no collective off the training thread."""

    def finish(self, trainer: Any, task: Any, trajectories: list[Trajectory], metrics: dict[str, float]) -> Rollout:
        """The `Rollout` the trainer takes (feeds the Pareto archive and the curriculum; may reduce across ranks)."""


class SchedulingPolicy(Protocol):
    """When the engine samples: what the callback asks of a scheduling policy."""

    background: bool  # generation runs off the training thread (no collective may be issued there)

    def start(self, device: torch.device) -> None:
        """Before a fit's first engine call: the device the policy's engine thread selects (if it has one)."""

    def wrap_engine(self, engine: Any) -> Any:
        """The engine the callback uses, built from `engine` (once per process)."""

    def rollout(self, steps: RolloutSteps, trainer: Any, task: Any, batch: dict, batch_idx: int) -> Rollout:
        """Training batch `batch_idx`'s rollout, scored."""

    def call(self, work: Callable[[], T]) -> T:
        """Run engine work outside a training rollout (a validation), where this policy's engine calls run."""

    def idle(self) -> None:
        """Wait until no background generation uses the engine."""

    def close(self) -> None:
        """Wait for and drop any pending rollout; release threads."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the policy ({} for none)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s part."""


class Synchronous:
    """``async_steps: 0``: each rollout is sampled at its batch's start by the current policy, in the training thread."""

    background = False

    def start(self, device: torch.device) -> None:
        """Nothing to start: the training thread drives the engine."""

    def wrap_engine(self, engine: Any) -> Any:
        """`engine` itself."""
        return engine

    def rollout(self, steps: RolloutSteps, trainer: Any, task: Any, batch: dict, batch_idx: int) -> Rollout:
        """Push, sample, score; then the engine sleeps and the host memory generation freed goes back."""
        steps.prepare_engine(trainer, task)
        trajectories, metrics = steps.sample(trainer, task, batch["prompts"], task.rollouts)
        result = steps.finish(trainer, task, trajectories, metrics)
        steps.engine.sleep()
        release_host_memory()  # what generation freed goes back to the system before the update
        return result

    def call(self, work: Callable[[], T]) -> T:
        """`work()` here."""
        return work()

    def idle(self) -> None:
        """Nothing runs in the background."""

    def close(self) -> None:
        """Nothing to release."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing pending."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class Background:
    """The engine thread that the policies generating off the main thread share.

    Waiting for it, closing it, and the pending rollout in checkpoints; `OneStepOff` and
    `rl_lightning.rollout.inflight.InFlight` add the schedule.

    Args:
        max_pending: rollouts generating at once.
    """

    background = True

    def __init__(self, max_pending: int = 1) -> None:
        self.generator = ThreadGenerator(max_pending)

    def start(self, device: torch.device) -> None:
        """The engine threads select `device` (and the rank's engine stream) before their first call."""
        self.generator.device = device

    def call(self, work: Callable[[], T]) -> T:
        """`work()` on the engine thread, once no background generation uses the engine."""
        self.generator.idle()
        return self.generator.run(work)

    def idle(self) -> None:
        """Wait for the background generation."""
        self.generator.idle()

    def close(self) -> None:
        """Drop any in-flight rollout (it still uses the reward workers) and stop the engine threads."""
        self.generator.close()

    def state_dict(self) -> dict[str, Any]:
        """Every rank's in-flight rollout (with its tokens' versions), for an exact resume (`pending_state`)."""
        return {"pending": pending_state(self.generator)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's in-flight rollout back as the pending one."""
        if state.get("pending"):
            restore_pending(self.generator, state["pending"])


class OneStepOff(Background):
    """``async_steps: 1``: take rollout k (generated during step k-1), push the current weights, submit rollout k+1.

    See `rl_lightning.rollout.async_rollout`. The engine stays awake: the background generation runs during training.
    """

    def wrap_engine(self, engine: Any) -> Any:
        """`engine` itself."""
        return engine

    def rollout(self, steps: RolloutSteps, trainer: Any, task: Any, batch: dict, batch_idx: int) -> Rollout:
        """Rollout k: the one read ahead, or (nothing read ahead) sampled now; then rollout k+1 is submitted."""
        generator, index, prompts = self.generator, task.rollouts, batch["prompts"]
        finished = generator.take(rollout_key(index, prompts))
        generator.run(lambda: steps.prepare_engine(trainer, task))  # version `index`: no generation uses the engine
        if finished is None:  # nothing read ahead (a fit's or an epoch's first batch): sampled now, up to date
            trajectories, metrics = generator.run(lambda: steps.sample(trainer, task, prompts, index))
            version, waited = index, 0.0
        else:
            (trajectories, metrics), version, waited = finished.value, finished.version, finished.wait_s
        metrics.update({"rollout/staleness": float(index - version),  # policy updates between sampling and training
                        "rollout/wait_s": waited})  # the trainer's wait for the background rollout
        # the counters in the Rollout are read before the next rollout's generation can move them
        result = steps.finish(trainer, task, trajectories, metrics)
        submit_ahead(generator, steps, trainer, task, read_ahead(trainer, task, batch_idx), index)
        return result


def rollout_key(index: int, prompts: list) -> tuple[int, ...]:
    """The key a rollout is submitted and taken under: its index and its prompts' dataset rows."""
    return (index, *(p.index for p in prompts))


def submit_ahead(generator: ThreadGenerator, steps: RolloutSteps, trainer: Any, task: Any, ahead: list | None,
                 index: int) -> None:
    """Submit rollout ``index + 1`` of the prompts read ahead (none: nothing), by the engine's policy `index`."""
    if ahead is not None:
        generator.submit(rollout_key(index + 1, ahead), index, lambda: steps.sample(trainer, task, ahead, index + 1))
