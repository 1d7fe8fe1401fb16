"""Prompt data for RL: generation-prompt tokenisation, dropped overlong prompts, disjoint per-rank rollout batches;
per-token values ride along at the predicting position."""

import json

import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL

from rl_lightning.data.prompts import PromptBatches, PromptDataModule, encode_prompt
from rl_lightning.data.steps import pack, pad
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import DataError


def test_prompts_end_with_the_generation_prompt(tokenizer):
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4)
    data.setup("fit")
    first = data.prompts["train"][0]
    assert tokenizer.decode(first.prompt_ids).endswith("<|im_start|>assistant\n")
    assert first.prompt_ids == encode_prompt(tokenizer, first.messages, True)
    assert data.stats == {"data/train_rows": 1000, "data/train_dropped": 0}


def test_overlong_prompts_are_dropped_and_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"messages": [{"role": "user", "content": "x" * n}], "answer": "1"} for n in (5, 50, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = PromptDataModule(str(path), tokenizer_name=str(TINY_MODEL), max_prompt_length=30, batch_size=1)
    data.setup("fit")
    assert data.stats["data/train_dropped"] == 1 and len(data.prompts["train"]) == 2
    strict = PromptDataModule(str(path), tokenizer_name=str(TINY_MODEL), max_prompt_length=3, batch_size=1)
    with pytest.raises(DataError, match="every prompt is longer than data.max_prompt_length=3"):
        strict.setup("fit")


def test_rollout_batches_split_the_global_batch_across_ranks():
    prompts = list(range(20))
    ranks = [list(PromptBatches(prompts, 3, r, 2, shuffle=True)) for r in range(2)]
    assert [len(r) for r in ranks] == [3, 3]  # 20 // (3 x 2)
    for step in range(3):
        together = ranks[0][step] + ranks[1][step]
        assert len(set(together)) == 6
    assert len({p for r in ranks for step in r for p in step}) == 18


def test_validation_batches_keep_the_last_partial_batch():
    """Held-out scoring covers every prompt once: 20 prompts, 3 per rank x 2 ranks -> 3 full batches + 2 left."""
    ranks = [list(PromptBatches(list(range(20)), 3, r, 2, shuffle=False, keep_last=True)) for r in range(2)]
    assert [len(r) for r in ranks] == [4, 4]  # every rank runs the same number of validation steps
    assert ranks[0][-1] == [18, 19] and ranks[1][-1] == []
    assert sorted(p for r in ranks for step in r for p in step) == list(range(20))


def test_per_token_values_shift_to_the_predicting_position():
    """Engine logprob of token i is stored at position i - 1 (which predicts token i), like target_ids."""
    sequence = TokenizedExample([5, 6, 7, 8], [0, 0, 1, 1], values={"engine_logprobs": [0, 0, -0.5, -0.25]})
    other = TokenizedExample([9, 10], [0, 1], values={"engine_logprobs": [0, -1.0]})
    for batch in (pack([sequence, other], 0), pad([sequence, other], 0)):
        values = batch["target_engine_logprobs"].flatten()[batch["target_mask"].flatten() > 0]
        assert values.tolist() == [-0.5, -0.25, -1.0]
        assert batch["target_engine_logprobs"].dtype == torch.float32
