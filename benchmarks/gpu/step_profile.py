"""GPU check: where an SFT step's time and memory go (the ``sft`` check's Qwen2.5-1.5B shape, checkpointing off).

The same model, packed 16,384-token micro-batch and FSDP2 bf16 wrapping as `train.py`'s ``sft`` check. Measured:

- the output head both ways: chunked (``lm_head_chunk`` 1024, the SFT and PPO tasks' default: the logits are never
  built whole) and full (``null``: (tokens x vocab) logits): tokens/s, MFU and peak memory of each;
- the step's phases with CUDA synchronised between them (forward + loss, backward, gradient clipping, AdamW): the
  median seconds of 3 steps;
- AdamW's ``foreach`` (torch's default, the project's) against ``fused`` on the same sharded parameters: seconds
  per optimizer step;
- one step under ``torch.profiler``: the GPU-busy share of the step's wall time (kernel time / wall; the rest is
  the host launching kernels or waiting) and the kernel time per category (matrix products, attention, the
  optimizer's multi-tensor kernels, copies, other element-wise and reduction kernels), and the ten longest kernels;
- with ``--compile``, the chunked-head step again with every decoder block compiled (``ParallelStrategy(compile=True)``:
  torch.compile per block before FSDP2): tokens/s, MFU, peak memory and the first step's seconds (compilation
  included) next to the eager row of the same run, and the compiled step's kernel time per category.

    python benchmarks/gpu/step_profile.py --results RESULTS.jsonl [--dry] [--compile]   # --dry: CPU, tiny shape
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import train
from table import record

CATEGORIES = (("attention", ("flash", "fmha", "attention")), ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
              ("optimizer", ("multi_tensor", "foreach", "fused_adam")), ("copy", ("memcpy", "memset", "copy")))


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "elementwise/reduction")


def phases(model, optimizer, batch, num_tokens, chunk, device) -> dict[str, float]:
    """Seconds of forward + loss, backward, clipping and the optimizer in one step, synchronised between them."""
    from rl_lightning.algorithms import sft_loss
    from rl_lightning.models.logprobs import target_logprobs
    from rl_lightning.models.optim import clip_grad_norm

    marks = [time.perf_counter()]

    def mark() -> None:
        train.synchronize(device)
        marks.append(time.perf_counter())

    loss, _ = sft_loss(target_logprobs(model, batch, chunk_size=chunk)[0], batch["target_mask"], num_tokens)
    mark()
    loss.backward()
    mark()
    clip_grad_norm(model.parameters(), 1.0)
    mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()
    return dict(zip(("forward", "backward", "clip", "optimizer"), (b - a for a, b in zip(marks, marks[1:], strict=False)),
                    strict=True))


def shard(model, device, compile: bool):
    """FSDP2 over this one process as `train.shard` does (bf16 on CUDA, no checkpointing), compiled per block if asked."""
    from torch.distributed.device_mesh import init_device_mesh

    from rl_lightning.parallel.parallelize import parallelize
    from rl_lightning.parallel.strategy import ParallelStrategy

    strategy = ParallelStrategy(mixed_precision="bf16" if device.type == "cuda" else None, compile=compile)
    strategy.fsdp_mesh = init_device_mesh(device.type, (1,))
    return parallelize(model, strategy)


def measure(shape, batch, sizes, chunk, device, steps, fused=False, compile=False) -> dict:
    from rl_lightning.models.optim import adamw

    gc.collect()  # the last configuration's model and optimizer are gone before the peak counter restarts
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = train.build_model(shape, device)
    flops = train.step_flops(model, sizes, int((batch["target_mask"] > 0).any(0).sum()))
    model = shard(model, device, compile)
    optimizer = adamw(model, 1e-5, 0.0, (0.9, 0.95), 1e-8)
    if fused:
        for group in optimizer.param_groups:
            group["foreach"], group["fused"] = False, True
    num_tokens = float(batch["target_mask"].sum())
    runs = []
    for _ in range(steps):
        train.synchronize(device)
        runs.append(phases(model, optimizer, batch, num_tokens, chunk, device))
    first, runs = sum(runs[0].values()), runs[2:]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["step"] = statistics.median(sum(r.values()) for r in runs)
    out["flops"], out["first"] = flops, first
    out["peak"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    out["_model"], out["_optimizer"], out["num_tokens"] = model, optimizer, num_tokens
    return out


def profile_step(run: dict, batch, chunk, device) -> tuple[float, dict[str, float], list[tuple[str, float]]]:
    """(wall seconds, kernel seconds per category, the ten longest kernels) of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        phases(run["_model"], run["_optimizer"], batch, run["num_tokens"], chunk, device)
        wall = time.perf_counter() - start
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if getattr(event, "is_user_annotation", False) or "#" in event.name:
            continue  # ranges such as "Optimizer.step#AdamW.step" on the GPU timeline span kernels counted already
        if device.type == "cuda" and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.time_range.elapsed_us() / 1e6
        elif device.type != "cuda" and event.device_type == torch.autograd.DeviceType.CPU and not event.cpu_children:
            kernels[event.name] += event.self_cpu_time_total / 1e6  # CPU dry run: leaf ops stand in for kernels
    per_category: dict[str, float] = defaultdict(float)
    for name, seconds in kernels.items():
        per_category[category(name)] += seconds
    return wall, dict(per_category), sorted(kernels.items(), key=lambda kv: -kv[1])[:10]


