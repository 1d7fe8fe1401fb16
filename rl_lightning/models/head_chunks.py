"""Per-position quantities of the output head's logits, computed chunk by chunk so ``[tokens, vocabulary]`` never exists.

`head_inputs` returns the hidden states a model's output head gets at some positions (the head itself does not run);
`map_head_chunks` runs a function of each chunk's logits (and of per-position extras, e.g. another model's hidden
states) inside the model's forward, under activation checkpointing, so a chunk's (chunk, V) logits are freed after
the forward and recomputed in the backward. `head_weight` is a head's full weight, for logits outside its model's
forward (a sharded head gathered). GKD's JSD uses all three (`rl_lightning.tasks.ppo.distill`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_lightning.models.logprobs import forward_with_head, output_head


class _StandIn(torch.nn.Module):
    """Takes the output head's place during one forward (`forward_with_head`): ``compute(head, hidden)``."""

    def __init__(self, head: torch.nn.Module, compute: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule: the head stays registered where it was
        self.compute = compute
        self.output: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.compute(self.head, hidden)
        self.output = output
        return output


def head_inputs(model: Any, micro_batch: dict[str, Any], keep: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(B, K, H) the hidden states `model`'s output head would get at positions `keep`; the head does not run.

    For the head's chunks (``model.lm.lm_head_chunk``, `chunk_size`: named if the model's logits are not its head's).
    """
    stand_in = _StandIn(output_head(model)[2], lambda head, hidden: hidden)
    return forward_with_head(model, micro_batch, keep, stand_in, chunk_size)


def head_weight(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model`'s output head's whole weight (V, H) and bias, a sharded (DTensor) head gathered.

    For logits computed outside the model's forward, where FSDP2 does not gather the head's parameters.
    """
    head: Any = output_head(model)[2]
    weight, bias = head.weight.detach(), getattr(head, "bias", None)

    def full(tensor: Any) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    return full(weight), None if bias is None else full(bias.detach())


def map_head_chunks(model: Any, micro_batch: dict[str, Any], keep: torch.Tensor,
                    per_chunk: Callable[..., torch.Tensor], extras: list[torch.Tensor], chunk_size: int
                    ) -> torch.Tensor:
    """(B, K) ``per_chunk(logits, *extra_chunks)`` over `keep`'s positions, `chunk_size` positions at a time.

    Runs inside `model`'s forward (its head replaced for that forward, so FSDP2 gathers the head's parameters around
    it); each chunk's ``head(hidden)`` logits (C, V) and `per_chunk` run under non-reentrant activation
    checkpointing, recomputed one chunk at a time in the backward.

    Args:
        model: a causal LM whose forward returns its output head's result as the logits.
        micro_batch: the packed micro-batch.
        keep: (K,) positions the head runs at.
        per_chunk: ``(logits (C, V), *extras (C, ...)) -> (C,)``.
        extras: per-position tensors (B, K, ...) cut into the same chunks.
        chunk_size: positions per chunk.
    """
    from torch.utils.checkpoint import checkpoint

    def compute(head: Any, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B x K, H)
        rows = [extra.reshape(flat.shape[0], *extra.shape[2:]) for extra in extras]

        def piece(h: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
            logits = head(h)  # (C, V)
            if hasattr(logits, "full_tensor"):
                logits = logits.full_tensor()  # a vocabulary-sharded head: the whole chunk's logits on every rank
            return per_chunk(logits, *parts)

        pieces = [checkpoint(piece, flat[s:s + chunk_size], *(r[s:s + chunk_size] for r in rows), use_reentrant=False)
                  if torch.is_grad_enabled() else piece(flat[s:s + chunk_size], *(r[s:s + chunk_size] for r in rows))
                  for s in range(0, flat.shape[0], chunk_size)]
        # (B, K, 1), stacked rather than viewed: FSDP2 warns about a root output that is a view
        return torch.stack([torch.cat(pieces).view(hidden.shape[:-1])], -1)

    return forward_with_head(model, micro_batch, keep, _StandIn(output_head(model)[2], compute), chunk_size)[..., 0]
