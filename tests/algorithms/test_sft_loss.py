"""SFT loss and token log-probabilities (also through a model forward) against hand-computed values and a reference
implementation."""

import math
import types

import torch
from conftest import assert_close

from rl_lightning.algorithms import sft_loss, token_logprobs
from rl_lightning.algorithms.policy import entropy_from_logits
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.models.logprobs import model_inputs, target_logprobs


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


def test_target_logprobs_runs_the_head_only_at_targets():
    """One forward on the micro-batch's model inputs (packed: no attention mask) asking for logits at the target
    positions only; the (B, T) log-probabilities of the next-token targets at the temperature and their entropy
    equal those from the full logits there, 0 elsewhere. The entropy is differentiable only when asked."""
    torch.manual_seed(0)
    micro_batch = pack([TokenizedExample([3, 1, 4], [0, 1, 1]), TokenizedExample([1, 5], [0, 1])], pad_token_id=0)
    full, calls = torch.randn(1, 5, 7, requires_grad=True), []

    def model(logits_to_keep, **inputs):
        calls.append((inputs, logits_to_keep))
        return types.SimpleNamespace(logits=full[:, logits_to_keep])

    logprobs, entropy = target_logprobs(model, micro_batch, temperature=0.7, entropy="value")
    inputs, keep = calls[0]
    assert len(calls) == 1 and inputs.keys() == model_inputs(micro_batch).keys() and "attention_mask" not in inputs
    assert torch.equal(inputs["input_ids"], micro_batch["input_ids"])
    targets = micro_batch["target_mask"][0] > 0
    assert keep.tolist() == targets.nonzero().flatten().tolist() and len(keep) < 5  # the head skips non-targets
    expected = token_logprobs(full, micro_batch["target_ids"], temperature=0.7)
    assert_close(logprobs[0, targets], expected[0, targets])
    assert_close(entropy[0, targets], entropy_from_logits(full)[0, targets])
    assert not logprobs[0, ~targets].any() and not entropy[0, ~targets].any()
    assert_close(logprobs[0, 0], torch.log_softmax(full[0, 0] / 0.7, -1)[1])  # token 3 predicts 1
    assert logprobs.requires_grad and not entropy.requires_grad
    assert target_logprobs(model, micro_batch, entropy="grad")[1].requires_grad
    without_mask = {k: v for k, v in micro_batch.items() if k != "target_mask"}
    assert target_logprobs(model, without_mask)[1] is None and calls[-1][1].tolist() == [0, 1, 2, 3, 4]


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
