"""The model card of the Hugging Face export: ``README.md`` beside the weights, so the folder can be shared as it is.

It follows the Hugging Face model card layout: YAML front matter (``base_model``, ``library_name: transformers``, the
``pipeline_tag``, ``tags``, the base model's ``license`` when its own card states one), then what the model is, how it
was trained (task and algorithm, recipe, data with its SHA-256, the key settings as CLI keys), the held-out metrics
at the start and the end of the run, the command that reproduces it, how to load it, and the library versions. The
resolved config (redacted: `rl_lightning.redaction`) is written beside it as ``rl_lightning_config.yaml``, readable by
its owner only.

`card_text` is pure (a `CardInfo` in, markdown out); `collect` reads the run (the module's hparams, the DataModule's,
the CLI's config callback, the MLflow history: `rl_lightning.tracking.history`).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_lightning.assets.package_files import shown_path
from rl_lightning.compat import mlflow as mlflow_compat
from rl_lightning.tracking.history import XY

CONFIG_FILE = "rl_lightning_config.yaml"
ESTIMATORS = {"drgrpo": "Dr. GRPO", "grpo": "GRPO", "rloo": "RLOO", "reinforce_pp": "REINFORCE++", "gae": "PPO",
              "vtrace": "V-trace", "retrace": "Retrace", "td_lambda": "TD(lambda)", "nstep": "n-step returns"}
TASKS = {"SFT": ("supervised fine-tuning", "sft"), "DPO": ("preference optimisation", "dpo"),
         "RewardModel": ("reward model (Bradley-Terry)", "reward-model"),
         "PPO": ("reinforcement learning", "reinforcement-learning")}  # task -> (what it does, its tag)
# The settings a reader wants first, as CLI keys; the card shows those the run has (the full config is CONFIG_FILE).
MODEL_SETTINGS = ("lm.optim.lr", "lm.optim.lr_schedule", "lm.optim.warmup_steps", "lm.optim.weight_decay",
                  "max_rollouts",
                  "update_per_rollout", "advantage_estimator", "policy_loss", "aggregation", "clip_low", "clip_high",
                  "kl.coef", "entropy_coef", "beta", "loss_type", "label_smoothing", "rollout.responses_per_prompt",
                  "rollout.max_new_tokens", "rollout.temperature", "rollout.reward_weights", "rollout.env_path",
                  "lm.lora.r", "lm.lora.alpha")
DATA_SETTINGS = ("batch_size", "micro_batch_size", "max_length", "max_prompt_length")
# Built assets (`rl_lightning.assets.real`): the hub model each is built from, its license, and how it was built.
ASSET_ORIGINS = {"asset:SmolLM2-135M-Instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0",
                                                 "as `asset:SmolLM2-135M-Instruct`: its Q4_1 GGUF dequantised")}


@dataclass
class CardInfo:
    """What the card says (see `card_text`)."""

    base_model: str
    task: str  # the task's class name: SFT, DPO, RewardModel, PPO
    algorithm: str  # e.g. "Dr. GRPO", "DPO (sigmoid)"
    length: str  # e.g. "40 rollouts (80 optimizer steps)"
    version: str
    run_name: str | None = None
    license: str | None = None
    base_note: str | None = None  # e.g. how a built asset relates to the hub model in `base_model`
    lineage: dict[str, str] = field(default_factory=dict)  # `rl_lightning.tracking.lineage` tags
    settings: dict[str, Any] = field(default_factory=dict)  # CLI key -> value
    metrics: dict[str, tuple[XY | None, XY]] = field(default_factory=dict)  # val/* at start (None: unknown), end
    x_unit: str = "step"
    command: str | None = None
    mlflow: str | None = None  # "run <id> in experiment <name>"
    versions: dict[str, str] = field(default_factory=dict)


def front_matter(text: str) -> dict[str, Any]:
    """The YAML front matter of a markdown file (``---`` ... ``---`` at its top), {} when it has none."""
    import yaml

    if not text.startswith("---"):
        return {}
    head, closed, _ = text[3:].partition("\n---")
    if not closed:
        return {}
    try:
        loaded = yaml.safe_load(head)
    except yaml.YAMLError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def card_text(info: CardInfo) -> str:
    """The model card: YAML front matter, then the markdown body."""
    import yaml

    family, tag = TASKS.get(info.task, (info.task, info.task.lower()))
    short = _slug(info.algorithm.split(" (")[0].split(",")[0])  # "DPO (sigmoid loss, ...)" -> dpo
    meta: dict[str, Any] = {"base_model": info.base_model, "library_name": "transformers",
                            "pipeline_tag": "text-classification" if info.task == "RewardModel" else "text-generation",
                            "tags": list(dict.fromkeys(["rl_lightning", tag, short]))}
    if info.license:
        meta["license"] = info.license
    name = info.run_name or "model"
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {name}", "",
             f"`{info.base_model}` trained by {family} with **{info.algorithm}** in "
             f"rl_lightning {info.version}, for {info.length}.", ""]
    lines += _training_section(info) + _metrics_section(info) + _command_section(info) + _use_section(info)
    lines += ["## Framework versions", ""] + [f"- {k} {v}" for k, v in info.versions.items()] + [""]
    return "\n".join(lines)


def _training_section(info: CardInfo) -> list[str]:
    note = f" ({info.base_note})" if info.base_note else ""
    rows = [("task", f"{info.task} ({info.algorithm})"), ("base model", f"`{info.base_model}`{note}")]
    lineage = info.lineage
    if "recipe" in lineage:
        rows.append(("recipe", f"`{lineage['recipe']}`"))
    for key, label in (("data", "data"), ("val_data", "validation data"), ("env", "environment")):
        if key in lineage:
            rows.append((label, f"`{lineage[key]}` (SHA-256 `{lineage.get(f'{key}_sha256', '')[:16]}`)"))
    if "git_commit" in lineage:
        dirty = " (with uncommitted changes)" if lineage.get("git_dirty") == "true" else ""
        rows.append(("git commit", f"`{lineage['git_commit']}`{dirty}"))
    if info.mlflow:
        rows.append(("MLflow", info.mlflow))
    rows += [(f"`{key}`", f"`{value}`".replace("|", "\\|")) for key, value in info.settings.items()]
    return ["## Training", "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
            f"The resolved config is `{CONFIG_FILE}` in this folder.", ""]


def _metrics_section(info: CardInfo) -> list[str]:
    if not info.metrics:
        return []
    lines = ["## Held-out metrics", "", "| metric | start | end |", "| --- | --- | --- |"]
    for name, (first, last) in info.metrics.items():
        start = f"{first[1]:.4g} ({info.x_unit} {first[0]})" if first is not None and first[0] != last[0] else ""
        lines.append(f"| `{name}` | {start} | {last[1]:.4g} ({info.x_unit} {last[0]}) |")
    return [*lines, ""]


def _command_section(info: CardInfo) -> list[str]:
    if info.command is None:
        return []
    commit = info.lineage.get("git_commit")
    where = f"at commit `{commit[:12]}`" if commit else "(the paths are relative to its root)"
    return ["## Reproduce", "", f"From a checkout of rl_lightning {where}:", "", "```bash", info.command, "```", ""]


def _use_section(info: CardInfo) -> list[str]:
    auto = "AutoModelForSequenceClassification" if info.task == "RewardModel" else "AutoModelForCausalLM"
    return ["## Use", "", "```python", f"from transformers import {auto}, AutoTokenizer", "",
            'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
            f'model = {auto}.from_pretrained("path/to/this/folder")', "```", ""]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


def flat(values: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts (and dataclasses) as ``{"optim.lr": 1e-3, ...}``."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(values) and not isinstance(values, type):
        values = asdict(values)
    if not isinstance(values, dict):
        return {prefix: values}
    out: dict[str, Any] = {}
    for key, value in values.items():
        out.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def algorithm(task: str, hparams: dict[str, Any]) -> str:
    """The algorithm's name from the task and its flat hparams (``Dr. GRPO``, ``DPO (sigmoid loss, beta 0.1)``)."""
    if task == "PPO":
        name = ESTIMATORS.get(hparams.get("advantage_estimator", ""), "PPO")
        loss = hparams.get("policy_loss", "ppo")
        return name if loss == "ppo" else f"{name}, {str(loss).upper()} policy loss"
    if task == "DPO":
        return f"DPO ({hparams.get('loss_type', 'sigmoid')} loss, beta {hparams.get('beta')})"
    return {"SFT": "SFT (cross-entropy on the assistant tokens)", "RewardModel": "Bradley-Terry"}.get(task, task)


