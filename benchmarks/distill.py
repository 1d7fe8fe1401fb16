"""On-policy distillation on CPU: the student's held-out reverse KL to the teacher, and its accuracy, before and after.

Trains ``recipes/distill.yaml`` (the random-init tiny model taught by the SFT'd tiny model, same tokenizer) through
the real CLI for ``--rollouts`` rollouts, three ways at the same budget and seed:

- ``reward``: the recipe (the teacher's per-token reverse KL in the advantages, plus the task reward);
- ``loss``: ``model.distill.type loss`` (GKD's JSD_0.5 over the vocabulary added to the policy loss);
- ``control``: no teacher (``model.distill null``): the task reward alone, Dr. GRPO, as the baseline.

Each exported student, the starting student and the teacher are then measured on the held-out prompts
(``easy_test.jsonl``, 100 questions): the exact per-token KL(student || teacher) over the vocabulary at the positions
of the student's own sampled completions (temperature 1, ``--samples`` per prompt, seeded), and the greedy accuracy
(``rl_lightning/recipes/envs/arithmetic.py``'s reward, as `heldout_reward.py` measures it).

    python benchmarks/distill.py --rollouts 60 --out benchmarks/results/distill_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from heldout_reward import DEFAULT_DATA, load_prompts, mean_reward

from rl_lightning.algorithms.distill import masked_token_mean, token_kl
from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.envs.environment import load_environment
from rl_lightning.models.loading import load_tokenizer
from rl_lightning.rollout.trajectory import rollout

REPO = Path(__file__).resolve().parents[1]
STUDENT = REPO / "rl_lightning" / "assets" / "tiny-qwen2"
TEACHER = REPO / "rl_lightning" / "assets" / "tiny-qwen2-sft"
ENV = REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"
ARMS = {"reward": [], "loss": ["--model.distill.type", "loss"], "control": ["--model.distill", "null"]}


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def heldout_reverse_kl(student, teacher, tokenizer, prompts, samples: int, max_new_tokens: int, seed: int) -> float:
    """Mean over the student's sampled completion tokens of the exact KL(student || teacher) of the next token."""
    engine = HFEngine(student, tokenizer.pad_token_id)
    params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=max_new_tokens,
                            stop_token_ids=[tokenizer.eos_token_id], seed=seed)
    kl_sum, tokens = 0.0, 0.0
    for t in rollout(engine, prompts, load_environment(str(ENV)), tokenizer, params):
        ids = torch.tensor([t.input_ids])  # (1, T)
        mask = torch.tensor([t.completion_mask[1:]], dtype=torch.float32)  # (1, T - 1): position i predicts i + 1
        kl = token_kl(student(ids).logits[:, :-1], teacher(ids).logits[:, :-1])  # (1, T - 1)
        kl_sum += float(masked_token_mean(kl, mask, num_tokens=1.0))
        tokens += float(mask.sum())
    return kl_sum / max(tokens, 1.0)


def train(arm: str, rollouts: int, folder: Path) -> tuple[Path, float]:
    """Fit the recipe through the CLI in `folder` (a scratch working directory); the export folder and seconds."""
    for name in ("rl_lightning", "examples"):
        (folder / name).symlink_to(REPO / name)
    command = [sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/distill.yaml",
               "--model.max_rollouts", str(rollouts), "--trainer.limit_val_batches", "0",
               "--trainer.enable_checkpointing", "false", *ARMS[arm]]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=folder, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if result.returncode != 0:
        raise SystemExit(f"{arm} run failed:\n{result.stderr[-3000:]}")
    return folder / "outputs" / "distill" / "latest" / "export", time.perf_counter() - start


def measure(path: Path, teacher, tokenizer, prompts, args: argparse.Namespace) -> tuple[float, float]:
    model = load(path)
    kl = heldout_reverse_kl(model, teacher, tokenizer, prompts, args.samples, args.max_new_tokens, args.seed)
    return kl, mean_reward(model, tokenizer, prompts, str(ENV), max_new_tokens=args.max_new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=60)
    parser.add_argument("--samples", type=int, default=2, help="sampled completions per held-out prompt (KL)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=None, help="held-out prompts used (default: all)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    parser.add_argument("--out", default=None, help="markdown file for the results table")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tokenizer, teacher = load_tokenizer(str(STUDENT)), load(TEACHER)
    prompts = load_prompts(DEFAULT_DATA, tokenizer)[:args.prompts]
    rows = [("teacher (tiny-qwen2-sft)", "-", *measure(TEACHER, teacher, tokenizer, prompts, args))]  # KL 0: a check
    rows.append(("student at start (tiny-qwen2)", "-", *measure(STUDENT, teacher, tokenizer, prompts, args)))
    with tempfile.TemporaryDirectory() as scratch:
        for arm in args.arms:
            folder = Path(scratch) / arm
            folder.mkdir()
            export, seconds = train(arm, args.rollouts, folder)
            rows.append((f"student after {args.rollouts} rollouts, {arm}", f"{seconds:.0f}",
                         *measure(export, teacher, tokenizer, prompts, args)))
    lines = ["| model | fit wall s | held-out KL(student \\|\\| teacher) per token | held-out greedy accuracy |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {seconds} | {kl:.3f} | {accuracy:.2f} |" for name, seconds, kl, accuracy in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    if args.json:
        keys = ("model", "fit_s", "kl", "accuracy")
        Path(args.json).write_text(json.dumps({"rows": [dict(zip(keys, row, strict=True)) for row in rows]}))


if __name__ == "__main__":
    main()
