"""Step time of each rollout mode, side by side in one run, on the same prompts, seed and budget.

Modes (``model.rollout`` settings of the PPO task):

- ``sync``: colocated synchronous (``engine: vllm``, ``async_steps: 0``): the baseline every ratio is taken against;
- ``async``: one-step-off-policy on a background thread of the training process (``engine: vllm``,
  ``async_steps: 1``; `rl_lightning.rollout.async_rollout`);
- ``process-sync`` / ``process-async``: disaggregated, vLLM in a process of its own fed full weights over a gloo
  group of its own (``engine: vllm_process``, ``async_steps`` 0 / 1; `rl_lightning.engines.process`);
- ``inflight``: one-step-off-policy with in-flight weight updates (``engine: vllm``, ``async_steps: 1``,
  ``inflight_segment_tokens: --segment-tokens``; `rl_lightning.rollout.inflight`): generation runs in segments and
  new weights load between them; run when this checkout's `RolloutConfig` has the key, else listed as skipped.

Every mode fits the same seeded PPO run (Dr. GRPO defaults, one optimizer step per rollout) from the same starting
weights; the colocated modes share one vLLM engine, the process modes another (a fit pushes its own weights into it
first). Per mode it reports the median over the rollouts after the first (the first is synchronous in every mode and
warms up) of: the training step's wall time (rollout hand-off + update), the generation time (sampling and scoring,
``rollout/generate_s``; in the background for the asynchronous modes), the update time (the task's
``training_step``), and the overlap: the share of generation hidden behind the update, 1 - sum(wait) / sum(generate),
where wait is the trainer's wait for the rollout (``rollout/wait_s``; the whole generation when synchronous). Also,
over the same rollouts, the share of completion tokens sampled by an older policy than the one trained (in flight:
``rollout/stale_token_share``) and the mean engine-vs-trainer log-probability gap (``train/engine_logprob_diff`` per
completion token: staleness shows here), and the mean training reward over every rollout.

    OMP_NUM_THREADS=1 python benchmarks/rollout_modes.py --out benchmarks/results/rollout_modes_cpu.md   # ~10 min
    python benchmarks/rollout_modes.py --modes sync,process-async --rollouts 3
    python benchmarks/rollout_modes.py --smoke --json rows.json     # tiny model, 2 rollouts per mode (~1 min)

The real run needs SmolLM2-135M-Instruct (``make real-model``) and reasoning-gym (``.[reasoning]``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L

REPO = Path(__file__).resolve().parents[1]
TASK = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2&train_size=1000&test_size=64"
WEIGHTS = {"correct": 1.0, "format": 0.5}
# --smoke: the untrained tiny model never answers right; rewarding the completion's length parity gives every group
# different rewards, so each update moves the policy and a stale rollout shows in the log-probability gap
PARITY_ENV = "def reward_fn(messages, answer):\n    return float(len(messages[-1]['content']) % 2)\n"
MODES = {  # name: (engine, async_steps), in the order they run (the colocated engine first, then the process)
    "sync": ("vllm", 0), "async": ("vllm", 1), "inflight": ("vllm", 1), "process-sync": ("vllm_process", 0),
    "process-async": ("vllm_process", 1)}
BASELINE = "sync"
INFLIGHT_KEY = "inflight_segment_tokens"


def has_inflight() -> bool:
    """Whether this checkout has in-flight weight updates (``model.rollout.inflight_segment_tokens``)."""
    from rl_lightning.rollout.config import RolloutConfig

    return INFLIGHT_KEY in {f.name for f in dataclasses.fields(RolloutConfig)}


class Recorder(L.Callback):
    """Per training batch: wall time from before the rollout hand-off to the end of the update, the logged metrics,
    and a digest of the completion tokens (equal digests: the same completions)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds = time.perf_counter() - self._start
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("rollout/", "train/"))}
        completions = [[token for token, m in zip(t.input_ids, t.completion_mask, strict=True) if m]
                       for t in batch["rollout"].trajectories]
        digest = hashlib.sha1(json.dumps(completions).encode()).hexdigest()[:16]
        self.steps.append({"step_s": seconds, "update_s": pl_module.update_seconds, "tokens": digest, **metrics})


def timed_task_class() -> type:
    """PPO, with the wall time of its ``training_step`` (scoring, advantages, the update) kept for the recorder."""
    from rl_lightning.tasks import PPO

    class TimedPPO(PPO):
        update_seconds = 0.0

        def training_step(self, batch, batch_idx):
            start = time.perf_counter()
            result = super().training_step(batch, batch_idx)
            self.update_seconds = time.perf_counter() - start
            return result

    return TimedPPO


