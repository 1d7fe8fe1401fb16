"""A run's lineage (what it was trained from) and the MLflow model of its Hugging Face export.

Lineage tags (on the MLflow run at train start, and on the logged model and the registered model version), short so
the MLflow UI shows them whole:

- ``recipe``: the config file(s) given with ``--config``;
- ``base_model``: the ``model.lm.name`` training started from;
- ``data`` / ``data_sha256`` (and ``val_data`` / ``val_data_sha256``): the data and the SHA-256 of its content (a
  folder: of its files, in name order; a ``reasoning_gym:`` spec or a hub dataset name: of the string itself, since
  the rows come from a generator or the hub);
- ``env`` / ``env_sha256``: an RL task's environment file (``model.rollout.env_path``), also uploaded as the run
  artifact ``environment/<file name>``;
- ``mlflow.source.git.commit`` (MLflow's own tag) and ``git_commit`` / ``git_dirty``: the commit of the git
  repository holding the working directory, when there is one (no tag otherwise).

The export is logged with MLflow's transformers flavor into an MLflow 3 *logged model* named after the run
(`model_name`: ``grpo lr=2e-05``) whose source run is the training run (the run page's "Logged models", the experiment's "Models" tab), so ``mlflow.transformers.load_model``
and ``client.create_model_version`` (the registry) both work with it. With ``log_weights=False`` the logged model
holds only the export's config and tokenizer files, with the export folder as ``export_dir``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rl_lightning.assets.package_files import shown_path

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
PIP_REQUIREMENTS = ["torch", "transformers", "accelerate"]  # given, so MLflow does not infer them (slow)


def sha256(path: str | Path) -> str:
    """SHA-256 of a file's content, or of a folder's files (relative path and content, in path order)."""
    path, digest = Path(path), hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def data_sha256(spec: str) -> str:
    """The content hash of a data path (`sha256`); of the string itself for generated or hub data."""
    local = Path(spec).expanduser()
    if not spec.startswith("reasoning_gym:") and local.exists():
        return sha256(local)
    return hashlib.sha256(spec.encode()).hexdigest()


def git_commit(cwd: str | Path = ".") -> tuple[str, bool] | None:
    """``(commit, dirty)`` of the git repository holding `cwd`; None without git or a repository."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()

        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return commit, dirty


def recipe(trainer: Any) -> str | None:
    """The config file(s) of a CLI run (the ``config`` argument kept by the CLI's config callback), or None."""
    from lightning.pytorch.cli import SaveConfigCallback

    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigCallback):
            files = callback.config.get("config") or []
            return ", ".join(shown_path(str(f)) for f in files) or None  # a bundled recipe: rl_lightning/recipes/...
    return None


def env_path(pl_module: Any) -> Path | None:
    """An RL task's environment file (``rollout_config.env_path``), None for other tasks."""
    path = getattr(getattr(pl_module, "rollout_config", None), "env_path", None)
    return Path(path) if path and Path(path).is_file() else None


def collect(trainer: Any, pl_module: Any) -> dict[str, str]:
    """Every lineage tag of the run (see the module docstring)."""
    tags: dict[str, str] = {}
    if (files := recipe(trainer)) is not None:
        tags["recipe"] = files
    # the package's own files (a bundled recipe's model, data, environment) as rl_lightning/..., not this machine's path
    if (model_name := getattr(getattr(pl_module, "lm", None), "name", None)) is not None:
        tags["base_model"] = shown_path(str(model_name))
    data = getattr(getattr(trainer, "datamodule", None), "hparams", {})
    for key, tag in (("path", "data"), ("val_path", "val_data")):
        if data.get(key):
            tags[tag], tags[f"{tag}_sha256"] = shown_path(str(data[key])), data_sha256(str(data[key]))
    if (env := env_path(pl_module)) is not None:
        tags["env"], tags["env_sha256"] = shown_path(str(env)), sha256(env)
    if (git := git_commit()) is not None:
        tags["mlflow.source.git.commit"] = tags["git_commit"] = git[0]
        tags["git_dirty"] = str(git[1]).lower()
    return tags


def model_name(run_name: str | None) -> str:
    """A logged model's name from its run's: MLflow refuses ``/ : . % " '`` in it (``lr=0.001`` -> ``lr=0_001``)."""
    name = "".join("_" if c in "/:.%\"'" else c for c in (run_name or "").strip())
    return name or "model"


def tag_run(client: Any, run_id: str, tags: dict[str, str], env: Path | None) -> None:
    """Set the lineage tags on the run and upload the environment file as ``environment/<name>``."""
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    if env is not None:
        client.log_artifact(run_id, str(env), "environment")


def log_model(client: Any, tracking_uri: str, run_id: str, export_dir: str | Path, tags: dict[str, str],
              log_weights: bool = True, name: str = "model") -> Any:
    """Log the Hugging Face folder `export_dir` as an MLflow logged model of run `run_id`; returns the LoggedModel.

    With `log_weights` the transformers flavor copies the whole folder (loadable with ``mlflow.transformers``);
    without, only its non-weight files are stored and the model points at `export_dir`.
    """
    import mlflow

    from rl_lightning.compat.mlflow import tracking_uri_scope

    experiment_id = client.get_run(run_id).info.experiment_id
    tags = {**tags, "export_dir": str(Path(export_dir).resolve())}
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id, tags=tags)
    if log_weights:
        flavor_log = logging.getLogger("mlflow.transformers")
        level = flavor_log.level
        flavor_log.setLevel(logging.ERROR)  # its model-card and license warnings are about hub models
        try:
            with tracking_uri_scope(tracking_uri):
                mlflow.transformers.log_model(str(export_dir), name=name, model_id=model.model_id,
                                              task="text-generation", pip_requirements=PIP_REQUIREMENTS)
        finally:
            flavor_log.setLevel(level)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for file in Path(export_dir).iterdir():
                if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES):
                    shutil.copy(file, tmp)
            client.log_model_artifacts(model.model_id, tmp)
        client.finalize_logged_model(model.model_id, "READY")
    _link_output(client, run_id, model.model_id)
    return client.get_logged_model(model.model_id)


def _link_output(client: Any, run_id: str, model_id: str) -> None:
    """Record the model as the run's output (the run page lists it under "Logged models")."""
    try:
        from mlflow.entities import LoggedModelOutput

        client.log_outputs(run_id, [LoggedModelOutput(model_id, step=0)])
    except Exception as e:  # noqa: BLE001 - the model is logged and tagged with its run either way
        log.warning("could not link the logged model to the run: %s", e)


def register(client: Any, registered_model_name: str, model: Any, run_id: str, tags: dict[str, str]) -> Any:
    """A new version of `registered_model_name` (created if missing) from the logged `model`, tagged with `tags`."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(registered_model_name,
                                       description="Hugging Face exports of rl_lightning runs")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    lines = [f"Hugging Face export of run {run_id}."] + [f"{k}: {v}" for k, v in sorted(tags.items())]
    return client.create_model_version(registered_model_name, model.model_uri, run_id=run_id, tags=tags,
                                       description="\n".join(lines), model_id=model.model_id)
