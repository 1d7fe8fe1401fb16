"""Zigzag ring attention (P2P ring, log-sum-exp merge) equals full causal attention on packed uneven sequences,
forward and backward: on 2 and 4 gloo ranks, on sub-groups (the P2P peers are global ranks), and emulated in one
process. Each ring step's block call equals attention under the true global-position mask; shard + gather
round-trips a packed micro-batch."""

import pytest
import torch
import torch.nn.functional as F
from helpers import run_on_cpu_ranks

from rl_lightning.attention.ring import (
    gather_tokens,
    ring_attention_emulated,
    shard_micro_batch,
    shard_tokens,
    step_forward,
    step_kind,
    zigzag_blocks,
    zigzag_layout,
)
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample

LENGTHS = [13, 1, 30, 7, 22]  # uneven, one of length 1, none a multiple of 2 * cp
H, HKV, D = 4, 2, 8


def _cu(lengths=LENGTHS):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _full_attention(q, k, v, cu):
    """Reference: causal attention within each sequence of a packed row; q (1, H, N, D) -> (1, N, H, D)."""
    out = []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                  enable_gqa=True))
    return torch.cat(out, dim=2).transpose(1, 2)


def _inputs(seed):
    """Query, key, value (1, heads, N, D), an output weight (1, N, H, D) and the reference output and gradients."""
    torch.manual_seed(seed)
    n = sum(LENGTHS)
    q, k, v = torch.randn(1, H, n, D), torch.randn(1, HKV, n, D), torch.randn(1, HKV, n, D)
    weight = torch.randn(1, n, H, D)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    reference = _full_attention(q_ref, k_ref, v_ref, _cu().tolist())
    (reference * weight).sum().backward()
    return (q, k, v), weight, reference.detach(), (q_ref.grad, k_ref.grad, v_ref.grad)


def _ring_max_diffs(rank, size, group, seed):
    """Max |ring - full| over this rank's real tokens (outputs and dq, dk, dv), and |gather_tokens - full|."""
    from rl_lightning.attention.ring import ring_attention

    (q, k, v), weight, reference, grads = _inputs(seed)
    layout = zigzag_layout(_cu(), rank, size, group)
    q_loc, k_loc, v_loc = (shard_tokens(t, layout, dim=2).requires_grad_() for t in (q, k, v))
    out = ring_attention(q_loc, k_loc, v_loc, layout)
    (out * shard_tokens(weight, layout)).sum().backward()
    real = shard_tokens(torch.ones(1, sum(LENGTHS)), layout)[0].bool()  # local tokens that are not padding
    diffs = [(out[0, real] - shard_tokens(reference, layout)[0, real]).abs().max().item()]
    for local, full in zip((q_loc, k_loc, v_loc), grads, strict=True):
        diffs.append((local.grad[0, :, real] - shard_tokens(full, layout, dim=2)[0, :, real]).abs().max().item())
    return {"max_diff": max(diffs), "gather_diff": (gather_tokens(out, layout) - reference).abs().max().item()}


def _ring_worker(rank, world_size, out_path):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {"world": _ring_max_diffs(rank, world_size, dist.group.WORLD, seed=0)}
    if world_size == 4:  # two cp=2 rings on interleaved sub-groups: group rank != global rank on ranks 1 and 2
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group = groups[rank % 2]
        results["sub_group"] = _ring_max_diffs(dist.get_rank(group), 2, group, seed=1 + rank % 2)
    torch.save(results, f"{out_path}.{rank}")


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_attention_forward_and_backward(cp, tmp_path):
    run_on_cpu_ranks(_ring_worker, cp, cp, tmp_path / "ring")
    for rank in range(cp):
        results = torch.load(f"{tmp_path / 'ring'}.{rank}")
        assert set(results) == ({"world", "sub_group"} if cp == 4 else {"world"})
        for name, result in results.items():
            assert result["max_diff"] < 1e-5, (rank, name, result)
            assert result["gather_diff"] < 1e-5, (rank, name, result)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_emulated_ring_equals_full_attention_forward_and_backward(cp):
    (q, k, v), weight, reference, grads = _inputs(seed=0)
    layouts = [zigzag_layout(_cu(), r, cp) for r in range(cp)]

    def stack(t, dim=1):  # (1, ..., N, ...) -> (cp, n, heads, D): every rank's share, rank r in row r
        shards = torch.cat([shard_tokens(t, layout, dim) for layout in layouts])
        return shards if dim == 1 else shards.transpose(1, 2)

    q_s, k_s, v_s = (stack(t, dim=2).requires_grad_() for t in (q, k, v))
    out = ring_attention_emulated(q_s, k_s, v_s, layouts[0].local_cu_seqlens)
    (out * stack(weight)).sum().backward()
    real = stack(torch.ones(1, sum(LENGTHS))).bool()  # (cp, n)
    torch.testing.assert_close(out[real], stack(reference)[real], atol=1e-5, rtol=0)
    for local, full in zip((q_s, k_s, v_s), grads, strict=True):
        torch.testing.assert_close(local.grad[real], stack(full, dim=2)[real], atol=1e-5, rtol=0)


