"""The sanity check of an RL implementation on a real model: GRPO must master the prompts the base model half-solves.

prime-rl publishes such a check; this is ours, for rl_lightning and TRL 1.16 with equal settings:

1. **probe**: the base model (SmolLM2-135M-Instruct) answers ``--candidates`` training questions of a reasoning-gym
   task ``--probe-samples`` times each at the training temperature; the questions it solves between ``--low`` and
   ``--high`` of the time (at most ``--max-prompts``) become the training set, written to ``sanity.jsonl``;
2. **train**: GRPO on exactly those prompts, ``--rollouts`` rollouts of ``--prompts`` prompts x ``--group``
   completions, with `benchmarks/real_grpo.py`'s settings for both libraries (Dr. GRPO advantages, token-mean loss,
   clip 0.2/0.28, no KL, same lr, warmup, temperature, reward weights);
3. **check**: greedy accuracy on the same prompts after training must exceed ``--target`` (0.9); the table gives the
   base and trained greedy accuracy, the sampled accuracy and pass@K, and PASS/FAIL for each library.

The budget is stated in the table's header (rollouts x prompts x completions x max tokens). Every measurement runs in
its own process; evaluation is ``python -m rl_lightning eval``'s code with the vLLM engine (``--engine hf`` for
transformers).

    python benchmarks/sanity.py --out benchmarks/results/sanity_cpu.md    # about an hour on 2 quiet cores with TRL
    python benchmarks/sanity.py --candidates 32 --rollouts 4 --skip-trl  # a short run
    python benchmarks/sanity.py --smoke --workdir /tmp/smoke             # tiny model, seconds (what the tests run)

Needs the real model (``python -m rl_lightning.assets.build --real``), ``pip install -e ".[real,reasoning,bench]"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo_runs  # noqa: E402 - the setup the real-model benchmarks share
import real_grpo  # noqa: E402 - the benchmark next to this one: its training runs (ours and TRL's) are reused

# --smoke (on top of grpo_runs.SMOKE): every probed question kept, so a model that solves none still trains
SMOKE = {"candidates": 4, "probe_samples": 2, "low": 0.0, "high": 1.0, "max_prompts": 4}


def probe(model_dir: str, args: argparse.Namespace, out: Path) -> dict:
    """Pass rate of each candidate question under the base model; writes the in-band questions to `out` (JSONL)."""
    import torch

    from rl_lightning.cli.eval.evaluate import EvalConfig
    from rl_lightning.cli.eval.evaluate import evaluate as run_eval

    torch.set_num_threads(args.threads)
    rates: list[tuple[float, dict]] = []

    def keep(name: str, trajectories: list) -> None:
        if name != "sampled":
            return
        for start in range(0, len(trajectories), args.probe_samples):
            group = trajectories[start:start + args.probe_samples]
            solved = sum(t.reward_components["correct"] >= 1.0 for t in group) / len(group)
            rates.append((solved, {"messages": group[0].prompt.messages, "answer": group[0].prompt.answer}))

    config = EvalConfig(model=model_dir, data=grpo_runs.data_spec(args), engine=args.engine, n=args.probe_samples,
                        temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=4321,
                        limit=args.candidates, reward_weights=json.dumps(grpo_runs.WEIGHTS), env=grpo_runs.ENV)
    run_eval(config, on_samples=keep)
    chosen = [(rate, row) for rate, row in rates if args.low <= rate <= args.high][:args.max_prompts]
    out.write_text("".join(json.dumps(row) + "\n" for _, row in chosen))
    histogram = {f"{r:.3f}": sum(1 for rate, _ in rates if rate == r) for r in sorted({rate for rate, _ in rates})}
    return {"candidates": len(rates), "chosen": len(chosen), "pass_rate_histogram": histogram,
            "chosen_mean_rate": sum(rate for rate, _ in chosen) / max(1, len(chosen))}


def _child(mode: str, target: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Run `mode` (probe/eval/trl) in a fresh process (vLLM owns its process) and return its JSON result."""
    return grpo_runs.child(__file__, mode, target, args, workdir, log=f"{mode}.log")


