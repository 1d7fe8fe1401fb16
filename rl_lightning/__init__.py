"""rl_lightning: LLM post-training (SFT, RM, DPO, PPO family) structured as PyTorch Lightning modules.

Importing the package is cheap and never imports vllm or flash-attn; those load lazily in the modules that use them.
"""

__version__ = "0.1.0"
