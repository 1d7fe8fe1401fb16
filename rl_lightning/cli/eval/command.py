"""The command line of ``python -m rl_lightning eval``; bad input is one line on stderr and exit status 2.

For example ``python -m rl_lightning eval --model asset:SmolLM2-135M-Instruct --data
'reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2&test_size=64&split=test' --n 8 --k 1 4 8
--temperature 0.7 --max-new-tokens 32 --json eval.json --mlflow sqlite:///mlflow.db``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from rl_lightning.errors import UserError

# The engines `evaluate` knows (`rl_lightning.cli.eval.evaluate.ENGINES`, a test checks they agree): written here so
# that ``eval --help`` imports no torch (the evaluation's modules load when it runs).
ENGINES = ("auto", "vllm", "hf")


class _Parser(argparse.ArgumentParser):
    """Command-line errors as one line (``rl_lightning: error: ...``), exit status 2, no usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"rl_lightning: error: {message}; see python -m rl_lightning eval --help\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``eval`` command's argument parser."""
    p = _Parser(prog="python -m rl_lightning eval", allow_abbrev=False,
                description="Held-out accuracy, pass@k and mean reward of a model on a data set: greedy (T=0) and "
                            "n sampled completions per prompt, scored by an environment's reward_fn.")
    p.add_argument("--model", required=True, help="model folder, a run's folder or its export/, asset:<name> "
                   "(asset:SmolLM2-135M-Instruct), a .gguf file or a hub id")
    p.add_argument("--data", required=True, help="prompts with answers: any data path fit accepts (jsonl, csv, "
                   "parquet, a save_to_disk folder, a hub name, reasoning_gym:<task>?...&split=test)")
    p.add_argument("--env", help="Python file defining reward_fn(messages, answer) -> float or dict of components "
                   "(default: the rows' built-in reward; reasoning-gym rows have one)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="vllm, hf (transformers), or auto: vllm when installed and it supports the model here")
    p.add_argument("--n", type=int, default=4, help="sampled completions per prompt (0: greedy only)")
    p.add_argument("--k", type=int, nargs="+", help="pass@k for each k (1 <= k <= n; default: 1 and n)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the n samples")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per completion at most")
    p.add_argument("--limit", type=int, help="evaluate only the first LIMIT rows")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (a prompt's samples use seed + its row index)")
    p.add_argument("--threshold", type=float, default=1.0, help="a completion is correct when its 'correct' reward "
                   "component (or the reward, without one) is at least this")
    p.add_argument("--reward-weights", help="JSON weights of the reward's components, e.g. '{\"correct\": 1, "
                   "\"format\": 0.5}' (default: each 1)")
    p.add_argument("--split", default="train", help="split of a hub dataset or save_to_disk folder")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="feed the prompt's message contents concatenated (base models) instead of the chat template")
    p.add_argument("--max-turns", type=int, default=1, help="assistant turns per conversation (an env with interact)")
    p.add_argument("--batch-size", type=int, default=64, help="prompts per generation call")
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="vLLM's KV cache on CPU, in bytes")
    p.add_argument("--json", help="also write the result (settings and metrics) to this JSON file")
    p.add_argument("--mlflow", metavar="TRACKING_URI", help="also log to MLflow, e.g. sqlite:///mlflow.db")
    p.add_argument("--experiment", default="rl_lightning/eval", help="MLflow experiment of a new run")
    p.add_argument("--run-name", help="MLflow run name (default: eval-<model folder name>)")
    p.add_argument("--run-id", help="log into this existing MLflow run instead (e.g. the model's training run)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments, the package's own files resolved.

    ``rl_lightning/assets/...`` and the example environments ``rl_lightning/recipes/envs/...`` name the installed
    package's files from any folder (`rl_lightning.assets.package_files`).
    """
    from rl_lightning.assets.package_files import resolve_reference

    args = build_parser().parse_args(argv)
    for key in ("model", "data", "env"):
        if getattr(args, key) is not None:
            setattr(args, key, resolve_reference(getattr(args, key)))
    return args


def run(argv: list[str] | None = None) -> int:
    """Parse `argv`, evaluate, print the table, write/log the result; returns the exit status (0)."""
    args = parse(argv)
    from rl_lightning.cli.eval.evaluate import EvalConfig, evaluate
    from rl_lightning.cli.eval.report import log_to_mlflow, table, write_json

    reporting = {"json", "mlflow", "experiment", "run_name", "run_id"}
    config = EvalConfig(**{k: v for k, v in vars(args).items() if k not in reporting})
    config.check()  # before any model loads
    result = evaluate(config)
    print(table(result), flush=True)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.mlflow:
        run_id = log_to_mlflow(result, args.mlflow, args.experiment, args.run_name, args.run_id)
        print(f"logged to MLflow run {run_id} ({args.mlflow})")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m rl_lightning eval``: a `UserError` ends in one line on stderr and exit status 2."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        raise SystemExit(run(argv))
    except UserError as e:
        print(f"rl_lightning: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
