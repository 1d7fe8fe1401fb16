"""Adapter-only weight sync with vLLM: whether the engine can serve the policy's LoRA adapter, and at which rank.

`adapter_sync_rank` resolves ``model.rollout.engine.weight_sync`` before the engine is built: with a rank, the engine
is built with LoRA support and each step pushes only the adapter
(`rl_lightning.engines.vllm.VLLMEngine.update_adapter`); with None, every step pushes the merged weights.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rl_lightning.engines.weights import adapter_config, is_peft
from rl_lightning.errors import ConfigError

log = logging.getLogger(__name__)

# Ranks vLLM 0.32 accepts as max_lora_rank (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ConfigError(f"model.lm.lora.r={rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}); use a "
                      "smaller rank or model.rollout.engine.weight_sync: full")


def adapter_blockers(config: dict[str, Any]) -> list[str]:
    """Why vLLM cannot serve a PEFT LoRA adapter with this ``adapter_config.json`` content (empty: it can)."""
    targets = config.get("target_modules") or []
    checks = [(config.get("peft_type", "LORA") != "LORA", f"peft_type={config.get('peft_type')} (only LORA)"),
              (config.get("use_dora"), "use_dora=true"),
              (config.get("bias", "none") != "none" or config.get("lora_bias"), "adapter biases (bias, lora_bias)"),
              (config.get("modules_to_save"), f"modules_to_save={config.get('modules_to_save')}"),
              (isinstance(targets, str) or {"embed_tokens", "lm_head"} & {t.rsplit(".", 1)[-1] for t in targets},
               f"target_modules={targets!r} (only the decoder layers' linear projections, as a list)")]
    return [message for failed, message in checks if failed]


def adapter_sync_rank(model: torch.nn.Module, weight_sync: str, device_type: str = "cuda") -> int | None:
    """The LoRA rank to build the engine for, or None (full sync).

    A rank when ``model.rollout.engine.weight_sync`` (`weight_sync`) resolves to adapter-only sync for `model`.
    ``adapter`` with a plain model or an adapter vLLM cannot serve is a `ConfigError`; ``auto`` falls back to full
    sync then, and on CPU, where vLLM 0.32's LoRA kernels made generation 2.3x slower than merged weights
    (SmolLM2-135M, rank 16: benchmarks/lora_sync.py), more than the sync saves.
    """
    if weight_sync == "full" or (weight_sync == "auto" and device_type == "cpu"):
        return None
    if not is_peft(model):
        if weight_sync == "adapter":
            raise ConfigError("model.rollout.engine.weight_sync=adapter needs a LoRA policy (a PEFT model: set "
                              "model.lm.lora), "
                              "got a plain model; use weight_sync: full or auto")
        return None
    config = adapter_config(model)
    rank = max([config["r"], *(config.get("rank_pattern") or {}).values()])
    blockers = adapter_blockers(config) + ([f"r={rank} > {VLLM_LORA_RANKS[-1]}"] if rank > VLLM_LORA_RANKS[-1] else [])
    if blockers:
        if weight_sync == "adapter":
            raise ConfigError(f"model.rollout.engine.weight_sync=adapter: vLLM cannot serve this LoRA adapter "
                              f"({'; '.join(blockers)}); use weight_sync: full (merged weights)")
        log.info("LoRA adapter not servable by vLLM (%s): full (merged) weight sync", "; ".join(blockers))
        return None
    return rank
