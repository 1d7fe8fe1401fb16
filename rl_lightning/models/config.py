"""The language model a task trains, its adapters, memory switches and optimizer: ``model.lm.*`` of every task.

SFT, RewardModel, DPO and PPO take the same group, so a key means the same in each::

    model:
      class_path: PPO
      init_args:
        lm:
          name: asset:SmolLM2-135M-Instruct
          optim: {lr: 1e-6}
          lora: {r: 8}

Task-specific keys stay on the task (DPO's ``beta`` and ``ref_model_name``, PPO's algorithm keys).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any

from rl_lightning.errors import ConfigError
from rl_lightning.models.lora import LoRAConfig, lora_config
from rl_lightning.models.optim import OptimConfig, typed

LM_HEAD_CHUNK = 1024  # positions per chunk of the output head, by default


@dataclass(frozen=True)
class LMConfig:
    """The trained language model (``model.lm.*``).

    Args:
        name: Hugging Face model folder or hub name (``asset:<name>``, a ``.gguf`` file); also the tokenizer (linked to
            ``data.tokenizer_name``) and, for DPO and PPO, the reference.
        optim: AdamW, its schedule and gradient clipping (``model.lm.optim.*``); a field left unset
            (``lr``, ``lr_schedule``) takes the task's own default (SFT lr 1e-5, RewardModel 5e-6, DPO 5e-7, PPO 1e-6
            with a constant schedule).
        lora: train low-rank adapters on the frozen model instead of every weight (``model.lm.lora.*``, see
            `rl_lightning.models.lora.LoRAConfig`); null: full fine-tuning.
        gradient_checkpointing: recompute each decoder block's activations in the backward pass to save memory; the
            one switch (`rl_lightning.parallel.ParallelStrategy` applies it per block when it shards the model).
        lean_activations: memory-lean SwiGLU MLP and RMSNorm forwards (the same values and gradients, about a third
            fewer saved activations; `rl_lightning.models.lean`); false: the model's own forwards.
        attn_implementation: ``rl_varlen`` (exact per-sequence attention for packed micro-batches, any device) or a
            transformers implementation (``sdpa``, ``eager``, ``flash_attention_2``).
        lm_head_chunk: positions per chunk of the output head: the (tokens x vocabulary) logits are never built whole,
            only (lm_head_chunk x vocabulary) at a time, in the forward and the backward (same values); null: the
            full logits. The RewardModel has a scalar head, no output head: it refuses any other value than the
            default or null.
        memory_check: refuse, at start-up, a run whose predicted peak memory per device exceeds the device's (one line
            naming the keys that would fit; the plan is printed either way, see `rl_lightning.tasks.memory_check`);
            false: print the plan and run anyway.
    """

    name: str
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoRAConfig | None = None
    gradient_checkpointing: bool = False
    lean_activations: bool = True
    attn_implementation: str = "rl_varlen"
    lm_head_chunk: int | None = LM_HEAD_CHUNK
    memory_check: bool = True

    def __post_init__(self) -> None:
        from rl_lightning.models.logprobs import check_lm_head_chunk

        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"model.lm.name must name a model (a folder, hub name or asset:<name>), got "
                              f"{self.name!r}")
        check_lm_head_chunk(self.lm_head_chunk)
        object.__setattr__(self, "optim", typed(OptimConfig, self.optim))
        object.__setattr__(self, "lora", lora_config(self.lora))

    def for_task(self, **optim_defaults: Any) -> LMConfig:
        """This config with the optimizer's unset fields taken from the task's defaults (``lr``, ``lr_schedule``)."""
        unset = {k: v for k, v in optim_defaults.items() if getattr(self.optim, k) is None}
        return replace(self, optim=replace(self.optim, **unset)) if unset else self

    def as_dict(self) -> dict[str, Any]:
        """The group as plain data (what a checkpoint's hyperparameters keep)."""
        return asdict(self)


def lm_config(value: Any) -> LMConfig:
    """``model.lm`` as its dataclass: the CLI passes an instance, ``load_from_checkpoint`` a plain dict."""
    if isinstance(value, LMConfig):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if not isinstance(value, dict):
        raise ConfigError(f"model.lm must be a group of keys (name, optim, lora, ...), got {value!r}")
    return LMConfig(**value)
