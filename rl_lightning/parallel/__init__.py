"""Parallelism: the 3-D (data x context x tensor) strategy, sharding, offload and zigzag ring attention."""

from rl_lightning.parallel.strategy import ParallelStrategy

__all__ = ["ParallelStrategy"]
