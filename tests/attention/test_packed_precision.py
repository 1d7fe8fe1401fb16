"""``precision: bf16-mixed`` reaches the kernel choice: with fp32 parameters under autocast, transformers' rotary
embedding hands `rl_varlen` fp32 q and k next to a bf16 v; the attention brings all three to the autocast dtype before
choosing a kernel from the query's dtype, on packed rows, padded batches and context-parallel shards alike."""

import pytest
import torch
from conftest import TINY_MODEL, assert_close

import rl_lightning.attention.kernels as kernels
import rl_lightning.attention.packed as attention
import rl_lightning.attention.ring as ring
from rl_lightning.attention.zigzag import shard_micro_batch
from rl_lightning.data.steps import pack, pad
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import model_inputs


def _sequences():
    torch.manual_seed(0)
    return [TokenizedExample(torch.randint(0, 256, (n,)).tolist(), [1] * n) for n in (17, 1, 40, 5, 23)]


def _record(monkeypatch, module, name, seen):
    """Wrap ``module.name(q, k, v, ...)`` to note the dtypes it is given under ``seen[name]``."""
    original = getattr(module, name)

    def recorded(q, k, v, *args, **kwargs):
        seen.setdefault(name, []).append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(module, name, recorded)


BATCHES = {
    "packed": lambda: pack(_sequences(), 0),
    "padded": lambda: pad(_sequences(), 0),
    "context-parallel": lambda: shard_micro_batch(pack(_sequences(), 0), 0, 1, None),
}
KERNELS = {"packed": "packed_sdpa", "padded": "padded_sdpa", "context-parallel": "block_forward"}


@pytest.mark.parametrize("kind", list(BATCHES))
def test_bf16_mixed_brings_q_k_v_to_bf16_before_the_kernel_choice(kind, monkeypatch):
    model = load_causal_lm(str(TINY_MODEL), attn_implementation="rl_varlen")
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # fp32 master weights
    seen = {}
    queries = []  # the query dtypes every kernel choice (torch's flash kernels, ring-flash-attn) looks at
    choose, flash_ring = kernels.uses_flash_kernels, ring._flash_ring_available
    monkeypatch.setattr(kernels, "uses_flash_kernels", lambda q: queries.append(q.dtype) or choose(q))
    monkeypatch.setattr(ring, "_flash_ring_available", lambda q: queries.append(q.dtype) or flash_ring(q))
    for name in ("packed_sdpa", "padded_sdpa"):
        _record(monkeypatch, attention, name, seen)
    _record(monkeypatch, ring, "block_forward", seen)  # each step of the torch ring
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(**model_inputs(BATCHES[kind]())).logits
    assert list(seen) == [KERNELS[kind]]
    assert set(seen[KERNELS[kind]]) == {(torch.bfloat16,) * 3}
    if kind == "padded":  # padded batches choose their kernel by device alone
        assert queries == []
    else:
        assert queries and set(queries) == {torch.bfloat16}
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_autocast_inputs_casts_to_the_autocast_dtype_or_the_promoted_one():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    v = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = kernels.autocast_inputs(q, k, v)
    for actual, original in zip(cast, (q, k, v), strict=True):
        assert actual.dtype == torch.bfloat16 and torch.equal(actual, original.to(torch.bfloat16))
    promoted = kernels.autocast_inputs(q, k, v)  # no autocast: the common dtype, fp32 here
    assert [t.dtype for t in promoted] == [torch.float32] * 3
    assert promoted[0] is q and promoted[1] is k and torch.equal(promoted[2], v.float())
    same = (q, k, k.clone())
    assert all(a is b for a, b in zip(kernels.autocast_inputs(*same), same, strict=True))  # nothing to do
    double = q.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp64 stays fp64, as autocast leaves it
        assert kernels.autocast_inputs(double, k, v)[0] is double


def test_bf16_mixed_packed_rows_still_equal_the_padded_batch():
    model = load_causal_lm(str(TINY_MODEL), attn_implementation="rl_varlen")
    sequences = _sequences()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        packed = model(**model_inputs(pack(sequences, 0))).logits[0].float()  # (N, V)
        batch = pad(sequences, 0)
        padded = model(**model_inputs(batch)).logits.float()
    rows = torch.cat([padded[i, : len(s.input_ids)] for i, s in enumerate(sequences)])
    # bf16 logits (|logit| < 2.1 here) from bf16 attention: per-sequence SDPA and masked SDPA round differently, so
    # equal to one bf16 step at 2 (2**-6 = 1.6e-2) only; measured 3.9e-3.
    assert_close(packed, rows, atol=1.6e-2)
