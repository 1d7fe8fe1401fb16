"""Attention for packed sequences: the ``rl_varlen`` implementation, its kernels and zigzag ring attention.

- `packed`: attention over packed variable-length micro-batches, registered with transformers as ``rl_varlen``;
- `kernels`: the block kernels (flash-attn when installed, a SDPA/eager fallback) with their log-sum-exp;
- `ring`: ZigZag ring attention across a context-parallel group; `zigzag`: how a sequence is split over that group.

May import: compat.
"""
