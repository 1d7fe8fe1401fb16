"""How long the command line's help takes, side by side with ``python -c "import lightning"`` in the same run.

    python benchmarks/cli_help.py                # 3 runs of each, the median
    python benchmarks/cli_help.py --runs 5 --json help.json
    python benchmarks/cli_help.py --rows help eval demo   # the light commands only

Each row is a fresh interpreter (``python -m rl_lightning ...``, output discarded), timed from start to exit:
``import lightning`` (the floor of anything that builds the LightningCLI parser), ``--help`` (the command overview),
``eval --help``, ``demo --help`` (argparse commands: no torch, no Lightning) and ``fit --help`` (every option of every
task and DataModule: Lightning plus the parser). Targets (issue 37): the overview, eval and demo help under 2 s on an
idle machine; fit's help close to the cost of importing Lightning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

# row name -> (what the table shows, the interpreter's arguments)
ROWS = {
    "lightning": ('python -c "import lightning"', ["-c", "import lightning"]),
    "help": ("python -m rl_lightning --help", ["-m", "rl_lightning", "--help"]),
    "eval": ("python -m rl_lightning eval --help", ["-m", "rl_lightning", "eval", "--help"]),
    "demo": ("python -m rl_lightning demo --help", ["-m", "rl_lightning", "demo", "--help"]),
    "fit": ("python -m rl_lightning fit --help", ["-m", "rl_lightning", "fit", "--help"]),
}


def seconds(args: list[str], runs: int) -> float:
    """The median wall time of `runs` fresh interpreters running `args` (each must exit 0)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each row (the median is reported)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="which rows to time")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = [{"row": name, "command": ROWS[name][0], "s": seconds(ROWS[name][1], args.runs)} for name in args.rows]
    floor = next((row["s"] for row in rows if row["row"] == "lightning"), None)
    print(f"| command | seconds (median of {args.runs}) | vs import lightning |\n| --- | --- | --- |")
    for row in rows:
        row["vs_lightning"] = None if floor is None else row["s"] / floor
        ratio = "" if floor is None else f"{row['vs_lightning']:.2f}x"
        print(f"| `{row['command']}` | {row['s']:.2f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
