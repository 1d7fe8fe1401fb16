"""Evidence across seeds and tasks: rl_lightning vs TRL 1.16 on SmolLM2-135M-Instruct, mean ± std over seeds.

For each reasoning-gym task in ``--tasks`` and each seed in ``--seeds``, runs `benchmarks/real_grpo.py` (same model,
data, reward, budget and settings for both libraries; one process per measurement) and then writes:

- a Markdown table per task: held-out greedy accuracy and pass@K before, and after each library, mean ± std (sample
  std, n-1) over the seeds, plus the training wall time;
- one PNG per task with both libraries' training curves (``correct`` reward per rollout, mean over seeds with a band
  of ± one std), in ``--plots``.

The default tasks have different shapes: the demo's two-term sums (the base model solves 25% of the 64 held-out
questions greedily, in short answers) and products of two one- or two-digit numbers (23% greedily, but 67% of its
greedy answers run past the 32-token budget explaining themselves: it must learn to answer concisely as well as
correctly). Three single-digit terms of chain_sum were tried first and left: the base model solves 7.8%, below the 10%
to 40% the comparison asks for. The default settings are the demo's of stop 43, which the committed results used (reward
``correct`` only, DAPO's soft overlong punishment over the last 8 of 32 tokens, 10 rollouts x 8 prompts x 4
completions, lr 2e-5; `benchmarks/panel.py` measures the current default), about 25 minutes per task and seed
for both libraries on one core. Every step's result is kept in
``--workdir``, so the sweep can be stopped and restarted, and split over processes with ``--seeds 1,2``.

    python benchmarks/seeds.py --out benchmarks/results/seeds_cpu.md --plots docs/images/seeds
    python benchmarks/seeds.py --seeds 1 --rollouts 2 --prompts 2 --group 2 --skip-trl  # a short run
    python benchmarks/seeds.py --smoke --workdir /tmp/smoke  # tiny model, 2 seeds, about a minute (what the tests run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASKS = ("reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2",
         "reasoning_gym:products?min_terms=2&max_terms=2&min_digits=1&max_digits=2")
# --smoke: one task, two seeds (a std needs two), and real_grpo.py's own --smoke (tiny model, one small rollout)
SMOKE = {"tasks": TASKS[0], "seeds": "2", "samples": 2}  # "2": argparse converts string defaults


def _run(task: str, seed: int, args: argparse.Namespace, passthrough: list[str]) -> dict:
    """One `real_grpo.py` run; it keeps each step's result with its settings (`grpo_runs.kept`), so a rerun with the
    same flags takes a second and other flags (``--skip-trl``, another budget) compute what differs."""
    name = f"{task.split(':', 1)[1].replace('?', '_').replace('&', '_').replace('=', '')}_seed{seed}"
    folder = args.workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    result = folder / "result.json"
    # The starting model's evaluation does not depend on the seed: one per task, shared by its seeds' folders.
    shared, base = args.workdir / "base", folder / "runs" / "base"
    shared.mkdir(parents=True, exist_ok=True)
    if not base.exists():
        base.parent.mkdir(parents=True, exist_ok=True)
        base.symlink_to(shared, target_is_directory=True)
    command = [sys.executable, str(REPO / "benchmarks" / "real_grpo.py"), "--task", task, "--seed", str(seed),
               "--workdir", str(folder / "runs"), "--json", str(result), *passthrough]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    (folder / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{name} failed; see {folder / 'log.txt'}:\n{done.stderr[-2000:]}")
    print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(result.read_text())["rows"]


def _seed_list(text: str) -> list[int]:
    """``--seeds``: N (seeds 1..N) or a comma-separated list of seeds."""
    try:
        seeds = [int(s) for s in text.split(",")] if "," in text else list(range(1, int(text) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count (3) nor a list of seeds (2,3)") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{text!r} names no seed; give a count >= 1 or a list (2,3)")
    return seeds


def _mean_std(values: list[float], digits: int = 3) -> str:
    std = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.{digits}f} ± {std:.{digits}f}"


def table(task: str, runs: list[dict], k: int) -> str:
    """The task's Markdown table over the seeds' rows."""
    lines = [f"### `{task}` ({len(runs)} seeds)", "",
             f"| model | greedy acc | greedy per seed | greedy gain vs base | sampled acc (T=1) | pass@{k} | "
             "train wall s |", "|---|---|---|---|---|---|---|"]
    for name in ("before", "rl_lightning", "TRL"):
        rows = [run[name] for run in runs if name in run]
        if not rows:
            continue
        gains = [row["greedy"] - run["before"]["greedy"] for row, run in zip(rows, runs, strict=False)]
        wall = _mean_std([row["train"]["seconds"] for row in rows], 0) if "train" in rows[0] else ""
        per_seed = ", ".join(f"{row['greedy']:.3f}" for row in rows)
        lines.append(f"| {name} | {_mean_std([r['greedy'] for r in rows])} | "
                     f"{per_seed if name != 'before' else ''} | "
                     f"{_mean_std(gains) if name != 'before' else ''} | "
                     f"{_mean_std([r.get('sampled', float('nan')) for r in rows])} | "
                     f"{_mean_std([r.get('pass_at_k', float('nan')) for r in rows])} | {wall} |")
    return "\n".join(lines)


def plot(task: str, runs: list[dict], path: Path) -> None:
    """Both libraries' ``correct`` reward per rollout: mean over seeds and a ± one-std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, colour in (("rl_lightning", "tab:blue"), ("TRL", "tab:orange")):
        curves = [run[name]["train"]["curve_correct"] for run in runs if name in run]
        if not curves:
            continue
        length = min(len(c) for c in curves)
        values = np.array([c[:length] for c in curves])
        steps, mean = np.arange(1, length + 1), values.mean(0)
        std = values.std(0, ddof=1) if len(values) > 1 else np.zeros(length)  # the tables' sample std
        axes.plot(steps, mean, color=colour, label=f"{name} ({len(curves)} seeds)")
        axes.fill_between(steps, mean - std, mean + std, color=colour, alpha=0.2)
    axes.set_title(f"GRPO on SmolLM2-135M-Instruct, mean ± std over seeds\n{task.split(':', 1)[1]}", fontsize=10)
    axes.set(xlabel="rollout", ylabel="correct completions (share)")
    axes.legend()
    axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Other flags (--rollouts, --prompts, --group, --lr, --skip-trl, ...) go to "
                                            "benchmarks/real_grpo.py unchanged.")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated reasoning_gym: data paths")
    parser.add_argument("--seeds", type=_seed_list, default="3", help="N: seeds 1..N; or a comma-separated list (2,3) to split a "
                        "sweep over processes sharing --workdir (then one run without it writes the tables)")
    parser.add_argument("--samples", type=int, default=4, help="pass@K: sampled completions per held-out question")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rl_lightning_seeds"))
    parser.add_argument("--out", type=Path, help="write the tables (Markdown) here")
    parser.add_argument("--plots", type=Path, help="write one PNG per task into this folder")
    parser.add_argument("--json", type=Path, help="write every run's rows (per task, per seed) as JSON here")
    parser.add_argument("--smoke", action="store_true", help="one task, 2 seeds, real_grpo.py --smoke: seconds")
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**SMOKE)
    args, passthrough = parser.parse_known_args()
    # The default settings are the demo's of stop 43 (the committed results'): correctness alone (the recipe's `format`
    # bonus gets learned instead of the answer on some seeds), DAPO's overlong punishment, 10 rollouts of 8 prompts x
    # 4; flags given here win.
    budget = [] if args.smoke else ["--rollouts", "10", "--prompts", "8", "--group", "4", "--lr", "2e-5",
                                    "--warmup", "2", "--format-weight", "0", "--overlong-cache", "8",
                                    "--test-size", "64", "--threads", "1"]
    passthrough = budget + passthrough + ["--samples", str(args.samples)] + (["--smoke"] if args.smoke else [])
    sections, start, everything = [], time.perf_counter(), {}
    for i, task in enumerate(args.tasks.split(",")):
        runs = everything[task] = [_run(task, seed, args, passthrough) for seed in args.seeds]
        sections.append(table(task, runs, args.samples))
        if args.plots:
            plot(task, runs, args.plots / f"task{i + 1}.png")
    text = "\n\n".join(sections) + f"\n\nSweep wall time (this invocation): {time.perf_counter() - start:.0f} s; " \
                                   f"settings passed to real_grpo.py: {' '.join(passthrough)}\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"passthrough": passthrough, "runs": everything}))


if __name__ == "__main__":
    main()
