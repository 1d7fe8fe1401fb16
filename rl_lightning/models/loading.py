"""Loading Hugging Face models and tokenizers (local folders or hub names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rl_lightning.assets.real import resolve_model
from rl_lightning.attention.packed import NAME as VARLEN_ATTENTION
from rl_lightning.attention.packed import register_varlen_attention
from rl_lightning.errors import ConfigError


def check_local_path(name: str) -> None:
    """A `name` written as a path must be an existing folder.

    A path is ``/``, ``./``, ``../``, ``~`` or more than one ``/`` (never a hub id); otherwise transformers would
    report it as a malformed hub id ("Repo id must be in the form").
    """
    looks_local = name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or "\\" in name
    path = Path(name).expanduser()
    if looks_local and not path.is_dir():
        what = "is a file, not a model folder" if path.exists() else "does not exist"
        raise ConfigError(f"model.lm.name '{name}': the local folder {what} (resolved to {path.resolve()}); "
                          "check the path, or give a Hugging Face hub id such as Qwen/Qwen2.5-0.5B-Instruct")


def load_tokenizer(name: str) -> Any:
    """Load a tokenizer (a folder, hub name, ``asset:<name>`` or ``.gguf`` file, see `rl_lightning.assets.real`).

    A missing pad token falls back to EOS (needed for padded batches).
    """
    from transformers import AutoTokenizer

    path = resolve_model(name)
    check_local_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise ConfigError(f"cannot load tokenizer '{name}': {str(e).splitlines()[0]}; check model.lm.name") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_for_training(auto_class: Any, name: str, dtype: torch.dtype | None, attn_implementation: str,
                       gradient_checkpointing: bool, lean_activations: bool = True, **kwargs: Any) -> Any:
    path = resolve_model(name)
    check_local_path(path)
    if attn_implementation == VARLEN_ATTENTION:
        register_varlen_attention()
    try:
        model = auto_class.from_pretrained(
            path, dtype=dtype or torch.get_default_dtype(), attn_implementation=attn_implementation, **kwargs
        )
    except OSError as e:
        raise ConfigError(f"cannot load model '{name}': {str(e).splitlines()[0]}; check model.lm.name") from None
    # Training never reads a KV cache; with one, packed sequences would also attend to each other (reference §4.2).
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lean_activations:  # the same values and gradients, 36% fewer saved activations (rl_lightning.models.lean)
        from rl_lightning.models.lean import apply_lean_activations

        apply_lean_activations(model)
    return model


def load_causal_lm(
    name: str,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "rl_varlen",
    gradient_checkpointing: bool = False,
    lean_activations: bool = True,
) -> Any:
    """Load a causal LM for training.

    Args:
        name: local folder or hub name.
        dtype: parameter dtype; defaults to ``torch.get_default_dtype()``, which Lightning sets from the trainer's
            precision inside ``configure_model`` (``bf16-true`` gives bf16 weights, ``bf16-mixed`` fp32 masters).
        attn_implementation: ``rl_varlen`` (exact per-sequence attention for packed rows, any device; see
            `rl_lightning.attention.packed`) or a transformers name (``sdpa``, ``eager``, ``flash_attention_2``).
        gradient_checkpointing: recompute block activations in the backward pass.
        lean_activations: memory-lean SwiGLU MLPs and RMSNorms (`rl_lightning.models.lean`): bitwise the same
            outputs and gradients, about a third fewer activations saved for the backward pass.
    """
    from transformers import AutoModelForCausalLM

    return _load_for_training(AutoModelForCausalLM, name, dtype, attn_implementation, gradient_checkpointing,
                              lean_activations)


def load_reward_model(
    name: str,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "rl_varlen",
    gradient_checkpointing: bool = False,
    lean_activations: bool = True,
) -> Any:
    """Load a sequence-classification model with one output (a scalar reward head on a causal-LM backbone).

    The arguments are `load_causal_lm`'s.

    Loading a plain causal LM adds a freshly initialised head (transformers logs which weights are new). The pad
    token id is set in the config because transformers pools at the last non-pad token at inference.
    """
    from transformers import AutoModelForSequenceClassification

    model = _load_for_training(AutoModelForSequenceClassification, name, dtype, attn_implementation,
                               gradient_checkpointing, lean_activations, num_labels=1)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(name).pad_token_id
    return model
