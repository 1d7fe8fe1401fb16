"""SFT loss and token log-probabilities (also through a model forward) against hand-computed values and a reference
implementation."""

import math
import types

import torch
from conftest import assert_close

from rl_lightning.algorithms import sft_loss, token_logprobs
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.models import model_inputs, target_logprobs


def test_token_logprobs_hand_computed():
    """logits [0, ln 2, ln 3] -> softmax [1/6, 2/6, 3/6]; label 2 -> log(1/2); at temperature 2 the logits halve:
    [0, ln 2 / 2, ln 3 / 2] -> weights [1, sqrt 2, sqrt 3], so p(label 0) = 1 / (1 + sqrt 2 + sqrt 3)."""
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)]]])
    assert_close(token_logprobs(logits, torch.tensor([[2]])), torch.tensor([[math.log(0.5)]]))
    expected = -math.log(1 + math.sqrt(2) + math.sqrt(3))
    assert_close(token_logprobs(logits, torch.tensor([[0]]), temperature=2.0), torch.tensor([[expected]]))


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    reference = torch.log_softmax(logits / 0.7, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(token_logprobs(logits, labels, temperature=0.7), reference, atol=1e-5)


def test_target_logprobs_returns_the_logprobs_and_the_logits_they_came_from():
    """One forward on the micro-batch's model inputs (packed: no attention mask); the (B, T) log-probabilities of
    its next-token targets at the temperature, and the (B, T, V) logits themselves (entropy needs them)."""
    torch.manual_seed(0)
    micro_batch = pack([TokenizedExample([3, 1, 4], [0, 1, 1]), TokenizedExample([1, 5], [0, 1])], pad_token_id=0)
    logits, calls = torch.randn(1, 5, 7), []

    def model(**inputs):
        calls.append(inputs)
        return types.SimpleNamespace(logits=logits)

    logprobs, returned = target_logprobs(model, micro_batch, temperature=0.7)
    assert returned is logits and len(calls) == 1 and "attention_mask" not in calls[0]
    assert calls[0].keys() == model_inputs(micro_batch).keys()
    assert torch.equal(calls[0]["input_ids"], micro_batch["input_ids"])
    assert_close(logprobs, token_logprobs(logits, micro_batch["target_ids"], temperature=0.7))
    assert_close(logprobs[0, 0], torch.log_softmax(logits[0, 0] / 0.7, -1)[1])  # token 3 predicts 1


def test_sft_loss_hand_computed():
    """Targets with probabilities 1/2, 1/4 and 1/8 (one masked out, p = 1/16):
    loss = -(ln 1/2 + ln 1/4 + ln 1/8) / 3 = (1 + 2 + 3) ln 2 / 3 = 2 ln 2 with the per-batch count, and
    6 ln 2 / 12 = ln 2 / 2 with an external normaliser of 12 tokens."""
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 1 / 16], [0.125, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = sft_loss(logprobs, mask, mask.sum())
    assert_close(loss, torch.tensor(2 * math.log(2)))
    assert_close(metrics["nll_sum"], torch.tensor(6 * math.log(2)))
    assert metrics["num_tokens"].item() == 3
    loss, _ = sft_loss(logprobs, mask, 12)
    assert_close(loss, torch.tensor(math.log(2) / 2))


def test_sft_loss_equals_cross_entropy_with_ignore_index():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 13)
    labels = torch.randint(0, 13, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    loss, _ = sft_loss(token_logprobs(logits, labels), mask, mask.sum())
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, 13), labels.masked_fill(mask == 0, -100).reshape(-1))
    assert_close(loss, reference, atol=1e-6)


def test_split_into_micro_batches_gives_the_same_gradient():
    """Summing per-micro-batch losses normalised by the global count == one loss over the whole batch."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (4, 5))
    mask = (torch.rand(4, 5) > 0.3).long()
    whole, _ = sft_loss(token_logprobs(logits, labels), mask, mask.sum())
    (grad_whole,) = torch.autograd.grad(whole, logits)
    total = sum(sft_loss(token_logprobs(logits[i : i + 1], labels[i : i + 1]), mask[i : i + 1], mask.sum())[0]
                for i in range(4))
    (grad_split,) = torch.autograd.grad(total, logits)
    assert_close(grad_split, grad_whole, atol=1e-7)
