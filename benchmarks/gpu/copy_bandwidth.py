"""GPU probe: pinned host <-> device copy bandwidth, one direction at a time and both at once (issue 39).

What the optimizer offload must move each step is 2 x (AdamW's two fp32 moments): this says how long that takes at
best, with the copies in and out on one side stream (serialised) or on two (the two copy engines in parallel).

    python benchmarks/gpu/copy_bandwidth.py [--gib 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn, repeats: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    args = parser.parse_args()
    n = int(args.gib * (1 << 30)) // 4
    host_in = torch.empty(n, pin_memory=True)
    host_out = torch.empty(n, pin_memory=True)
    dev_in = torch.empty(n, device="cuda")
    dev_out = torch.randn(n, device="cuda")
    one, two = torch.cuda.Stream(), torch.cuda.Stream()
    gib = n * 4 / (1 << 30)

    def h2d() -> None:
        with torch.cuda.stream(one):
            dev_in.copy_(host_in, non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(one):
            host_out.copy_(dev_out, non_blocking=True)

    def same_stream() -> None:
        with torch.cuda.stream(one):
            dev_in.copy_(host_in, non_blocking=True)
            host_out.copy_(dev_out, non_blocking=True)

    def two_streams() -> None:
        with torch.cuda.stream(one):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(two):
            host_out.copy_(dev_out, non_blocking=True)

    for name, fn, moved in (("h2d", h2d, gib), ("d2h", d2h, gib), ("both, one stream", same_stream, 2 * gib),
                            ("both, two streams", two_streams, 2 * gib)):
        seconds = timed(fn)
        print(f"copy {name:18s} {moved:5.2f} GiB in {seconds:.4f} s = {moved / seconds:6.1f} GiB/s", flush=True)


if __name__ == "__main__":
    main()
