"""An evaluation's result as a table (`table`), a JSON file (`write_json`) and an MLflow run (`log_to_mlflow`).

MLflow: a new run (``run_name``) in the experiment ``experiment`` (created when missing), or the existing run
``run_id`` (e.g. the training run of the evaluated model). Metrics are logged as ``eval/<metric>``
(``eval/greedy/accuracy``, ``eval/sampled/pass_at_4``); the settings as params (``eval.model``, ...); the table as
``eval.md`` and the whole result as ``eval.json``. A model from a run's ``export/`` tags the run with
``rl_lightning.eval.source_run_id`` (its training run).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rl_lightning.cli.eval.evaluate import EvalResult
from rl_lightning.errors import ConfigError

ROWS = ("accuracy", "pass_at_*", "reward", "reward/*", "completion_length", "truncated")
MLFLOW_PARAM_LIMIT = 6000  # characters mlflow >= 2.x accepts in a param value


def _row_names(metrics: dict[str, float]) -> list[str]:
    """Metric names without their pass (``greedy/``, ``sampled/``), in table order."""
    names = sorted({name.split("/", 1)[1] for name in metrics})
    order: list[str] = []
    for pattern in ROWS:
        if pattern.endswith("*"):
            matched = [n for n in names if n.startswith(pattern[:-1])]
            numbered = pattern == "pass_at_*"  # pass_at_2 before pass_at_10
            order += sorted(matched, key=lambda n: (len(n) if numbered else 0, n))
        elif pattern in names:
            order.append(pattern)
    return order


def _cell(value: float | None, name: str) -> str:
    if value is None:
        return ""
    return f"{value:.1f}" if name == "completion_length" else f"{value:.3f}"


def table(result: EvalResult) -> str:
    """A heading line and a Markdown table: one row per metric, one column per pass (greedy, sampled)."""
    c, metrics = result.config, result.metrics
    columns = [("greedy", "greedy (T=0)")]
    if c.n:
        columns.append(("sampled", f"sampled (T={c.temperature:g}, n={c.n})"))
    names = _row_names(metrics)
    labels = {n: n.replace("pass_at_", "pass@") for n in names}
    width = max(len(label) for label in [*labels.values(), "metric"])
    widths = [len(title) for _, title in columns]
    head = (f"{c.model} on {c.data}: {result.prompts} prompts, engine {result.engine}, <= {c.max_new_tokens} new "
            f"tokens, {result.seconds:.0f} s")
    lines = [head, "", "| " + " | ".join(["metric".ljust(width), *(t for _, t in columns)]) + " |",
             "|" + "|".join("-" * (w + 2) for w in [width, *widths]) + "|"]
    for name in names:
        cells = [_cell(metrics.get(f"{prefix}/{name}"), name).rjust(w) for (prefix, _), w in zip(columns, widths,
                                                                                               strict=True)]
        lines.append("| " + " | ".join([labels[name].ljust(width), *cells]) + " |")
    return "\n".join(lines)


def write_json(result: EvalResult, path: str) -> None:
    """Write `result` (settings, resolved model, engine, environment, metrics) as JSON to `path`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result.as_dict(), indent=2) + "\n")


def log_to_mlflow(result: EvalResult, tracking_uri: str, experiment: str, run_name: str | None = None,
                  run_id: str | None = None) -> str:
    """Log `result` to MLflow (see the module docstring); returns the run's id."""
    import mlflow
    from mlflow.entities import Metric, Param

    client = mlflow.MlflowClient(tracking_uri)
    if run_id is None:
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        name = run_name or f"eval-{Path(result.config.model.rstrip('/')).name}"
        run_id = client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(f"eval.{k}", str(v)[:MLFLOW_PARAM_LIMIT]) for k, v in _params(result).items()]
    else:
        try:
            client.get_run(run_id)
        except Exception as e:  # noqa: BLE001 - MLflow raises its own error types for a missing run
            raise ConfigError(f"--run-id {run_id}: no such run in {tracking_uri} ({str(e).splitlines()[0]}); "
                              "give a run id of that store, or leave it out for a new run") from None
        params = []  # an existing run keeps its params (MLflow refuses to change one)
    now, step = int(time.time() * 1000), 0
    metrics = [Metric(f"eval/{k}", v, now, step) for k, v in sorted(result.metrics.items())]
    for start in range(0, max(len(metrics), len(params)), 100):
        client.log_batch(run_id, metrics=metrics[start : start + 100], params=params[start : start + 100])
    if result.source_run_id:
        client.set_tag(run_id, "rl_lightning.eval.source_run_id", result.source_run_id)
    client.log_text(run_id, table(result), "eval.md")
    client.log_dict(run_id, result.as_dict(), "eval.json")
    if params:
        client.set_terminated(run_id)
    return run_id


def _params(result: EvalResult) -> dict[str, object]:
    c = result.config
    return {"model": c.model, "model_dir": result.model_dir, "data": c.data, "env": result.env,
            "engine": result.engine, "n": c.n, "k": c.ks(), "temperature": c.temperature,
            "max_new_tokens": c.max_new_tokens, "limit": c.limit, "seed": c.seed, "threshold": c.threshold,
            "reward_weights": c.reward_weights, "prompts": result.prompts}
