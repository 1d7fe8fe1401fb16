"""Per-token log-probabilities from logits, or from hidden states and the output head in chunks of positions."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities log p(labels | logits / temperature), computed in fp32.

    Uses ``logit[label] - logsumexp(logits)`` instead of materialising ``log_softmax`` over the vocabulary twice.

    Args:
        logits: (B, T, V) or (N, V) next-token logits.
        labels: (B, T) or (N,) token ids aligned with `logits` (already shifted by the caller).
        temperature: sampling temperature the logprobs should correspond to.

    Returns:
        (B, T) or (N,) fp32 log-probabilities.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    entropy: Literal["value", "grad"] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` (and the entropy) of the linear head ``hidden @ weight.T + bias``, `chunk_size` rows at a time.

    Equal to ``token_logprobs(logits, labels, temperature)`` and ``entropy_from_logits(logits)`` on the full logits
    (up to summation order), with the same fp32 log-softmax, but no (N, V) tensor exists in the forward or the
    backward: the backward recomputes each chunk's logits from `hidden` and `weight` (which it keeps) and the
    forward's log-normalisers (N,), except the last chunk's, which the forward keeps (one (chunk_size, V) tensor
    between the forward and the backward; with a single chunk nothing is recomputed). Peak extra memory is a few
    (chunk_size, V) fp32 tensors.

    The logits are computed in the dtype ``F.linear`` gives them (autocast's under autocast; the backward recomputes
    them in that dtype too) and upcast to fp32, as the full path does. Gradients flow to `hidden`, `weight` and
    `bias` when they require them; the weight's gradient is accumulated over the chunks in the weight's dtype.
    When only `hidden` needs a gradient (a frozen head: LoRA, a reference) the forward also computes each chunk's
    (C, H) gradient per unit of upstream gradient, (onehot - softmax) / T @ weight (and the entropy's), so the
    backward is a row scaling with no recomputation: the head's matmuls are then as many as the full path's.

    Args:
        hidden: (N, H) hidden states of the N positions.
        weight: (V, H) output head (for tied embeddings, the input embedding matrix).
        bias: (V,) head bias, or None.
        labels: (N,) token ids whose log-probabilities are wanted.
        temperature: the log-probabilities are those of ``logits / temperature``.
        chunk_size: positions per chunk (>= 1).
        entropy: also return the entropy of the next-token distribution at temperature 1 (as `entropy_from_logits`
            does): ``value`` (detached) or ``grad`` (differentiable); None: no entropy.

    Returns:
        (N,) fp32 log-probabilities, and (N,) fp32 entropies or None.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logprobs, entropies = _ChunkedHead.apply(hidden, weight, bias, labels, float(temperature), int(chunk_size),
                                             entropy, torch.is_grad_enabled())
    return logprobs, entropies if entropy is not None else None


def _chunk_forward(logits: torch.Tensor, labels: torch.Tensor, temperature: float, entropy: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(C,) log-probs and log-normaliser at `temperature`; with `entropy`, (C,) entropy and log-normaliser at 1."""
    z = logits.float()  # (C, V)
    scaled = z / temperature if temperature != 1.0 else z
    lse = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logprobs, lse, None, None
    lse1 = lse if temperature == 1.0 else torch.logsumexp(z, dim=-1)
    return logprobs, lse, lse1 - (torch.exp(z - lse1.unsqueeze(-1)) * z).sum(-1), lse1