def base_license(model_name: str) -> str | None:
    """The ``license`` of the base model's own card: a local folder's README.md, or the hub's from the local cache."""
    readme = Path(model_name).expanduser() / "README.md"
    if not readme.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model_name, "README.md")  # no network: what a download left
        except Exception:  # noqa: BLE001 - not a hub id: no license known
            return None
        if not isinstance(cached, str):
            return None
        readme = Path(cached)
    value = front_matter(readme.read_text(errors="replace")).get("license")
    return str(value) if value else None


def cli_config(trainer: Any) -> tuple[str | None, str | None]:
    """``(command, resolved config)`` of a CLI run (from its config callback); Nones for a run started from Python.

    Both redacted (`rl_lightning.redaction`): no credential, values read with ``${oc.env:NAME}`` as that reference.
    """
    from lightning.pytorch.cli import SaveConfigCallback

    from rl_lightning.redaction import redact_argv, redact_yaml

    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigCallback):
            argv = getattr(callback.parser, "argv", None) or sys.argv[1:]
            command = format_command(redact_argv([shown_path(str(a)) for a in argv]))  # a bundled recipe: its path
            return command, redact_yaml(callback.parser.dump(callback.config, skip_none=False))
    return None, None


def format_command(argv: list[str]) -> str:
    """``python -m rl_lightning <argv>``, shell-quoted, one ``--flag value`` group a line."""
    groups: list[list[str]] = [["python", "-m", "rl_lightning"]]
    for arg in argv:
        if arg.startswith("--"):
            groups.append([])
        groups[-1].append(arg)
    return " \\\n    ".join(shlex.join(group) for group in groups)


