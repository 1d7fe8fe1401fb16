"""Chunked vs full output head: time and peak memory of `target_logprobs` forward + backward.

SmolLM2-135M's head shapes (hidden 576, vocabulary 49152, tied to the input embedding, fp32) on synthetic tensors:
a stand-in model (embedding, one trainable hidden x hidden projection, the tied head) so the head dominates. Every
(N, path, head) runs in its own process, so its peak RSS is its own; the peak is the RSS high-water mark above the
process's RSS after an 8-position warm-up (lazy imports, the weights' gradients allocated) and before the first
measured forward.
``trained``: the tied head is trained (full fine-tuning); ``frozen``: it is not (LoRA, or a reference) and only the
hidden states need a gradient. Time: the median of `--repeats` forward + backward passes after one warm-up, wall
clock and CPU time of the process (one thread: CPU time is the work done, steadier on a shared machine; the ratio
column uses it).

    OMP_NUM_THREADS=1 python benchmarks/lm_head_chunk.py            # N = 1k, 4k, 16k (~15 min, ~13 GB at 16k full)
    OMP_NUM_THREADS=1 python benchmarks/lm_head_chunk.py --quick    # smoke scale (tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, VOCAB = 576, 49152  # SmolLM2-135M


def _model(hidden: int, vocab: int, head: str):
    import torch

    class HeadLM(torch.nn.Module):
        """input ids -> embedding -> one hidden x hidden projection -> tied output head (the transformers calls)."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, hidden)
            self.proj = torch.nn.Linear(hidden, hidden, bias=False)
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
            self.lm_head.weight = self.embed.weight
            torch.nn.init.normal_(self.embed.weight, std=0.02)
            self.embed.weight.requires_grad_(head == "trained")

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

        def forward(self, input_ids, logits_to_keep, **_):
            hidden_states = self.proj(self.embed(input_ids))
            return types.SimpleNamespace(logits=self.lm_head(hidden_states[:, logits_to_keep]))

    return HeadLM()


def measure(n: int, chunk: int | None, head: str, hidden: int, vocab: int, repeats: int) -> dict:
    """Seconds per forward + backward (median) and peak RSS MiB above the start, in this process."""
    import torch

    from rl_lightning.models.logprobs import target_logprobs

    torch.manual_seed(0)
    model = _model(hidden, vocab, head)
    ids = torch.randint(0, vocab, (1, n))
    micro_batch = {"input_ids": ids, "position_ids": torch.arange(n)[None], "target_ids": ids.roll(-1, 1),
                   "target_mask": torch.ones(1, n, dtype=torch.long)}
    small = {k: v[:, :8] for k, v in micro_batch.items()}  # lazy imports and first allocations, far below the peak
    target_logprobs(model, small, chunk_size=chunk)[0].sum().backward()
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, cpu_times = [], []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=False)
        begin, cpu_begin = time.perf_counter(), time.process_time()
        logprobs, _ = target_logprobs(model, micro_batch, chunk_size=chunk)
        (-logprobs.sum() / n).backward()
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu_begin)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss) / 2**10
    return {"n": n, "chunk": chunk, "head": head, "s": statistics.median(times[1:]),
            "cpu_s": statistics.median(cpu_times[1:]), "peak_mib": peak,
            "checksum": float(model.proj.weight.grad.double().abs().sum())}


def _child(n: int, chunk: int | None, head: str, hidden: int, vocab: int, repeats: int) -> dict:
    args = [sys.executable, __file__, "--one", json.dumps([n, chunk, head, hidden, vocab, repeats])]
    out = subprocess.run(args, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,16384", help="comma-separated N (positions through the head)")
    parser.add_argument("--chunk", type=int, default=1024, help="model.lm.lm_head_chunk of the chunked path")
    parser.add_argument("--heads", default="trained,frozen", help="trained and/or frozen")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke scale: hidden 64, vocabulary 1000, N 256/1024")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(*json.loads(args.one))))
        return
    hidden, vocab, sizes, chunk = HIDDEN, VOCAB, [int(s) for s in args.sizes.split(",")], args.chunk
    if args.quick:
        hidden, vocab, sizes, chunk = 64, 1000, [256, 1024], 128
    print(f"hidden {hidden}, vocabulary {vocab}, chunk {chunk}, fp32, torch threads: one process each\n")
    print("| N | head | full s (CPU s) | chunked s (CPU s) | chunked / full CPU time | full peak MiB | chunked peak MiB "
          "| chunked / full memory |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for head in args.heads.split(","):
        for n in sizes:
            full, chunked = (_child(n, c, head, hidden, vocab, args.repeats) for c in (None, chunk))
            same = abs(full["checksum"] - chunked["checksum"]) <= 1e-6 * abs(full["checksum"])
            row = {"n": n, "head": head, "full_s": full["s"], "chunked_s": chunked["s"], "full_cpu_s": full["cpu_s"],
                   "chunked_cpu_s": chunked["cpu_s"], "time_ratio": chunked["cpu_s"] / full["cpu_s"],
                   "full_mib": full["peak_mib"],
                   "chunked_mib": chunked["peak_mib"], "memory_ratio": chunked["peak_mib"] / max(full["peak_mib"], 1),
                   "same_gradients": same}
            rows.append(row)
            print(f"| {n} | {head} | {row['full_s']:.3f} ({row['full_cpu_s']:.3f}) | {row['chunked_s']:.3f} "
                  f"({row['chunked_cpu_s']:.3f}) | {row['time_ratio']:.2f}x | "
                  f"{row['full_mib']:.0f} | {row['chunked_mib']:.0f} | {row['memory_ratio']:.2f}x |", flush=True)
    if not all(r["same_gradients"] for r in rows):
        print("WARNING: chunked and full gradients differ beyond 1e-6 relative")
    if args.json:
        Path(args.json).write_text(json.dumps({"hidden": hidden, "vocab": vocab, "chunk": chunk, "rows": rows}))


if __name__ == "__main__":
    main()
