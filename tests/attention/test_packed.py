"""`rl_varlen` attention: packed rows equal the sequences run alone (outputs and gradients); padded batches and cached
generation equal stock SDPA."""

import torch
from conftest import TINY_MODEL, assert_close

from rl_lightning.data.steps import pack, pad
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import model_inputs


def _sequences():
    torch.manual_seed(0)
    return [TokenizedExample(torch.randint(0, 256, (n,)).tolist(), [1] * n) for n in (17, 1, 40, 5, 23)]


def test_packed_varlen_equals_each_sequence_alone_with_gradients():
    varlen = load_causal_lm(str(TINY_MODEL), attn_implementation="rl_varlen")
    reference = load_causal_lm(str(TINY_MODEL), attn_implementation="eager")
    sequences = _sequences()
    packed = varlen(**model_inputs(pack(sequences, 0))).logits[0]  # (N, V)
    packed.pow(2).mean().backward()
    alone = torch.cat([reference(input_ids=torch.tensor([s.input_ids]), use_cache=False).logits[0]
                       for s in sequences])
    assert_close(packed, alone, atol=1e-5)
    # Same objective, one sequence at a time: sum of per-sequence squared logits over the same N * V normaliser.
    alone.pow(2).mean().backward()
    for (_, a), (_, b) in zip(varlen.named_parameters(), reference.named_parameters(), strict=True):
        assert_close(a.grad, b.grad, atol=1e-6)


def test_padded_batches_and_generation_match_sdpa():
    varlen = load_causal_lm(str(TINY_MODEL), attn_implementation="rl_varlen").eval()
    sdpa = load_causal_lm(str(TINY_MODEL), attn_implementation="sdpa").eval()
    batch = pad(_sequences(), 0)
    mask = batch["attention_mask"][..., None]
    assert_close(varlen(**model_inputs(batch)).logits * mask, sdpa(**model_inputs(batch)).logits * mask, atol=1e-5)
    prompt = torch.tensor([[258, 84, 82, 68, 81, 198]])
    out_varlen = varlen.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    out_sdpa = sdpa.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(out_varlen, out_sdpa)
