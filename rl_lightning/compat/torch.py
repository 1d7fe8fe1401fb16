"""torch's private names, behind named functions (tested on torch 2.9-2.13).

torch exposes a gloo group's device and timeout only through ``ProcessGroupGloo._Options`` (private, stable since
torch 1.x); a tensor's in-place modification counter only as ``tensor._version``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

TESTED = "torch 2.9-2.13"


def gloo_options(hostname: str, timeout: timedelta) -> Any:
    """Options for a ``ProcessGroupGloo`` whose sockets bind `hostname` only (``ProcessGroupGloo._Options``)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = timeout
    return options


def tensor_version(tensor: Any) -> int:
    """`tensor`'s in-place modification counter (``tensor._version``; it moves on every in-place write)."""
    return int(tensor._version)