def collect(trainer: Any, pl_module: Any, lineage: dict[str, str]) -> tuple[CardInfo, str | None]:
    """The card of a finished run (with its `lineage` tags), and its resolved config (None outside the CLI)."""
    import lightning
    import torch
    import transformers

    import rl_lightning
    from rl_lightning.tracking.history import first_and_last, mlflow_loggers, read_history

    task, hparams = type(pl_module).__name__, flat(dict(pl_module.hparams))
    data = flat(dict(getattr(getattr(trainer, "datamodule", None), "hparams", None) or {}))
    settings = {f"model.{k}": hparams[k] for k in MODEL_SETTINGS if hparams.get(k) is not None}
    settings |= {f"data.{k}": data[k] for k in DATA_SETTINGS if data.get(k) is not None}
    by_epochs = trainer.max_steps in (None, -1) and hparams.get("max_rollouts") is None  # else max_epochs is moot
    run = {"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs if by_epochs else None,
           "devices": trainer.num_devices, "num_nodes": trainer.num_nodes, "precision": trainer.precision}
    settings |= {f"trainer.{k}": v for k, v in run.items() if v not in (None, -1)}
    steps = f"{trainer.global_step} optimizer step{'s' if trainer.global_step != 1 else ''}"
    rollouts = getattr(pl_module, "rollouts", None) if task == "PPO" else None
    base = shown_path(str(hparams.get("lm.name")))  # a bundled model as rl_lightning/assets/..., not this machine's
    hub_id, known_license, note = ASSET_ORIGINS.get(base, (base, base_license(base), None))
    info = CardInfo(base_model=hub_id, task=task, algorithm=algorithm(task, hparams),
                    length=f"{rollouts} rollouts ({steps})" if rollouts is not None else steps,
                    version=rl_lightning.__version__, license=known_license, base_note=note,
                    lineage=lineage, settings=settings, x_unit="rollout" if task == "PPO" else "step",
                    versions={"rl_lightning": rl_lightning.__version__, "transformers": transformers.__version__,
                              "torch": torch.__version__, "lightning": lightning.__version__})
    loggers = mlflow_loggers(trainer)
    if loggers:
        first = loggers[0]
        info.run_name = mlflow_compat.run_name(first)
        info.mlflow = f"run `{mlflow_compat.run_name(first)}` (`{mlflow_compat.started_run_id(first)}`) in experiment `{mlflow_compat.experiment_name(first)}`"
        info.metrics = dict(first_and_last(read_history(first.experiment, mlflow_compat.started_run_id(first), ("val/", "train/"))))
    else:
        info.metrics = {k: (None, (trainer.global_step, float(v))) for k, v in sorted(trainer.callback_metrics.items())
                        if k.startswith("val/")}
    info.command, config = cli_config(trainer)
    return info, config


def write_card(dirpath: str | Path, trainer: Any, pl_module: Any, lineage: dict[str, str]) -> Path:
    """Write ``README.md`` (and the resolved config, `CONFIG_FILE`, for a CLI run) into the export `dirpath`."""
    from rl_lightning.parallel.checkpoint_io import write_atomic

    info, config = collect(trainer, pl_module, lineage)
    if config is not None:
        write_atomic(Path(dirpath) / CONFIG_FILE, config, mode=0o600)  # the run's settings: its owner's only
    path = Path(dirpath) / "README.md"
    write_atomic(path, card_text(info))
    return path
