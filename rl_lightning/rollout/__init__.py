"""Rollouts: the engine protocol (HF generate, colocated vLLM), environments (`env_path`), the callback."""