def fit_mode(args: argparse.Namespace, name: str, engine: Any) -> tuple[dict[str, Any], Any]:
    """Fit mode `name` (sharing `engine` when given) and return its summary row and the engine it used."""
    from rl_lightning.data import PromptDataModule
    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.rollout.callback import RolloutConfig

    L.seed_everything(args.seed)
    engine_name, async_steps = MODES[name]
    extra = {INFLIGHT_KEY: args.segment_tokens} if name == "inflight" else {}
    rollout = RolloutConfig(args.env, responses_per_prompt=args.responses, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature,
                            engine={"kind": engine_name, "kv_cache_memory_bytes": 256 << 20},
                            async_steps=async_steps, reward_workers=0, reward_weights=args.weights, **extra)
    lm = LMConfig(args.model, optim=OptimConfig(lr=args.lr, lr_schedule="constant"))
    task = timed_task_class()(lm, rollout, max_rollouts=args.rollouts, max_length_per_device=512)
    if name == "inflight" and engine is not None:  # the callback wraps only an engine it builds itself
        from rl_lightning.engines.segmented import SegmentedEngine

        engine = SegmentedEngine(engine, args.segment_tokens)
    task.rollout_callback.engine = engine  # None: built at fit start; else the earlier mode's, reused
    data = PromptDataModule(args.data, tokenizer_name=args.model, batch_size=args.prompts, shuffle=False,
                            max_prompt_length=256)
    recorder = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
    start = time.perf_counter()
    trainer.fit(task, datamodule=data)
    row = summarise(recorder.steps)
    row.update(mode=name, engine=engine_name, async_steps=async_steps, fit_s=time.perf_counter() - start)
    print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'rollouts'})}", flush=True)
    engine = task.rollout_callback.engine
    return row, engine.engine if name == "inflight" else engine  # the SegmentedEngine's own VLLMEngine


