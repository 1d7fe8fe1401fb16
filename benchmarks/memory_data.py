"""Synthetic inputs of `benchmarks/memory.py`: long SFT conversations and DPO pairs of a chosen token length, and the
``--quick`` model.

An SFT conversation asks for sums and the assistant lists ``a + b = c`` lines, as many as fit in the token limit with
the model's chat template (rl_lightning's own tokenisation, so the length is the one our data modules see), so most
tokens are loss tokens. A DPO pair: the same prompt, chosen = correct sums, rejected = every 4th sum (the first
included) off by one. Rows are deterministic given their seed.

The ``--quick`` model (`quick_model`) keeps SmolLM2-135M-Instruct's tokenizer and vocabulary (49152, the size that
makes the output head matter) on a 2-layer, hidden-64 Llama with random weights: the logits are as wide as the real
model's, everything else is small, so the chunked head's saving shows in seconds (tiny-qwen2's 320-token vocabulary
hides it: its logits are a few hundred KiB).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import vs_trl


def _sums(seed: int, count: int, wrong_every: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        x, y = rng.randint(10, 999), rng.randint(10, 999)
        lines.append(f"{x} + {y} = {x + y + (wrong_every > 0 and i % wrong_every == 0)}")
    return "\n".join(lines)


def _ask(count: int) -> list[dict]:
    return [{"role": "user", "content": f"Write out {count} sums of two random numbers, one per line."}]


def _longest(length, limit: int) -> int:
    """The largest line count whose tokenised length is <= `limit` (binary search; at least 1)."""
    low, high = 1, 1
    while length(high) <= limit:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if length(mid) <= limit else (low, mid)
    return low


def sft_rows(tokenizer, count: int, tokens: int, seed: int) -> list[dict]:
    """`count` conversations of at most `tokens` tokens (tokens=0: one line each, a warm-up step's rows)."""
    from rl_lightning.data.tokenization import tokenize_messages

    def messages(i: int, lines: int) -> list[dict]:
        return _ask(lines) + [{"role": "assistant", "content": _sums(seed + i, lines)}]

    def length(i: int, lines: int) -> int:
        return len(tokenize_messages(tokenizer, messages(i, lines)).input_ids)

    return [{"messages": messages(i, _longest(lambda k, i=i: length(i, k), tokens) if tokens else 1)}
            for i in range(count)]


def preference_rows(tokenizer, count: int, tokens: int, seed: int) -> list[dict]:
    """`count` pairs whose chosen sequence (prompt + completion) has at most `tokens` tokens."""
    from rl_lightning.data.tokenization import tokenize_messages

    def length(i: int, lines: int) -> int:
        done = [{"role": "assistant", "content": _sums(seed + i, lines, wrong_every=4)}]
        return len(tokenize_messages(tokenizer, _ask(lines) + done).input_ids)

    rows = []
    for i in range(count):
        lines = _longest(lambda k, i=i: length(i, k), tokens)
        rows.append({"messages": _ask(lines), "chosen": _sums(seed + i, lines),
                     "rejected": _sums(seed + i, lines, wrong_every=4)})
    return rows


QUICK_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def quick_model(real: Path, folder: Path) -> Path:
    """`real`'s tokenizer and vocabulary on a `QUICK_SHAPE` model with seeded random fp32 weights, saved in `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(real)
    for key, value in QUICK_SHAPE.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (real / name).exists():
            shutil.copy(real / name, folder / name)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_data(folder: Path, tokenizer, a: argparse.Namespace) -> Path:
    """sft.jsonl, preference.jsonl and easy.jsonl of the main rows (vs_trl reads these names under its DATA)."""
    steps = a.warmup + a.steps
    write_jsonl(folder / "sft.jsonl", sft_rows(tokenizer, steps * a.sft_rows, a.conv_tokens, seed=0))
    write_jsonl(folder / "preference.jsonl", preference_rows(tokenizer, steps * a.dpo_pairs, a.conv_tokens // 2, 1))
    shutil.copy(vs_trl.DATA / "easy.jsonl", folder / "easy.jsonl")
    return folder

