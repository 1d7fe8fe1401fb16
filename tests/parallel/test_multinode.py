"""Multi-node, tested on one machine: two "nodes" launched as a user launches them, equal to one node.

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint localhost:PORT``
(gloo), started in its own working directory, as on two machines with node-local disks; the reference is one
``torchrun --standalone --nproc-per-node 2`` with the same total processes. Asserted: the exported weights equal the
single-node run's bit for bit (the same two data-parallel ranks, whichever node holds which), and only the node that
c10d made global rank 0 wrote anything (outputs, checkpoints, the MLflow store with one run, the export): the other
node's folder holds its log alone. The GRPO run builds a colocated vLLM engine per node, so each node's engine gets its
weights from its own rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_SFT
from helpers import free_port
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ASSETS = REPO / "rl_lightning" / "assets"
SFT = ["--config", str(REPO / "rl_lightning" / "recipes" / "sft.yaml"), *TINY_SFT]  # its one-node run: conftest.sft_on_two_processes
GRPO = ["--config", str(REPO / "rl_lightning" / "recipes" / "grpo.yaml"), "--model.lm.name", str(ASSETS / "tiny-qwen2-sft"),
        "--model.rollout.env_path", str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic_format.py"),
        "--data.path", str(ASSETS / "data" / "easy.jsonl"), "--data.val_path", "null", "--model.max_rollouts", "2",
        "--data.batch_size", "4", "--model.rollout.responses_per_prompt", "2", "--trainer.num_sanity_val_steps", "0"]


def _torchrun(launch: list[str], cwd: Path, fit: list[str], nodes: int) -> subprocess.Popen:
    cwd.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "rl_lightning", "fit", *fit,
               "--trainer.num_nodes", str(nodes), "--trainer.devices", str(2 // nodes),
               "--trainer.enable_progress_bar", "false"]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=(cwd / "log.txt").open("w"), stderr=subprocess.STDOUT)


def _wait(processes: list[subprocess.Popen], folders: list[Path]) -> None:
    try:
        codes = [p.wait(timeout=1200) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for code, folder in zip(codes, folders, strict=True):
        assert code == 0, f"{folder.name} exited {code}:\n{(folder / 'log.txt').read_text()[-3000:]}"


def _exported(folder: Path, task: str) -> dict[str, torch.Tensor]:
    (export,) = folder.glob(f"outputs/{task}/20*/export/model.safetensors")
    return load_file(export)


def _single_node(tmp_path: Path, fit: list[str], task: str) -> dict[str, torch.Tensor]:
    """The exported weights of `fit` on one node with two processes."""
    single = tmp_path / "single"
    _wait([_torchrun(["--standalone", "--nproc-per-node", "2"], single, fit, nodes=1)], [single])
    return _exported(single, task)


def _two_nodes(tmp_path: Path, fit: list[str]) -> Path:
    """The folder of the node that wrote (global rank 0) after `fit` on two nodes of one process each."""
    port = free_port()
    nodes = [tmp_path / f"node{i}" for i in range(2)]
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}"]
    _wait([_torchrun([*launch, "--node-rank", str(i)], folder, fit, nodes=2) for i, folder in enumerate(nodes)], nodes)
    writers = [folder for folder in nodes if sorted(p.name for p in folder.iterdir()) != ["log.txt"]]
    assert len(writers) == 1, f"every node but global rank 0's writes nothing: {[sorted(os.listdir(n)) for n in nodes]}"
    assert "GLOBAL_RANK: 0" in (writers[0] / "log.txt").read_text()
    return writers[0]


def _one_mlflow_run(folder: Path, metric: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and metric in runs[0].data.metrics, [r.data.metrics for r in runs]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_two_nodes_sft_equals_one_node_and_rank_zero_writes_alone(tmp_path, sft_on_two_processes):
    writer = _two_nodes(tmp_path, SFT)
    _assert_equal(_exported(writer, "sft"), sft_on_two_processes)
    _one_mlflow_run(writer, "train/loss")
    assert (writer / "outputs" / "sft" / "latest" / "checkpoints" / "last.ckpt").exists()


def test_two_nodes_grpo_with_an_engine_per_node_equals_one_node(tmp_path):
    single = _single_node(tmp_path, GRPO, "grpo")
    writer = _two_nodes(tmp_path, GRPO)
    _assert_equal(_exported(writer, "grpo"), single)
    _one_mlflow_run(writer, "train/reward")
