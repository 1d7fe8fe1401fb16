"""Real learning on a real model: held-out accuracy of SmolLM2-135M-Instruct before and after GRPO, ours vs TRL.

One run does, on the same model, data, reward and budget:

1. evaluates the starting model on held-out questions of a reasoning-gym task: greedy accuracy, and with ``--samples
   K`` sampled completions per question (T=1, seeded) their mean accuracy and pass@K;
2. trains with rl_lightning (``recipes/real/grpo.yaml``: Dr. GRPO, colocated vLLM engine on CPU, or ``--engine hf``)
   for ``--rollouts`` rollouts of ``--prompts`` prompts x ``--group`` completions, one optimizer step per rollout;
3. trains with TRL's ``GRPOTrainer`` (transformers generate; TRL's vLLM needs CUDA) with the same settings:
   ``loss_type="dapo"`` (token-level mean, as ours) and ``scale_rewards="none"`` (reward minus the group mean: Dr.
   GRPO's advantage), clip 0.2/0.28, no KL, the same learning rate, warmup, max completion length, temperature (0.7)
   and reward (`rl_lightning.rewards.reasoning_gym`, weights ``correct`` 1.0 and ``format`` 0.5);
4. evaluates both trained models with the same evaluator, and prints a table: accuracy before/after, wall time of each
   training run (process start to exit, model loading included), and completion tokens per second of training.

Every measurement runs in its own process, one after the other, with the same thread count (``--threads``).
The evaluator is ``python -m rl_lightning eval``'s (`rl_lightning.cli.eval`) with ``--engine`` (vLLM by default, or
`HFEngine`); it scores with the rollout's reward code.

    python benchmarks/real_grpo.py                                   # CPU defaults (about an hour on 2 cores)
    python benchmarks/real_grpo.py --rollouts 4 --prompts 4 --skip-trl # a smoke run
    python benchmarks/real_grpo.py --out benchmarks/results/real_grpo_cpu.md

Needs the real model (``python -m rl_lightning.assets.build --real``), ``pip install -e ".[real,reasoning,bench]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASK = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2"
WEIGHTS = {"correct": 1.0, "format": 0.5}


def _spec(args: argparse.Namespace, split: str = "train") -> str:
    """The data path of `split`; a caller (benchmarks/sanity.py) may set ``args.train_data`` / ``args.eval_data``."""
    given = getattr(args, "eval_data" if split == "test" else "train_data", None)
    return given or f"{args.task}&train_size={args.train_size}&test_size={args.test_size}&split={split}"


# ------------------------------------------------------------------------------------------------------- evaluation


def evaluate(model_dir: str, args: argparse.Namespace) -> dict[str, float]:
    """Held-out accuracy of `model_dir` with `rl_lightning.cli.eval` (runs in its own process: vLLM owns its process).

    ``greedy``: the share of greedy completions scored correct (``correct`` component 1); ``greedy_format``: the mean
    ``format`` component; ``sampled`` / ``pass_at_k``: the same over ``--samples`` completions per question at T=1
    (seeded), and the unbiased pass@K.
    """
    import torch

    from rl_lightning.cli.eval import EvalConfig
    from rl_lightning.cli.eval import evaluate as run_eval

    torch.set_num_threads(args.threads)
    config = EvalConfig(model=model_dir, data=_spec(args, "test"), engine=args.engine, n=args.samples,
                        k=[args.samples] if args.samples else None, temperature=1.0,
                        max_new_tokens=args.max_new_tokens, seed=1234, reward_weights=json.dumps(WEIGHTS),
                        env=str(REPO / "examples" / "envs" / "reasoning_gym_env.py"))
    metrics = run_eval(config).metrics
    result = {"greedy": metrics["greedy/accuracy"], "greedy_format": metrics["greedy/reward/format"]}
    if args.samples:
        result.update(sampled=metrics["sampled/accuracy"], pass_at_k=metrics[f"sampled/pass_at_{args.samples}"])
    return result


# ------------------------------------------------------------------------------------------------- rl_lightning run


def train_ours(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    import yaml

    config = yaml.safe_load((REPO / "recipes" / "real" / "grpo.yaml").read_text())
    config["seed_everything"] = args.seed
    model, data, trainer = config["model"]["init_args"], config["data"]["init_args"], config["trainer"]
    model.update(max_rollouts=args.rollouts, update_per_rollout=1)  # PPO counts its run in rollouts
    model["optim"].update(lr=args.lr, warmup_steps=args.warmup)
    model["rollout"].update(responses_per_prompt=args.group, max_new_tokens=args.max_new_tokens, engine=args.engine,
                            temperature=args.temperature, reward_weights=WEIGHTS,
                            env_path=str(REPO / "examples" / "envs" / "reasoning_gym_env.py"))
    data.update(path=_spec(args), val_path=None, batch_size=args.prompts)
    trainer.update(max_epochs=-1, num_sanity_val_steps=0, enable_checkpointing=False)
    trainer.pop("val_check_interval", None)
    # our own logger and export folder (the recipe's callbacks are dropped; the CLI's defaults stay, the progress bar
    # and checkpoints switched off below)
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {
        "experiment_name": "rl_lightning", "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}"}}
    trainer["callbacks"] = [{"class_path": "rl_lightning.tracking.export.HFExport",
                             "init_args": {"dirpath": str(workdir / "export")}}]
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    start = time.perf_counter()
    _run([sys.executable, "-m", "rl_lightning", "fit", "--config", str(workdir / "config.yaml"),
          "--trainer.enable_progress_bar", "false"], workdir, args)
    seconds = time.perf_counter() - start
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rl_lightning").experiment_id])
    lengths = [m.value for m in client.get_metric_history(run.info.run_id, "train/completion_length")]
    rewards = sorted(client.get_metric_history(run.info.run_id, "train/reward"), key=lambda m: m.step)
    tokens = sum(lengths) * args.prompts * args.group
    correct = sorted(client.get_metric_history(run.info.run_id, "train/reward/correct"), key=lambda m: m.step)
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "first_reward": rewards[0].value,
            "curve_correct": [m.value for m in correct],
            "step_s": _median_interval([m.timestamp / 1000 for m in rewards]),
            "last_reward": sum(m.value for m in rewards[-5:]) / min(5, len(rewards)), "export": str(workdir / "export")}


# ---------------------------------------------------------------------------------------------------------- TRL run


def train_trl(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """TRL's GRPOTrainer on the same data, reward and budget (runs in its own process)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_lightning.assets.real import resolve_model
    from rl_lightning.data.loading import load_rows
    from rl_lightning.models.loading import load_tokenizer
    from rl_lightning.rewards.reasoning_gym import score

    torch.set_num_threads(args.threads)
    rows = load_rows(_spec(args)).rows
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": json.dumps(r["answer"])} for r in rows])

    def correct(completions, answer, **_):
        return [score(c[0]["content"], json.loads(a))["correct"] for c, a in zip(completions, answer, strict=True)]

    def format(completions, answer, **_):  # noqa: A001 - TRL logs the reward under the function's name
        return [score(c[0]["content"], json.loads(a))["format"] for c, a in zip(completions, answer, strict=True)]

    completion_tokens, reward_log, correct_log, times = [], [], [], []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                completion_tokens.append(logs["completions/mean_length"] * args.prompts * args.group)
                reward_log.append(logs.get("reward", float("nan")))
                correct_log.append(logs.get("rewards/correct/mean", float("nan")))
                times.append(time.time())

    path = resolve_model("asset:SmolLM2-135M-Instruct")
    config = GRPOConfig(
        output_dir=str(workdir / "trl"), use_cpu=True, bf16=False, seed=args.seed, max_steps=args.rollouts,
        learning_rate=args.lr, warmup_steps=args.warmup, lr_scheduler_type="constant_with_warmup",
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="none", num_iterations=1,
        reward_weights=[WEIGHTS["correct"], WEIGHTS["format"]], logging_steps=1, save_strategy="no",
        report_to=[], dataloader_num_workers=0, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[correct, format], args=config, train_dataset=dataset,
                          processing_class=load_tokenizer(path), callbacks=[Record()])
    trainer.train()
    trainer.save_model(str(workdir / "export"))
    load_tokenizer(path).save_pretrained(str(workdir / "export"))
    return {"tokens": sum(completion_tokens), "step_s": _median_interval(times), "curve_correct": correct_log,
            "first_reward": reward_log[0] if reward_log else float("nan"),
            "last_reward": sum(reward_log[-5:]) / max(1, min(5, len(reward_log))), "export": str(workdir / "export")}


