"""Rollouts: the engine protocol (HF generate now, colocated vLLM next), environments (`env_path`), the callback."""