def _parser() -> argparse.ArgumentParser:
    parser = grpo_runs.parser(__doc__.splitlines()[0])
    parser.set_defaults(rollouts=30, prompts=8, group=8, samples=8, lr=2e-5,
                        workdir=Path("/tmp/rl_lightning_sanity"))
    parser.add_argument("--candidates", type=int, default=256, help="training questions probed")
    parser.add_argument("--probe-samples", type=int, default=8, help="completions per probed question")
    parser.add_argument("--low", type=float, default=0.2, help="lowest base pass rate kept")
    parser.add_argument("--high", type=float, default=0.8, help="highest base pass rate kept")
    parser.add_argument("--max-prompts", type=int, default=32, help="at most this many prompts are trained on")
    parser.add_argument("--target", type=float, default=0.9, help="greedy accuracy the trained model must exceed")
    parser.add_argument("--_probe", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = grpo_runs.parse(_parser(), smoke=SMOKE)
    data = args.workdir / "sanity.jsonl"
    args.train_data = args.eval_data = str(data) if data.is_file() else None
    if args._probe:
        print(json.dumps(probe(args._probe, args, data)))
        return
    if args._eval:
        print(json.dumps(grpo_runs.evaluate(args._eval, args)))
        return
    if args._trl:
        print(json.dumps(real_grpo.train_trl(args, Path(args._trl))))
        return
    for sub in ("base", "ours", "trl"):
        (args.workdir / sub).mkdir(parents=True, exist_ok=True)
    base = grpo_runs.base_model(args)
    # Each step's result is kept with its settings (`grpo_runs.kept`): a stopped run restarts at the next step.
    probed = args.workdir / "base" / "probe.json"
    if not data.is_file():  # the kept probe result describes this file
        probed.unlink(missing_ok=True)

    def fresh_probe() -> dict:
        data.unlink(missing_ok=True)  # the child probes the task, not the questions an earlier probe chose
        return _child("probe", base, args, args.workdir / "base")

    found = grpo_runs.kept(args, probed, fresh_probe)
    print(f"probe: {found}", flush=True)
    if found["chosen"] < args.prompts:
        raise SystemExit(f"only {found['chosen']} of {found['candidates']} questions have a base pass rate in "
                         f"[{args.low}, {args.high}]; raise --candidates or widen the band")
    args.train_data = args.eval_data = str(data)
    rows = {"before": grpo_runs.kept(args, args.workdir / "base" / "before.json",
                                     lambda: _child("eval", base, args, args.workdir / "base"))}
    print(f"before: {rows['before']}", flush=True)
    rows["rl_lightning"] = grpo_runs.kept(args, args.workdir / "ours" / "result.json",
                                          lambda: real_grpo.run_ours(args, _child))
    print(f"ours after: {rows['rl_lightning']}", flush=True)
    if not args.skip_trl:
        rows["TRL"] = grpo_runs.kept(args, args.workdir / "trl" / "result.json", lambda: real_grpo.run_trl(args, _child))
        print(f"trl after: {rows['TRL']}", flush=True)
    table = _table(rows, found, args)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "probe": found,
                                         "rows": rows}))


def _table(rows: dict, found: dict, args: argparse.Namespace) -> str:
    k = args.samples
    head = (f"Task `{args.task}`: {found['chosen']} training questions whose base pass rate (of {args.probe_samples} "
            f"samples at T={args.temperature}) lies in [{args.low}, {args.high}] (mean {found['chosen_mean_rate']:.2f}; "
            f"{found['candidates']} probed). Budget: {args.rollouts} rollouts x {args.prompts} prompts x {args.group} "
            f"completions (<= {args.max_new_tokens} tokens), lr {args.lr}, seed {args.seed}, {args.threads} threads. "
            f"Accuracy is measured on the same questions; target: greedy > {args.target}.\n\n")
    lines = [f"| model | greedy acc | sampled acc (T=1) | pass@{k} | train wall s | sanity |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        train = r.get("train")
        seconds, verdict = (f"{train['seconds']:.0f}", "PASS" if r["greedy"] > args.target else "FAIL") if train else ("", "")
        lines.append(f"| {name} | {r['greedy']:.3f} | {r.get('sampled', float('nan')):.3f} | "
                     f"{r.get('pass_at_k', float('nan')):.3f} | {seconds} | {verdict} |")
    return head + "\n".join(lines)


if __name__ == "__main__":
    main()
