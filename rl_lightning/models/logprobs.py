"""The per-token log-probability forward: each target token's log-probability (and entropy) under a model.

A model's forward on a packed micro-batch, then the output head at a temperature, in chunks of positions.

`target_logprobs` is what every task trains and scores with; `ChunkedHead` computes the output head chunk by chunk so
the full ``[tokens, vocabulary]`` logits never exist at once (``model.lm.lm_head_chunk``); `model_inputs` is the
transformers keyword arguments of a micro-batch.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from rl_lightning.compat.torch import has_own_hooks
from rl_lightning.errors import ConfigError


def model_inputs(micro_batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for a transformers forward on a micro-batch.

    Packed micro-batches pass no attention mask (``rl_varlen`` attention isolates the sequences by their position-id
    resets, or runs ring attention given ``cp_layout``).
    """
    inputs = {"input_ids": micro_batch["input_ids"], "position_ids": micro_batch["position_ids"], "use_cache": False}
    if "attention_mask" in micro_batch:
        inputs["attention_mask"] = micro_batch["attention_mask"]
    if "cp_layout" in micro_batch:
        inputs["cp_layout"] = micro_batch["cp_layout"]
    return inputs


def check_lm_head_chunk(value: int | None) -> None:
    """Raise a one-line `ConfigError` unless ``model.lm.lm_head_chunk`` is a positive number of positions or null."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"model.lm.lm_head_chunk must be a number of positions >= 1 or null, got {value!r}; use e.g. "
                          "1024 (the default), or null for the full-logits path")


def target_logprobs(model: Any, micro_batch: dict[str, Any], temperature: float = 1.0,
                    entropy: Literal["value", "grad"] | None = None, chunk_size: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log-probability of each ``target_ids`` token at `temperature`, and with `entropy` the (B, T) entropy.

    The entropy is that of the next-token distribution (at temperature 1; ``value``: detached, ``grad``:
    differentiable); both are 0 at positions where no row has a target.

    The language-model head runs only at those positions (``logits_to_keep`` with the target columns): in RL the
    prompt tokens, and in SFT the masked ones, are often most of a micro-batch, and with a 150k-token vocabulary the
    head's (tokens x vocab) logits cost more time and memory than a decoder block. Without ``target_mask`` every
    position is a target.

    With `chunk_size` the head's logits are never built whole: inside the model's forward the output head is
    replaced by `ChunkedHead`, which turns the (B, K, H) hidden states at the kept positions into log-probabilities
    `chunk_size` positions at a time (`rl_lightning.algorithms.logprobs.chunked_token_logprobs`), so the largest
    head tensor, forward or backward, is (chunk_size, V) instead of (B x K, V). None: the full (B, K, V) logits.
    """
    targets = micro_batch["target_ids"]
    mask = micro_batch.get("target_mask")
    keep = torch.arange(targets.shape[1], device=targets.device) if mask is None else (mask > 0).any(0).nonzero()[:, 0]
    if len(keep) == 0:  # a filler micro-batch: one position, so the backward still reaches every parameter
        keep = keep.new_zeros(1)
    if chunk_size is not None:
        return _chunked_target_logprobs(model, micro_batch, keep, temperature, entropy, chunk_size)
    from rl_lightning.algorithms import token_logprobs
    from rl_lightning.algorithms.policy import entropy_from_logits

    logits = model(**model_inputs(micro_batch), logits_to_keep=keep).logits  # (B, K, V)
    zeros = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    logprobs = zeros.index_copy(1, keep, token_logprobs(logits, targets[:, keep], temperature))
    if entropy is None:
        return logprobs, None
    return logprobs, zeros.index_copy(1, keep, entropy_from_logits(logits if entropy == "grad" else logits.detach()))


