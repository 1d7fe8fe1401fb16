"""Real learning on a real model: held-out accuracy of SmolLM2-135M-Instruct before and after GRPO, ours vs TRL.

One run does, on the same model, data, reward and budget:

1. evaluates the starting model on held-out questions of a reasoning-gym task: greedy accuracy, and with ``--samples
   K`` sampled completions per question (T=1, seeded) their mean accuracy and pass@K;
2. trains with rl_lightning (``recipes/real/grpo.yaml``: Dr. GRPO, colocated vLLM engine on CPU, or ``--engine hf``)
   for ``--rollouts`` rollouts of ``--prompts`` prompts x ``--group`` completions, one optimizer step per rollout;
3. trains with TRL's ``GRPOTrainer`` (transformers generate; TRL's vLLM needs CUDA) with the same settings:
   ``loss_type="dapo"`` (token-level mean, as ours) and ``scale_rewards="none"`` (reward minus the group mean: Dr.
   GRPO's advantage), clip 0.2/0.28, no KL, the same learning rate, warmup, max completion length, temperature (0.7)
   and reward (`rl_lightning.rewards.reasoning_gym`, weights ``correct`` 1.0 and ``format`` 0.5, or
   ``--format-weight``; with ``--overlong-cache N`` DAPO's soft overlong punishment too, TRL's own for TRL);
4. evaluates both trained models with the same evaluator, and prints a table: accuracy before/after, wall time of each
   training run (process start to exit, model loading included), and completion tokens per second of training.

The shared setup (flags, fit config, child processes, evaluator) is `benchmarks/grpo_runs.py`. Every measurement runs
in its own process, one after the other, with the same thread count (``--threads``).
The evaluator is ``python -m rl_lightning eval``'s (`rl_lightning.cli.eval`) with ``--engine`` (vLLM by default, or
`HFEngine`); it scores with the rollout's reward code.

    python benchmarks/real_grpo.py                                   # CPU defaults (about an hour on 2 cores)
    python benchmarks/real_grpo.py --rollouts 4 --prompts 4 --skip-trl # a short run
    python benchmarks/real_grpo.py --smoke --workdir /tmp/smoke          # tiny model, seconds (what the tests run)
    python benchmarks/real_grpo.py --out benchmarks/results/real_grpo_cpu.md

Needs the real model (``python -m rl_lightning.assets.build --real``), ``pip install -e ".[real,reasoning,bench]"``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_runs  # noqa: E402 - the setup the real-model benchmarks share
from grpo_runs import evaluate  # noqa: E402

# ------------------------------------------------------------------------------------------------- rl_lightning run


def train_ours(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Train with the CLI (`grpo_runs.fit_config`); wall time, tokens per second and the reward curve."""
    seconds = grpo_runs.fit(args, workdir, grpo_runs.fit_config(args, workdir))
    series = grpo_runs.metric_series(workdir, "train/completion_length", "train/reward", "train/reward/correct")
    rewards, correct = series["train/reward"], series["train/reward/correct"]
    tokens = sum(m.value for m in series["train/completion_length"]) * args.prompts * args.group
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "first_reward": rewards[0].value,
            "curve_correct": [m.value for m in correct],
            "step_s": grpo_runs.median_interval([m.timestamp / 1000 for m in rewards]),
            "last_reward": sum(m.value for m in rewards[-5:]) / min(5, len(rewards)), "export": str(workdir / "export")}


# ---------------------------------------------------------------------------------------------------------- TRL run


def gated(shaping: Any, correct: Any, group: int) -> Any:
    """TRL reward function `shaping`, counted only in groups (`group` consecutive completions, TRL's order) where
    `correct` scores a completion > 0 (`rl_lightning.algorithms.dapo.gated_shaping` with no correctness term)."""
    from rl_lightning.algorithms.dapo import gated_shaping

    def reward(completions: list, **kwargs: Any) -> list[float]:
        values = shaping(completions=completions, **kwargs)
        return gated_shaping(values, correct(completions, **kwargs), group, 0.0)

    reward.__name__ = getattr(shaping, "__name__", "shaping")  # TRL logs a reward under its function's name
    return reward


