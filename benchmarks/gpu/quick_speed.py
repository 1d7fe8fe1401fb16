"""Quick GPU checks of speed through the real task path (`run.sh --quick`): SFT MFU and the RL trainer's throughput.

- ``sft``: the `SFT` task under ``ParallelStrategy(mixed_precision="bf16", compile=True)`` and a Lightning Trainer on
  a random-init Qwen2.5-1.5B-shaped model (fp32 masters, bf16 compute), one packed micro-batch of 16,384 tokens per
  step (`task_fits.SFT_LENGTHS`, loss on the last 3/4 of each sequence). Step time: the median of the steps after
  `WARMUP` (the first compiles). MFU: `train.step_flops` (6 x linear weights x tokens + the head at the target
  positions + causal attention) / step time / the device's dense bf16 peak (`train.PEAK_BF16`). Target >= 40%.
- ``rl``: the `PPO` task's step (Dr. GRPO's policy-gradient loss: one update per rollout, no KL, so no extra
  scoring pass) on prime-rl's published benchmark shape: Qwen3-0.6B, 16,384 tokens per step (2 prompts x 4
  completions, each trajectory 2,048 tokens), synthetic rollouts (`task_fits.SyntheticRollouts`: no generation),
  the same strategy. prime-rl reports 11.9k tokens/s and 11.1% MFU on one H100; the target is twice that. The rows
  name the device (``nvidia-h100-x1``): the comparison is fair only on an H100.

``--dry``: CPU, 2-layer stand-ins of the same shapes and 1,024 tokens per step, eager (inductor on CPU costs 10-50 s
per process; tests/parallel/test_compile.py covers the compiled path on CPU); MFU is n/a (no peak).

    python benchmarks/gpu/quick_speed.py {sft,rl} --results RESULTS.jsonl [--dry]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from table import record
from task_fits import (
    DRY_SFT_LENGTHS,
    SFT_LENGTHS,
    SyntheticRollouts,
    SyntheticSFT,
    fit_trainer,
    model_folder,
    parallel_strategy,
    peak_allocated,
    ppo_task,
    prompt_data,
    sft_task,
    step_seconds,
)
from train import (
    DRY_SHAPES,
    MFU_TARGET,
    QWEN2_5_1_5B,
    QWEN3_0_6B,
    StepTimer,
    build_model,
    peak_flops,
    setup,
    step_flops,
)

WARMUP, MEASURED = 2, 4  # steps: the first compiles (and the second may recompile for the backward's shapes)
PRIME_RL = {"tokens/s": 11.9e3, "MFU": 11.1}  # Qwen3-0.6B, 16k tokens per step, one H100 (prime-rl's benchmark)
RL_PROMPTS, RL_GROUP, RL_SEQUENCE = 2, 4, 2048
DRY_RL_SEQUENCE = 128


def device_tag(device: torch.device) -> str:
    """``nvidia-h100-x1``: the device's make and model and the number used (one), for the rows' names."""
    if device.type != "cuda":
        return "cpu-x1"
    words = torch.cuda.get_device_name(device).lower().replace("_", " ").split()
    return "-".join(words[:2]) + "-x1"


def meta_flops(shape: dict, lengths: list[int], head_positions: int) -> float:
    """`train.step_flops` of `shape` (built on the meta device: no memory) for packed sequences of `lengths`."""
    return step_flops(build_model(shape, torch.device("meta")), lengths, head_positions)


def throughput_rows(path: Path, name: str, tokens: int, seconds: list[float], flops: float, device: torch.device,
                    speed_target: float | None, mfu_target: float | None, note: str) -> None:
    """tokens/s and MFU rows; the targets (minimum tokens/s, minimum MFU %) are checked on CUDA only."""
    import statistics

    median = statistics.median(seconds[WARMUP:])
    peak, cuda = peak_flops(device), device.type == "cuda"
    detail = (f"median step {median:.3f} s of {len(seconds) - WARMUP} after {WARMUP} warm-up steps (first "
              f"{seconds[0]:.1f} s); {tokens} tokens/step; {flops / tokens / 1e9:.3g} GFLOP/token; {note}")
    record(path, f"{name} tokens/s", tokens / median, "tok/s", "" if speed_target is None else f">= {speed_target:,.0f}",
           not cuda or speed_target is None or tokens / median >= speed_target, detail)
    target = "" if mfu_target is None else f">= {mfu_target:g}%"
    if peak is None:
        record(path, f"{name} MFU", "n/a", "%", target, not cuda,
               "dry run: no peak FLOP/s on CPU" if not cuda else "no peak FLOP/s known for this device")
    else:
        mfu = 100 * flops / median / peak
        record(path, f"{name} MFU", mfu, "%", target, mfu_target is None or mfu >= mfu_target,
               f"of {peak / 1e12:.0f} TFLOP/s dense bf16")


def memory_row(path: Path, name: str, task: Any, device: torch.device) -> None:
    """The measured CUDA peak of the fit, with the memory plan's prediction in the detail."""
    plan = getattr(task, "memory_plan", None)
    predicted = f"memory plan {plan.peak / 2**30:.2f} GiB (it does not model compile)" if plan is not None else "no plan"
    peak = peak_allocated(device)
    record(path, f"{name} peak memory", "n/a (cpu)" if peak is None else peak / 2**30, "GiB", "", True, predicted)


