"""The difficulty curriculum (``data.curriculum``) on a real model: held-out accuracy with and without it.

SmolLM2-135M-Instruct, GRPO with ``recipes/real/grpo.yaml``'s settings (those of `benchmarks/real_grpo.py`: Dr. GRPO,
colocated vLLM engine on CPU, reward ``correct`` 1.0 + ``format`` 0.5), on a reasoning-gym task the base model solves
less than 20% of the time (``chain_sum`` with three two-digit terms by default). Two training runs with the same seed,
data, rollouts and budget, one plain and one with ``data.curriculum`` (a completion passes at reward >= 1, i.e. a
correct answer; prompts with pass rate 0 or 1 parked, re-admitted after ``--readmit-after`` rollouts). The training
set is small (``--train-size``) so that prompts come back within the run: the curriculum can only skip a prompt it
has seen. Each trained model (and the base) is evaluated on the held-out split with the same evaluator as
real_grpo.py (greedy accuracy, sampled accuracy and pass@K).

The table gives the completion tokens each run generated (the cost), the accuracies, and the curriculum's pools at
the end; both runs take the same number of rollouts of the same size, so their token counts differ only by
completion length.

    python benchmarks/curriculum.py                                  # CPU defaults (about 30 minutes on 2 cores)
    python benchmarks/curriculum.py --rollouts 2 --prompts 2 --train-size 4 --test-size 8 --samples 0   # smoke
    python benchmarks/curriculum.py --out benchmarks/results/curriculum_cpu.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_runs  # noqa: E402 - the setup the real-model benchmarks share

TASK = "reasoning_gym:chain_sum?min_terms=3&max_terms=3&max_digits=2"
POOLS = ("curriculum/active", "curriculum/solved", "curriculum/hopeless", "curriculum/unseen")


def train(args: argparse.Namespace, workdir: Path, curriculum: bool) -> dict:
    """One training run through the CLI (real_grpo.py's settings; `curriculum`: with ``data.curriculum``)."""
    settings = {"solved_threshold": 1.0, "readmit_after": args.readmit_after} if curriculum else None
    seconds = grpo_runs.fit(args, workdir, grpo_runs.fit_config(args, workdir, settings))
    return {"seconds": seconds, "export": str(workdir / "export"), **_history(workdir, args)}


def _history(workdir: Path, args: argparse.Namespace) -> dict:
    """Tokens generated, the per-rollout share of correct completions and the final pool sizes, from MLflow."""
    series = {name: [m.value for m in metrics] for name, metrics in
              grpo_runs.metric_series(workdir, "train/completion_length", "train/reward/correct", *POOLS).items()}
    return {"tokens": sum(series["train/completion_length"]) * args.prompts * args.group,
            "curve_correct": series["train/reward/correct"],
            "pools": {name.split("/")[1]: (series[name] or [float("nan")])[-1] for name in POOLS}}


def _parser() -> argparse.ArgumentParser:
    parser = grpo_runs.parser(__doc__.splitlines()[0])
    parser.set_defaults(task=TASK, train_size=24, test_size=64, rollouts=12, prompts=4, lr=2e-5, threads=1,
                        workdir=Path("/tmp/rl_lightning_curriculum"))
    parser.add_argument("--readmit-after", type=int, default=12, help="rollouts a parked prompt stays parked")
    parser.add_argument("--arms", default="plain,curriculum",
                        help="arms trained now; the others' results are reused from --workdir (same settings)")
    return parser


def main() -> None:
    args = grpo_runs.parse(_parser())
    if args._eval:
        print(json.dumps(grpo_runs.evaluate(args._eval, args)))
        return
    (args.workdir / "base").mkdir(parents=True, exist_ok=True)
    # each arm's result is kept with its settings (`grpo_runs.kept`); ``--arms`` reruns the arms it names, and the
    # base model's evaluation is always reused
    rows = {"before": grpo_runs.kept(args, args.workdir / "base" / "result.json",
                                     lambda: _child(grpo_runs.base_model(args), args, args.workdir / "base"))}
    print(f"before: {rows['before']}", flush=True)
    for name, curriculum in (("plain", False), ("curriculum", True)):
        def run(name: str = name, curriculum: bool = curriculum) -> dict:
            trained = train(args, args.workdir / name, curriculum)
            return {**_child(trained["export"], args, args.workdir / name), "train": trained}

        rows[name] = grpo_runs.kept(args, args.workdir / name / "result.json", run,
                                    reuse=name not in args.arms.split(","))
        print(f"{name}: {rows[name]}", flush=True)
    table = _table(rows, args)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))


def _child(model_dir: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Evaluate `model_dir` in a fresh process (vLLM owns its process)."""
    return grpo_runs.child(__file__, "eval", model_dir, args, workdir)


def _table(rows: dict, args: argparse.Namespace) -> str:
    k = args.samples
    head = (f"Task `{args.task}`, {args.train_size} training / {args.test_size} held-out questions; {args.rollouts} "
            f"rollouts x {args.prompts} prompts x {args.group} completions (<= {args.max_new_tokens} tokens, "
            f"T={args.temperature}), lr {args.lr}, seed {args.seed}, {args.threads} thread(s), evaluator engine "
            f"{args.engine}; curriculum: pass at reward >= 1, readmit_after {args.readmit_after}.\n\n")
    lines = [f"| model | completion tokens | greedy acc | sampled acc (T=1) | pass@{k} | train correct first -> last3 "
             "| pools at the end (active / solved / hopeless / unseen) | train wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        t = r.get("train")
        curve = t["curve_correct"] if t else []
        trend = f"{curve[0]:.3f} -> {sum(curve[-3:]) / len(curve[-3:]):.3f}" if curve else ""
        pools = " / ".join(f"{t['pools'][p.split('/')[1]]:.0f}" for p in POOLS) if t and name == "curriculum" else ""
        lines.append(f"| {name} | {t['tokens']:.0f} | " if t else f"| {name} | | ")
        lines[-1] += (f"{r['greedy']:.3f} | {r.get('sampled', float('nan')):.3f} | {r.get('pass_at_k', float('nan')):.3f} "
                      f"| {trend} | {pools} | {t['seconds']:.0f} |" if t else
                      f"{r['greedy']:.3f} | {r.get('sampled', float('nan')):.3f} | "
                      f"{r.get('pass_at_k', float('nan')):.3f} | | | |")
    return head + "\n".join(lines)


if __name__ == "__main__":
    main()