def _chunk_grad(logits: torch.Tensor, labels: torch.Tensor, temperature: float, lse: torch.Tensor,
                grad_logprobs: torch.Tensor | None, entropy_terms: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """(C, V) fp32 gradient wrt the logits z of a chunk (`logits` is left as it is).

    d logp / dz = (onehot(y) - softmax(z / T)) / T and dH / dz = -p (log p + H) with p = softmax(z).
    `entropy_terms` is (grad of the entropy, entropy, log-normaliser at temperature 1), all (C,).
    """
    z = logits.float()
    entropy_grad = None
    if entropy_terms is not None:
        grad_entropy, entropies, lse1 = (t.unsqueeze(-1) for t in entropy_terms)
        log_p = z - lse1
        entropy_grad = log_p.exp().mul_(log_p.add_(entropies)).mul_(grad_entropy)  # -dH/dz x grad
    if grad_logprobs is None:
        assert entropy_grad is not None  # the backward runs only when one output has a gradient
        return entropy_grad.neg_()
    scale = (grad_logprobs / temperature).unsqueeze(-1)  # (C, 1)
    scaled = (z / temperature).sub_(lse.unsqueeze(-1)) if temperature != 1.0 else z.sub(lse.unsqueeze(-1))
    grad = scaled.exp_().mul_(-scale)
    grad.scatter_add_(-1, labels.unsqueeze(-1), scale)
    return grad if entropy_grad is None else grad.sub_(entropy_grad)


class _ChunkedHead(torch.autograd.Function):
    """`chunked_token_logprobs`: forward and backward chunk by chunk, the logits recomputed in the backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, temperature: float, chunk_size: int, entropy: str | None,
                grad_enabled: bool) -> Any:
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropies = hidden.new_zeros(n if entropy else 0, dtype=torch.float32)
        lse1 = hidden.new_empty(n if entropy else 0, dtype=torch.float32)
        # a frozen head: the hidden states' gradient per unit of upstream gradient, made now (see the docstring)
        frozen = grad_enabled and ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        unit_grads = [hidden.new_empty(n if frozen else 0, hidden.shape[1], dtype=torch.float32),
                      hidden.new_empty(n if frozen and entropy == "grad" else 0, hidden.shape[1], dtype=torch.float32)]
        compute_dtype, logits = hidden.dtype, hidden.new_empty(0)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(hidden[rows], weight, bias)  # (C, V)
            compute_dtype = logits.dtype
            logprobs[rows], lse[rows], chunk_entropy, chunk_lse1 = _chunk_forward(
                logits, labels[rows], temperature, entropy is not None)
            if chunk_entropy is not None and chunk_lse1 is not None:
                entropies[rows], lse1[rows] = chunk_entropy, chunk_lse1
            if frozen:
                _unit_grads(logits, weight, labels[rows], temperature, lse[rows], entropies[rows], lse1[rows],
                            [g[rows] for g in unit_grads if len(g)])
        # the last chunk's logits wait for the backward (trained head only: a frozen one has its gradients already)
        keep = grad_enabled and any(ctx.needs_input_grad[:3]) and not frozen
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropies, lse1, *unit_grads,
                              logits if keep else hidden.new_empty(0))
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype, ctx.frozen = temperature, chunk_size, compute_dtype, frozen
        ctx.set_materialize_grads(False)
        if entropy != "grad":
            ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> Any:
        hidden, weight, bias, labels, lse, entropies, lse1, unit_logprobs, unit_entropy, last = ctx.saved_tensors
        if ctx.frozen:  # d loss / d hidden = sum over outputs of (upstream gradient x unit gradient), row by row
            grad = torch.zeros_like(hidden, dtype=torch.float32)
            if grad_logprobs is not None:
                grad += grad_logprobs.unsqueeze(-1) * unit_logprobs
            if grad_entropy is not None and len(unit_entropy):
                grad += grad_entropy.unsqueeze(-1) * unit_entropy
            return grad.to(hidden.dtype), None, None, None, None, None, None, None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype, temperature = ctx.compute_dtype, ctx.temperature
        w = weight.to(dtype)  # a copy only under autocast (what autocast's own backward multiplies by)
        b = bias.to(dtype) if bias is not None else None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h = hidden[rows].to(dtype)
            entropy_terms = None
            if grad_entropy is not None:
                entropy_terms = (grad_entropy[rows], entropies[rows], lse1[rows])
            logits = last if start + ctx.chunk_size >= hidden.shape[0] and len(last) else F.linear(h, w, b)
            grad = _chunk_grad(logits, labels[rows], temperature, lse[rows],
                               None if grad_logprobs is None else grad_logprobs[rows], entropy_terms)
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            grad = grad.to(dtype)  # (C, V)
            if grad_hidden is not None:
                grad_hidden[rows] = grad @ w
            if grad_weight is not None and grad_weight.dtype == dtype:
                grad_weight.addmm_(grad.T, h)  # (V, H), no temporary
            elif grad_weight is not None:
                grad_weight += grad.T @ h  # autocast: bf16 products summed into the fp32 weight's gradient
        if grad_bias is not None and bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _unit_grads(logits: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                lse: torch.Tensor, entropies: torch.Tensor, lse1: torch.Tensor, out: list[torch.Tensor]) -> None:
    """Write a chunk's (C, H) d logp / d hidden (and d H / d hidden) per unit upstream gradient into `out`."""
    ones, dtype = torch.ones_like(lse), logits.dtype
    w = weight.to(dtype)
    if len(out) == 2:
        out[1].copy_(_chunk_grad(logits, labels, temperature, lse, None, (ones, entropies, lse1)).to(dtype) @ w)
    out[0].copy_(_chunk_grad(logits, labels, temperature, lse, ones, None).to(dtype) @ w)
