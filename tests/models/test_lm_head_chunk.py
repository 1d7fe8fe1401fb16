"""`target_logprobs` with a chunked output head (``model.lm.lm_head_chunk``) on the tiny model (tied embeddings, fp32):
the same log-probs, entropies and parameter gradients as the full-logits path, plain and with LoRA (adapters on the
decoder, on the head itself, the head in ``modules_to_save``), packed and padded micro-batches, the LoRA reference;
no head tensor larger than one (chunk, V) chunk in the forward or the backward; and its errors."""

import pytest
import torch
from conftest import TINY_MODEL, assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from rl_lightning.data.steps import pack, pad
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import ConfigError
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import check_lm_head_chunk, output_head, target_logprobs
from rl_lightning.models.lora import AdaptersDisabled, LoRAConfig, apply_lora

VOCAB, HIDDEN = 320, 128
PARAMETER_SHAPES = {(VOCAB, HIDDEN), (HIDDEN, VOCAB)}  # the head weight, its transpose and its gradient


def _sequences(lengths=(37, 20, 51), seed=0):
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for n in lengths:
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        prompt = n // 3  # the first third is prompt: no targets
        sequences.append(TokenizedExample(ids, [0] * prompt + [1] * (n - prompt)))
    return sequences


def _model(lora=None):
    torch.manual_seed(0)
    model = load_causal_lm(str(TINY_MODEL))
    if lora is not None:
        model = apply_lora(model, lora)
        with torch.no_grad():  # adapters away from their zero start, so they change the outputs and get gradients
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.05)
    return model


def _run(model, micro_batch, chunk_size, entropy="grad", temperature=0.7):
    """Log-probs, entropies and the gradients of a loss with per-token weights, by parameter name."""
    model.zero_grad(set_to_none=True)
    logprobs, entropies = target_logprobs(model, micro_batch, temperature, entropy, chunk_size)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(logprobs.shape, generator=gen) / logprobs.numel()
    loss = (weights * logprobs).sum() + (0.0 if entropy != "grad" else (weights.flip(-1) * entropies).sum())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), None if entropies is None else entropies.detach(), grads


LORAS = {"full": None, "lora": LoRAConfig(r=4, alpha=8.0),
         "lora-on-head": LoRAConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "lm_head")),
         "head-saved": LoRAConfig(r=4, alpha=8.0, modules_to_save=("lm_head",))}


@pytest.mark.parametrize("lora", LORAS.values(), ids=LORAS.keys())
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_chunked_head_equals_full_logits(lora, layout):
    model = _model(lora)
    micro_batch = (pack if layout == "packed" else pad)(_sequences(), pad_token_id=257)
    full = _run(model, micro_batch, None)
    for chunk_size in (7, 16, 4096):  # does not divide the targets, divides nothing, larger than all of them
        chunked = _run(model, micro_batch, chunk_size)
        assert_close(chunked[0], full[0])
        assert_close(chunked[1], full[1])
        assert chunked[2].keys() == full[2].keys() and len(full[2]) > 0
        for name, grad in full[2].items():
            assert grad.abs().sum() > 0, name
            assert_close(chunked[2][name], grad)
    targets = micro_batch["target_mask"] > 0
    assert (full[0][targets] < 0).all() and not full[0][:, ~targets.any(0)].any()  # 0 where no row has a target
    assert output_head(model)[2] is (model.get_output_embeddings() if lora is None else
                                     model.get_base_model().get_output_embeddings())  # swapped back


def test_the_tied_weight_gets_the_head_gradient_too():
    """The tiny model ties its head to the embedding: the chunked head's weight gradient lands on that one tensor
    (untied, with a frozen head copy, the embedding gets less, and the same as the full path's)."""
    model = _model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    micro_batch = pack(_sequences(), 257)
    tied = _run(model, micro_batch, 8, entropy=None)[2]["model.embed_tokens.weight"]
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    embedding_only = _run(model, micro_batch, 8, entropy=None)[2]["model.embed_tokens.weight"]
    assert_close(embedding_only, _run(model, micro_batch, None, entropy=None)[2]["model.embed_tokens.weight"])
    assert (tied - embedding_only).abs().max() > 1e-4


