"""Attention kernels: the log-sum-exp merge is exact, the fp32 block kernels equal masked softmax attention and its
autograd gradients (GQA, causal and unmasked, q and k lengths that differ), and the dispatch never picks a CUDA kernel
for a CPU tensor while CUDA fp16/bf16 picks torch's flash kernels when they exist. The flash calls themselves cannot
run without a GPU; on meta tensors they run torch's shape functions for the aten ops, which checks our argument lists
and the shapes the ring loop relies on (`benchmarks/gpu/attention.py` checks their numbers on a GPU)."""

import pytest
import torch
from conftest import assert_close
from torch._subclasses.fake_tensor import FakeTensorMode

import rl_lightning.attention.kernels as kernels
import rl_lightning.attention.packed as attention
from rl_lightning.attention.kernels import block_backend, block_backward, block_forward, merge_partials
from rl_lightning.attention.packed import packed_backend
from rl_lightning.attention.ring import ring_attention_emulated, zigzag_layout

H, HKV, D = 4, 2, 8


def _reference(q, k, v, cu_q, cu_k, causal):
    """Masked softmax attention with autograd: q (n_q, H, D), k/v (n_k, H_kv, D) -> out (n_q, H, D), lse (H, n_q)."""
    seq_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), cu_q[1:] - cu_q[:-1])
    seq_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), cu_k[1:] - cu_k[:-1])
    # causal aligns each sequence's last query with its last key
    pos_q = torch.arange(len(seq_q)) - cu_q[seq_q] + (cu_k[1:] - cu_k[:-1])[seq_q] - (cu_q[1:] - cu_q[:-1])[seq_q]
    pos_k = torch.arange(len(seq_k)) - cu_k[seq_k]
    visible = seq_q[:, None] == seq_k[None, :]
    if causal:
        visible &= pos_k[None, :] <= pos_q[:, None]
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * D**-0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1))
    return out, scores.logsumexp(-1)


CASES = {  # (query lengths, key lengths, causal): one block of each kind a ring step makes, length-1 sequences
    "causal": ([5, 1, 12], [5, 1, 12], True),
    "all-queries-early-keys": ([10, 2, 8], [5, 1, 4], False),
    "late-queries-all-keys": ([5, 1, 4], [10, 2, 8], False),
}


@pytest.mark.parametrize("tile", [1024, 3], ids=["one-tile", "tiles-of-3"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_block_kernels_equal_masked_attention_and_its_gradients(case, tile, monkeypatch):
    monkeypatch.setattr(kernels, "_TILE", tile)
    lengths_q, lengths_k, causal = CASES[case]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()]) for n in (lengths_q, lengths_k))
    torch.manual_seed(0)
    q = torch.randn(sum(lengths_q), H, D, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), HKV, D, requires_grad=True) for _ in range(2))
    out_ref, lse_ref = _reference(q, k, v, cu_q, cu_k, causal)
    dout = torch.randn_like(out_ref)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k), causal, D**-0.5)
    # inside bf16 autocast, as in a bf16-mixed training step: the fp32 kernels must stay fp32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = block_forward(q, k, v, *args)
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, *args)
    for actual, expected in [(out, out_ref), (lse, lse_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)]:
        assert actual.dtype == torch.float32
        assert_close(actual, expected.detach(), atol=1e-5)


