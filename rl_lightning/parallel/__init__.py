"""Parallelism: the 3-D (data x context x tensor) strategy, model sharding and zigzag ring attention."""
