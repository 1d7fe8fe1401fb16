"""Lean activations (`rl_lightning.models.lean`) vs the stock modules: one training forward + backward of SmolLM2-135M.

SmolLM2-135M-Instruct (fp32, ``rl_varlen`` attention, the chunked output head of ``model.lm.lm_head_chunk: 1024`` so the
logits do not dominate) on a packed micro-batch of N tokens (sequences of 512), the loss the mean log-probability of
the tokens. Stock and lean each run in their own process, so a peak RSS is its own: the peak is the RSS high-water
mark above the process's RSS after a 64-token warm-up (lazy imports, the gradients allocated) and before the first
measured forward. ``saved MiB``: the tensors the forward saved for the backward (saved_tensors_hooks, storages counted
once, parameters excluded). Time: the median of `--repeats` forward + backward passes after one warm-up at N, wall
clock and CPU time (one thread: CPU time is the work done, steadier on a shared machine; the ratio column uses it).
The gradients of both are compared (they are bitwise equal).

    OMP_NUM_THREADS=1 python benchmarks/lean_activations.py              # N = 1k, 2k, 4k (~8 GB peak at 4k stock)
    OMP_NUM_THREADS=1 python benchmarks/lean_activations.py --quick      # smoke scale (the tiny model)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL, TINY = "asset:SmolLM2-135M-Instruct", str(ROOT / "rl_lightning" / "assets" / "tiny-qwen2")


def _micro_batch(n: int, vocab: int, seed: int = 0) -> dict:
    import torch

    from rl_lightning.data.steps import pack
    from rl_lightning.data.tokenization import TokenizedExample

    gen = torch.Generator().manual_seed(seed)
    lengths = [512] * (n // 512) + ([n % 512] if n % 512 else [])
    batch = pack([TokenizedExample(torch.randint(3, vocab, (k,), generator=gen).tolist(), [1] * k) for k in lengths],
                 pad_token_id=0)
    batch["target_ids"] = batch["input_ids"].roll(-1, 1)
    return batch


def _step(model, batch: dict) -> None:
    from rl_lightning.models.logprobs import target_logprobs

    logprobs, _ = target_logprobs(model, batch, chunk_size=1024)
    (-logprobs.mean()).backward()


def _saved_mib(model, batch: dict) -> float:
    """MiB the forward saves for the backward: storages once, parameters never."""
    import torch

    from rl_lightning.models.logprobs import target_logprobs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack_hook(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        target_logprobs(model, batch, chunk_size=1024)
    return sum(seen.values()) / 2**20


def measure(model_name: str, n: int, lean: bool, repeats: int) -> dict:
    """Seconds per forward + backward (median), peak RSS MiB above the start and saved MiB, in this process."""
    import torch

    from rl_lightning.models.lean import apply_lean_activations
    from rl_lightning.models.loading import load_causal_lm

    model = load_causal_lm(model_name, lean_activations=False)  # the stock model; patched here when `lean`
    patched = apply_lean_activations(model) if lean else 0
    vocab = model.config.vocab_size
    _step(model, _micro_batch(64, vocab, seed=1))  # lazy imports and first allocations, far below the peak
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    batch = _micro_batch(n, vocab)
    times, cpu_times = [], []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=False)
        begin, cpu_begin = time.perf_counter(), time.process_time()
        _step(model, batch)
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss) / 2**10
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"n": n, "lean": lean, "patched": patched, "s": statistics.median(times[1:]),
            "cpu_s": statistics.median(cpu_times[1:]), "peak_mib": peak, "saved_mib": _saved_mib(model, batch),
            "grad_hash": float(grads.double().abs().sum()), "grad_head": grads[:8].tolist()}


def _child(model_name: str, n: int, lean: bool, repeats: int) -> dict:
    args = [sys.executable, __file__, "--one", json.dumps([model_name, n, lean, repeats])]
    out = subprocess.run(args, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096", help="comma-separated N (tokens in the micro-batch)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke scale: the tiny model, N 256/512")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(*json.loads(args.one))))
        return
    model_name, sizes = REAL, [int(s) for s in args.sizes.split(",")]
    if args.quick:
        model_name, sizes = TINY, [256, 512]
    print(f"{model_name}, fp32, chunked head (1024), one process each, {args.repeats} timed pass(es)\n")
    print("| N | stock s (CPU s) | lean s (CPU s) | lean / stock CPU time | stock peak MiB | lean peak MiB "
          "| lean / stock peak | stock saved MiB | lean saved MiB | lean / stock saved |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in sizes:
        stock, lean = (_child(model_name, n, flag, args.repeats) for flag in (False, True))
        row = {"n": n, "patched": lean["patched"], "stock_s": stock["s"], "lean_s": lean["s"],
               "stock_cpu_s": stock["cpu_s"], "lean_cpu_s": lean["cpu_s"],
               "time_ratio": lean["cpu_s"] / stock["cpu_s"], "stock_mib": stock["peak_mib"],
               "lean_mib": lean["peak_mib"], "memory_ratio": lean["peak_mib"] / max(stock["peak_mib"], 1),
               "stock_saved_mib": stock["saved_mib"], "lean_saved_mib": lean["saved_mib"],
               "saved_ratio": lean["saved_mib"] / stock["saved_mib"],
               "same_gradients": (stock["grad_hash"], stock["grad_head"]) == (lean["grad_hash"], lean["grad_head"])}
        rows.append(row)
        print(f"| {n} | {row['stock_s']:.2f} ({row['stock_cpu_s']:.2f}) | {row['lean_s']:.2f} "
              f"({row['lean_cpu_s']:.2f}) | {row['time_ratio']:.2f}x | {row['stock_mib']:.0f} | {row['lean_mib']:.0f} "
              f"| {row['memory_ratio']:.2f}x | {row['stock_saved_mib']:.0f} | {row['lean_saved_mib']:.0f} "
              f"| {row['saved_ratio']:.2f}x |", flush=True)
    if not all(r["same_gradients"] for r in rows):
        print("WARNING: lean and stock gradients differ")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model_name, "rows": rows}))


if __name__ == "__main__":
    main()
