"""The GPU checks' records (JSONL, one per check, written by benchmarks/gpu/train.py and attention.py): writing one,
and printing them all as one table.

    python benchmarks/gpu/table.py RESULTS.jsonl [--dry]        # the table, the device line; exit 1 if a check failed
    python benchmarks/gpu/table.py RESULTS.jsonl --add-failure NAME --log LOG [--reason TEXT]

``--add-failure`` appends a failed record for a check that crashed or timed out, with the last line of its log (the
error's message), so the table shows it next to the checks that ran.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
from pathlib import Path

COLUMNS = ("check", "value", "unit", "target", "ok")


def record(path: Path, check: str, value: float | str, unit: str = "", target: str = "", ok: bool = True,
           detail: str = "") -> None:
    """Append ``{"check", "value", "unit", "target", "ok"[, "detail"]}`` to `path` (a non-finite value fails) and
    echo it."""
    if isinstance(value, float) and not math.isfinite(value):
        value, ok = str(value), False
    row = {"check": check, "value": value, "unit": unit, "target": target, "ok": bool(ok)}
    if detail:
        row["detail"] = detail
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_value(value: float | str) -> str:
    if isinstance(value, str):
        return value
    if value == 0 or 1e-2 <= abs(value) < 1e6:
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:.2e}"


def environment() -> str:
    """One line: device, torch (and its CUDA), transformers, lightning, Python."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    versions = []
    for name in ("transformers", "lightning"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    return f"device: {device} | torch {torch.__version__}{cuda} | {' | '.join(versions)} | python {platform.python_version()}"


def render(rows: list[dict]) -> str:
    cells = [[r["check"], format_value(r["value"]), r.get("unit", ""), r.get("target", ""),
              "ok" if r["ok"] else "FAIL", r.get("detail", "")] for r in rows]
    header = [*COLUMNS, "detail"]
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(COLUMNS))]
    right = {1}  # values align right

    def line(row: list[str]) -> str:
        parts = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row[:-1], widths, strict=True))]
        return "  ".join(parts + [row[-1]]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(c) for c in cells)])


def add_failure(path: Path, name: str, log: Path, reason: str) -> None:
    lines = [s.strip() for s in log.read_text(errors="replace").splitlines() if s.strip()] if log.exists() else []
    record(path, name, "failed", ok=False, detail=f"{reason}: {lines[-1] if lines else 'no output'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--dry", action="store_true", help="say that the values come from the CPU dry run")
    parser.add_argument("--add-failure", metavar="NAME", help="append a failed record for check NAME and exit")
    parser.add_argument("--log", type=Path, help="--add-failure: the check's output; its last line is the error")
    parser.add_argument("--reason", default="crashed", help="--add-failure: what happened (exit status, timeout)")
    args = parser.parse_args()
    if args.add_failure:
        add_failure(args.results, args.add_failure, args.log or Path("/nonexistent"), args.reason)
        return 0
    rows = load(args.results) if args.results.exists() else []
    if args.dry:
        print("DRY RUN: CPU, 2-layer stand-ins for the named shapes; values check the code path, not performance")
    print(render(rows) if rows else "no results")
    print(environment())
    failed = [r["check"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks ok" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
