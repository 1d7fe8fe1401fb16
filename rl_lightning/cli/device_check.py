"""Start-up check of the devices a config asks for against the machine, before any model loads.

A GPU recipe on a machine without CUDA (a laptop, a CPU CI runner, a CUDA-less torch wheel) otherwise fails inside
Lightning's accelerator connector with a traceback, and a ``trainer.devices`` larger than the node only fails once
the processes start. Both become one line naming the key, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_lightning.errors import ConfigError

GPU_ACCELERATORS = ("gpu", "cuda")


def requested_devices(devices: Any) -> list[int] | int | None:
    """The device indices (a list) or the device count (an int) ``trainer.devices`` asks for; None for auto/-1."""
    if devices is None or devices in ("auto", -1, "-1"):
        return None
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return [int(part) for part in text.split(",") if part.strip()]
        return int(text) if text.lstrip("-").isdigit() else None
    if isinstance(devices, list | tuple):
        return [int(d) for d in devices]
    return int(devices)


def check_devices(accelerator: Any, devices: Any, cuda_count: int, torch_cuda: str | None) -> None:
    """Refuse, in one line, a CUDA accelerator or a device count the machine cannot give.

    Args:
        accelerator: ``trainer.accelerator`` as configured (``auto``, ``cpu``, ``gpu``, ``cuda``...).
        devices: ``trainer.devices`` as configured (an int, a list of indices, ``"0,1"``, ``auto`` or -1).
        cuda_count: CUDA devices visible to this process (``torch.cuda.device_count()``).
        torch_cuda: the CUDA version torch was built with (``torch.version.cuda``), None for a CPU build.
    """
    if str(accelerator).lower() not in GPU_ACCELERATORS:
        return
    if cuda_count == 0:
        why = ("this torch is a CPU build (torch.version.cuda is None)" if torch_cuda is None
               else f"torch (CUDA {torch_cuda}) sees no CUDA device")
        raise ConfigError(f"trainer.accelerator={accelerator}: {why}; run on a GPU machine with a CUDA build of torch "
                          "(docs: GPU checklist), or set --trainer.accelerator cpu")
    wanted = requested_devices(devices)
    if isinstance(wanted, int) and wanted > cuda_count:
        raise ConfigError(f"trainer.devices={devices}: this machine has {cuda_count} CUDA device(s); set "
                          f"--trainer.devices {cuda_count} (or -1 for all); several nodes: torchrun --nnodes with "
                          "devices per node")
    if isinstance(wanted, list) and any(not 0 <= d < cuda_count for d in wanted):
        raise ConfigError(f"trainer.devices={devices}: device indices must be in 0..{cuda_count - 1} on this machine "
                          f"({cuda_count} CUDA device(s)); pick from those, or give a count")


def check_launch(devices: Any, num_nodes: Any, env: Mapping[str, str]) -> None:
    """Refuse, in one line, ``trainer.devices`` / ``trainer.num_nodes`` that disagree with the launcher's processes.

    Under torchrun (``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE`` set, ``srun torchrun`` included) ``devices`` must be the
    processes per node (``--nproc-per-node``) and ``num_nodes`` their number (``--nnodes``); under ``srun`` alone,
    ``num_nodes`` must be ``SLURM_NNODES`` and ``devices`` ``SLURM_NTASKS_PER_NODE``. Otherwise every process loads
    its model before Lightning's environment check fails, or the ranks wait for peers that never come.
    """
    nodes = int(num_nodes or 1)
    wanted = requested_devices(devices)
    count = len(wanted) if isinstance(wanted, list) else wanted
    if "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
        local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
        launched, per_node, flag = world // max(local, 1), local, "torchrun --nproc-per-node"
        node_flag = "torchrun --nnodes"
    elif "SLURM_NTASKS" in env and "SLURM_NNODES" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        launched, node_flag = int(env["SLURM_NNODES"]), "sbatch/srun --nodes"
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or int(env["SLURM_NTASKS"]) // launched
        flag = "srun --ntasks-per-node"
    else:
        return
    if count is not None and count != per_node:
        raise ConfigError(f"trainer.devices={devices}: the launcher started {per_node} process(es) on this node "
                          f"({flag} {per_node}); set --trainer.devices {per_node}, or launch {count} per node")
    if nodes != launched:
        raise ConfigError(f"trainer.num_nodes={num_nodes}: the launcher started {launched} node(s) of {per_node} "
                          f"process(es) ({node_flag} {launched}); set --trainer.num_nodes {launched}, or launch "
                          f"{nodes} node(s)")


def check_trainer_devices(trainer: Any) -> None:
    """`check_devices` for a parsed ``trainer`` config section, against this machine's torch and launcher."""
    import os

    import torch

    check_launch(trainer.get("devices", "auto"), trainer.get("num_nodes", 1), os.environ)
    accelerator = trainer.get("accelerator", "auto")
    if str(accelerator).lower() not in GPU_ACCELERATORS:  # no CUDA query (and no CUDA init) for CPU runs
        return
    check_devices(accelerator, trainer.get("devices", "auto"), torch.cuda.device_count(), torch.version.cuda)
