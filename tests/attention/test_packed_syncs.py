"""Host syncs of `rl_varlen` attention: where the packed sequences are is worked out once per forward (at the first
layer, from the position ids) and every later layer reuses it, making no host sync and no host-to-device copy; the
context-parallel ring takes its offsets and longest length from the layout `shard_micro_batch` made (once per
micro-batch), on the flash-attn route as on the torch one. Counted with a `TorchFunctionMode` that records every
tensor-to-host conversion (``item``, ``tolist``, ``int()``, ``nonzero``, ...) and every host-to-device tensor made."""

import copy
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL, assert_close
from torch.overrides import TorchFunctionMode

import rl_lightning.attention.packed as attention
import rl_lightning.attention.ring as ring
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.models.logprobs import model_inputs

LENGTHS = (17, 1, 40, 5, 23)
COUNTED = "rl_varlen_counted"


class HostSyncs(TorchFunctionMode):
    """Records the tensor calls that wait for the device or copy host data to it."""

    TO_HOST = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        moves = name == "to" and ("device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:]))
        if name in self.TO_HOST or func in (torch.tensor, torch.as_tensor) or moves:
            self.calls.append(name)
        return func(*args, **kwargs)


def _batch(lengths=LENGTHS, seed=0):
    torch.manual_seed(seed)
    return pack([TokenizedExample(torch.randint(0, 256, (n,)).tolist(), [1] * n) for n in lengths], 0)


@pytest.fixture
def counted_model():
    """The tiny Qwen2 with 4 layers on `rl_varlen`, each attention call's host syncs recorded as (layer, calls)."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface

    attention.register_varlen_attention()
    records, cache = [], attention.PackedRowCache()

    def counted(module, *args, **kwargs):
        with HostSyncs() as syncs:
            out = attention.varlen_attention(module, *args, row_cache=cache, **kwargs)
        records.append((module.layer_idx, syncs.calls))
        return out

    AttentionInterface.register(COUNTED, counted)
    AttentionMaskInterface.register(COUNTED, attention.varlen_mask)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.num_hidden_layers, config.layer_types = 4, ["full_attention"] * 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=COUNTED)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")  # own config
    reference.load_state_dict(model.state_dict())
    return model, reference, records


def test_only_the_first_layer_of_a_packed_forward_syncs(counted_model):
    model, reference, records = counted_model
    for seed in (0, 1):  # a second batch (new position ids) is worked out afresh at its first layer
        records.clear()
        batch = _batch(seed=seed)
        logits = model(**model_inputs(batch)).logits[0]
        assert [layer for layer, _ in records] == [0, 1, 2, 3]
        assert [calls for _, calls in records[1:]] == [[], [], []]  # no layer after the first syncs
        assert records[0][1] == ["nonzero", "tolist"]  # the forward's two: where the resets are, then to the host
        alone = torch.cat([reference(input_ids=batch["input_ids"][:, s:e], use_cache=False).logits[0]
                           for s, e in zip(batch["cu_seqlens"][:-1].tolist(), batch["cu_seqlens"][1:].tolist(),
                                           strict=True)])
        assert_close(logits, alone, atol=1e-5)  # the reused offsets are the right ones


def test_packed_row_is_the_batch_offsets_and_follows_changes_of_the_position_ids():
    batch = _batch()
    positions, cache = batch["position_ids"], attention.PackedRowCache()
    row = attention.packed_row(positions, layer_idx=0, cache=cache)
    assert row.bounds == tuple(batch["cu_seqlens"].tolist()) == (0, 17, 18, 58, 63, 86)
    assert row.cu_seqlens.dtype == torch.int32 and torch.equal(row.cu_seqlens, batch["cu_seqlens"])
    assert row.max_len == 40
    with HostSyncs() as syncs:
        assert attention.packed_row(positions, layer_idx=1, cache=cache) is row  # a later layer: the same, without a sync
    assert syncs.calls == []
    positions[0, 30] = 0  # changed in place: its version moved, so the next layer recomputes
    assert attention.packed_row(positions, layer_idx=2, cache=cache).bounds == (0, 17, 18, 30, 58, 63, 86)
    copy = positions.clone()  # another tensor with the same values: recomputed, never taken from the cache
    with HostSyncs() as syncs:
        assert attention.packed_row(copy, layer_idx=3, cache=cache).bounds == (0, 17, 18, 30, 58, 63, 86)
    assert syncs.calls == ["nonzero", "tolist"]
    assert attention.packed_row(torch.arange(1, 9)[None], layer_idx=0) is None  # does not start at 0: not packed


def _full_attention(q, k, v, cu):
    """Causal attention within each sequence: q (1, H, N, D) -> (1, N, H, D)."""
    out = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True)
           for s, e in zip(cu[:-1], cu[1:], strict=True)]
    return torch.cat(out, dim=2).transpose(1, 2)


def _sharded_inputs():
    """A one-rank context-parallel shard of a packed row (the ring's layout with it) and random q, k, v for it."""
    micro_batch = ring.shard_micro_batch(_batch(), 0, 1, None)
    layout = micro_batch["cp_layout"]
    n = micro_batch["input_ids"].shape[1]
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, n, 32), torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32)
    return layout, (q, k, v)


def test_the_torch_ring_takes_its_row_sets_from_the_layout(monkeypatch):
    layout, (q, k, v) = _sharded_inputs()
    monkeypatch.setattr(ring, "zigzag_blocks", lambda *a: pytest.fail("row sets rebuilt in a layer"))
    out = ring.ring_attention(q, k, v, layout)
    assert_close(out, _full_attention(q, k, v, layout.local_cu_seqlens.tolist()), atol=1e-5)


def test_the_flash_ring_gets_precomputed_offsets_and_makes_no_host_sync(monkeypatch):
    layout, (q, k, v) = _sharded_inputs()
    seen = {}

    def fake_zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, group):
        seen.update(cu=cu_seqlens, max_seqlen=max_seqlen, causal=causal, group=group, shape=q.shape)
        return torch.zeros_like(q)

    fake = ModuleType("ring_flash_attn")
    fake.zigzag_ring_flash_attn_varlen_func = fake_zigzag_ring_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "ring_flash_attn", fake)
    monkeypatch.setattr(ring, "_flash_ring_available", lambda query: True)
    with HostSyncs() as syncs:
        out = ring.ring_attention(q, k, v, layout)
    assert syncs.calls == []
    assert seen["cu"] is layout.blocks.cu and torch.equal(seen["cu"], layout.local_cu_seqlens)
    assert seen["max_seqlen"] == 40 and type(seen["max_seqlen"]) is int
    assert (seen["causal"], seen["group"], seen["shape"]) == (True, None, (90, 4, 32))  # each sequence padded to a multiple of 2 cp
    assert out.shape == (1, 90, 4, 32)
