"""Mean reward of a model on held-out prompts: greedy accuracy (and optionally sampled accuracy) before/after RL.

Prompts are tokenised as `rl_lightning.data.PromptDataModule` does (chat template + generation prompt), completions
come from `rl_lightning.engines.hf.HFEngine` stopping at the tokenizer's EOS, and each is scored by the environment's
``reward_fn`` (``rl_lightning/recipes/envs/arithmetic.py``: 1 for the right final number, else 0), exactly as in a rollout.

    python benchmarks/heldout_reward.py rl_lightning/assets/tiny-qwen2-sft          # the warm start
    python benchmarks/heldout_reward.py outputs/grpo/latest/export                                 # after `fit --config grpo`
    python benchmarks/heldout_reward.py outputs/grpo/latest/export --samples 8 --temperature 1.0   # also sampled mean reward

Greedy decoding is deterministic; sampled rewards are seeded (``--seed``), per prompt. Runs on CPU with one thread
by default (``--threads``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from rl_lightning.data.loading import load_rows
from rl_lightning.data.prompts import Prompt, encode_prompt
from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.envs.environment import load_environment
from rl_lightning.models.loading import load_tokenizer
from rl_lightning.rollout.trajectory import rollout

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "rl_lightning" / "assets" / "data" / "easy_test.jsonl"
DEFAULT_ENV = REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"


def load_prompts(path: str | Path, tokenizer, apply_chat_template: bool = True) -> list[Prompt]:
    """Every row of `path` as a `Prompt` (no length filter: held-out rows are all short)."""
    rows = load_rows(str(path))
    return [Prompt(encode_prompt(tokenizer, row["messages"], apply_chat_template), row["messages"], row["answer"],
                   rows.locate(i), i) for i, row in enumerate(rows.rows)]


@torch.no_grad()
def mean_reward(model, tokenizer, prompts: list[Prompt], env_path: str | Path = DEFAULT_ENV, samples: int = 1,
                temperature: float = 0.0, max_new_tokens: int = 24, seed: int = 0) -> float:
    """Mean reward over `prompts` x `samples` completions (`temperature` 0: greedy, one completion per prompt)."""
    env = load_environment(str(env_path))
    engine = HFEngine(model, tokenizer.pad_token_id)
    params = SamplingParams(n=1 if temperature == 0 else samples, temperature=temperature,
                            max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id], seed=seed)
    trajectories = rollout(engine, prompts, env, tokenizer, params)
    return sum(t.reward for t in trajectories) / len(trajectories)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="+", help="Hugging Face model folder(s), e.g. outputs/grpo/latest/export")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="held-out prompt rows {messages, answer}")
    parser.add_argument("--env", default=str(DEFAULT_ENV), help="environment file with reward_fn")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--samples", type=int, default=0, help="also report sampled mean reward over N per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled measurement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 by default: on small shared CPUs more threads of a tiny model only "
                        "contend (OpenMP oversubscription, 10-50x slower measured)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    for name in args.model:
        start = time.perf_counter()
        tokenizer = load_tokenizer(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
        prompts = load_prompts(args.data, tokenizer)
        greedy = mean_reward(model, tokenizer, prompts, args.env, 1, 0.0, args.max_new_tokens)
        line = f"{name}: greedy mean reward {greedy:.4f}"
        if args.samples:
            sampled = mean_reward(model, tokenizer, prompts, args.env, args.samples, args.temperature,
                                  args.max_new_tokens, args.seed)
            line += f", sampled (T={args.temperature}, n={args.samples}) {sampled:.4f}"
        print(f"{line}  [{len(prompts)} prompts, {time.perf_counter() - start:.1f}s]", flush=True)


if __name__ == "__main__":
    main()
