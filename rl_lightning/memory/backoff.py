"""Back-off of the packed micro-batch token budget on out-of-memory errors (PPO's ``model.max_length_per_device``).

When a micro-batch's forward or backward raises `torch.OutOfMemoryError`, the task frees what the failed attempt
held (`free_after_oom`), halves its budget (`smaller_budget`, never below the minibatch's longest trajectory),
re-packs that minibatch and redoes it from scratch; the optimizer has not stepped on it yet, so nothing of the
failed attempt reaches the parameters. The smaller budget is kept for the rest of the run.

Single process only: under data or model parallelism an error on one rank would leave the others waiting in a
collective (FSDP's all-gathers inside the forward), and agreeing on "someone ran out" after every micro-batch costs a
collective of its own. There the error is re-raised (`oom_backoff_supported`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

AUTO_BUDGET = 65536
"""Where ``max_length_per_device: auto`` starts: the back-off finds what fits from there."""


@dataclass
class TokenBudget:
    """The token budget of one packed micro-batch in use (the task's, checkpointed); the back-off lowers it."""

    tokens: int


def initial_budget(max_length_per_device: int | str) -> int:
    """The token budget a run starts from: the configured one, or `AUTO_BUDGET` for ``auto``."""
    return AUTO_BUDGET if max_length_per_device == "auto" else int(max_length_per_device)


def budget_errors(max_length_per_device: object) -> list[str]:
    """Configuration errors of a ``model.max_length_per_device`` value (an int >= 1 or ``auto``)."""
    if max_length_per_device == "auto" or (isinstance(max_length_per_device, int)
                                           and not isinstance(max_length_per_device, bool)
                                           and max_length_per_device >= 1):
        return []
    return [f"model.max_length_per_device must be an integer >= 1 or 'auto', got {max_length_per_device!r}"]


def oom_backoff_supported(world_size: int) -> bool:
    """Whether an out-of-memory error can be retried with a smaller budget: only in a single process (see above)."""
    return world_size == 1


def smaller_budget(budget: int, longest: int) -> int:
    """Half of `budget`, but at least `longest` (the minibatch's longest trajectory, which must fit whole).

    Raises `torch.OutOfMemoryError` with a one-line message when the budget is already there.
    """
    smaller = max(budget // 2, longest)
    if smaller >= budget:
        raise torch.OutOfMemoryError(
            f"out of memory on a micro-batch of model.max_length_per_device={budget} tokens, which cannot shrink below "
            f"the longest trajectory ({longest} tokens): it needs more memory than this device has (shorten "
            "model.rollout.max_new_tokens or the prompts, enable model.lm.gradient_checkpointing, or shard the model)")
    return smaller


def free_after_oom(modules: Iterable[torch.nn.Module | None], device: torch.device) -> None:
    """Drop the gradients a failed attempt accumulated and return cached blocks to the device."""
    for module in modules:
        if module is not None:
            module.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