def _global_positions(layout):
    """(sequence index, position in the padded sequence) of each local row of `layout`."""
    padded = torch.tensor(layout.padded_lengths)
    sequence = torch.repeat_interleave(torch.arange(len(padded)), padded)  # (N',)
    position = torch.cat([torch.arange(n) for n in layout.padded_lengths])
    return sequence[layout.local_index], position[layout.local_index]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_step_is_attention_under_the_global_causal_mask(cp):
    """The zigzag claim: against rank j's block, rank r's visible (query, key) pairs by global position are exactly
    what `step_kind`'s unmasked/causal call covers, and its (out, lse) are the masked attention's."""
    torch.manual_seed(0)
    layouts = [zigzag_layout(_cu(), r, cp) for r in range(cp)]
    n = len(layouts[0].local_index)
    blocks = zigzag_blocks(layouts[0].local_cu_seqlens)
    q, k, v = torch.randn(cp, n, H, D), torch.randn(cp, n, HKV, D), torch.randn(cp, n, HKV, D)
    for r, j in [(r, j) for r in range(cp) for j in range(cp)]:
        (seq_q, pos_q), (seq_k, pos_k) = _global_positions(layouts[r]), _global_positions(layouts[j])
        visible = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])  # (n, n)
        scores = torch.einsum("qhd,khd->hqk", q[r], k[j].repeat_interleave(H // HKV, 1)) * D**-0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = scores.logsumexp(-1)  # (H, n)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[j].repeat_interleave(H // HKV, 1))
        rows, out_step, lse_step = step_forward(q[r], torch.stack([k[j], v[j]]), step_kind(r, j), blocks, D**-0.5)
        rows = torch.arange(n) if rows is None else rows
        assert visible.any(1).nonzero().flatten().tolist() == rows.tolist(), (r, j)  # no visible key elsewhere
        torch.testing.assert_close(out_step, out[rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(lse_step, lse[:, rows], atol=1e-5, rtol=0)


def test_zigzag_layout_covers_each_token_once():
    cu = torch.tensor([0, 13, 14, 44])
    layouts = [zigzag_layout(cu, r, 2) for r in range(2)]
    assert layouts[0].padded_lengths == [16, 4, 32]
    # rank 0 holds chunks 0 and 3 of every sequence, rank 1 chunks 1 and 2
    assert layouts[0].local_index[:8].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layouts[1].local_index[:8].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    both = torch.cat([layout.local_index for layout in layouts]).sort().values
    assert both.tolist() == list(range(52))
    assert layouts[0].local_cu_seqlens.tolist() == [0, 8, 10, 26]
    blocks = zigzag_blocks(layouts[0].local_cu_seqlens)
    assert blocks.early.tolist() == [0, 1, 2, 3, 8, *range(10, 18)]
    assert blocks.late.tolist() == [4, 5, 6, 7, 9, *range(18, 26)]
    assert blocks.chunk_cu.tolist() == [0, 4, 5, 13] and (blocks.max_len, blocks.max_chunk) == (16, 8)


def test_shard_keeps_targets_with_their_tokens():
    sequences = [TokenizedExample(list(range(1, 8)), [0, 0, 1, 1, 1, 1, 1]), TokenizedExample([9, 8, 7], [0, 1, 1])]
    micro_batch = pack(sequences, 0)
    shards = [shard_micro_batch(micro_batch, r, 2, None) for r in range(2)]
    total_targets = sum(int(s["target_mask"].sum()) for s in shards)
    assert total_targets == int(micro_batch["target_mask"].sum()) == 7
    for shard in shards:  # every local target is the token that follows its input token in the original row
        for token, target, is_target in zip(shard["input_ids"][0], shard["target_ids"][0], shard["target_mask"][0],
                                            strict=True):
            if is_target:
                assert target.item() == (token.item() + 1 if token.item() < 8 else token.item() - 1)
