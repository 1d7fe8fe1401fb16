"""Zigzag ring attention on 2 and 4 gloo ranks equals full causal attention on packed uneven sequences, forward and
backward; shard + gather round-trips a packed micro-batch."""

import pytest
import torch
import torch.nn.functional as F
from helpers import run_on_cpu_ranks

from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.parallel.ring_attention import gather_tokens, shard_micro_batch, zigzag_layout

LENGTHS = [13, 1, 30, 7, 22]  # uneven, one of length 1, none a multiple of 2 * cp
H, HKV, D = 4, 2, 8


def _full_attention(q, k, v, cu):
    """Reference: causal attention within each sequence of a packed row; q (1, H, N, D)."""
    out = []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                  enable_gqa=True))
    return torch.cat(out, dim=2).transpose(1, 2)  # (1, N, H, D)


def _ring_worker(rank, world_size, out_path):
    import torch.distributed as dist

    from rl_lightning.parallel.ring_attention import ring_attention

    dist.init_process_group("gloo")
    torch.manual_seed(0)  # same tensors on every rank
    n = sum(LENGTHS)
    q, k, v = torch.randn(1, H, n, D), torch.randn(1, HKV, n, D), torch.randn(1, HKV, n, D)
    weight = torch.randn(1, n, H, D)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    reference = _full_attention(q_ref, k_ref, v_ref, cu.tolist())
    (reference * weight).sum().backward()

    layout = zigzag_layout(cu, rank, world_size, dist.group.WORLD)
    padded_index = layout.source.clamp(min=0)
    real = layout.source >= 0

    def local(t, dim):  # this rank's zigzag share of a (padded) row
        padded = t.index_select(dim, padded_index) * real.view([-1 if i == dim else 1 for i in range(t.dim())])
        return padded.index_select(dim, layout.local_index).detach()

    q_loc, k_loc, v_loc = (local(t, 2).requires_grad_() for t in (q, k, v))
    out = ring_attention(q_loc, k_loc, v_loc, layout)
    (out * local(weight, 1)).sum().backward()
    mask = local(real.float().view(1, -1), 1)[0].bool()  # local tokens that are not padding
    max_diff = max(
        (out[0, mask] - local(reference.detach(), 1)[0, mask]).abs().max().item(),
        (q_loc.grad[0, :, mask] - local(q_ref.grad, 2)[0, :, mask]).abs().max().item(),
        (k_loc.grad[0, :, mask] - local(k_ref.grad, 2)[0, :, mask]).abs().max().item(),
        (v_loc.grad[0, :, mask] - local(v_ref.grad, 2)[0, :, mask]).abs().max().item(),
    )
    gathered = gather_tokens(out, layout)
    gather_diff = (gathered - reference.detach()).abs().max().item()
    torch.save({"max_diff": max_diff, "gather_diff": gather_diff}, f"{out_path}.{rank}")


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_attention_forward_and_backward(cp, tmp_path):
    run_on_cpu_ranks(_ring_worker, cp, cp, tmp_path / "ring")
    for rank in range(cp):
        result = torch.load(f"{tmp_path / 'ring'}.{rank}")
        assert result["max_diff"] < 1e-5, (rank, result)
        assert result["gather_diff"] < 1e-5, (rank, result)


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
