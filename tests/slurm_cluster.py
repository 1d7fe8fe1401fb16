"""A real Slurm cluster on this host for the tests: munged, slurmctld and one slurmd per node, all in one temp folder.

Debian's slurm-wlm 22.05 is built without ``--enable-multiple-slurmd``, yet two slurmd daemons share a host when each
node has its own ``NodeHostname`` and ``Port`` and the daemon is started with ``-N <node>`` (``NodeName=localhost``
would not do: Slurm swaps it for the host's name). The nodes are ``node1`` and ``node2`` at ``NodeAddr=127.0.0.1``;
the batch script's c10d endpoint is the first node's NodeAddr, so nothing needs a hosts entry. No cgroups
(``proctrack/linuxproc``, ``task/none``), no accounting; every node offers two fake GPUs (``gres.conf`` maps them to
``/dev/null`` and ``/dev/zero``) so that sbatch's GPU checks run. Slurm's daemons launch jobs as root here, so the
cluster needs root; ``make setup`` (as root) installs the daemons.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from helpers import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol")
FAKE_GPUS = 2
NODES = ["node1", "node2"]


def missing() -> str | None:
    """Why this host cannot run the cluster (a skip reason), or None."""
    absent = [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if absent:
        return (f"Slurm/munge not installed ({', '.join(absent)} missing): `make setup` as root installs them "
                "(apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        return "the test Slurm cluster launches jobs as root (SlurmdUser=root); run the test as root, as CI does"
    return None


def write_config(folder: Path, nodes: list[str]) -> Path:
    """slurm.conf, gres.conf and a munge key in `folder`; returns the slurm.conf path (export it as SLURM_CONF)."""
    for sub in ("state", "log", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    cpus = max(1, (os.cpu_count() or 1) // len(nodes))
    lines = [
        "ClusterName=rltest", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={folder / 'munge.socket'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "GresTypes=gpu",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.%n.pid'}",
        f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'log' / 'slurmd.%n.log'}",
    ]
    lines += [f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} "
              f"Gres=gpu:{FAKE_GPUS} State=UNKNOWN" for name in nodes]
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    (folder / "slurm.conf").write_text("\n".join(lines) + "\n")
    (folder / "gres.conf").write_text("Name=gpu File=/dev/null\nName=gpu File=/dev/zero\n")
    return folder / "slurm.conf"


def start(folder: Path, nodes: list[str]) -> list[subprocess.Popen]:
    """Start munged, slurmctld and a slurmd per node (foreground, so each is our child) and wait for idle nodes."""
    conf = write_config(folder, nodes)
    subprocess.run(["mungekey", "--create", "--keyfile", str(folder / "munge.key")], check=True)
    log = (folder / "log" / "daemons.txt").open("w")
    spawn = lambda *command: subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # noqa: E731
    daemons = [spawn("munged", "--foreground", "--force", f"--key-file={folder / 'munge.key'}",
                     f"--socket={folder / 'munge.socket'}", f"--pid-file={folder / 'munged.pid'}",
                     f"--seed-file={folder / 'munged.seed'}", f"--log-file={folder / 'log' / 'munged.log'}")]
    _wait_for(lambda: (folder / "munge.socket").exists(), 20, folder, "munged never opened its socket")
    daemons.append(spawn("slurmctld", "-D", "-i", "-f", str(conf)))
    daemons += [spawn("slurmd", "-D", "-N", name, "-f", str(conf)) for name in nodes]
    env = {**os.environ, "SLURM_CONF": str(conf)}
    states = lambda: subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,  # noqa: E731
                                    text=True).stdout.split()
    try:
        _wait_for(lambda: states() == ["idle"] * len(nodes), 90, folder, "the nodes never became idle")
    except Exception:
        stop(daemons)
        raise
    return daemons


def stop(daemons: list[subprocess.Popen]) -> None:
    """Stop the daemons we started, slurmd first, munged last."""
    for daemon in reversed(daemons):
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def _wait_for(ready, timeout_s: float, folder: Path, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            errors = [line for log in sorted((folder / "log").glob("*")) for line in log.read_text().splitlines()
                      if "error" in line.lower() or "fatal" in line.lower()]
            errors = sorted(errors, key=lambda line: "fatal" not in line)[:30]  # the fatal lines say why first
            raise RuntimeError(f"{what} within {timeout_s}s; daemon errors:\n" + "\n".join(errors))
        time.sleep(0.5)