def summarise(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's row: medians and means over the rollouts after the first, the reward over all, per-rollout values."""
    later = steps[1:] or steps  # one rollout only (a smoke run's --rollouts 1): that one
    generate = [s["rollout/generate_s"] for s in later]
    wait = [s.get("rollout/wait_s", s["rollout/generate_s"]) for s in later]  # synchronous: all of it waited for
    return {
        "steps": len(steps),
        "step_s": statistics.median(s["step_s"] for s in later),
        "min_step_s": min(s["step_s"] for s in later),  # the step least disturbed by other jobs on the machine
        "generate_s": statistics.median(generate),
        "update_s": statistics.median(s["update_s"] for s in later),
        "wait_s": statistics.median(wait),
        "overlap": 1.0 - sum(wait) / sum(generate) if sum(generate) > 0 else 0.0,
        # completion tokens sampled by an older policy than the one trained (in-flight: the tokens before the push)
        "stale_tokens": statistics.mean(s.get("rollout/stale_token_share", min(1.0, s.get("rollout/staleness", 0.0)))
                                        for s in later),
        "logprob_gap": statistics.mean(s["train/engine_logprob_diff"] for s in later),
        "reward": statistics.mean(s["train/reward"] for s in steps),
        "rollouts": [{"tokens": s["tokens"], "staleness": s.get("rollout/staleness", 0.0),
                      "stale_tokens": s.get("rollout/stale_token_share"),
                      "logprob_gap": s["train/engine_logprob_diff"], "reward": s["train/reward"],
                      "step_s": s["step_s"], "generate_s": s["rollout/generate_s"], "update_s": s["update_s"]}
                     for s in steps],
    }


def table(rows: list[dict[str, Any]], skipped: dict[str, str]) -> str:
    """The Markdown table, ratios against the baseline's row, then one line per skipped mode."""
    base = next(r for r in rows if r["mode"] == BASELINE)
    lines = ["| mode | engine | async_steps | median step s | step vs sync | min step s | median generate s | "
             "median update s | overlap | stale tokens | logprob gap | mean reward |", "|---" * 12 + "|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['engine']} | {r['async_steps']} | {r['step_s']:.2f} | "
                     f"{r['step_s'] / base['step_s']:.2f} | {r['min_step_s']:.2f} | {r['generate_s']:.2f} | {r['update_s']:.2f} | "
                     f"{r['overlap']:.0%} | {r['stale_tokens']:.0%} | {r['logprob_gap']:.2e} | {r['reward']:.3f} |")
    lines += [f"\n{name}: skipped: {reason}" for name, reason in skipped.items()]
    return "\n".join(lines)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], skipped: dict[str, str],
           load: tuple[tuple[float, ...], tuple[float, ...]], seconds: float) -> str:
    """The results page: what was run, on what, under which load, then the table."""
    import torch
    import vllm

    command = "python benchmarks/rollout_modes.py " + " ".join(sys.argv[1:])
    return (f"Rollout modes side by side (`benchmarks/rollout_modes.py`), measured {time.strftime('%Y-%m-%d')}.\n\n"
            f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} {command}`\n\n"
            f"Model {Path(args.model).name}, data `{args.data}`, {args.rollouts} rollouts of {args.prompts} prompts x "
            f"{args.responses} completions (<= {args.max_new_tokens} new tokens, T={args.temperature}), lr {args.lr}, "
            f"seed {args.seed}, one optimizer step per rollout. Machine: {platform.processor() or platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} CPUs, torch {torch.__version__}, vllm {vllm.__version__}; whole run "
            f"{seconds:.0f} s. Other jobs shared the cores during the run (load average {load[0][0]:.1f} at the "
            f"start, {load[1][0]:.1f} at the end), so the timings are rough.\n\n"
            "Medians (and the minimum step) over the rollouts after the first; overlap = the share of generation hidden behind the update "
            "(1 - wait / generate); stale tokens = the share of completion tokens sampled by an older policy than the one "
            "trained; logprob gap = mean |trainer - engine| log-probability per completion token; "
            "reward = mean training reward over all rollouts.\n\n" + table(rows, skipped) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--rollouts", type=int, default=5, help="rollouts per mode")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--responses", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--segment-tokens", type=int, default=8,
                        help="inflight: tokens per generation segment (model.rollout.inflight_segment_tokens)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model", default="asset:SmolLM2-135M-Instruct")
    parser.add_argument("--data", default=TASK)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, bundled arithmetic prompts, 2 rollouts of 2 x 2 completions per mode")
    parser.add_argument("--out", type=Path, help="also write the results page (Markdown) here")
    parser.add_argument("--json", type=Path, help="also write every row (with per-rollout values) here")
    args = parser.parse_args(argv)
    args.env, args.weights = str(REPO / "rl_lightning" / "recipes" / "envs" / "reasoning_gym_env.py"), WEIGHTS
    if args.smoke:
        args.model, args.data = str(REPO / "rl_lightning" / "assets" / "tiny-qwen2"), str(
            REPO / "rl_lightning" / "assets" / "data" / "arithmetic.jsonl")
        args.env, args.weights, args.temperature, args.lr = "", None, 1.0, 3e-2  # env: PARITY_ENV, written in main
        args.rollouts, args.prompts, args.responses, args.max_new_tokens, args.segment_tokens = 2, 2, 2, 8, 4
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose among {', '.join(MODES)}")
    args.modes = [m for m in MODES if m in modes or m == BASELINE]  # the baseline always runs, first
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from rl_lightning.assets.real import resolve_model

    args.model = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.env = os.path.join(tmp, "parity.py")
            Path(args.env).write_text(PARITY_ENV)
        rows, skipped, seconds, load = run_modes(args)
    text = report(args, rows, skipped, load, seconds)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))


def run_modes(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, str], float, tuple]:
    """Fit every mode of ``args.modes`` in turn; the rows, the skipped modes, the seconds and the load averages."""
    start, load_start = time.perf_counter(), os.getloadavg()
    rows, skipped, engines = [], {}, {}
    if "inflight" in args.modes and not has_inflight():
        skipped["inflight"] = (f"in-flight weight updates are not in this checkout (RolloutConfig has no "
                               f"{INFLIGHT_KEY})")
        print(f"inflight: skipped: {skipped['inflight']}", flush=True)
    for name in [m for m in args.modes if m not in skipped]:
        engine_name = MODES[name][0]
        for other in [e for e in engines if e != engine_name]:  # one engine alive at a time
            engines.pop(other).shutdown()
        row, engines[engine_name] = fit_mode(args, name, engines.get(engine_name))
        rows.append(row)
    for engine in engines.values():
        engine.shutdown()
    return rows, skipped, time.perf_counter() - start, (load_start, os.getloadavg())


if __name__ == "__main__":
    main()
