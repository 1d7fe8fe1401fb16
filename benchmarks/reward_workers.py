"""Scoring N trajectories inline (``reward_workers: 0``) vs in W worker processes, in the same run.

    python benchmarks/reward_workers.py                         # code rewards in the sandbox, N=64, W=4
    python benchmarks/reward_workers.py --reward cpu --workers 2

Rewards: ``code`` runs each completion's program on two test cases in the code sandbox (`rl_lightning.rewards.code`:
two sandboxed interpreter starts per trajectory, the usual cost of code RL); ``cpu`` spends ~20 ms of pure-Python
arithmetic per trajectory (bounded by the cores available). Workers are started before timing (they live for the
whole run in training); the figure printed last is inline time / pooled time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rl_lightning.envs.environment import load_environment
from rl_lightning.envs.workers import RewardPool

ENVS = {
    "code": "from rl_lightning.rewards.code import code_reward\n\n"
            "def reward_fn(messages, answer):\n    return code_reward(messages, answer)\n",
    "cpu": "def reward_fn(messages, answer):\n    total = 0\n    for i in range(400_000):\n        total += i % 7\n"
           "    return float(total > 0)\n",
}
PROGRAM = "```python\nn = int(input())\nprint(n * n)\n```"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", choices=sorted(ENVS), default="code")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "env.py"
        path.write_text(ENVS[args.reward])
        env = load_environment(str(path))
        calls = [([{"role": "assistant", "content": PROGRAM}], [{"input": str(i), "output": str(i * i)},
                                                                 {"input": "3", "output": "9"}], f"row {i}")
                 for i in range(args.trajectories)]
        env.score_all(calls[:1])  # warm: imports, the sandbox's isolation probe
        start = time.perf_counter()
        inline = env.score_all(calls)
        inline_s = time.perf_counter() - start
        env.scorer = RewardPool(str(path), args.workers, timeout_s=60.0)
        env.score_all(calls[: args.workers])  # start the workers
        start = time.perf_counter()
        pooled = env.score_all(calls)
        pooled_s = time.perf_counter() - start
        env.scorer.close()
    assert pooled == inline and all(score == 1.0 for score, _ in pooled), "pooled scores differ from inline ones"
    print(f"{args.reward} reward, N={args.trajectories} trajectories: inline {inline_s:.2f} s, "
          f"{args.workers} workers {pooled_s:.2f} s, speed-up x{inline_s / pooled_s:.2f}")


if __name__ == "__main__":
    main()
