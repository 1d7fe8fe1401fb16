"""The shape of a decoder-only model, from its Hugging Face config alone (no weights): what the memory plan reads.

`model_shape` builds the model on the ``meta`` device (no memory, no weights) to count its parameters exactly
(biases, tied embeddings counted once) and to list one decoder layer's linear layers (LoRA's targets, what tensor
parallelism splits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only model (from its Hugging Face config, see `model_shape`).

    Args:
        hidden: hidden size h.
        intermediate: MLP intermediate size i.
        layers: decoder layers.
        heads: attention heads.
        kv_heads: key-value heads.
        head_dim: size of one head.
        vocab: vocabulary size V.
        params: total parameters (tied weights once).
        embedding: parameters of the input embedding.
        untied_head: parameters of a separate output head (0 when tied to the embedding).
        linears: each decoder layer's linear layers: (name, in features, out features).
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int
    embedding: int = 0
    untied_head: int = 0
    linears: tuple[tuple[str, int, int], ...] = ()

    @property
    def q_dim(self) -> int:
        """Query width: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Key (or value) width: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def linear_params(self) -> int:
        """Weights of every decoder layer's linear layers (what tensor parallelism splits and vLLM-CPU repacks)."""
        return self.layers * sum(fan_in * fan_out for _, fan_in, fan_out in self.linears)



def lora_parameters(model: ModelShape, rank: int, targets: Sequence[str] | str) -> int:
    """LoRA's adapter parameters: r x (in + out) for each targeted linear layer of every decoder layer.

    `targets` are module-name suffixes (PEFT's ``target_modules``) or ``all-linear`` (every decoder linear layer;
    PEFT leaves the output head out).
    """
    chosen = [(i, o) for name, i, o in model.linears if targets == "all-linear" or name in targets]
    return model.layers * sum(rank * (i + o) for i, o in chosen)


def model_shape(config: Any) -> ModelShape:
    """The `ModelShape` of a transformers causal-LM config (built on the meta device: no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    untied = 0 if head is None or head.weight is embedding else head.weight.numel()
    layer = model.base_model.layers[0]
    linears = tuple((name.rpartition(".")[2], module.in_features, module.out_features)
                    for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear))
    heads = config.num_attention_heads
    return ModelShape(
        hidden=config.hidden_size, intermediate=config.intermediate_size, layers=config.num_hidden_layers,
        heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
        params=sum(p.numel() for p in model.parameters()), embedding=embedding.numel(), untied_head=untied,
        linears=linears)


def load_model_shape(name: str) -> ModelShape:
    """The `ModelShape` of a model folder, hub name or ``asset:<name>``: its config only, no weights."""
    from transformers import AutoConfig

    from rl_lightning.assets.real import resolve_model

    return model_shape(AutoConfig.from_pretrained(resolve_model(name)))
