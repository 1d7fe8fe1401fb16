"""Per-call cost of the code sandbox's OS isolation, side by side with a bare interpreter start in the same run.

    python benchmarks/sandbox_overhead.py            # 50 calls of each
    python benchmarks/sandbox_overhead.py --calls 200

Three rows, each the median wall time of one call running ``print(input())``:
``bare``: ``python -I`` in a subprocess (what any out-of-process sandbox pays at least);
``none``: `run_sandboxed` without OS isolation (``RL_LIGHTNING_UNISOLATED_CODE=1``: resource limits + audit hook);
``bwrap``: `run_sandboxed` with bubblewrap namespaces (the default). The isolation overhead is ``bwrap - none``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from rl_lightning.rewards import isolation
from rl_lightning.rewards.sandbox import run_sandboxed


def _median_ms(call, calls: int) -> float:
    call()  # warm: caches, the isolation probe
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _sandboxed(level: str) -> float:
    isolation.isolation_level.cache_clear()
    isolation.require_isolation.cache_clear()
    path = os.environ["PATH"]
    if level == "none":
        os.environ["PATH"], os.environ[isolation.OPT_IN] = "/nonexistent", "1"  # hide bwrap
    try:
        result = run_sandboxed("print(input())", stdin="hello")
        assert result.ok and result.stdout == "hello\n", result
        assert isolation.isolation_level() == level, f"wanted {level}, got {isolation.isolation_level()}"
        return _median_ms(lambda: run_sandboxed("print(input())", stdin="hello"), ARGS.calls)
    finally:
        os.environ["PATH"] = path
        os.environ.pop(isolation.OPT_IN, None)
        isolation.isolation_level.cache_clear()
        isolation.require_isolation.cache_clear()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    ARGS = parser.parse_args()
    bare = _median_ms(lambda: subprocess.run([isolation.interpreter(), "-I", "-c", "print(input())"], input=b"hello",
                                             capture_output=True, check=True), ARGS.calls)
    none = _sandboxed("none")
    rows = [("bare", bare), ("none", none)]
    if isolation.isolation_level() == "bwrap":
        rows.append(("bwrap", _sandboxed("bwrap")))
    for name, ms in rows:
        print(f"{name:6s} {ms:7.1f} ms/call")
    if len(rows) == 3:
        print(f"isolation overhead (bwrap - none): {rows[2][1] - none:.1f} ms/call")
