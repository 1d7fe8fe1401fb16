"""Shared fixtures: the shipped tiny model/tokenizer, repo paths, hermetic hub settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "rl_lightning" / "assets" / "tiny-qwen2"
DEMO_DATA = REPO / "rl_lightning" / "assets" / "data"

# Nothing may reach a model hub: fail fast instead of waiting for timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch (OpenMP) thread per test process unless the caller chose: `make test` runs two pytest-xdist workers on CI's
# two cores, and each worker's default of one thread per core (plus spawned ranks, engines and CLI subprocesses, which
# inherit this) oversubscribes them; OpenMP threads then spin waiting for a descheduled peer. The spawned ranks
# (tests/helpers.py) and the timed benchmarks already run with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# completion-length parity: rewards vary within groups, so advantages (and per-set means) are non-zero
PARITY_ENV = '''
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)
'''


@pytest.fixture(scope="session")
def parity_env(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "parity.py"
    path.write_text(PARITY_ENV)
    return str(path)


# the SFT recipe on the tiny model for 3 steps, as the multi-node and Slurm tests launch it (after --config sft.yaml)
TINY_SFT = ["--model.lm.name", str(TINY_MODEL), "--data.path", str(DEMO_DATA / "sft.jsonl"), "--trainer.max_steps",
            "3", "--trainer.enable_progress_bar", "false"]


def shared_tmp(tmp_path_factory, worker_id: str) -> Path:
    """A folder all pytest-xdist workers of this run share (this run's own base folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


@pytest.fixture(scope="session")
def sft_on_two_processes(tmp_path_factory, worker_id) -> dict[str, torch.Tensor]:
    """The exported weights of `TINY_SFT` run by ``torchrun --standalone --nproc-per-node 2`` (one node, two
    data-parallel CPU processes): the single-node reference that the two-node runs of tests/parallel/test_multinode.py
    and tests/cluster/test_slurm.py must equal bit for bit. One run (two processes starting torch) serves both, also when
    the two files run in different pytest-xdist workers (the first one to need it runs it, under a file lock)."""
    from filelock import FileLock
    from safetensors.torch import load_file

    shared = shared_tmp(tmp_path_factory, worker_id)
    kept = shared / "sft_single_node.safetensors"
    with FileLock(str(shared / "sft_single_node.lock")):
        if not kept.exists():
            kept.write_bytes(_sft_on_two_processes(tmp_path_factory).read_bytes())
    return load_file(kept)


def _sft_on_two_processes(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sft_single_node")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "rl_lightning", "fit", "--config", str(REPO / "rl_lightning" / "recipes" / "sft.yaml"), *TINY_SFT,
               "--trainer.num_nodes", "1", "--trainer.devices", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (export,) = folder.glob("outputs/sft/20*/export/model.safetensors")
    return export


# The files that take minutes in `make test` (its `--durations=40` and per-file totals, tracked in CI logs), longest
# first. They are collected first, and `make test` hands files to its two pytest-xdist workers in collection order
# (`--no-loadscope-reorder`; xdist's default orders files by their number of tests): the workers start on the long
# files and end on short ones, where one of these picked up last would run on alone at the end.
LONG_FILES = (  # worker-seconds per file in the full run of 2026-11-28 13:41 (its log's PASSED timestamps)
    "tests/cli/test_demo.py", "tests/e2e/test_e2e.py", "tests/memory/test_plan.py", "tests/assets/test_real_model.py",
    "tests/benchmarks/test_benchmarks.py", "tests/parallel/test_compile.py", "tests/cli/test_resume_bitwise.py",
    "tests/cli/test_resume_check.py", "tests/engines/test_restart.py", "tests/cli/test_atomic_checkpoints.py",
    "tests/benchmarks/test_gpu_script.py", "tests/benchmarks/test_benchmarks_real_model.py",
    "tests/rewards/test_reward_model.py", "tests/tasks/ppo/test_ppo_parallel.py", "tests/parallel/test_multinode.py",
    "tests/engines/test_vllm.py", "tests/rollout/test_async_rollout.py", "tests/cluster/test_slurm.py",
    "tests/engines/test_shared.py", "tests/cli/test_cli.py", "tests/tasks/ppo/test_ppo_dp_rounds.py",
    "tests/tracking/test_mlflow_ui.py", "tests/e2e/test_wheel.py", "tests/parallel/test_strategy.py",
)


def pytest_collection_modifyitems(config, items):
    """`LONG_FILES` first, in that order; every other file after them, in collection order."""
    rank = {path: i for i, path in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))


@pytest.fixture(scope="session")
def tokenizer():
    from rl_lightning.models.loading import load_tokenizer

    return load_tokenizer(str(TINY_MODEL))


# What an in-process fit leaves in os.environ for the rendezvous (Lightning sets MASTER_PORT and the ranks). Left set,
# every later subprocess (torchrun, benchmarks, vLLM's own process group) inherits a port the pytest process may
# still hold: EADDRINUSE far from the test that set it.
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                  "GROUP_RANK")
RENDEZVOUS_AT_START = {key: os.environ.get(key) for key in RENDEZVOUS_ENV}  # before any fixture, module-scoped ones too


@pytest.fixture(autouse=True)
def _reset_torch_state():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in RENDEZVOUS_AT_START.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6, rtol: float = 0.0) -> None:
    """`torch.testing.assert_close` whose message always shows the max and mean absolute difference."""
    diff = (actual.double() - expected.double()).abs()
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=rtol,
        msg=lambda m: f"{m}\nmax |diff| = {diff.max().item():.3e}, mean |diff| = {diff.mean().item():.3e}",
    )


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory laid out like the repo root (recipes' relative paths resolve), so MLflow stores,
    checkpoints and exports land in tmp_path."""
    for name in ("rl_lightning", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    _forget_mlflow_stores()
    yield tmp_path
    _forget_modules_under(tmp_path)


def _forget_modules_under(folder):
    """The CLI puts the working directory on sys.path, so ``callbacks`` may be imported through this folder's symlink;
    once the folder is deleted (a passing test's tmp_path is), that cached package cannot import its submodules."""
    import sys

    prefix = str(folder)
    for name, module in list(sys.modules.items()):
        found = getattr(module, "__dict__", {})  # not getattr: lazy modules (transformers) import on attribute access
        paths = [found.get("__file__") or ""]
        try:
            paths += [str(p) for p in found.get("__path__") or []]
        except TypeError:  # not a package path (torch's op namespaces)
            pass
        if any(isinstance(p, str) and p.startswith(prefix) for p in paths):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not str(p).startswith(prefix)]


def _forget_mlflow_stores():
    """MLflow caches its tracking and registry stores by URI string, so the CLI's relative ``sqlite:///mlflow.db``
    would keep pointing at the first test's folder after a chdir: forget them (private API, tests only)."""
    from mlflow.tracking._model_registry.registry import ModelRegistryStoreRegistry
    from mlflow.tracking._tracking_service.registry import TrackingStoreRegistry

    for registry in (TrackingStoreRegistry, ModelRegistryStoreRegistry):
        for attribute in vars(registry).values():
            if hasattr(attribute, "cache_clear"):
                attribute.cache_clear()
    # The SQL stores keep one engine per URI string, whose pooled connections hold the previous folder's database
    # open; once that folder is deleted (a passing test's tmp_path is), sqlite refuses writes as "readonly".
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistrySqlStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingSqlStore

    for store in (TrackingSqlStore, RegistrySqlStore):
        with store._engine_map_lock:
            for engine in store._engine_map.values():
                engine.dispose()
            store._engine_map.clear()
