"""Parallelism: the 3-D (data x context x tensor) strategy, sharding, offload, checkpoints and reductions.

`ParallelStrategy` is imported on first use, so a light submodule (`rl_lightning.parallel.local_group`, which the
engine process's child imports) does not load Lightning with it.

May import: models, attention, compat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_lightning.parallel.strategy import ParallelStrategy

__all__ = ["ParallelStrategy"]


def __getattr__(name: str) -> Any:
    if name == "ParallelStrategy":
        from rl_lightning.parallel.strategy import ParallelStrategy

        return ParallelStrategy
    raise AttributeError(f"module 'rl_lightning.parallel' has no attribute '{name}'")
