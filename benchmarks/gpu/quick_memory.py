"""Quick GPU checks of memory and state (`run.sh --quick`): the memory plan against measured peaks, and an offloaded
save + resume.

- ``memory``: three short fits through the real tasks on one random-init Qwen3-0.6B-shaped model, bf16 compute over
  fp32 masters (`ParallelStrategy`), eager: SFT (4,096 tokens per step), GRPO (the PPO task, the HF engine
  generating 2 prompts x 4 completions x 64 tokens) and GKD (the same with a frozen teacher, ``distill.type:
  loss``: the JSD over the whole vocabulary). Each: the plan's predicted peak (`rl_lightning.memory.plan.plan_memory`,
  which the task computes at ``setup``) against the measured one, CUDA's ``max_memory_allocated`` since just before
  the fit (on CPU the process's ``VmHWM``, reset the same way, which is what the plan predicts there), and their
  ratio; target: within 15% on CUDA (reported only on CPU).
- ``resume``: the SFT task with ``optimizer_offload`` (a 1 MiB bucket, so the step streams many buckets) trains 4
  steps and saves a checkpoint after step 2; a new run resumes from it and trains steps 3-4. Rows: the gap between
  the two runs' losses on steps 3-4 (target: equal, up to the kernels' run-to-run gap on CUDA), and where AdamW's
  moments are right after the resume, before the first step (target on CUDA: the host, which is what offload means).

    python benchmarks/gpu/quick_memory.py {memory,resume} --results RESULTS.jsonl [--dry]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from table import record
from task_fits import SyntheticSFT, fit_trainer, model_folder, parallel_strategy, ppo_task, prompt_data, sft_task
from train import DRY_SHAPES, QWEN3_0_6B, setup

MEMORY_TOLERANCE = 0.15
MEMORY_LENGTHS, DRY_MEMORY_LENGTHS = (2048, 1024, 512, 512), (128, 64, 32, 32)
RESUME_TOLERANCE = {"cpu": 1e-6, "cuda": 1e-4}  # CUDA: bf16 kernels' run-to-run gap (1.3e-5 measured, offload.py)


def reset_peak(device: torch.device) -> None:
    """Free what the last fit left and start a new peak window (CUDA's allocator peak; on CPU the kernel's VmHWM)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measured_peak(device: torch.device) -> int:
    """Bytes at the peak since `reset_peak`."""
    from rl_lightning.memory.phases import host_peak_mib

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(host_peak_mib() * 2**20)


def plan_row(path: Path, name: str, task: Any, device: torch.device, note: str) -> None:
    """Predicted vs measured peak of the fit just done, as the measured / predicted ratio."""
    plan, measured = task.memory_plan, measured_peak(device)
    ratio = measured / plan.peak
    cuda = device.type == "cuda"
    record(path, f"quick memory {name} measured/planned", ratio, "ratio", f"1 +- {MEMORY_TOLERANCE:g}",
           not cuda or abs(ratio - 1) <= MEMORY_TOLERANCE,
           f"planned {plan.peak / 2**30:.3f} GiB, measured {measured / 2**30:.3f} GiB "
           f"({'max_memory_allocated' if cuda else 'VmHWM'}); {note}" + ("" if cuda else "; target checked on CUDA"))


def memory(args: argparse.Namespace) -> None:
    device = setup(args.dry, process_group=False)
    shape = DRY_SHAPES["qwen3-0.6b"] if args.dry else QWEN3_0_6B
    lengths = DRY_MEMORY_LENGTHS if args.dry else MEMORY_LENGTHS
    new_tokens = 16 if args.dry else 64
    with tempfile.TemporaryDirectory() as folder:
        model = model_folder(shape, folder, device)
        reset_peak(device)
        task = sft_task(model)
        fit_trainer(device, parallel_strategy(device), max_steps=2).fit(
            task, datamodule=SyntheticSFT(model, lengths, 2, shape["vocab_size"]).build())
        plan_row(args.results, "sft", task, device, f"SFT, {sum(lengths)} tokens per step, 2 steps")
        del task
        for name, teacher in (("grpo", None), ("gkd", model)):
            reset_peak(device)
            task = ppo_task(model, 2, 4, new_tokens, 8192, teacher=teacher)
            fit_trainer(device, parallel_strategy(device), max_epochs=1).fit(task, datamodule=prompt_data(model, 2))
            plan_row(args.results, name, task, device,
                     f"PPO{' + GKD (teacher: the same random model, JSD loss)' if teacher else ''}, HF engine, "
                     f"2 prompts x 4 x {new_tokens} new tokens, 2 rollouts")
            del task


class LossesAndMoments(L.Callback):
    """Each step's loss, and where AdamW's moments are when training starts (after a resume has loaded them)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.moments_at_start: set[str] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        for state in trainer.optimizers[0].state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    self.moments_at_start.add(local.device.type)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])


def resume(args: argparse.Namespace) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    device = setup(args.dry, process_group=False)
    shape = DRY_SHAPES["qwen3-0.6b"]  # what is checked is where the state lives, not speed: the small model
    lengths = DRY_MEMORY_LENGTHS
    with tempfile.TemporaryDirectory() as folder:
        model = model_folder(shape, folder, device)
        runs = []
        for resume_from in (None, "step2"):
            L.seed_everything(0)
            recorder = LossesAndMoments()
            saver = ModelCheckpoint(dirpath=f"{folder}/ckpt", filename="step{step}", every_n_train_steps=2,
                                    save_top_k=-1, save_last=False, auto_insert_metric_name=False)
            callbacks = [recorder] if resume_from else [recorder, saver]
            strategy = parallel_strategy(device, optimizer_offload=True, offload_bucket_mb=1)
            data = SyntheticSFT(model, lengths, 4, shape["vocab_size"]).build()
            trainer = fit_trainer(device, strategy, callbacks, max_steps=4, enable_checkpointing=not resume_from)
            trainer.fit(sft_task(model), datamodule=data,
                        ckpt_path=None if resume_from is None else f"{folder}/ckpt/{resume_from}.ckpt")
            runs.append(recorder)
    first, resumed = runs
    steps = sorted(resumed.losses)
    gap = max(abs(resumed.losses[s] - first.losses[s]) / abs(first.losses[s]) for s in steps)
    limit = RESUME_TOLERANCE[device.type]
    record(args.results, "quick resume offloaded losses gap", gap, "relative", f"<= {limit:g}", gap <= limit,
           f"steps {steps} resumed from step 2 vs uninterrupted, optimizer_offload on: "
           + ", ".join(f"{first.losses[s]:.6f}/{resumed.losses[s]:.6f}" for s in steps))
    where = ",".join(sorted(resumed.moments_at_start)) or "none"
    cuda = device.type == "cuda"
    record(args.results, "quick resume moments after load", where if cuda else f"n/a (cpu: {where})", "device",
           "cpu" if cuda else "", not cuda or where == "cpu",
           "AdamW's moments when training starts after the resume (offload keeps them on the host)")


CHECKS = {"memory": memory, "resume": resume}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--results", type=Path, required=True, help="JSONL file the records are appended to")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes (the CI smoke run)")
    args = parser.parse_args()
    CHECKS[args.check](args)


if __name__ == "__main__":
    main()
