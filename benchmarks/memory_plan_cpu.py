"""The memory plan against measured peaks: SFT, DPO and GRPO fits on CPU, predicted vs measured peak resident memory.

Each configuration runs in its own process (so the peak is its own): 2 optimizer steps (rollouts for GRPO) of the
task with ``model.lm.memory_check: false``; the prediction is the plan the task printed at start-up
(`rl_lightning.tasks.memory_check`, baseline measured then), the measurement the process's peak resident memory
at the end of the fit (`rl_lightning.memory.phases.process_peak_mib`). Checkpoints are off: the plan covers the
training step. The data is synthetic so micro-batches fill their budget: one short prompt and a long answer (SFT, DPO)
or the demo arithmetic prompts with long sampled completions, scored by their length's parity (GRPO: the rewards
differ inside each group, so every step updates the weights and holds the optimizer state).

    OMP_NUM_THREADS=1 python benchmarks/memory_plan_cpu.py            # every configuration, ~5 min on 2 cores
    python benchmarks/memory_plan_cpu.py --only sft-tiny,dpo-tiny      # some of them
    python benchmarks/memory_plan_cpu.py --json rows.json --markdown table.md   # also as files
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "rl_lightning" / "assets" / "tiny-qwen2")
REAL = "asset:SmolLM2-135M-Instruct"
PARITY_ENV = "def reward_fn(messages, answer):\n    return float(len(messages[-1]['content']) % 2)\n"
WORDS = "the cat sat on a mat and then went home to eat some fish while the dog barked loudly at birds".split()

# name: task, model, token budget, answer words per row (SFT/DPO; the tiny tokenizer is byte-level) or new tokens
# (GRPO), rows (GRPO: prompts, 4 completions each) per step, and the task's memory switches. Each step packs into
# micro-batches of equal size that nearly fill the budget (unequal ones leave glibc's heap fragmented differently from
# run to run: +-15% on SmolLM2 SFT).
CONFIGS: dict[str, dict] = {
    "sft-tiny": {"task": "sft", "model": "tiny", "tokens": 8192, "words": 215, "rows": 16},
    "sft-tiny-lora-ckpt-full-head": {"task": "sft", "model": "tiny", "tokens": 8192, "words": 215, "rows": 16,
                                     "lora": True, "ckpt": True, "chunk": None},
    "dpo-tiny-full-head": {"task": "dpo", "model": "tiny", "tokens": 8192, "words": 105, "rows": 16, "chunk": None},
    "grpo-tiny-lora-kl": {"task": "grpo", "model": "tiny", "tokens": 1536, "words": 128, "rows": 4, "lora": True,
                          "kl": 0.1},
    "grpo-tiny-vllm": {"task": "grpo", "model": "tiny", "tokens": 1536, "words": 128, "rows": 4, "engine": "vllm"},
    "sft-real": {"task": "sft", "model": "real", "tokens": 1100, "words": 230, "rows": 8},
    "dpo-real-lora-ckpt-full-head": {"task": "dpo", "model": "real", "tokens": 950, "words": 115, "rows": 6,
                                     "lora": True, "ckpt": True, "chunk": None},
    "grpo-real-vllm": {"task": "grpo", "model": "real", "tokens": 1024, "words": 40, "rows": 6, "engine": "vllm"},
}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_data(path: str, task: str, rows: int, words: int) -> None:
    """Synthetic rows: a short prompt and a long answer (SFT), or two long answers to choose from (DPO)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            prompt = [{"role": "user", "content": "Tell me a story."}]
            if task == "sft":
                row = {"messages": [*prompt, {"role": "assistant", "content": _text(rng, words)}]}
            else:
                row = {"messages": prompt, "chosen": _text(rng, words), "rejected": _text(rng, words)}
            f.write(json.dumps(row) + "\n")


