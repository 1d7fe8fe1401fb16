"""Pins `rl_lightning.compat.torch`: the private gloo options still take a device and a timeout.

A failure names the private name, the versions tested and the module to update (`_pinned`).
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from rl_lightning.compat import torch as compat


def _pinned(condition: object, name: str, change: str = "is gone") -> None:
    assert condition, (f"{compat.TESTED} (installed {torch.__version__}): {name} {change}; "
                       "update rl_lightning/compat/torch.py")


def test_loopback_gloo_options():
    _pinned(hasattr(dist.ProcessGroupGloo, "_Options"), "ProcessGroupGloo._Options")
    options = compat.gloo_options("127.0.0.1", timedelta(seconds=7))
    _pinned(len(options._devices) == 1, "ProcessGroupGloo._Options._devices")
    _pinned(options._timeout == timedelta(seconds=7), "ProcessGroupGloo._Options._timeout")


def test_a_tensors_version_counts_in_place_writes():
    tensor = torch.zeros(3)
    _pinned(isinstance(getattr(tensor, "_version", None), int), "Tensor._version")
    before = compat.tensor_version(tensor)
    tensor[0] = 1.0
    assert compat.tensor_version(tensor) == before + 1
