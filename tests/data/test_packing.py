"""Balanced packing: partitions are exact, budgets hold, ranks and micro-batches are balanced on the demo data, a
validation epoch keeps its last partial step, and a packed forward equals the sequences run one by one."""

import random

import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close

from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.data.packing import karmarkar_karp, plan_micro_batches
from rl_lightning.data.steps import StepDataset, layout_stats, pack, pad
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import ConfigError


def test_karmarkar_karp_small_cases():
    """{8, 7, 6, 5, 4} into 2: differencing gives 16 / 14 ({7, 5, 4} / {8, 6}); 3 items into 5 leaves 2 empty."""
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]
    parts = karmarkar_karp([3, 1, 2], 5)
    assert sorted(i for p in parts for i in p) == [0, 1, 2] and sum(not p for p in parts) == 2


@pytest.mark.parametrize("k", [2, 3, 8])
def test_karmarkar_karp_is_an_exact_balanced_partition(k):
    rng = random.Random(k)
    weights = [rng.randint(10, 500) for _ in range(200)]
    parts = karmarkar_karp(weights, k)
    assert sorted(i for p in parts for i in p) == list(range(200))
    sums = [sum(weights[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(weights)  # differencing is at least as good as greedy's bound


def test_plan_respects_budget_and_gives_every_rank_the_same_count():
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(97)]
    plan = plan_micro_batches(lengths, dp_size=3, max_tokens=600)
    assert len({len(rank) for rank in plan}) == 1
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(97))
    assert all(sum(lengths[i] for i in mb) <= 600 for rank in plan for mb in rank)
    with pytest.raises(ConfigError, match="a packing unit has 300 tokens but max_length_per_device is 299"):
        plan_micro_batches([300, 3], 1, 299)


def test_demo_packing_is_dense_and_balanced():
    sft = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL))
    sft.setup("fit")
    fraction, balance = layout_stats(sft.units["train"], 4, 64, True, 1024, 8)
    assert fraction == 1.0 and balance <= 1.05, (fraction, balance)
    padded_fraction, _ = layout_stats(sft.units["train"], 4, 64, False, 1024, 8)
    assert padded_fraction < 0.98  # padding wastes tokens on the same data
    pairs = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL))
    pairs.setup("fit")
    fraction, balance = layout_stats(pairs.units["train"], 2, 32, True, 1024, 4)
    assert fraction == 1.0 and balance <= 1.05, (fraction, balance)


def test_validation_keeps_the_last_partial_step():
    units = [TokenizedExample([1, 2, 3], [0, 1, 1]) for _ in range(7)]
    seen = 0
    for rank in range(2):
        dataset = StepDataset(units, 2, rank, 2, packing=False, max_tokens=64, micro_batch_size=2, pad_token_id=0,
                              shuffle=False, drop_remainder=False)
        assert len(dataset) == 2  # 7 rows, 4 per step
        steps = list(dataset)
        assert [len(s["micro_batches"]) for s in steps] == [1, 1]  # same count on every rank, filler if empty
        seen += sum(int(mb["num_units"]) for s in steps for mb in s["micro_batches"])
    assert seen == 7


def test_pack_and_pad_layouts():
    a, b = TokenizedExample([5, 6, 7], [0, 1, 1]), TokenizedExample([8, 9], [1, 1])
    packed = pack([a, b], pad_token_id=0)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # token t carries its next token as target; a sequence's first token (8) is never a target, even if masked 1
    assert packed["target_ids"].tolist() == [[6, 7, 0, 9, 0]]
    assert packed["target_mask"].tolist() == [[1, 1, 0, 1, 0]]
    assert packed["last_mask"].tolist() == [[0, 0, 1, 0, 1]]
    assert packed["seq_index"].tolist() == [[0, 0, 0, 1, 1]]
    assert packed["cu_seqlens"].tolist() == [0, 3, 5] and packed["num_sequences"].item() == 2
    padded = pad([a, b], pad_token_id=0)
    assert padded["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert padded["seq_index"].tolist() == [[0, 0, 0], [1, 1, -1]]
    assert padded["target_mask"].tolist() == [[1, 1, 0], [1, 0, 0]]
    assert padded["last_mask"].tolist() == [[0, 0, 1], [0, 1, 0]]
    filler = pack([], pad_token_id=0)  # empty micro-batch: one masked pad token keeps collectives matched
    assert filler["input_ids"].tolist() == [[0]] and filler["target_mask"].sum() == 0


def test_packed_forward_equals_sequences_one_by_one():
    from transformers import AutoModelForCausalLM

    from rl_lightning.models.logprobs import model_inputs

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    sequences = [TokenizedExample(torch.randint(0, 256, (n,)).tolist(), [1] * n) for n in (7, 13, 4)]
    packed_logits = model(**model_inputs(pack(sequences, 0))).logits[0]
    start = 0
    for s in sequences:
        alone = model(input_ids=torch.tensor([s.input_ids]), use_cache=False).logits[0]
        assert_close(packed_logits[start : start + len(s.input_ids)], alone, atol=1e-5)
        start += len(s.input_ids)