def write_prompts(path: str, rows: int) -> None:
    """Prompts that ask for long answers (GRPO: completions run to ``max_new_tokens``)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            topic = " ".join(rng.choice(WORDS) for _ in range(3))
            messages = [{"role": "user", "content": f"Write a very long story about {topic}."}]
            f.write(json.dumps({"messages": messages, "answer": "0"}) + "\n")


def build(config: dict, tmp: str) -> tuple:
    """The task and DataModule of `config` (``model.lm.memory_check: false``: measured, not refused)."""
    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.lora import LoRAConfig
    from rl_lightning.models.optim import OptimConfig

    model = TINY if config["model"] == "tiny" else REAL
    switches = {"gradient_checkpointing": config.get("ckpt", False), "lm_head_chunk": config.get("chunk", 1024),
                "lora": LoRAConfig() if config.get("lora") else None, "memory_check": False}
    task, rows, words = config["task"], config["rows"], config["words"]
    if task == "grpo":
        from rl_lightning.data import PromptDataModule
        from rl_lightning.rollout.callback import RolloutConfig
        from rl_lightning.tasks import PPO
        from rl_lightning.tasks.ppo import KLConfig

        engine = ({"engine": {"kind": "vllm", "kv_cache_memory_bytes": 256 << 20}} if config.get("engine") == "vllm"
                  else {})
        env = Path(tmp) / "parity_env.py"  # rewards that differ inside a group: each rollout really updates (a
        env.write_text(PARITY_ENV)           # step on an all-zero gradient creates no optimizer state at all)
        rollout = RolloutConfig(str(env), responses_per_prompt=4, max_new_tokens=words, reward_workers=0, **engine)
        path = f"{tmp}/prompts.jsonl"
        write_prompts(path, 4 * rows)
        data = PromptDataModule(path, tokenizer_name=model, batch_size=rows, shuffle=False)
        module = PPO(LMConfig(model, optim=OptimConfig(lr=1e-6, lr_schedule="constant"), **switches), rollout, max_rollouts=2,
                     max_length_per_device=config["tokens"], kl=KLConfig(coef=config.get("kl", 0.0)))
        return module, data
    path = f"{tmp}/data.jsonl"
    write_data(path, task, 4 * rows, words)
    if task == "sft":
        from rl_lightning.data import SFTDataModule
        from rl_lightning.tasks import SFT

        data = SFTDataModule(path, tokenizer_name=model, batch_size=rows, max_length=4096,
                             max_length_per_device=config["tokens"], shuffle=False)
        return SFT(LMConfig(model, optim=OptimConfig(lr=1e-6), **switches)), data
    from rl_lightning.data import PreferenceDataModule
    from rl_lightning.tasks import DPO

    data = PreferenceDataModule(path, tokenizer_name=model, batch_size=rows, max_length=4096,
                                max_length_per_device=config["tokens"], shuffle=False)
    return DPO(LMConfig(model, optim=OptimConfig(lr=1e-6), **switches)), data


def measure(name: str) -> dict:
    """Fit configuration `name` in this process: the plan's prediction, the measured peak and the phases' peaks."""
    import lightning as L

    from rl_lightning.memory.phases import PhaseProfiler, process_peak_mib
    from rl_lightning.memory.plan import MIB

    config = CONFIGS[name]
    L.seed_everything(0)
    with tempfile.TemporaryDirectory() as tmp:
        module, data = build(config, tmp)
        trainer = L.Trainer(accelerator="cpu", max_steps=-1 if config["task"] == "grpo" else 2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp, num_sanity_val_steps=0)
        started = time.perf_counter()
        with PhaseProfiler() as profiler:
            trainer.fit(module, datamodule=data)
        seconds = time.perf_counter() - started
    plan = module.memory_plan
    return {"name": name, "predicted_mib": plan.peak / MIB, "measured_mib": process_peak_mib(),
            "baseline_mib": plan.setup.baseline / MIB, "tokens": plan.tokens, "seconds": seconds,
            "components_mib": {k: v / MIB for k, v in plan.components.items()},
            "phases_mib": {k: v / MIB for k, v in plan.phases.items()},
            "measured_phases_mib": {k: v["peak_rss_mib"] for k, v in profiler.summary().items()},
            "phase_starts_mib": {r.name: r.start_rss_mib for r in reversed(profiler.records)}}  # each first start


def run(name: str) -> dict:
    """`measure` in a fresh process (its own peak)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def markdown(rows: list[dict]) -> str:
    """Predicted vs measured peak per configuration, MiB."""
    lines = ["| configuration | tokens per micro-batch | baseline | predicted peak | measured peak | error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        error = r["predicted_mib"] / r["measured_mib"] - 1
        lines.append(f"| {r['name']} | {r['tokens']} | {r['baseline_mib']:.0f} | {r['predicted_mib']:.0f} | "
                     f"{r['measured_mib']:.0f} | {error:+.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated configuration names (default: all)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one)))
        return
    names = args.only.split(",") if args.only else list(CONFIGS)
    rows = []
    for name in names:
        rows.append(run(name))
        r = rows[-1]
        print(f"{name}: predicted {r['predicted_mib']:.0f} MiB, measured {r['measured_mib']:.0f} MiB "
              f"({r['predicted_mib'] / r['measured_mib'] - 1:+.1%}), {r['seconds']:.0f} s", flush=True)
    table = markdown(rows)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
