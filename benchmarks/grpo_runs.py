"""The setup the real-model GRPO benchmarks share: their flags, the fit config, child processes, evaluation, MLflow.

`benchmarks/real_grpo.py`, `benchmarks/sanity.py` and `benchmarks/curriculum.py` train SmolLM2-135M-Instruct with
``recipes/real/grpo.yaml`` through the CLI and evaluate with ``python -m rl_lightning eval``'s code, every measurement
in its own process (vLLM owns its process). This module holds what they have in common:

- `parser` / `parse`: the shared flags (task, sizes, budget, sampling, engine, threads, seed) and ``--smoke``, which
  swaps in the bundled tiny model and a budget of seconds (one rollout of 2 prompts x 2 completions, the
  transformers engine, no TRL) so that tests can run each script end to end;
- `fit_config` / `fit`: the recipe with the benchmark's budget, its own MLflow store and export folder, run by the
  CLI; `metric_series` reads the run's curves back;
- `run_command` / `child`: a command or a ``--_<mode>`` re-run of the calling script in a fresh process, with the
  thread count pinned, its output kept in the work folder;
- `evaluate`: held-out greedy (and sampled, pass@K) accuracy of a model folder;
- `kept`: a step's JSON result kept in the work folder with the settings that made it, so a stopped run (a sweep of
  hours) restarts where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = "asset:SmolLM2-135M-Instruct"
TASK = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2"
WEIGHTS = {"correct": 1.0, "format": 0.5}
ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "reasoning_gym_env.py")
# --smoke: the bundled tiny model (random weights: accuracies are about 0) and a budget of seconds
SMOKE = {"model": str(REPO / "rl_lightning" / "assets" / "tiny-qwen2"), "train_size": 8, "test_size": 4,
         "rollouts": 1, "prompts": 2, "group": 2, "max_new_tokens": 8, "samples": 2, "engine": "hf", "threads": 1,
         "skip_trl": True}


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every real-model GRPO benchmark takes (each script adds its own and may change the defaults)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=MODEL, help="starting model (an asset: name or a folder); --smoke: tiny-qwen2")
    p.add_argument("--task", default=TASK, help="reasoning_gym: data path of the task")
    p.add_argument("--train-size", type=int, default=1000)
    p.add_argument("--test-size", type=int, default=100)
    p.add_argument("--rollouts", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7, help="training rollouts' sampling temperature")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--format-weight", type=float, default=WEIGHTS["format"],
                   help="weight of the `format` reward component in training (`correct` has 1); 0: correctness only")
    p.add_argument("--overlong-cache", type=int, default=0,
                   help="DAPO's soft overlong punishment over the last N of --max-new-tokens (0: off)")
    p.add_argument("--gate-shaping", action="store_true",
                   help="shaping (format, overlong punishment) only in groups with a correct completion (the recipe's "
                        "model.rollout.gate_shaping; TRL: the same gate applied to its reward functions)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--samples", type=int, default=4, help="sampled completions per held-out question (pass@K)")
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42, help="training seed of both libraries (the evaluator's is fixed)")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny model, one small rollout, no TRL: checks the script runs")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rl_lightning_real_grpo"))
    p.add_argument("--out", type=Path, help="also write the result table (Markdown) here")
    p.add_argument("--json", type=Path, help="also write every row (accuracies, training curves) as JSON here")
    p.add_argument("--_eval", help=argparse.SUPPRESS)
    p.add_argument("--_trl", help=argparse.SUPPRESS)
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None, smoke: dict[str, Any] | None = None
          ) -> argparse.Namespace:
    """Parse `argv`; with ``--smoke`` the `SMOKE` values (and the script's `smoke` ones) become the defaults, so a
    flag given explicitly still wins."""
    if p.parse_known_args(argv)[0].smoke:
        p.set_defaults(**{**SMOKE, **(smoke or {})})
    return p.parse_args(argv)


def train_weights(args: argparse.Namespace) -> dict[str, float]:
    """The training reward's component weights (the evaluator reports both components, with `WEIGHTS`)."""
    return {"correct": WEIGHTS["correct"], "format": args.format_weight}


def data_spec(args: argparse.Namespace, split: str = "train") -> str:
    """The data path of `split`; a caller (benchmarks/sanity.py) may set ``args.train_data`` / ``args.eval_data``."""
    given = getattr(args, "eval_data" if split == "test" else "train_data", None)
    return given or f"{args.task}&train_size={args.train_size}&test_size={args.test_size}&split={split}"


def base_model(args: argparse.Namespace) -> str:
    """The starting model's folder."""
    from rl_lightning.assets.real import resolve_model

    return resolve_model(args.model)


def evaluate(model_dir: str, args: argparse.Namespace) -> dict[str, float]:
    """Held-out accuracy of `model_dir` with `rl_lightning.cli.eval` (call it in a child: vLLM owns its process).

    ``greedy``: the share of greedy completions scored correct (``correct`` component 1); ``greedy_format``: the mean
    ``format`` component; ``sampled`` / ``pass_at_k``: the same over ``--samples`` completions per question at T=1
    (seeded), and the unbiased pass@K.
    """
    import torch

    from rl_lightning.cli.eval.evaluate import EvalConfig
    from rl_lightning.cli.eval.evaluate import evaluate as run_eval

    torch.set_num_threads(args.threads)
    config = EvalConfig(model=model_dir, data=data_spec(args, "test"), engine=args.engine, n=args.samples,
                        k=[args.samples] if args.samples else None, temperature=1.0,
                        max_new_tokens=args.max_new_tokens, seed=1234, reward_weights=json.dumps(WEIGHTS), env=ENV)
    metrics = run_eval(config).metrics
    result = {"greedy": metrics["greedy/accuracy"], "greedy_format": metrics["greedy/reward/format"]}
    if args.samples:
        result.update(sampled=metrics["sampled/accuracy"], pass_at_k=metrics[f"sampled/pass_at_{args.samples}"])
    return result


def fit_config(args: argparse.Namespace, workdir: Path, curriculum: dict | None = None) -> dict:
    """``recipes/real/grpo.yaml`` with the benchmark's budget: one optimizer step per rollout, no validation, no
    checkpoints, the run's own MLflow store and an HF export in `workdir` (the recipe's callbacks are dropped)."""
    import yaml

    config = yaml.safe_load((REPO / "rl_lightning" / "recipes" / "real" / "grpo.yaml").read_text())
    config["seed_everything"] = args.seed
    model, data, trainer = config["model"]["init_args"], config["data"]["init_args"], config["trainer"]
    model.update(max_rollouts=args.rollouts, update_per_rollout=1)  # PPO counts its run in rollouts
    model["lm"]["name"] = args.model
    model["lm"]["optim"].update(lr=args.lr, warmup_steps=args.warmup)
    model["rollout"].update(responses_per_prompt=args.group, max_new_tokens=args.max_new_tokens, engine=args.engine,
                            temperature=args.temperature, reward_weights=train_weights(args), env_path=ENV)
    model["dapo"] = {"overlong_cache_length": args.overlong_cache or None}
    model["rollout"]["gate_shaping"] = args.gate_shaping  # the flag, not the recipe's default (TRL's runs match it)
    data.update(path=data_spec(args), val_path=None, batch_size=args.prompts)
    if curriculum is not None:
        data["curriculum"] = curriculum
    trainer.update(max_epochs=-1, num_sanity_val_steps=0, enable_checkpointing=False)
    trainer.pop("val_check_interval", None)
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {
        "experiment_name": "rl_lightning", "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}"}}
    trainer["callbacks"] = [{"class_path": "rl_lightning.tracking.export.HFExport",
                             "init_args": {"dirpath": str(workdir / "export")}}]
    return config


