"""Build the demo assets: a tiny Qwen2-architecture model, its byte-level tokenizer and synthetic datasets.

Everything here is deterministic (fixed seeds, no network), so ``python -m rl_lightning.assets.build`` rebuilds the
files that ship in ``rl_lightning/assets/`` byte for byte; ``tests/test_assets.py`` checks that.

The model is random-initialised: it exists so that every code path (training, export, vLLM) runs on CPU in seconds,
not to be good at anything. ``head_dim`` is 32 because vLLM's CPU attention backend rejects smaller heads, and the
4 query / 2 key-value heads let tensor parallelism of size 2 split both.

The tokenizer is byte-level BPE with no merges (one token per byte) plus ChatML special tokens, so it needs no
training data and every string round-trips.

Datasets (JSONL, one object per line), all built from arithmetic so rewards are verifiable:
- ``sft.jsonl``: ``{"messages": [...]}`` single- and multi-turn chats with assistant answers.
- ``preference.jsonl``: ``{"messages": [prompt], "chosen": str, "rejected": str}``: the right answer vs. a wrong one,
  half of the wrong ones also hedged and verbose.
- ``arithmetic.jsonl`` / ``arithmetic_test.jsonl``: ``{"messages": [prompt], "answer": str}`` for RL.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
MODEL_DIR = ASSETS_DIR / "tiny-qwen2"
DATA_DIR = ASSETS_DIR / "data"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<answer>", "</answer>"]

# ChatML as Qwen2 renders it, without a `{% generation %}` block on purpose: rl_lightning computes assistant masks
# by rendering prefixes, so it must work with the templates most models ship.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SYSTEM_PROMPT = "You are a careful calculator. Answer with the number only."


def build_tokenizer(out_dir: Path) -> None:
    """Write a byte-level tokenizer (256 byte tokens + ChatML specials) with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )
    hf_tok.save_pretrained(out_dir)


def build_model(out_dir: Path, vocab_size: int, eos_token_id: int, pad_token_id: int, seed: int = 0) -> None:
    """Write a random-initialised 2-layer Qwen2 model (~0.4M parameters, fp32 safetensors)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)


def _question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", str(value)


def _prompt(rng: random.Random, question: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
    return messages + [{"role": "user", "content": question}]


def sft_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        question, answer = _question(rng)
        messages = _prompt(rng, question) + [{"role": "assistant", "content": answer}]
        if rng.random() < 0.3:  # a second turn, so multi-turn masking is exercised by the demo too
            question, answer = _question(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows


def preference_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        question, answer = _question(rng)
        wrong = str(int(answer) + rng.choice([-10, -2, -1, 1, 2, 10]))
        # Half the rejected answers are only numerically wrong (hard to tell apart without arithmetic), half are
        # also hedged and verbose against the system prompt (a style signal a tiny model picks up in a few steps).
        rejected = wrong if rng.random() < 0.5 else f"I think it is {wrong}, but I am not sure."
        rows.append({"messages": _prompt(rng, question), "chosen": answer, "rejected": rejected})
    return rows


def prompt_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        question, answer = _question(rng)
        rows.append({"messages": _prompt(rng, question), "answer": answer})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build_data(out_dir: Path, seed: int = 0) -> None:
    write_jsonl(out_dir / "sft.jsonl", sft_rows(random.Random(seed), 2000))
    write_jsonl(out_dir / "preference.jsonl", preference_rows(random.Random(seed + 1), 1000))
    write_jsonl(out_dir / "arithmetic.jsonl", prompt_rows(random.Random(seed + 2), 1000))
    write_jsonl(out_dir / "arithmetic_test.jsonl", prompt_rows(random.Random(seed + 3), 200))


def build(model_dir: Path = MODEL_DIR, data_dir: Path = DATA_DIR) -> None:
    from transformers import AutoTokenizer

    build_tokenizer(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Round the vocabulary up to a multiple of 64 (as real checkpoints do); extra rows are never produced.
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    build_model(model_dir, vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)
    build_data(data_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args()
    build(args.model_dir, args.data_dir)
    print(f"wrote {args.model_dir} and {args.data_dir}")


if __name__ == "__main__":
    main()
