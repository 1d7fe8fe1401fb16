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