@pytest.mark.parametrize("entropy", [None, "value"])
def test_the_lora_reference_and_no_grad_passes(entropy):
    model = _model(LORAS["lora"])
    reference = AdaptersDisabled(model)
    micro_batch = pack(_sequences(), 257)
    with torch.no_grad():
        full = target_logprobs(reference, micro_batch, 1.3, entropy)
        chunked = target_logprobs(reference, micro_batch, 1.3, entropy, chunk_size=9)
        policy = target_logprobs(model, micro_batch, 1.3, entropy, chunk_size=9)
    assert_close(chunked[0], full[0])
    assert (chunked[1] is None) == (entropy is None)
    if entropy:
        assert_close(chunked[1], full[1])
    assert (policy[0] - chunked[0]).abs().max() > 1e-3  # the reference really ran without the adapters


class _HeadTensors(TorchDispatchMode):
    """The largest output (in elements) of any aten op with a vocabulary-sized dimension, parameter shapes aside."""

    def __init__(self):
        super().__init__()
        self.largest, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and VOCAB in t.shape and tuple(t.shape) not in PARAMETER_SHAPES:
                if t.numel() > self.largest:
                    self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


@pytest.mark.parametrize("lora", [None, LORAS["lora"], LORAS["lora-on-head"]],
                         ids=["fused", "fused-frozen-head", "module-calls"])
def test_no_head_tensor_larger_than_a_chunk(lora):
    """Forward and backward (the loss, entropy gradient included): with chunks of 16 positions nothing with a
    vocabulary dimension is larger than (16, V); the full path makes (1, N, V) for the N = 221 target positions."""
    model = _model(lora)
    micro_batch = pack(_sequences((100, 90, 80, 60)), 257)
    targets = int((micro_batch["target_mask"] > 0).sum())
    for chunk_size, bound in ((16, 16 * VOCAB), (None, targets * VOCAB)):
        with _HeadTensors() as seen:
            logprobs, entropies = target_logprobs(model, micro_batch, 0.7, "grad", chunk_size)
            (logprobs.sum() + entropies.sum()).backward()
        assert seen.largest == bound, (chunk_size, seen.shape)
    assert targets == 67 + 60 + 54 + 40  # each sequence's first third is prompt


def test_a_forward_that_changes_the_head_output_is_refused():
    model = _model()
    model.register_forward_hook(lambda module, args, out: out.__class__(logits=out.logits * 2.0))  # soft-capping-like
    with pytest.raises(ConfigError, match=r"^model.lm.lm_head_chunk=8: .* set model.lm.lm_head_chunk: null$"):
        target_logprobs(model, pack(_sequences(), 257), chunk_size=8)
    assert type(model.lm_head) is torch.nn.Linear  # put back


@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_bad_chunk_sizes_are_one_line(value):
    with pytest.raises(ConfigError) as info:
        check_lm_head_chunk(value)
    assert str(info.value) == (f"model.lm.lm_head_chunk must be a number of positions >= 1 or null, got {value!r}; use "
                               "e.g. 1024 (the default), or null for the full-logits path")
    check_lm_head_chunk(None)
    check_lm_head_chunk(1)


def test_bf16_autocast_recomputes_in_bf16():
    """Under bf16 autocast (``bf16-mixed``) the chunk logits are bf16 like the full path's, in the forward and the
    recomputing backward: log-probs and entropies agree to fp32 rounding."""
    model = _model()
    micro_batch = pack(_sequences(), 257)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full, chunked = _run(model, micro_batch, None), _run(model, micro_batch, 7)
    assert_close(chunked[0], full[0])
    assert_close(chunked[1], full[1])
    for name, grad in full[2].items():
        assert chunked[2][name].dtype == grad.dtype == torch.float32
        # both round the (tokens, V) logit gradient to bf16 before the head's matmuls (2^-8 relative), in chunks here
        assert_close(chunked[2][name], grad, atol=1e-2 * float(grad.abs().max()))