def _chunked_target_logprobs(model: Any, micro_batch: dict[str, Any], keep: torch.Tensor, temperature: float,
                             entropy: Literal["value", "grad"] | None, chunk_size: int
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`target_logprobs` with the output head swapped for a `ChunkedHead` during the model's forward."""
    targets = micro_batch["target_ids"]
    chunked = ChunkedHead(output_head(model)[2], targets[:, keep], temperature, chunk_size, entropy)
    out = forward_with_head(model, micro_batch, keep, chunked, chunk_size)  # (B, K, 1 or 2)
    zeros = torch.zeros(targets.shape, dtype=torch.float32, device=out.device)
    logprobs = zeros.index_copy(1, keep, out[..., 0])
    return logprobs, None if entropy is None else zeros.index_copy(1, keep, out[..., 1])


def forward_with_head(model: Any, micro_batch: dict[str, Any], keep: torch.Tensor, stand_in: Any, chunk_size: int
                      ) -> torch.Tensor:
    """`model`'s forward at positions `keep` with `stand_in` in its output head's place: the stand-in's ``output``.

    The stand-in runs inside the forward (under FSDP2 the root's parameters, the head's among them, are gathered
    around it); a model whose forward changes the head's result (soft-capping, scaling) is refused in one line.
    """
    parent, name, head = output_head(model)
    setattr(parent, name, stand_in)
    try:
        out = model(**model_inputs(micro_batch), logits_to_keep=keep).logits
    finally:
        setattr(parent, name, head)
    if stand_in.output is None or out is not stand_in.output:
        raise ConfigError(f"model.lm.lm_head_chunk={chunk_size}: {type(parent).__name__}'s forward does not return its output "
                          "head's result as the logits (e.g. it soft-caps or scales them), which a chunked head cannot "
                          "reproduce; set model.lm.lm_head_chunk: null")
    return out


def output_head(model: Any) -> tuple[torch.nn.Module, str, torch.nn.Module]:
    """(parent module, attribute name, module) of the output embedding (``lm_head``) of `model`.

    Looks through a PEFT wrapper and `rl_lightning.models.lora.AdaptersDisabled`; with LoRA on the head or
    ``modules_to_save: [lm_head]`` the module is PEFT's layer around the head.
    """
    from rl_lightning.models.lora import AdaptersDisabled, base_model

    inner = base_model(model.model if isinstance(model, AdaptersDisabled) else model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    path = next((n for n, m in inner.named_modules(remove_duplicate=False) if m is head and n), None)
    if head is None or path is None:
        raise ConfigError(f"model.lm.lm_head_chunk: {type(inner).__name__} has no output embedding module "
                          "(get_output_embeddings()) to chunk; set model.lm.lm_head_chunk: null")
    parent_path, _, name = path.rpartition(".")
    return inner.get_submodule(parent_path), name, head


class ChunkedHead(torch.nn.Module):
    """Stands in for the output head during one forward: (B, K, H) hidden states to (B, K, 1 or 2) log-probs.

    The model's own forward calls it where it would call the head, so it runs inside that forward: under FSDP2 the
    root's parameters (the head's, tied or not) are gathered around it and its output gets the root's backward
    hooks. A plain ``nn.Linear`` head without hooks (the usual case, tied embeddings included) goes through
    `chunked_token_logprobs` with its weight and bias; any other head (PEFT's LoRA layer or ``modules_to_save``
    copy on the head, a head with tensor-parallel hooks) is called as a module on each chunk under activation
    checkpointing, so its (chunk, V) logits are recomputed in the backward; a DTensor output (a vocabulary-sharded
    head) is gathered per chunk before the log-softmax.

    Args:
        head: the output head module.
        labels: (B, K) target ids at the kept positions.
        temperature: the log-probabilities' temperature.
        chunk_size: positions per chunk.
        entropy: also the entropy (``value`` or ``grad``), or None.
    """

    def __init__(self, head: torch.nn.Module, labels: torch.Tensor, temperature: float, chunk_size: int,
                 entropy: Literal["value", "grad"] | None) -> None:
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule: the head stays registered where it was
        self.labels, self.temperature, self.chunk_size, self.entropy = labels, temperature, chunk_size, entropy
        self.output: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, K, H) hidden states at the kept positions -> (B, K, 2) log-probs and entropies ((B, K, 1) without)."""
        from rl_lightning.algorithms.logprobs import chunked_token_logprobs

        if hidden.shape[:-1] != self.labels.shape:
            raise RuntimeError(f"the output head got hidden states {tuple(hidden.shape)} for targets "
                               f"{tuple(self.labels.shape)}; set model.lm.lm_head_chunk: null for this model")
        flat, labels = hidden.reshape(-1, hidden.shape[-1]), self.labels.reshape(-1)
        head: Any = self.head
        plain = type(head) is torch.nn.Linear and not has_own_hooks(head) and not _is_dtensor(head.weight)
        if plain:
            logprobs, entropy = chunked_token_logprobs(flat, head.weight, head.bias, labels, self.temperature,
                                                       self.chunk_size, self.entropy)
        else:
            logprobs, entropy = _module_chunks(head, flat, labels, self.temperature, self.chunk_size, self.entropy)
        columns = [logprobs] if entropy is None else [logprobs, entropy]
        # stacked from (B, K) views, not viewed after stacking: FSDP2 warns about a root output that is a view
        self.output = torch.stack([c.view(self.labels.shape) for c in columns], -1)
        return self.output


def _is_dtensor(tensor: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _module_chunks(head: Any, hidden: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int,
                   entropy: Literal["value", "grad"] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N,) log-probs (and entropies) of `head` called on `chunk_size` rows of (N, H) `hidden` at a time.

    Each chunk runs under non-reentrant activation checkpointing: its (chunk, V) logits are freed after the forward
    and recomputed, one chunk at a time, in the backward.
    """
    from torch.utils.checkpoint import checkpoint

    from rl_lightning.algorithms import token_logprobs
    from rl_lightning.algorithms.policy import entropy_from_logits

    def piece(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(h)  # (C, V)
        if _is_dtensor(logits):
            logits = logits.full_tensor()  # a vocabulary-sharded head: the whole chunk's logits on every rank
        if logits.shape[-1] != getattr(head, "out_features", logits.shape[-1]):
            raise RuntimeError(f"the output head returned {logits.shape[-1]} logits per position for a vocabulary of "
                               f"{head.out_features} (a local shard of a tensor-parallel head?); return a DTensor "
                               "(use_local_output=False) or set model.lm.lm_head_chunk: null")
        ent = entropy_from_logits(logits if entropy == "grad" else logits.detach()) if entropy else y.new_zeros(0)
        return token_logprobs(logits, y, temperature), ent

    pieces = [checkpoint(piece, hidden[s:s + chunk_size], labels[s:s + chunk_size], use_reentrant=False)
              if torch.is_grad_enabled() else piece(hidden[s:s + chunk_size], labels[s:s + chunk_size])
              for s in range(0, hidden.shape[0], chunk_size)]
    logprobs = torch.cat([p[0] for p in pieces])
    return logprobs, torch.cat([p[1] for p in pieces]) if entropy else None
