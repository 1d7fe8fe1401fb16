"""Shard a Hugging Face decoder for `ParallelStrategy`.

Tensor-parallel plan per block, optional activation checkpointing, optional ``torch.compile`` of each block, then
FSDP2 ``fully_shard`` on every decoder block and the root: the order torchtitan uses. Compiling before sharding keeps
FSDP2's all-gather/reduce-scatter hooks outside the compiled code (dynamo skips FSDP hooks by default) and compiles
one block's code once for all blocks (they share it; only shapes and grad mode make new graphs).
"""

from __future__ import annotations

from typing import Any

from rl_lightning.compat.lightning import module_trainer
from rl_lightning.compat.transformers import attention_implementation
from rl_lightning.errors import ConfigError

# Llama/Qwen2/Mistral-style blocks: split q/k/v and gate/up by output features (each rank gets whole heads / a slice
# of the MLP), o/down by input features, so each block needs one all-reduce after attention and one after the MLP.
TP_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def decoder_layers(model: Any) -> Any:
    """The decoder blocks of a transformers model, or of the one inside a PEFT (LoRA) wrapper."""
    from rl_lightning.models.lora import base_model

    layers = getattr(base_model(model).base_model, "layers", None)
    if layers is None:
        raise ConfigError(f"{type(model).__name__} has no `base_model.layers`; ParallelStrategy supports Llama/Qwen2-style "
                          "decoders")
    return layers


def check_tensor_parallel(model: Any, tp_size: int) -> None:
    """Raise a `ConfigError` unless `tp_size` divides both the attention and the key-value head counts of `model`."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    if heads % tp_size or kv_heads % tp_size:
        raise ConfigError(
            f"the model has {heads} attention heads and {kv_heads} key-value heads, not both divisible by "
            f"strategy.tensor_parallel_size={tp_size}; pick a tensor_parallel_size that divides {kv_heads}"
        )


def apply_tensor_parallel(model: Any, tp_mesh: Any) -> None:
    """Shard every decoder layer of `model` in place over `tp_mesh` with the column/row-wise plan `TP_PLAN`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tensor_parallel(model, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in decoder_layers(model):
        plan = {name: styles[kind]() for name, kind in TP_PLAN.items()}
        parallelize_module(layer, tp_mesh, plan)


def parallelize(model: Any, strategy: Any, trainable: bool = True, checkpointing: bool = False) -> Any:
    """Apply TP, activation checkpointing, compilation and FSDP2 to `model` in place; returns it. Idempotent.

    TP when the strategy's tensor-parallel size > 1, activation checkpointing for trainable models with
    `checkpointing` (the task's ``model.lm.gradient_checkpointing``, the one switch; a model loaded with it on keeps
    it), ``torch.compile``
    of every decoder block (trainable or not: reference models' forwards gain too) with the strategy's ``compile``.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from rl_lightning.models.lora import base_model, check_lora_strategy, is_peft

    if isinstance(model, FSDPModule):
        return model
    if is_peft(model):
        check_lora_strategy(strategy)
    if strategy.tp_size > 1:
        apply_tensor_parallel(model, strategy.tp_mesh)
    if trainable and checkpointing and not getattr(base_model(model), "is_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trainable and getattr(strategy, "activation_offload", False):
        attach_activation_offload(model, strategy)
    if getattr(strategy, "compile", False):
        compile_decoder_layers(model, strategy.compile_mode)
    kwargs = {"mesh": strategy.fsdp_mesh, "mp_policy": strategy.mp_policy(),
              "offload_policy": strategy.offload_policy(), "reshard_after_forward": strategy.reshard_after_forward}
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    inner = base_model(model)  # a PEFT model shards the same modules: frozen base and adapters in one unit each
    if hasattr(inner, "score"):
        # Reward models call the backbone and the scalar head separately (per-token scores for packed rows), so each
        # must be its own FSDP unit: the root's hooks only gather the root's parameters around model(...).
        fully_shard(inner.base_model, **kwargs)
        fully_shard(inner.score, **kwargs)
    fully_shard(model, **kwargs)
    return model


def compile_decoder_layers(model: Any, mode: str | None = None) -> None:
    """``torch.compile`` every decoder block of `model` in place, with torch.compile's `mode`.

    ``nn.Module.compile`` keeps each block's class, name and parameters, so FSDP2, checkpoints and state dicts see the
    same module tree.

    transformers' gradient checkpointing wraps the block's ``__call__`` from outside, so under
    ``model.lm.gradient_checkpointing`` the recomputation in the backward calls the compiled forward again.
    Attention stays eager (`rl_lightning.attention.packed.varlen_attention` is excluded from compilation: its
    packed-row bookkeeping syncs with the host), so each block compiles as two graphs, before and after attention.
    With LoRA the PEFT adapter layers inside each block are compiled with it.
    """
    for layer in decoder_layers(model):
        layer.compile(mode=mode)


def attach_activation_offload(model: Any, strategy: Any) -> None:
    """Attach `ActivationOffload` (the strategy keeps it: ``strategy.activation_offloader``) where it pays.

    Without checkpointing: to every decoder block, so each block's saved tensors go to the host and the block before
    it is prefetched in the backward. With ``model.lm.gradient_checkpointing``: to the decoder stack, outside the
    checkpointed blocks, so what goes to the host is what checkpointing keeps, each block's input (the tensors a
    block saves are recomputed, not saved: the checkpoint's own hooks are the inner ones); each input comes back when
    its block is recomputed. At one hidden vector per token and layer, that is the offload peers pair with
    checkpointing (all of a block's saved tensors move ~10x more bytes: see benchmarks/results/gpu_2026-11-28.md).
    """
    from rl_lightning.models.lora import base_model
    from rl_lightning.parallel.offload import ActivationOffload

    offload = getattr(strategy, "activation_offloader", None) or ActivationOffload()
    strategy.activation_offloader = offload
    inner = base_model(model)
    if getattr(inner, "is_gradient_checkpointing", False):
        offload.attach(inner.base_model)  # the decoder stack (embedding, blocks, final norm)
        return
    for layer in decoder_layers(model):
        offload.attach(layer)


def parallelize_for(module: Any, model: Any, trainable: bool = True) -> Any:
    """Shard `model` if `module` runs under `ParallelStrategy`, else return it unchanged.

    Checks what the model and task must support for the configured sizes (head counts for TP, ``rl_varlen`` attention
    for CP).
    """
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from rl_lightning.parallel.strategy import ParallelStrategy

    trainer = module_trainer(module)
    strategy = trainer.strategy if trainer is not None else None
    if strategy is not None and not isinstance(strategy, (ParallelStrategy, DDPStrategy, SingleDeviceStrategy)):
        # e.g. Lightning's ModelParallelStrategy (nothing would shard or synchronise the model) or FSDP1 (flat
        # parameters the global-norm clipping would treat as full copies).
        raise ConfigError(
            f"trainer.strategy {type(strategy).__name__} is not supported; use rl_lightning.parallel.ParallelStrategy "
            "(FSDP2 x context x tensor parallel), ddp, or a single device"
        )
    if model is None or not isinstance(strategy, ParallelStrategy):
        return model
    attn = attention_implementation(model.config)
    if strategy.cp_size > 1 and attn != "rl_varlen":
        raise ConfigError(
            f"strategy.context_parallel_size={strategy.cp_size} needs model.lm.attn_implementation: rl_varlen (ring "
            f"attention over packed sequences), got '{attn}'"
        )
    checkpointing = bool(getattr(getattr(module, "lm", None), "gradient_checkpointing", False))
    return parallelize(model, strategy, trainable, checkpointing)
