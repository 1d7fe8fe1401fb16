"""examples/slurm on a real Slurm cluster on this host (tests/slurm_cluster.py: munged, slurmctld, two slurmd nodes).

The GPU scripts are rendered from real allocations (``DRY_RUN=1``: the job prints its ``srun torchrun`` line) and
checked for one torchrun per node, ``--nnodes``, the c10d endpoint on the first node and the ``trainer.*`` sizes;
``sbatch --test-only`` accepts what the nodes have and refuses more GPUs than they have, and the pre-flight
(examples/slurm/submit.sh) refuses that in one line before sbatch sees it. The SFT script then runs end to end on two
Slurm nodes on CPU and its exported weights equal a plain ``torchrun --standalone`` run with the same two processes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import slurm_cluster
import torch
from conftest import REPO, TINY_SFT
from safetensors.torch import load_file

SLURM = REPO / "examples" / "slurm"
ASSETS = REPO / "rl_lightning" / "assets"
SFT = TINY_SFT  # its plain torchrun run: conftest.sft_on_two_processes


@pytest.fixture(scope="session")
def slurm():
    """The environment (``SLURM_CONF``) of a running two-node cluster; stopped and deleted after the session."""
    reason = slurm_cluster.missing()
    if reason:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="slurm"))  # short: munge's socket path must fit in sun_path
    daemons = slurm_cluster.start(folder, slurm_cluster.NODES)
    yield {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    slurm_cluster.stop(daemons)
    shutil.rmtree(folder)


def _submit(env: dict, cwd: Path, *args: str, **variables: str) -> subprocess.CompletedProcess:
    """examples/slurm/submit.sh in `cwd`, waiting for the job (its output in cwd/slurm.out)."""
    env = {**env, "SBATCH_WAIT": "1", "SBATCH_OUTPUT": str(cwd / "slurm.out"), **variables}
    return subprocess.run([str(SLURM / "submit.sh"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1500)


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("task", ["sft", "grpo"])
def test_gpu_script_renders_one_torchrun_per_node_from_a_real_allocation(slurm, tmp_path, task):
    done = _submit(slurm, tmp_path, task, "--data.path", "my data.jsonl", NODES="2", GPUS_PER_NODE="2", DRY_RUN="1")
    assert done.returncode == 0, done.stderr
    command = shlex.split((tmp_path / "slurm.out").read_text())
    torchrun = command.index("torch.distributed.run")
    assert command[:torchrun - 2] == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    assert command[torchrun - 2:torchrun] == [sys.executable, "-m"]
    assert _option(command, "--nnodes") == "2" and _option(command, "--nproc-per-node") == "2"  # the 2 GPUs a node
    host, port = _option(command, "--rdzv-endpoint").split(":")
    assert host == "127.0.0.1" and 20000 <= int(port) < 40000  # node1's NodeAddr in slurm.conf
    assert _option(command, "--rdzv-backend") == "c10d"
    assert _option(command, "--config") == task  # the bundled recipe, by name
    assert [_option(command, f"--trainer.{key}") for key in ("accelerator", "num_nodes", "devices")] == ["gpu", "2", "2"]
    assert command[-2:] == ["--data.path", "my data.jsonl"]  # user overrides last, quoting intact


def test_rendering_names_the_first_node_of_the_nodelist_and_refuses_mismatches(slurm, tmp_path):
    job = {**slurm, "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4321",
           "SLURM_GPUS_PER_NODE": "h100:8", "REPO": str(REPO), "DRY_RUN": "1"}
    run = lambda env: subprocess.run([str(SLURM / "launch.sh"), "recipes/sft.yaml"], env=env, cwd=tmp_path,  # noqa: E731
                                     capture_output=True, text=True, timeout=60)
    command = shlex.split(run(job).stdout)
    # a node the controller does not know keeps its name; the port follows the job id
    assert _option(command, "--rdzv-endpoint") == "gpu-07:24321" and _option(command, "--rdzv-id") == "4321"
    assert [_option(command, flag) for flag in ("--nnodes", "--nproc-per-node", "--trainer.num_nodes",
                                                "--trainer.devices")] == ["2", "8", "2", "8"]
    wrong = run({**job, "PROCS_PER_NODE": "4"})
    assert wrong.returncode == 2 and wrong.stderr == ("error: PROCS_PER_NODE=4: the job has 8 GPU(s) per node and runs "
                                                       "one process per GPU; unset PROCS_PER_NODE or set it to 8\n")
    outside = run({k: v for k, v in job.items() if not k.startswith("SLURM_JOB")})
    assert outside.returncode == 2 and outside.stderr.count("\n") == 1 and "submit.sh" in outside.stderr


def test_more_gpus_than_the_nodes_have_refused_by_sbatch_and_by_the_preflight_in_one_line(slurm, tmp_path):
    script = str(SLURM / "sft.sbatch")
    test_only = lambda gpus: subprocess.run(["sbatch", "--test-only", "--nodes", "2", "--gpus-per-node", gpus,  # noqa: E731
                                             script], env=slurm, capture_output=True, text=True, timeout=60)
    fits = test_only(str(slurm_cluster.FAKE_GPUS))
    assert fits.returncode == 0 and "to start at" in fits.stderr and "nodes node[1-2]" in fits.stderr, fits.stderr
    too_many = test_only(str(slurm_cluster.FAKE_GPUS + 1))
    assert too_many.returncode == 1 and "Requested node configuration is not available" in too_many.stderr
    refused = _submit(slurm, tmp_path, "sft", NODES="2", GPUS_PER_NODE="3")
    assert refused.returncode == 2 and refused.stderr == (
        "error: GPUS_PER_NODE=3: the nodes of partition 'debug' have at most 2 GPU(s) each; set GPUS_PER_NODE=2 (and "
        "raise NODES for more ranks), or PARTITION=<larger nodes>\n")
    nodes = _submit(slurm, tmp_path, "grpo", NODES="3", GPUS_PER_NODE="2")
    assert nodes.returncode == 2 and nodes.stderr == ("error: NODES=3: partition 'debug' has 2 node(s); set NODES=2 or "
                                                      "fewer, or PARTITION=<a larger partition>\n")
    queue = subprocess.run(["squeue", "-h"], env=slurm, capture_output=True, text=True, check=True)
    assert queue.stdout == "" and not (tmp_path / "slurm.out").exists()  # nothing was submitted


@pytest.mark.slow
def test_sft_script_on_two_slurm_nodes_equals_torchrun_standalone(slurm, tmp_path, sft_on_two_processes):
    job = tmp_path / "job"
    job.mkdir()
    done = _submit(slurm, job, "sft", *SFT, NODES="2", ACCELERATOR="cpu", PROCS_PER_NODE="1")
    log = (job / "slurm.out").read_text() if (job / "slurm.out").exists() else ""
    assert done.returncode == 0, f"{done.stderr}\n{log[-3000:]}"
    assert "rendezvous 127.0.0.1:" in log and "(first node node1), 2 node(s) x 1 process(es)" in log
    (got,) = job.glob("outputs/sft/20*/export/model.safetensors")
    got, want = load_file(got), sft_on_two_processes
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    initial = load_file(ASSETS / "tiny-qwen2" / "model.safetensors")
    assert any(not torch.equal(want[name], initial[name]) for name in want.keys() & initial.keys())  # it trained
    assert (job / "outputs" / "sft" / "latest" / "checkpoints" / "last.ckpt").exists()
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{job / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and "train/loss" in run.data.metrics, (run.info.status, run.data.metrics)