def sft(args: argparse.Namespace) -> None:
    device = setup(args.dry, process_group=False)
    shape = DRY_SHAPES["qwen2.5-1.5b"] if args.dry else QWEN2_5_1_5B
    lengths = list(DRY_SFT_LENGTHS if args.dry else SFT_LENGTHS)
    timer = StepTimer(device)
    with tempfile.TemporaryDirectory() as folder:
        model = model_folder(shape, folder, device)
        data = SyntheticSFT(model, lengths, WARMUP + MEASURED, shape["vocab_size"]).build()
        task = sft_task(model)
        strategy = parallel_strategy(device, compile=not args.dry)
        trainer = fit_trainer(device, strategy, [timer], max_steps=WARMUP + MEASURED)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer.fit(task, datamodule=data)
    _, seconds = step_seconds(timer, WARMUP)
    flops = meta_flops(shape, lengths, sum(n - n // 4 for n in lengths))
    micro = timer.steps[-1].get("train/micro_batches", float("nan"))
    name = "quick sft qwen2.5-1.5b"
    throughput_rows(args.results, name, sum(lengths), seconds, flops, device, None, MFU_TARGET,
                    f"SFT task + ParallelStrategy(compile={not args.dry}); {micro:.0f} micro-batch(es); loss "
                    f"{timer.steps[0]['train/loss']:.3f} -> {timer.steps[-1]['train/loss']:.3f}")
    memory_row(args.results, name, task, device)


def rl(args: argparse.Namespace) -> None:
    device = setup(args.dry, process_group=False)
    shape = DRY_SHAPES["qwen3-0.6b"] if args.dry else QWEN3_0_6B
    sequence = DRY_RL_SEQUENCE if args.dry else RL_SEQUENCE
    tokens = RL_PROMPTS * RL_GROUP * sequence
    timer, rollouts = StepTimer(device), SyntheticRollouts(RL_GROUP, sequence, shape["vocab_size"])
    with tempfile.TemporaryDirectory() as folder:
        model = model_folder(shape, folder, device)
        task = ppo_task(model, WARMUP + MEASURED, RL_GROUP, sequence, tokens)
        trainer = fit_trainer(device, parallel_strategy(device, compile=not args.dry), [timer, rollouts], max_epochs=1)
        trainer.fit(task, datamodule=prompt_data(model, RL_PROMPTS))
    _, seconds = step_seconds(timer, WARMUP)
    flops = meta_flops(shape, rollouts.lengths, rollouts.completion_tokens)
    tag = device_tag(device)
    fair = "" if tag == "nvidia-h100-x1" else f"; prime-rl measured on nvidia-h100-x1, this is {tag}"
    throughput_rows(args.results, f"quick rl qwen3-0.6b {tag}", tokens, seconds, flops, device,
                    2 * PRIME_RL["tokens/s"], 2 * PRIME_RL["MFU"],
                    f"PPO task, Dr. GRPO loss, synthetic rollouts of {RL_PROMPTS}x{RL_GROUP}x{sequence} tokens; "
                    f"target 2x prime-rl ({PRIME_RL['tokens/s']:,.0f} tok/s, {PRIME_RL['MFU']}% MFU){fair}")
    memory_row(args.results, f"quick rl qwen3-0.6b {tag}", task, device)


CHECKS = {"sft": sft, "rl": rl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--results", type=Path, required=True, help="JSONL file the records are appended to")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes (the CI smoke run)")
    args = parser.parse_args()
    CHECKS[args.check](args)


if __name__ == "__main__":
    main()