# ------------------------------------------------------------------------------------------------------------- main


def _median_interval(times: list[float]) -> float:
    """Median seconds between consecutive logged steps: the steady-state time of one rollout + update."""
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return gaps[len(gaps) // 2] if gaps else float("nan")


def _run(command: list[str], cwd: Path, args: argparse.Namespace) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    (cwd / "log.txt").write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:4])} failed; see {cwd / 'log.txt'}:\n{result.stderr[-3000:]}")
    return result.stdout


def _child(mode: str, target: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Run `mode` (eval/trl) in a fresh process and return its JSON result."""
    command = [sys.executable, __file__, f"--_{mode}", target, *sys.argv[1:]]
    start = time.perf_counter()
    out = _run(command, workdir, args)
    result = json.loads(out.strip().splitlines()[-1])
    result["seconds"] = time.perf_counter() - start
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default=TASK, help="reasoning_gym: data path of the task")
    parser.add_argument("--train-size", type=int, default=1000)
    parser.add_argument("--test-size", type=int, default=100)
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7, help="training rollouts' sampling temperature")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4, help="sampled completions per held-out question (pass@K)")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42, help="training seed of both libraries (the evaluator's is fixed)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rl_lightning_real_grpo"))
    parser.add_argument("--out", type=Path, help="also write the result table (Markdown) here")
    parser.add_argument("--json", type=Path, help="also write every row (accuracies, training curves) as JSON here")
    parser.add_argument("--_eval", help=argparse.SUPPRESS)
    parser.add_argument("--_trl", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args._eval:
        print(json.dumps(evaluate(args._eval, args)))
        return
    if args._trl:
        print(json.dumps(train_trl(args, Path(args._trl))))
        return
    for sub in ("base", "ours", "trl"):
        (args.workdir / sub).mkdir(parents=True, exist_ok=True)
    from rl_lightning.assets.real import resolve_model

    base = resolve_model("asset:SmolLM2-135M-Instruct")
    # The starting model's evaluation depends only on the evaluation settings: kept and reused across runs.
    cached = args.workdir / "base" / f"before-{args.task}-{args.test_size}-{args.samples}-{args.engine}.json".replace("/", "_")
    if not cached.is_file():
        cached.write_text(json.dumps(_child("eval", base, args, args.workdir / "base")))
    rows = {"before": json.loads(cached.read_text())}
    print(f"before: {rows['before']}", flush=True)
    ours = train_ours(args, args.workdir / "ours")
    print(f"ours trained: {ours}", flush=True)
    rows["rl_lightning"] = {**_child("eval", ours["export"], args, args.workdir / "ours"), "train": ours}
    print(f"ours after: {rows['rl_lightning']}", flush=True)
    if not args.skip_trl:
        trl = _child("trl", str(args.workdir / "trl"), args, args.workdir / "trl")
        trl["tokens_per_s"] = trl["tokens"] / trl["seconds"]
        rows["TRL"] = {**_child("eval", trl["export"], args, args.workdir / "trl"), "train": trl}
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
