"""LoRA through PEFT (``model.lm.lora.*`` of the SFT, DPO and PPO tasks).

Low-rank adapters on the policy's linear layers, the base weights frozen.

- `apply_lora` wraps the loaded model in a ``peft.PeftModel``; only adapter parameters (and `modules_to_save`)
  require gradients, so the optimizer (`rl_lightning.models.optim.adamw` takes trainable parameters only) holds adapter
  moments only.
- The reference of DPO and PPO is the same model with its adapters disabled (`AdaptersDisabled`): no second copy
  of the weights is loaded, and at the start of training it equals the base model exactly (LoRA's B is zero).
- `base_model` gives the transformers model inside the wrapper (decoder layers for FSDP2, ``config``).

Paper: LoRA, https://arxiv.org/abs/2106.09685 (W x + (alpha / r) B A x, B initialised to zero).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.errors import ConfigError

# Llama/Qwen2/Mistral attention and MLP projections (the names of parallelize.TP_PLAN).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the model's linear layers (``model.lm.lora.*``; null: full fine-tuning).

    Args:
        r: rank of each adapter (B is out x r, A is r x in).
        alpha: scaling numerator: the update is ``(alpha / r) B A x``.
        dropout: dropout on the adapter's input (0 keeps the training forward deterministic, which the PPO
            old/new log-prob ratio assumes).
        target_modules: module-name suffixes that get adapters, or ``all-linear`` (every linear layer but the
            output head); default: the attention and MLP projections.
        modules_to_save: modules trained in full next to the adapters (e.g. ``[lm_head]``), saved in the adapter.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = DEFAULT_TARGETS
    modules_to_save: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        errors = []
        if self.r < 1:
            errors.append(f"model.lm.lora.r must be >= 1, got {self.r}")
        if self.alpha <= 0:
            errors.append(f"model.lm.lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            errors.append(f"model.lm.lora.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            errors.append(f"model.lm.lora.target_modules must be a list of module names or 'all-linear', got "
                          f"'{self.target_modules}'")
        elif not self.target_modules:
            errors.append("model.lm.lora.target_modules is empty: name the linear layers to adapt (e.g. [q_proj, "
                          "v_proj]) or use 'all-linear'")
        if errors:
            raise ConfigError("; ".join(errors))


def lora_config(value: Any) -> LoRAConfig | None:
    """The ``lora`` argument as a `LoRAConfig` (the CLI passes one, a checkpoint a dict), or None."""
    return LoRAConfig(**value) if isinstance(value, dict) else value


def apply_lora(model: Any, config: LoRAConfig) -> Any:
    """Wrap a transformers causal LM (or sequence classifier) in a ``peft.PeftModel`` with `config`'s adapters.

    Only adapter parameters (and `modules_to_save`) require gradients. Target names matching no module fail here, at
    start-up, naming ``model.lm.lora.target_modules``.
    """
    from peft import LoraConfig, get_peft_model

    targets = config.target_modules if isinstance(config.target_modules, str) else list(config.target_modules)
    task_type = "SEQ_CLS" if hasattr(model, "score") else "CAUSAL_LM"
    peft_config = LoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                             target_modules=targets, task_type=task_type,
                             modules_to_save=list(config.modules_to_save) if config.modules_to_save else None)
    try:
        return get_peft_model(model, peft_config)
    except ValueError as e:
        raise ConfigError(f"model.lm.lora.target_modules={targets}: {str(e).splitlines()[0]}; name linear layers of "
                          f"{type(model).__name__} (e.g. {list(DEFAULT_TARGETS)}) or use 'all-linear'") from None


def is_peft(model: Any) -> bool:
    """Whether `model` is a PEFT wrapper (it has ``peft_config`` and ``get_base_model``)."""
    return model is not None and hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: Any) -> Any:
    """The transformers model itself: inside a PEFT wrapper, or `model` when it has none."""
    return model.get_base_model() if is_peft(model) else model


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; sharded (DTensor) parameters count in full."""
    sizes = [(p.requires_grad, p.numel()) for p in model.parameters()]  # DTensor.numel() is the global size
    return sum(n for grad, n in sizes if grad), sum(n for _, n in sizes)


@contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """Run `model` as its base inside the block (PEFT's ``disable_adapter``; a no-op without adapters)."""
    if not is_peft(model):
        yield
        return
    with model.disable_adapter():
        yield


class AdaptersDisabled:
    """The reference policy of a LoRA run: calls the policy with its adapters disabled, i.e. the frozen base model.

    There is no second copy of the weights. Stands where a reference model goes (`target_logprobs` calls it); ``to``
    is a no-op since it shares the policy's parameters (and their device).
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The policy's forward with its adapters disabled (the base model's output)."""
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    def to(self, *args: Any, **kwargs: Any) -> AdaptersDisabled:
        """No-op: it shares the policy's parameters (and their device)."""
        return self


def check_lora_strategy(strategy: Any) -> None:
    """LoRA under tensor parallelism is refused at start-up.

    The TP plan's ``ColwiseParallel``/``RowwiseParallel`` shard ``nn.Linear`` modules, and with LoRA the planned paths
    (``self_attn.q_proj``...) are PEFT ``lora.Linear`` wrappers whose A/B adapters would need a plan of their own (A
    row-wise after a row-wise base, B column-wise after a column-wise one). Not built yet.
    """
    if getattr(strategy, "tp_size", 1) > 1:
        raise ConfigError(f"model.lm.lora does not support strategy.tensor_parallel_size={strategy.tp_size} (PEFT's LoRA "
                          "layers are not tensor-parallel); use tensor_parallel_size: 1 (FSDP2 and context "
                          "parallelism work with LoRA)")
