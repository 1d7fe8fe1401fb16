"""`chunked_token_logprobs` against the full-logits path (`token_logprobs`, `entropy_from_logits` on hidden @ W.T + b):
values and gradients (hidden, weight, bias; the entropy's too) for chunk sizes that divide N and do not, temperature
!= 1, with and without a bias, a trained or frozen head; which chunks the backward recomputes; a hand-computed case."""

import math

import pytest
import torch
from conftest import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from rl_lightning.algorithms import token_logprobs
from rl_lightning.algorithms.logprobs import chunked_token_logprobs
from rl_lightning.algorithms.policy import entropy_from_logits

N, H, V = 24, 16, 50


def _inputs(bias, seed=0, dtype=torch.float32, frozen=False):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=dtype) / H**0.5).requires_grad_(not frozen)  # logits of std 1
    b = torch.randn(V, generator=gen, dtype=dtype).requires_grad_(not frozen) if bias else None
    labels = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, b, labels


def _full(hidden, weight, bias, labels, temperature, entropy):
    logits = torch.nn.functional.linear(hidden, weight, bias)  # (N, V)
    logprobs = token_logprobs(logits, labels, temperature)
    if entropy is None:
        return logprobs, None
    return logprobs, entropy_from_logits(logits if entropy == "grad" else logits.detach())


def _grads(fn, inputs, entropy, seed=1):
    """Values and the gradients of a random linear function of them (upstream gradients that differ per token)."""
    hidden, weight, bias, labels = inputs
    logprobs, entropies = fn(hidden, weight, bias, labels)
    gen = torch.Generator().manual_seed(seed)
    loss = (torch.randn(N, generator=gen) * logprobs).sum() / N  # a mean over tokens, as the losses take
    if entropy == "grad":
        loss = loss + (torch.randn(N, generator=gen) * entropies).sum() / N
    params = [p for p in (hidden, weight, bias) if p is not None and p.requires_grad]
    return logprobs, entropies, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 24, 100], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("entropy", [None, "value", "grad"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
def test_chunked_equals_full_values_and_gradients(chunk_size, temperature, bias, entropy, frozen):
    """A frozen head (LoRA, references) takes the other backward: gradients made in the forward, scaled per row."""
    inputs = _inputs(bias, frozen=frozen)
    expected = _grads(lambda *a: _full(*a, temperature, entropy), inputs, entropy)
    actual = _grads(lambda *a: chunked_token_logprobs(*a, temperature, chunk_size, entropy), inputs, entropy)
    assert_close(actual[0], expected[0])
    if entropy is None:
        assert actual[1] is None
    else:
        assert_close(actual[1], expected[1])
        assert actual[1].requires_grad == (entropy == "grad")
    assert len(actual[2]) == len(expected[2]) == (1 if frozen else 3 if bias else 2)
    for got, want in zip(actual[2], expected[2], strict=True):
        assert_close(got, want)


def test_only_the_entropy_carries_a_gradient():
    hidden, weight, bias, labels = _inputs(True)
    _, entropies = chunked_token_logprobs(hidden, weight, bias, labels, 1.0, 7, "grad")
    got = torch.autograd.grad(entropies.mean(), (hidden, weight, bias))
    _, full = _full(hidden, weight, bias, labels, 1.0, "grad")
    want = torch.autograd.grad(full.mean(), (hidden, weight, bias))
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_frozen_weight_gets_no_gradient_and_hidden_does():
    hidden, weight, _, labels = _inputs(False)
    weight = weight.detach()
    logprobs, _ = chunked_token_logprobs(hidden, weight, None, labels, 1.0, 5)
    (grad,) = torch.autograd.grad(logprobs.sum(), hidden)
    full = _full(hidden, weight, None, labels, 1.0, None)[0]
    assert_close(grad, torch.autograd.grad(full.sum(), hidden)[0])
    assert weight.grad is None


def test_hand_computed():
    """One position, identity-like head: logits [0, ln 2, ln 3] -> p = [1/6, 2/6, 3/6]; label 2 -> log 1/2;
    entropy -sum p ln p; d logp / dz = onehot - p = [-1/6, -2/6, 1/2] and dz / dh = W, so grad h = W.T (onehot - p)."""
    weight = torch.tensor([[0.0], [math.log(2)], [math.log(3)]])  # (V=3, H=1)
    hidden = torch.ones(1, 1, requires_grad=True)
    logprobs, entropies = chunked_token_logprobs(hidden, weight, None, torch.tensor([2]), 1.0, 1, "value")
    p = torch.tensor([1 / 6, 2 / 6, 3 / 6])
    assert_close(logprobs, torch.tensor([math.log(0.5)]))
    assert_close(entropies, -(p * p.log()).sum().reshape(1))
    logprobs.sum().backward()
    assert_close(hidden.grad, (weight[:, 0] * (torch.tensor([0.0, 0.0, 1.0]) - p)).sum().reshape(1, 1))


def test_without_grad_and_bad_chunk_size():
    hidden, weight, bias, labels = _inputs(True)
    with torch.no_grad():
        logprobs, _ = chunked_token_logprobs(hidden, weight, bias, labels, 0.5, 7)
    assert not logprobs.requires_grad
    assert_close(logprobs, _full(hidden, weight, bias, labels, 0.5, None)[0].detach())
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        chunked_token_logprobs(hidden, weight, bias, labels, 1.0, 0)


def test_bf16_matches_the_full_path_in_bf16():
    """bf16 hidden and weight: the logits are bf16 like the full path's and upcast; log-probs agree to fp32
    rounding, and gradients to bf16 rounding of the per-chunk weight-gradient sums (chunks are summed in bf16)."""
    inputs = _inputs(False, dtype=torch.bfloat16)
    expected = _grads(lambda *a: _full(*a, 1.0, None), inputs, None)
    actual = _grads(lambda *a: chunked_token_logprobs(*a, 1.0, 7, None), inputs, None)
    assert_close(actual[0], expected[0])
    for got, want in zip(actual[2], expected[2], strict=True):
        assert got.dtype == torch.bfloat16
        # bf16 has 8 bits of mantissa: 2^-8 relative per rounding of the summed weight-gradient chunks
        assert_close(got.float(), want.float(), atol=0.05 * float(want.abs().max()))


class _HeadMatmuls(TorchDispatchMode):
    """Counts matrix products that produce (rows, V) logits."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == V:
            self.count += 1
        return out


@pytest.mark.parametrize(("chunk_size", "chunks"), [(5, 5), (24, 1), (100, 1)])
def test_the_backward_recomputes_every_chunk_but_the_last(chunk_size, chunks):
    """The forward keeps its last chunk's logits, so one chunk (the whole batch here) needs no recomputation; a
    second backward through the kept graph (retain_graph) gives the same gradients."""
    hidden, weight, bias, labels = _inputs(True)
    logprobs, _ = chunked_token_logprobs(hidden, weight, bias, labels, 0.7, chunk_size)
    with _HeadMatmuls() as seen:
        first = torch.autograd.grad(logprobs.sum(), (hidden, weight), retain_graph=True)
    assert seen.count == chunks - 1
    second = torch.autograd.grad(logprobs.sum(), (hidden, weight))
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