def fit(args: argparse.Namespace, workdir: Path, config: dict) -> float:
    """Run `config` with ``python -m rl_lightning fit`` in `workdir`; its wall time (process start to exit)."""
    import yaml

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    start = time.perf_counter()
    run_command([sys.executable, "-m", "rl_lightning", "fit", "--config", str(workdir / "config.yaml"),
                 "--trainer.enable_progress_bar", "false"], workdir, args)
    return time.perf_counter() - start


def metric_series(workdir: Path, *names: str) -> dict[str, list]:
    """The fit's metric histories (MLflow ``Metric`` objects, in step order) from its store in `workdir`."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rl_lightning").experiment_id])
    return {name: sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step) for name in names}


def median_interval(times: list[float]) -> float:
    """Median seconds between consecutive logged steps: the steady-state time of one rollout + update."""
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return gaps[len(gaps) // 2] if gaps else float("nan")


# Flags that do not change what a step computes: where results go, and the children's own modes.
_NOT_SETTINGS = {"out", "json", "workdir", "plots", "train_data", "eval_data", "_eval", "_trl", "_probe", "skip_trl",
                 "arms"}


def kept(args: argparse.Namespace, path: Path, make: Any, reuse: bool = True) -> dict:
    """`make()`'s JSON result, kept in `path` with the settings (flags) that produced it; a later run with the same
    settings reuses it (unless `reuse` is false: computed again), any other settings compute it again."""
    settings = {k: str(v) for k, v in sorted(vars(args).items()) if k not in _NOT_SETTINGS}
    if reuse and path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings:
            print(f"reusing {path}", flush=True)
            return saved["result"]
    result = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "result": result}))
    return result


def run_command(command: list[str], cwd: Path, args: argparse.Namespace, log: str = "log.txt") -> str:
    """Run `command` in `cwd` with ``--threads`` OpenMP threads; its stdout (all output kept in `cwd`/`log`)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    (cwd / log).write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"{' '.join(command[:4])} failed; see {cwd / log}:\n{result.stderr[-3000:]}")
    return result.stdout


def child(script: str, mode: str, target: str, args: argparse.Namespace, workdir: Path, log: str = "log.txt") -> dict:
    """Re-run `script` with ``--_<mode> target`` (and this process's flags) in a fresh process; its JSON result (the
    last line of its output) plus ``seconds``, the child's wall time."""
    start = time.perf_counter()
    out = run_command([sys.executable, script, f"--_{mode}", target, *sys.argv[1:]], workdir, args, log)
    result = json.loads(out.strip().splitlines()[-1])
    result["seconds"] = time.perf_counter() - start
    return result
