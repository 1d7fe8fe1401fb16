"""`rl_lightning.models.head_chunks` and GKD's chunked JSD (`rl_lightning.tasks.ppo.distill.chunked_jsd`): the JSD
computed `chunk_size` positions at a time equals the one from both models' full logits, in value and in every student
gradient, for chunks of 1 position, an uneven split and the whole row; `head_inputs` is what the head gets."""

import pytest
import torch
from conftest import TINY_MODEL

from rl_lightning.algorithms.distill import generalized_jsd
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.models.head_chunks import head_inputs, head_weight
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import model_inputs
from rl_lightning.tasks.ppo.distill import chunked_jsd


@pytest.fixture(scope="module")
def models():
    student = load_causal_lm(str(TINY_MODEL))
    teacher = load_causal_lm(str(TINY_MODEL)).requires_grad_(False)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    gen = torch.Generator().manual_seed(0)
    batch = pack([TokenizedExample(torch.randint(0, 300, (n,), generator=gen).tolist(), [0] * 3 + [1] * (n - 3))
                  for n in (13, 9, 17)], pad_token_id=0)
    keep = (batch["target_mask"] > 0).any(0).nonzero()[:, 0]
    return student, teacher, batch, keep


def _full(student, teacher, batch, keep, beta, temperature):
    logits = student(**model_inputs(batch), logits_to_keep=keep).logits
    with torch.no_grad():
        teacher_logits = teacher(**model_inputs(batch), logits_to_keep=keep).logits
    return generalized_jsd(logits, teacher_logits, beta, temperature)


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_the_chunked_jsd_equals_the_full_one_in_value_and_gradients(models, chunk_size):
    student, teacher, batch, keep = models
    weights = torch.rand(1, len(keep), generator=torch.Generator().manual_seed(2))
    results = []
    for chunked in (False, True):
        student.zero_grad(set_to_none=True)
        per_token = (chunked_jsd(student, teacher, batch, keep, 0.3, 0.7, chunk_size) if chunked
                     else _full(student, teacher, batch, keep, 0.3, 0.7))
        (per_token * weights).sum().backward()
        results.append((per_token.detach(), {n: p.grad.clone() for n, p in student.named_parameters()}))
    (full, full_grads), (chunks, chunk_grads) = results
    assert full.shape == chunks.shape == (1, len(keep)) and full.min() > 0
    # the same products in other GEMM shapes (row chunks): float32 rounding, not formula, differences
    torch.testing.assert_close(chunks, full, rtol=1e-5, atol=1e-7)
    for name, grad in full_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(chunk_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_head_inputs_are_what_the_head_turns_into_the_logits(models):
    student, _, batch, keep = models
    with torch.no_grad():
        hidden = head_inputs(student, batch, keep, 4)  # (1, K, H)
        logits = student(**model_inputs(batch), logits_to_keep=keep).logits
        weight, bias = head_weight(student)
    assert hidden.shape == (1, len(keep), student.config.hidden_size) and bias is None
    torch.testing.assert_close(torch.nn.functional.linear(hidden, weight), logits, rtol=0, atol=0)
