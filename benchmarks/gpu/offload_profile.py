"""GPU probe: where an offloaded SFT step's time goes (issue 39.4), one configuration at a time.

Builds `offload.py`'s model and batch (Qwen3-0.6B shape, one packed micro-batch of 8192 tokens, bf16 FSDP2 over one
process), trains `--steps` steps with the chosen offload and prints each step's seconds, then profiles one more step
and prints the host calls and kernels that took longest (``cudaHostAlloc`` counts pinned allocations: after the
first step there should be none; ``Memcpy DtoH/HtoD`` is the copy volume the step must hide).

    python benchmarks/gpu/offload_profile.py --config activations [--steps 4]
"""

from __future__ import annotations

import argparse
import time

from offload import CONFIGS
from train import QWEN3_0_6B, build_model, packed_batch, setup, synchronize, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="activations")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from rl_lightning.models.optim import adamw
    from rl_lightning.parallel.offload import OptimizerStateOffload
    from rl_lightning.parallel.parallelize import parallelize
    from rl_lightning.parallel.strategy import ParallelStrategy

    device = setup(False)
    batch, _ = packed_batch(QWEN3_0_6B["vocab_size"], 8192, (64, 1024), seed=3, device=device)
    strategy = ParallelStrategy(mixed_precision="bf16", **CONFIGS[args.config])
    strategy.fsdp_mesh = init_device_mesh("cuda", (1,))
    model = parallelize(build_model(QWEN3_0_6B, device), strategy)
    optimizer = adamw(model, 1e-5, 0.0, (0.9, 0.95), 1e-8)
    if strategy.optimizer_offload:
        OptimizerStateOffload(optimizer, strategy.offload_bucket_mb << 20)
    tokens = float(batch["target_mask"].sum())
    for step in range(args.steps):
        start = time.perf_counter()
        train_step(model, optimizer, batch, tokens)
        synchronize(device)
        print(f"{args.config} step {step}: {time.perf_counter() - start:.3f} s", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(model, optimizer, batch, tokens)
        synchronize(device)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=48))


if __name__ == "__main__":
    main()
