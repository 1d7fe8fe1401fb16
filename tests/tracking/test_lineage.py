"""The Hugging Face export as an MLflow model with the run's lineage, registered when asked (real tiny CLI runs)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus

from rl_lightning.cli.main import main
from rl_lightning.errors import ConfigError
from rl_lightning.tracking import lineage
from rl_lightning.tracking.export import HFExport

TINY_RUN = ["--model.max_rollouts", "1", "--model.update_per_rollout", "1", "--data.batch_size", "2",
            "--model.rollout.engine", "hf", "--model.rollout.responses_per_prompt", "2",
            "--model.rollout.max_new_tokens", "4", "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0"]
REGISTER = """trainer:
  callbacks:
    - class_path: rl_lightning.tracking.export.HFExport
      init_args: {registered_model_name: tiny-grpo}
"""


def _digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _git_repo(workdir: Path) -> str:
    """Make the working directory a git repository with one commit; returns the commit."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=workdir, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "register.yaml")
    git("commit", "-q", "-m", "recipe overlay")
    return git("rev-parse", "HEAD")


def _only_run(client: MlflowClient, experiment: str, workdir: Path):
    """The test's run (by its output folder: MLflow caches its sqlite store by URI, so in one process every test's
    relative ``sqlite:///mlflow.db`` may be the first test's file)."""
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (run,) = [r for r in runs if r.data.tags["output_dir"].startswith(str(workdir.resolve()))]
    return run


def test_grpo_run_registers_its_export_with_lineage_and_env_file(workdir):
    (workdir / "register.yaml").write_text(REGISTER)
    commit = _git_repo(workdir) if _has_git() else None
    main(["fit", "--config", "register.yaml", "--config", "recipes/grpo.yaml", *TINY_RUN])

    client = MlflowClient("sqlite:///mlflow.db")
    run = _only_run(client, "rl_lightning/rl", workdir)
    env, data, val = ("rl_lightning/recipes/envs/arithmetic_format.py", "rl_lightning/assets/data/easy.jsonl",
                      "rl_lightning/assets/data/easy_test.jsonl")
    expected = {"recipe": "register.yaml, rl_lightning/recipes/grpo.yaml",  # a bundled recipe: its package path
                "base_model": "rl_lightning/assets/tiny-qwen2-sft",
                "data": data, "data_sha256": _digest(data),
                "val_data": val, "val_data_sha256": _digest(val),
                "env": env, "env_sha256": _digest(env)}
    if commit is not None:
        expected |= {"mlflow.source.git.commit": commit, "git_commit": commit,
                     "git_dirty": "false"}
    assert expected.items() <= run.data.tags.items()

    # the environment file, as run artifact
    local = client.download_artifacts(run.info.run_id, "environment/arithmetic_format.py", str(workdir / "dl"))
    assert Path(local).read_text() == Path(env).read_text()

    # the registered version: lineage tags, from the run's logged model
    name, number = run.data.tags["registered_model"].split("/")
    assert name == "tiny-grpo"
    version = client.get_model_version(name, number)
    assert version.run_id == run.info.run_id
    assert expected.items() <= version.tags.items()
    assert "data_sha256: " + _digest(data) in version.description
    assert version.source.startswith("models:/m-")  # the logged model (the sqlite store leaves `model_id` unset)
    model = client.get_logged_model(version.source.removeprefix("models:/"))
    assert model.source_run_id == run.info.run_id and model.status == LoggedModelStatus.READY
    assert expected.items() <= model.tags.items()
    outputs = client.get_run(run.info.run_id).outputs.model_outputs  # the run page's "Logged models"
    assert [o.model_id for o in outputs] == [model.model_id]

    # the logged model loads back as the exported weights
    import mlflow
    import torch
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri
    from transformers import AutoModelForCausalLM

    with _use_tracking_uri("sqlite:///mlflow.db"):
        loaded = mlflow.transformers.load_model(f"models:/tiny-grpo/{version.version}", return_type="components")
    export = AutoModelForCausalLM.from_pretrained(model.tags["export_dir"])
    for (name, a), (_, b) in zip(loaded["model"].state_dict().items(), export.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _has_git() -> bool:
    try:
        subprocess.run(["git", "--version"], check=True, capture_output=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def test_sft_run_logs_the_model_without_registering(workdir):
    main(["fit", "--config", "recipes/sft.yaml", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"])
    client = MlflowClient("sqlite:///mlflow.db")
    run = _only_run(client, "rl_lightning/sft", workdir)
    assert "registered_model" not in run.data.tags
    assert "env" not in run.data.tags
    assert run.data.tags["data_sha256"] == _digest("rl_lightning/assets/data/sft.jsonl")
    # this run's models only: MLflow's sqlite engines are cached per URI string, so an earlier in-process test's
    # relative sqlite:///mlflow.db may share this store (see `_only_run`)
    models = [m for m in client.search_logged_models([run.info.experiment_id]) if m.source_run_id == run.info.run_id]
    assert len(models) == 1
    files = {Path(f.path).name for f in client.list_logged_model_artifacts(models[0].model_id)}
    assert "MLmodel" in files
    # (not `search_registered_models() == []`: the store may be shared with other tests, see `_only_run`)
    assert client.search_model_versions(f"run_id = '{run.info.run_id}'") == []


def test_export_without_weights_keeps_config_and_tokenizer_only(workdir):
    from conftest import TINY_MODEL

    client = MlflowClient("sqlite:///mlflow.db")
    run = client.create_run(client.create_experiment("x"))
    model = lineage.log_model(client, "sqlite:///mlflow.db", run.info.run_id, TINY_MODEL, {"a": "b"}, log_weights=False)
    names = {f.path for f in client.list_logged_model_artifacts(model.model_id)}
    assert "config.json" in names and "tokenizer.json" in names and "model.safetensors" not in names
    assert model.tags["export_dir"] == str(TINY_MODEL) and model.tags["a"] == "b"


def test_lineage_helpers(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("x")
    assert lineage.sha256(tmp_path / "d" / "a.jsonl") == hashlib.sha256(b"x").hexdigest()
    assert lineage.data_sha256("reasoning_gym:basic_arithmetic") == hashlib.sha256(
        b"reasoning_gym:basic_arithmetic").hexdigest()
    before = lineage.data_sha256(str(tmp_path / "d"))
    (tmp_path / "d" / "b.jsonl").write_text("y")
    assert lineage.data_sha256(str(tmp_path / "d")) != before
    assert lineage.git_commit(tmp_path) is None  # not a repository: no tag, no error


def test_registration_needs_a_name_and_a_logged_model():
    with pytest.raises(ConfigError, match="needs log_model: true"):
        HFExport(log_model=False, registered_model_name="m")
    with pytest.raises(ConfigError, match="registered_model_name is empty"):
        HFExport(registered_model_name=" ")
