"""One-step-off rollouts with and without in-flight weight updates, side by side in one process, long-tailed lengths.

The same GRPO-style PPO run (tiny model by default, vLLM-CPU engine, completion-length parity reward, seeded,
``async_steps: 1``) is fit twice on one shared vLLM engine: first plain one-step-off (rollout k+1 is submitted once
rollout k has finished and version k is pushed), then with ``inflight_segment_tokens`` (version k is pushed at a
segment boundary while rollout k's long completions still run, rollout k+1 is submitted at once and shares the
engine with rollout k's tail). The workload is long-tailed: the tiny model's completions end at a rarely sampled stop
token, so at ``--max-new-tokens 896`` a few run to the limit while the median is a few hundred tokens; a rollout's
generation time is its longest completion's, with the engine mostly idle meanwhile.

Per run it prints the mean wall time of a training step after the first two (the first is synchronous in both modes,
the second is where in-flight mode first overlaps), the mean ``rollout/generate_s``, ``rollout/wait_s`` (the trainer's
wait for its rollout), the share of completion tokens sampled by the previous version (``rollout/stale_token_share``)
and the completion lengths' median and max, then the in-flight / plain step-time ratio.

    OMP_NUM_THREADS=1 python benchmarks/inflight.py                      # ~5 min on 2 CPU cores
    python benchmarks/inflight.py --rollouts 3 --max-new-tokens 16 --json out.json   # seconds (the test's)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L

ASSETS = Path(__file__).resolve().parents[1] / "rl_lightning" / "assets"
ENV = "def reward_fn(messages, answer):\n    return float(len(messages[-1]['content']) % 2)\n"


class StepTimer(L.Callback):
    """Wall time of each training batch (rollout hand-off + update), its rollout metrics and completion lengths."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.metrics: list[dict[str, float]] = []
        self.lengths: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")})
        self.lengths.append([t.completion_length for t in batch["rollout"].trajectories])


def run(args: argparse.Namespace, env_path: str, segment: int | None, engine=None) -> tuple[dict, object]:
    from rl_lightning.data import PromptDataModule
    from rl_lightning.engines.segmented import SegmentedEngine
    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.rollout.callback import RolloutConfig
    from rl_lightning.tasks import PPO

    L.seed_everything(0)
    rollout = RolloutConfig(env_path, responses_per_prompt=args.responses, max_new_tokens=args.max_new_tokens,
                            engine={"kind": "vllm", "kv_cache_memory_bytes": 256 << 20, "max_model_len": 1024},
                            async_steps=1, inflight_segment_tokens=segment)
    task = PPO(LMConfig(args.model, optim=OptimConfig(lr=1e-3, lr_schedule="constant")), rollout, max_rollouts=args.rollouts)
    raw = getattr(engine, "engine", engine)  # the VLLMEngine under a SegmentedEngine
    task.rollout_callback.engine = SegmentedEngine(raw, segment) if segment and raw is not None else raw
    data = PromptDataModule(str(ASSETS / "data" / "arithmetic.jsonl"), tokenizer_name=args.model,
                            batch_size=args.prompts, shuffle=False)
    timer = StepTimer()
    start = time.perf_counter()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(task, datamodule=data)
    later, lengths = timer.metrics[2:] or timer.metrics, [n for step in timer.lengths for n in step]
    row = {"mode": f"in-flight, segments of {segment}" if segment else "one-step-off", "steps": len(timer.seconds),
           "fit_s": time.perf_counter() - start, "step_s": statistics.mean(timer.seconds[2:] or timer.seconds),
           # completion tokens trained per second of training steps, steps 3+ (the modes sample different lengths)
           "tokens_per_s": sum(map(sum, timer.lengths[2:] or timer.lengths)) / sum(timer.seconds[2:] or timer.seconds),
           "step_seconds": timer.seconds,
           "generate_s": statistics.mean(m["rollout/generate_s"] for m in later),
           "wait_s": statistics.mean(m["rollout/wait_s"] for m in later),
           "stale_token_share": [m.get("rollout/stale_token_share", m["rollout/staleness"]) for m in timer.metrics],
           "median_length": statistics.median(lengths), "max_length": max(lengths)}
    return row, task.rollout_callback.engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ASSETS / "tiny-qwen2"))
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--responses", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=896)
    parser.add_argument("--segment", type=int, default=32, help="inflight_segment_tokens")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating (the CPU may be shared)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env_path = os.path.join(tmp, "parity.py")
        Path(env_path).write_text(ENV)
        rows, engine = [], None
        for _ in range(args.repeats):
            for segment in (None, args.segment):
                row, engine = run(args, env_path, segment, engine)
                rows.append(row)
        engine.shutdown()
    print(f"\n{args.rollouts} rollouts of {args.prompts} prompts x {args.responses} completions, <= "
          f"{args.max_new_tokens} new tokens, model {Path(args.model).name}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, {len(os.sched_getaffinity(0))} CPUs")
    print("| mode | mean step s (steps 3+) | tokens/s (steps 3+) | fit s | mean generate_s | mean wait_s | "
          "stale token share per rollout | median / max length |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['step_s']:.2f} | {row['tokens_per_s']:.0f} | {row['fit_s']:.1f} | "
              f"{row['generate_s']:.2f} | {row['wait_s']:.2f} | "
              f"{', '.join(f'{s:.2f}' for s in row['stale_token_share'])} | "
              f"{row['median_length']:.0f} / {row['max_length']} |")
    for plain, inflight in zip(rows[::2], rows[1::2], strict=True):
        print(f"in-flight / one-step-off step time: {inflight['step_s'] / plain['step_s']:.2f}, tokens/s: "
              f"{inflight['tokens_per_s'] / plain['tokens_per_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
