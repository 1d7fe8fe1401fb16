"""The trainer's process group when every rank runs on this host: a store and sockets only this host can reach.

torch's ``env://`` rendezvous makes rank 0 a ``TCPStore`` server that listens on every interface (``::``) whatever
``MASTER_ADDR`` says, and answers anyone, unauthenticated; gloo binds the address the host name resolves to and
NCCL's bootstrap the first non-loopback interface (the cluster network on most nodes). When all ranks share one host
(`single_host`) none of that needs to leave it:

- `init_local_group` builds the default group on a store that listens on ``127.0.0.1`` only (rank 0 binds the
  socket itself and hands it to the ``TCPStore``; one process needs no socket: an in-memory ``HashStore``);
- `loopback_environment` makes gloo (``GLOO_SOCKET_IFNAME``) and NCCL (``NCCL_SOCKET_IFNAME``) bind the loopback
  interface, for the default group and every group made after it (device meshes, vLLM's) — unless the user set them.

Outside our control: under ``torchrun`` the store is the agent's (``TORCHELASTIC_USE_AGENT_STORE``), which the
ranks only join; ``torchrun --standalone`` listens on every interface. Several hosts (``trainer.num_nodes`` > 1)
keep torch's rendezvous and the interfaces the launcher names.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

LOOPBACK = "127.0.0.1"
IFF_LOOPBACK = 0x8  # linux/if.h


def loopback_interface() -> str:
    """The name of this host's loopback network interface (``lo`` on Linux), read from ``/sys/class/net``."""
    for path in sorted(Path("/sys/class/net").glob("*/flags")):
        try:
            if int(path.read_text().strip(), 16) & IFF_LOOPBACK:
                return path.parent.name
        except (OSError, ValueError):
            continue
    return "lo"


def loopback_environment() -> dict[str, str]:
    """Variables that make gloo and NCCL bind the loopback interface (for a process that talks to this host only)."""
    interface = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def single_host(num_nodes: int, address: str) -> bool:
    """Whether every rank runs on this host: one node, and a rendezvous address that is loopback or this host."""
    if num_nodes != 1:
        return False
    if address in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def loopback_store(rank: int, world_size: int, port: int, timeout: timedelta) -> Any:
    """The default group's store, reachable from this host only: a ``TCPStore`` on ``127.0.0.1:port``.

    Rank 0 binds the listening socket on loopback itself (a ``TCPStore`` given a host still listens on ``::``) and
    hands it over with ``master_listen_fd``; the other ranks connect to it. One process gets a ``HashStore``.
    """
    import torch.distributed as dist

    if world_size == 1:
        return dist.HashStore()
    if rank != 0:
        return dist.TCPStore(LOOPBACK, port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, port))
        listener.listen(world_size * 4)
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(LOOPBACK, port, world_size, True, timeout=timeout, master_listen_fd=listener.detach())


def init_local_group(environment: Any, backend: str, timeout: timedelta | None, device: torch.device) -> None:
    """The default process group of `environment`'s ranks, all on this host, on loopback channels only.

    Args:
        environment: Lightning's ``ClusterEnvironment`` (ranks, world size, ``main_address``, ``main_port``).
        backend: the group's backend (``gloo``, ``nccl``, ``cuda:nccl,cpu:gloo``).
        timeout: the group's collective timeout (also the store's); None: torch's default.
        device: this rank's device; a CUDA one is made current and bound to the group, as Lightning does.
    """
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    timeout = timeout or default_pg_timeout
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = environment.main_address, str(environment.main_port)
    for key, value in loopback_environment().items():
        os.environ.setdefault(key, value)
    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return  # torchrun's agent holds the store: the ranks join it through env:// (Lightning's init)
    rank, world_size = environment.global_rank(), environment.world_size()
    store = loopback_store(rank, world_size, environment.main_port, timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type != "cpu" else None)
    if backend == "nccl":  # as Lightning does: torch warns at exit about an NCCL group left alive
        import atexit

        atexit.register(_destroy)


def init_single_process_group(device_type: str, timeout: timedelta | None = None) -> None:
    """A default group of this process alone (one rank, in-memory store), its gloo and NCCL sockets on loopback.

    Args:
        device_type: ``cuda`` (NCCL for CUDA tensors, gloo for host ones) or ``cpu`` (gloo).
        timeout: the group's collective timeout; None: torch's default.
    """
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    for key, value in loopback_environment().items():
        os.environ.setdefault(key, value)
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout or default_pg_timeout)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