def record_kernels(results: Path, label: str, run: dict, batch, device) -> None:
    """Profile one step of `run` (chunked head): the GPU-busy share, kernel time per category, the longest kernels."""
    wall, per_category, longest = profile_step(run, batch, 1024, device)
    busy = sum(per_category.values())
    record(results, f"{label} GPU busy share", round(100 * busy / wall, 1), "%",
           detail=f"{busy:.3f} s of kernels in a {wall:.3f} s step (profiled)")
    for name, seconds in sorted(per_category.items(), key=lambda kv: -kv[1]):
        record(results, f"{label} kernels {name}", round(100 * seconds / busy, 1), "%", detail=f"{seconds:.4f} s")
    for name, seconds in longest:
        print(f"    {seconds * 1e3:9.2f} ms  {name[:150]}")


def record_step(results: Path, label: str, run: dict, tokens: int, peak_flops: float | None, extra: str = "") -> None:
    """The tokens/s record of `run` (step time, MFU, phases in the detail) and its peak memory where measured."""
    mfu = f", MFU {100 * run['flops'] / run['step'] / peak_flops:.1f}%" if peak_flops else ""
    record(results, f"{label} tokens/s", round(tokens / run["step"]), "tok/s",
           detail=f"step {run['step']:.3f} s{mfu}; " + ", ".join(f"{k} {run[k]:.3f} s" for k in
                                                                 ("forward", "backward", "clip", "optimizer")) + extra)
    if run["peak"] is not None:
        record(results, f"{label} peak memory", round(run["peak"], 2), "GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="JSONL file the records are appended to")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shape (the CI smoke run)")
    parser.add_argument("--compile", action="store_true", help="also the chunked-head step with compiled blocks")
    args = parser.parse_args()
    device = train.setup(args.dry)
    shape = (train.DRY_SHAPES if args.dry else train.SHAPES)[train.MFU_SHAPE]
    tokens, lengths, steps = (1024, (32, 256), 4) if args.dry else (16384, (512, 4096), 5)
    batch, sizes = train.packed_batch(shape["vocab_size"], tokens, lengths, seed=1, device=device)
    peak = train.peak_flops(device)
    label = f"profile {train.MFU_SHAPE}"
    chunked: dict = {}
    for chunk in (None, 1024):  # full first: its model is dropped before the chunked one is built and kept
        chunked.clear()
        chunked.update(measure(shape, batch, sizes, chunk, device, steps))
        record_step(args.results, f"{label} head={'chunk1024' if chunk else 'full'}", chunked, tokens, peak)
    eager = {k: chunked[k] for k in ("step", "peak")}
    record_kernels(args.results, label, chunked, batch, device)
    chunked.clear()
    fused = measure(shape, batch, sizes, 1024, device, 4, fused=True)
    record(args.results, f"{label} AdamW fused step", round(fused["optimizer"], 4), "s",
           detail="foreach (the default) in the head=chunk1024 row's optimizer phase")
    fused.clear()
    if args.compile:
        compiled = measure(shape, batch, sizes, 1024, device, steps, compile=True)
        memory = f", peak {compiled['peak'] / eager['peak']:.2f}x" if eager["peak"] else ""
        record_step(args.results, f"{label} head=chunk1024 compiled", compiled, tokens, peak,
                    extra=f"; {eager['step'] / compiled['step']:.2f}x eager's tokens/s{memory}; first step "
                          f"{compiled['first']:.1f} s (compilation)")
        record_kernels(args.results, f"{label} compiled", compiled, batch, device)
        compiled.clear()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