def test_merging_two_halves_of_the_keys_equals_attention_over_all_keys():
    """Closed form: softmax over A + B = exp(lse_A - lse) softmax_A + exp(lse_B - lse) softmax_B, lse = log(e^lse_A
    + e^lse_B). Scores are scaled up so the two halves' lse differ by a lot (the merge must not overflow)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(6, H, D) * 4, torch.randn(10, HKV, D) * 4, torch.randn(10, HKV, D)
    one = torch.tensor([0, 6])
    full = block_forward(q, k, v, one, torch.tensor([0, 10]), 6, 10, False, D**-0.5)
    first = block_forward(q, k[:3], v[:3], one, torch.tensor([0, 3]), 6, 3, False, D**-0.5)
    second = block_forward(q, k[3:], v[3:], one, torch.tensor([0, 7]), 6, 7, False, D**-0.5)
    assert (first[1] - second[1]).abs().max() > 5  # the halves' weights differ by more than e^5 somewhere
    out, lse = merge_partials(*first, *second)
    out_ref, lse_ref = _reference(q, k, v, one, torch.tensor([0, 10]), False)  # softmax over all 10 keys
    for actual in (out, full[0]):
        assert_close(actual, out_ref, atol=1e-5)
    assert_close(lse, lse_ref, atol=1e-5)
    out_swapped, _ = merge_partials(*second, *first)  # order-free
    assert_close(out_swapped, out, atol=1e-6)


def _fake_cuda(dtype, head_dim=D):
    with FakeTensorMode():
        return torch.empty(3, H, head_dim, device="cuda", dtype=dtype)


@pytest.mark.parametrize("available", [True, False])
def test_cpu_tensors_never_pick_cuda_kernels(available, monkeypatch):
    monkeypatch.setattr(kernels, "flash_varlen_available", lambda device: available)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        query = torch.zeros(3, H, D, dtype=dtype)
        assert packed_backend(query) == "sdpa"
        assert block_backend(query) == "math"


def test_cuda_half_picks_torch_flash_kernels_when_available(monkeypatch):
    monkeypatch.setattr(kernels, "flash_varlen_available", lambda device: True)
    for dtype in (torch.bfloat16, torch.float16):
        assert packed_backend(_fake_cuda(dtype)) == "varlen_attn"
        assert block_backend(_fake_cuda(dtype)) == "flash"
    assert packed_backend(_fake_cuda(torch.bfloat16), dropout=0.1) == "sdpa"  # varlen_attn has no dropout
    assert (packed_backend(_fake_cuda(torch.float32)), block_backend(_fake_cuda(torch.float32))) == ("sdpa", "math")
    assert block_backend(_fake_cuda(torch.bfloat16, head_dim=12)) == "math"  # flash needs head_dim % 8 == 0
    monkeypatch.setattr(kernels, "flash_varlen_available", lambda device: False)
    assert (packed_backend(_fake_cuda(torch.bfloat16)), block_backend(_fake_cuda(torch.bfloat16))) == ("sdpa", "math")


def test_flash_availability_follows_the_torch_build():
    if not torch.backends.cuda.is_flash_attention_available():  # a CPU build: no CUDA kernel, without raising
        assert not kernels.flash_varlen_available(torch.device("cuda"))


def test_flash_calls_fit_the_aten_op_schemas_on_meta_tensors(monkeypatch):
    """The emulated ring with every block on the aten flash ops, forward and backward, and rl_varlen's packed
    varlen_attn call: shapes and dtypes from torch's meta functions for those ops (no numbers: no GPU here)."""
    calls = []
    for name in ("_flash_forward", "_flash_backward"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    monkeypatch.setattr(kernels, "uses_flash_kernels", lambda query: True)
    cp, lengths = 2, [13, 1, 30]
    layout = zigzag_layout(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), 0, cp)
    n = int(layout.local_cu_seqlens[-1])
    q = torch.empty(cp, n, H, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(cp, n, HKV, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = ring_attention_emulated(q, k, v, layout.local_cu_seqlens)
    out.sum().backward()
    assert (out.shape, out.dtype) == (q.shape, torch.bfloat16)
    assert [(t.grad.shape, t.grad.dtype) for t in (q, k, v)] == [(t.shape, torch.bfloat16) for t in (q, k, v)]
    assert calls.count("_flash_forward") == calls.count("_flash_backward") == cp * cp
    packed = attention.packed_varlen_attn(q[:1].transpose(1, 2), k[:1].transpose(1, 2), v[:1].transpose(1, 2),
                                          [0, 20, 21, n], None)
    assert (packed.shape, packed.dtype) == ((1, n, H, 64), torch.bfloat16)