def train_trl(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """TRL's GRPOTrainer on the same data, reward and budget (runs in its own process)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_lightning.data.loading import load_rows
    from rl_lightning.models.loading import load_tokenizer
    from rl_lightning.rewards.reasoning_gym import score

    torch.set_num_threads(args.threads)
    rows = load_rows(grpo_runs.data_spec(args)).rows
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": json.dumps(r["answer"])} for r in rows])

    def correct(completions, answer, **_):
        return [score(c[0]["content"], json.loads(a))["correct"] for c, a in zip(completions, answer, strict=True)]

    def format(completions, answer, **_):  # noqa: A001 - TRL logs the reward under the function's name
        return [score(c[0]["content"], json.loads(a))["format"] for c, a in zip(completions, answer, strict=True)]

    completion_tokens, reward_log, correct_log, lr_log, times = [], [], [], [], []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                completion_tokens.append(logs["completions/mean_length"] * args.prompts * args.group)
                reward_log.append(logs.get("reward", float("nan")))
                correct_log.append(logs.get("rewards/correct/mean", float("nan")))
                lr_log.append(logs.get("learning_rate", float("nan")))
                times.append(time.time())

    weights = grpo_runs.train_weights(args)
    functions: list[Any] = [correct, format]
    if args.overlong_cache:  # DAPO's soft overlong punishment, TRL's own implementation (the same eq. 13 as ours)
        from trl.rewards import get_soft_overlong_punishment

        functions.append(get_soft_overlong_punishment(args.max_new_tokens, args.overlong_cache))
    if args.gate_shaping:  # each shaping function counts only in groups with a correct completion, as ours
        functions = [correct, *(gated(f, correct, args.group) for f in functions[1:])]
    path = grpo_runs.base_model(args)
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, seed=args.seed, max_steps=args.rollouts,
        learning_rate=args.lr, max_grad_norm=1.0,  # the optimizer and its schedule: below
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="none", num_iterations=1,
        reward_weights=[*weights.values(), *([1.0] if args.overlong_cache else [])], logging_steps=1, save_strategy="no",
        report_to=[], dataloader_num_workers=0, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # Our learning-rate schedule, step for step: transformers' warmup starts at 0 (its first update would not move
    # the weights), ours at lr / warmup_steps (`rl_lightning.models.optim.lr_factor`).
    from rl_lightning.models.optim import lr_factor

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.warmup, args.rollouts, "constant", 0.0))
    trainer = GRPOTrainer(model=model, reward_funcs=functions, args=config, train_dataset=dataset,
                          processing_class=load_tokenizer(path), callbacks=[Record()], optimizers=(optimizer, schedule))
    trainer.train()
    trainer.save_model(str(workdir / "export"))
    load_tokenizer(path).save_pretrained(str(workdir / "export"))
    return {"tokens": sum(completion_tokens), "step_s": grpo_runs.median_interval(times), "curve_correct": correct_log, "lr": lr_log,
            "first_reward": reward_log[0] if reward_log else float("nan"),
            "last_reward": sum(reward_log[-5:]) / max(1, min(5, len(reward_log))), "export": str(workdir / "export")}


def run_ours(args: argparse.Namespace, child: Any = None) -> dict:
    """Train with rl_lightning in ``workdir/ours`` and evaluate the export: the row with its ``train`` details."""
    ours = train_ours(args, args.workdir / "ours")
    print(f"ours trained: {ours}", flush=True)
    return {**(child or _child)("eval", ours["export"], args, args.workdir / "ours"), "train": ours}


def run_trl(args: argparse.Namespace, child: Any) -> dict:
    """Train with TRL in ``workdir/trl`` (a `child` process of the calling script) and evaluate the export."""
    trl = child("trl", str(args.workdir / "trl"), args, args.workdir / "trl")
    trl["tokens_per_s"] = trl["tokens"] / trl["seconds"]
    return {**child("eval", trl["export"], args, args.workdir / "trl"), "train": trl}


# ------------------------------------------------------------------------------------------------------------- main


def _child(mode: str, target: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Run `mode` (eval/trl) in a fresh process and return its JSON result."""
    return grpo_runs.child(__file__, mode, target, args, workdir)


def _parser() -> argparse.ArgumentParser:
    """This benchmark's flags: `grpo_runs.parser`'s (sanity.py and curriculum.py start from them too)."""
    return grpo_runs.parser(__doc__.splitlines()[0])


def main() -> None:
    args = grpo_runs.parse(_parser())
    if args._eval:
        print(json.dumps(evaluate(args._eval, args)))
        return
    if args._trl:
        print(json.dumps(train_trl(args, Path(args._trl))))
        return
    for sub in ("base", "ours", "trl"):
        (args.workdir / sub).mkdir(parents=True, exist_ok=True)
    base = grpo_runs.base_model(args)
    # The starting model's evaluation depends only on the evaluation settings: kept and reused across runs.
    key = f"{Path(args.model).name}-{args.task}-{args.test_size}-{args.samples}-{args.max_new_tokens}-{args.engine}"
    cached = args.workdir / "base" / f"before-{key.replace('/', '_')}.json"
    if not cached.is_file():
        cached.write_text(json.dumps(_child("eval", base, args, args.workdir / "base")))
    rows = {"before": json.loads(cached.read_text())}
    print(f"before: {rows['before']}", flush=True)
    # Each library's run (training + evaluation) is kept with its settings: a stopped sweep restarts at the next one.
    rows["rl_lightning"] = grpo_runs.kept(args, args.workdir / "ours" / "result.json", lambda: run_ours(args))
    print(f"ours after: {rows['rl_lightning']}", flush=True)
    if not args.skip_trl:
        rows["TRL"] = grpo_runs.kept(args, args.workdir / "trl" / "result.json", lambda: run_trl(args, _child))
        print(f"trl after: {rows['TRL']}", flush=True)
    table = _table(rows, args)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))


