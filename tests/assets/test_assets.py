"""The shipped demo assets are what `python -m rl_lightning.assets.build` produces, and they work."""

import hashlib

import torch
from conftest import DEMO_DATA, TINY_MODEL

from rl_lightning.assets.build import build


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_build_is_reproducible_and_matches_shipped_files(tmp_path):
    build(tmp_path / "model", tmp_path / "data")
    assert _digests(tmp_path / "data") == _digests(DEMO_DATA)
    shipped = _digests(TINY_MODEL)
    rebuilt = _digests(tmp_path / "model")
    assert set(rebuilt) == set(shipped)
    for name in rebuilt:
        if name == "model.safetensors":
            continue  # compared by tensor values below (the file header may order metadata differently)
        assert rebuilt[name] == shipped[name], name
    from safetensors.torch import load_file

    ours, theirs = load_file(tmp_path / "model" / "model.safetensors"), load_file(TINY_MODEL / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_tiny_model_shape_suits_vllm_cpu_and_tp2(tokenizer):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(TINY_MODEL)
    assert config.model_type == "qwen2"
    assert config.head_dim >= 32  # vLLM's CPU attention backend rejects smaller heads
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0  # tensor parallel = 2
    assert config.vocab_size >= len(tokenizer)
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


def test_tokenizer_round_trips_and_template_is_chatml(tokenizer):
    text = "What is 12 * -3? Ünïcödé ✓\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_generates(tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    ids = tokenizer("What is", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
    # Reference: greedy decoding by hand with full forward passes.
    expected = ids
    with torch.no_grad():
        for _ in range(5):
            next_id = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_id], dim=1)
    assert torch.equal(out, expected)


def test_warm_start_answers_in_both_styles():
    """The RL demo's warm start (`--warm-start`) learned both answer styles of its sloppy SFT data, so the demo's
    `format` reward has something to fix (rebuilt weights differ across machines in the last bits, so this checks
    behaviour, not bytes)."""
    import json
    import re

    from rl_lightning.data.prompts import encode_prompt
    from rl_lightning.engines.hf import HFEngine
    from rl_lightning.engines.protocol import SamplingParams
    from rl_lightning.models.loading import load_causal_lm, load_tokenizer

    warm = TINY_MODEL.parent / "tiny-qwen2-sft"
    tokenizer, model = load_tokenizer(str(warm)), load_causal_lm(str(warm))
    rows = [json.loads(line) for line in (DEMO_DATA / "easy_test.jsonl").read_text().splitlines()][:40]
    prompts = [encode_prompt(tokenizer, r["messages"], True) for r in rows]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=20, stop_token_ids=[tokenizer.eos_token_id])
    texts = [tokenizer.decode(g[0].token_ids, skip_special_tokens=True).strip()
             for g in HFEngine(model, tokenizer.pad_token_id).generate(prompts, params)]
    bare = sum(bool(re.fullmatch(r"-?\d+", t)) for t in texts) / len(texts)
    verbose = sum(t.startswith("The answer is") for t in texts) / len(texts)
    # measured on the shipped model, greedy, these 40 held-out prompts: bare 0.15, verbose 0.78 (the rest malformed)
    assert bare >= 0.05 and verbose >= 0.3 and bare + verbose >= 0.8, texts
