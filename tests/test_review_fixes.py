"""Edge cases found in review: unsupported strategies, EOS-as-pad reward pooling, validation remainders, context
parallelism without packing, preference margins and last-turn targets, rows with no predictable token."""

import types

import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close

from rl_lightning.data import SFTDataModule
from rl_lightning.data.loading import Rows
from rl_lightning.data.rows import check_preference_rows
from rl_lightning.data.steps import StepDataset, pack
from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.parallel.parallelize import parallelize_for


def test_unsupported_strategies_are_rejected():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        module = types.SimpleNamespace(_trainer=types.SimpleNamespace(strategy=strategy))
        with pytest.raises(ConfigError, match=f"trainer.strategy {type(strategy).__name__} is not supported; use "
                                              "rl_lightning.parallel.ParallelStrategy"):
            parallelize_for(module, object())


def test_reward_is_read_where_hf_pools_when_eos_pads():
    """A tokenizer that pads with EOS and sequences ending in EOS: transformers pools at the last non-pad token, so
    training must read the reward there too."""
    from transformers import AutoModelForSequenceClassification

    from rl_lightning.models import load_reward_model
    from rl_lightning.tasks.reward import sequence_rewards

    model = load_reward_model(str(TINY_MODEL)).eval()
    eos = model.config.eos_token_id
    model.config.pad_token_id = eos
    sequence = TokenizedExample([258, 84, 82, 19, eos], [0, 0, 1, 1, 1])
    batch = pack([sequence, TokenizedExample([258, 19], [0, 1])], pad_token_id=eos)
    assert batch["last_mask"].tolist() == [[0, 0, 0, 1, 0, 0, 1]]
    hf = AutoModelForSequenceClassification.from_config(model.config)
    hf.load_state_dict(model.state_dict())
    expected = hf.eval()(input_ids=torch.tensor([sequence.input_ids])).logits[0, 0]
    assert_close(sequence_rewards(model, batch)[0], expected, atol=1e-5)


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


def test_context_parallel_needs_packing():
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), packing=False)
    data.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(cp_size=2))
    with pytest.raises(ConfigError, match="strategy.context_parallel_size=2 splits packed sequences; set data.packing"):
        data.setup("fit")


@pytest.mark.parametrize("margin", ["0.5", None, float("nan"), True])
def test_margin_must_be_a_finite_number(margin):
    rows = Rows([{"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b", "margin": margin}],
                "p.jsonl", [1])
    with pytest.raises(DataError, match="p.jsonl line 1: 'margin' must be a finite number"):
        check_preference_rows(rows)


def test_last_turn_only_and_has_targets(tokenizer):
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    all_turns = tokenize_messages(tokenizer, messages)
    last = tokenize_messages(tokenizer, messages, last_turn_only=True)
    assert last.input_ids == all_turns.input_ids
    assert sum(all_turns.loss_mask) == 2 * sum(last.loss_mask)  # "2<|im_end|>\n" and "4<|im_end|>\n", 3 tokens each
    assert tokenizer.decode([i for i, m in zip(last.input_ids, last.loss_mask, strict=True) if m]) == "4<|im_end|>\n"
    assert not TokenizedExample([5, 6], [1, 0]).has_targets and TokenizedExample([5, 6], [0, 1]).has_targets