def _table(rows: dict, args: argparse.Namespace) -> str:
    k = args.samples
    head = (f"Task `{args.task}`, {args.test_size} held-out questions; {args.rollouts} rollouts x {args.prompts} "
            f"prompts x {args.group} completions (<= {args.max_new_tokens} tokens, T={args.temperature}), lr {args.lr}, "
            f"{args.threads} threads, evaluator engine {args.engine}.\n\n")
    lines = [f"| model | greedy acc | format | sampled acc (T=1) | pass@{k} | train reward first -> last5 | "
             "train wall s | s/rollout (median) | completion tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        train = r.get("train", {})
        reward = f"{train['first_reward']:.3f} -> {train['last_reward']:.3f}" if train else ""
        speed = (f"{train['seconds']:.0f}", f"{train['step_s']:.1f}", f"{train['tokens_per_s']:.1f}") if train else ("",) * 3
        lines.append(f"| {name} | {r['greedy']:.3f} | {r['greedy_format']:.3f} | {r.get('sampled', float('nan')):.3f} "
                     f"| {r.get('pass_at_k', float('nan')):.3f} | {reward} | {' | '.join(speed)} |")
    if "TRL" in rows:
        ours, trl = rows["rl_lightning"]["train"], rows["TRL"]["train"]
        lines.append(f"\nTRL / rl_lightning: training wall time {trl['seconds'] / ours['seconds']:.2f}x, s/rollout "
                     f"{trl['step_s'] / ours['step_s']:.2f}x; "
                     f"greedy accuracy gain: rl_lightning {rows['rl_lightning']['greedy'] - rows['before']['greedy']:+.3f}, "
                     f"TRL {rows['TRL']['greedy'] - rows['before']['greedy']:+.3f}")
    return head + "\n".join(lines)


if __name__ == "__main__":
    main()
