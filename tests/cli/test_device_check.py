"""A GPU recipe on a machine that cannot give it (issue 25, bad input): one line naming the key, the value and the fix,
from the real CLI before any model loads; the pure check against each machine shape."""

import sys

import pytest
import torch

from rl_lightning.cli.device_check import check_devices, check_launch, requested_devices
from rl_lightning.cli.main import main
from rl_lightning.errors import ConfigError


@pytest.mark.parametrize(("devices", "expected"), [
    ("auto", None), (-1, None), ("-1", None), (None, None), (2, 2), ("4", 4), ([0, 3], [0, 3]), ("0,1", [0, 1]),
])
def test_requested_devices_reads_every_form_lightning_accepts(devices, expected):
    assert requested_devices(devices) == expected


@pytest.mark.parametrize("accelerator", ["cpu", "auto", "CPU"])
def test_cpu_and_auto_never_ask_for_cuda(accelerator):
    check_devices(accelerator, 8, cuda_count=0, torch_cuda=None)


def test_gpu_on_a_cpu_build_of_torch_names_the_key_and_the_fix():
    with pytest.raises(ConfigError) as info:
        check_devices("gpu", 1, cuda_count=0, torch_cuda=None)
    assert str(info.value).startswith("trainer.accelerator=gpu: this torch is a CPU build")
    assert "--trainer.accelerator cpu" in str(info.value)


def test_cuda_torch_without_a_visible_device_says_so():
    with pytest.raises(ConfigError, match=r"trainer.accelerator=cuda: torch \(CUDA 12.9\) sees no CUDA device"):
        check_devices("cuda", "auto", cuda_count=0, torch_cuda="12.9")


def test_more_devices_than_the_node_has_names_the_count_to_use():
    check_devices("gpu", 8, cuda_count=8, torch_cuda="12.9")
    with pytest.raises(ConfigError, match=r"^trainer.devices=8: this machine has 2 CUDA device\(s\); set "
                                          r"--trainer.devices 2"):
        check_devices("gpu", 8, cuda_count=2, torch_cuda="12.9")


@pytest.mark.parametrize("devices", [[0, 2], "1,2", [-1]])
def test_device_indices_off_the_machine_are_refused(devices):
    with pytest.raises(ConfigError, match=r"device indices must be in 0..1"):
        check_devices("gpu", devices, cuda_count=2, torch_cuda="12.9")
    check_devices("gpu", devices if devices != [-1] else [1], cuda_count=3, torch_cuda="12.9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_recipe_on_this_cpu_machine_is_one_line_before_the_model_loads(workdir, capsys, monkeypatch):
    import rl_lightning.models.loading as loading

    monkeypatch.setattr(sys, "argv", ["rl_lightning"])
    loads = []
    monkeypatch.setattr(loading, "_load_for_training", lambda *args, **kwargs: loads.append(args))
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/grpo.yaml", "--trainer.logger", "false", "--trainer.accelerator", "gpu",
              "--trainer.devices", "2"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("rl_lightning: error: ")]
    assert errors == ["rl_lightning: error: trainer.accelerator=gpu: this torch is a CPU build (torch.version.cuda is "
                      "None); run on a GPU machine with a CUDA build of torch (docs: GPU checklist), or set "
                      "--trainer.accelerator cpu"]
    assert loads == []


TORCHRUN_2X2 = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}


@pytest.mark.parametrize(("devices", "num_nodes", "env"), [
    (2, 2, TORCHRUN_2X2), ("2", "2", TORCHRUN_2X2), ([0, 1], 2, TORCHRUN_2X2), ("auto", 2, TORCHRUN_2X2),
    (1, 1, {}),  # no launcher: Lightning launches the processes itself
    (4, 2, {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NAME": "grpo"}),
    (1, 3, {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "bash"}),  # salloc shell: not a launch
])
def test_sizes_that_match_the_launcher_pass(devices, num_nodes, env):
    check_launch(devices, num_nodes, env)


@pytest.mark.parametrize(("devices", "num_nodes", "env", "message"), [
    (1, 2, TORCHRUN_2X2, "trainer.devices=1: the launcher started 2 process(es) on this node (torchrun "
                         "--nproc-per-node 2); set --trainer.devices 2, or launch 1 per node"),
    (2, 1, TORCHRUN_2X2, "trainer.num_nodes=1: the launcher started 2 node(s) of 2 process(es) (torchrun --nnodes 2); "
                         "set --trainer.num_nodes 2, or launch 1 node(s)"),
    (4, 1, {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NAME": "grpo"},
     "trainer.num_nodes=1: the launcher started 2 node(s) of 4 process(es) (sbatch/srun --nodes 2); set "
     "--trainer.num_nodes 2, or launch 1 node(s)"),
])
def test_sizes_that_disagree_with_the_launcher_name_the_key_and_the_fix(devices, num_nodes, env, message):
    with pytest.raises(ConfigError) as info:
        check_launch(devices, num_nodes, env)
    assert str(info.value) == message


@pytest.mark.slow
def test_a_real_torchrun_with_the_wrong_node_count_stops_in_one_line_before_any_model_loads(tmp_path):
    """Two processes from a real ``torchrun --standalone --nproc-per-node 2`` told ``--trainer.devices 1``: they stop
    with the one line, without loading the model (no 'trainable parameters' line)."""
    import os
    import subprocess

    from conftest import REPO

    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rl_lightning",
         "fit", "--config", str(REPO / "rl_lightning" / "recipes" / "sft.yaml"), "--model.lm.name",
         str(REPO / "rl_lightning" / "assets" / "tiny-qwen2"), "--data.path",
         str(REPO / "rl_lightning" / "assets" / "data" / "sft.jsonl"), "--trainer.devices", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert out.returncode != 0
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("rl_lightning: error: ")]
    # one line per rank that got that far (torchrun stops the other rank once one exits)
    assert 1 <= len(errors) <= 2 and set(errors) == {
        "rl_lightning: error: trainer.devices=1: the launcher started 2 process(es) on this node (torchrun "
        "--nproc-per-node 2); set --trainer.devices 2, or launch 1 per node"}
    # no traceback from our code (torchrun's agent prints its own ChildFailedError summary)
    assert "trainable parameters" not in out.stdout + out.stderr and str(REPO / "rl_lightning") not in out.stderr
