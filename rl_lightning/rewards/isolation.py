"""OS isolation for the code sandbox: which level this machine offers, and the command that applies it.

Levels, strongest first:

- ``bwrap``: bubblewrap (``apt-get install bubblewrap``) puts the program in fresh user, PID, mount, network, IPC,
  UTS and cgroup namespaces with every capability dropped and no way to create further user namespaces. Its filesystem
  is a private root holding read-only binds of ``/usr`` (and the ``/lib*``/``/bin`` links into it) and of the Python
  installation only, a ``/proc`` that shows only the sandbox's own processes, a minimal ``/dev`` and a size-capped tmpfs
  work directory (``/work``, the only writable place); no variable of the trainer's environment reaches it. A seccomp
  filter refuses to create processes (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``; threads still work), and
  killing the sandbox's first process tears the whole PID namespace down, so nothing outlives a call.
- ``none``: a plain child process with resource limits and the in-interpreter audit hook. Neither is a security
  boundary: the program can read what the trainer can. Used only when the user opts in
  (``RL_LIGHTNING_UNISOLATED_CODE=1``), otherwise code rewards refuse to run.

Known limits of ``bwrap``: the kernel is shared (a kernel exploit escapes any namespace); CPU time, memory, output
and file sizes are capped per call but a program can use its whole allowance; ``/usr`` and the Python installation
are readable (so do not keep secrets there).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import struct
import subprocess
import sys

from rl_lightning.errors import ConfigError

log = logging.getLogger(__name__)

OPT_IN = "RL_LIGHTNING_UNISOLATED_CODE"
WORKDIR = "/work"
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"


def interpreter() -> str:
    """The base Python (not a virtual environment's wrapper): the sandbox sees its installation only."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _read_only_paths() -> list[str]:
    paths = ["/usr", os.path.realpath(sys.base_prefix), os.path.dirname(interpreter())]
    kept: list[str] = []
    for path in sorted(set(paths), key=len):  # a path inside one already bound needs no bind of its own
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def bwrap_command(python_args: list[str], workdir_bytes: int, seccomp_fd: int | None = None,
                  files: dict[str, int] | None = None) -> list[str]:
    """The bubblewrap command line running ``interpreter() *python_args`` in the isolation described above.

    `files` (name in the work directory -> readable fd, passed to the child) are copied into the work directory.
    """
    # --unshare-user explicitly: --unshare-all only tries it, and as root would otherwise skip it
    command = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox"]
    for path in _read_only_paths():
        command += ["--ro-bind", path, path]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            command += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            command += ["--ro-bind", path, path]
    command += ["--proc", "/proc", "--dev", "/dev", "--size", str(workdir_bytes), "--tmpfs", WORKDIR,
                "--chdir", WORKDIR, "--clearenv"]
    for name, value in (("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8"), ("HOME", WORKDIR), ("TMPDIR", WORKDIR),
                        ("PYTHONDONTWRITEBYTECODE", "1")):
        command += ["--setenv", name, value]
    for name, fd in (files or {}).items():
        command += ["--file", str(fd), f"{WORKDIR}/{name}"]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    return command + ["--", interpreter(), *python_args]


# Seccomp BPF (linux/filter.h, linux/seccomp.h): refuse process creation, allow everything else.
_AUDIT_ARCH = {"x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435}),
               "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435})}
_CLONE_THREAD = 0x00010000
_EPERM, _ENOSYS = 1, 38
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000


def seccomp_program() -> bytes | None:
    """A compiled filter for this architecture (None where unknown).

    ``fork``/``vfork`` and ``clone`` without ``CLONE_THREAD`` fail with EPERM; ``clone3`` fails with ENOSYS so the C
    library falls back to ``clone``, whose flags a filter can read (threads keep working).
    """
    if platform.machine() not in _AUDIT_ARCH:
        return None
    arch, numbers = _AUDIT_ARCH[platform.machine()]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    # (code, jump if true, jump if false, k); jumps skip that many instructions
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, _ERRNO | _EPERM),  # another ABI (i386): refuse
               (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, _ERRNO | _EPERM),  # x32 numbering: refuse
               (jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, _ERRNO | _ENOSYS)]
    for name in ("fork", "vfork"):
        if name in numbers:
            program += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, _ERRNO | _EPERM)]
    program += [(jeq, 0, 3, numbers["clone"]), (ld, 0, 0, 16),  # args[0] (flags), low 32 bits (little-endian)
                (jset, 1, 0, _CLONE_THREAD), (ret, 0, 0, _ERRNO | _EPERM), (ret, 0, 0, _ALLOW)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


@functools.lru_cache(maxsize=1)
def isolation_level() -> str:
    """``bwrap`` when bubblewrap works here (tried once), else ``none``."""
    if shutil.which("bwrap") is None:
        return "none"
    try:
        probe = subprocess.run(bwrap_command(["-I", "-c", "pass"], 1 << 20, None), capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    if probe.returncode != 0:
        log.warning("code sandbox: bubblewrap is installed but fails here: %s",
                    probe.stderr.decode(errors="replace").strip()[:200])
        return "none"
    return "bwrap"


@functools.lru_cache(maxsize=1)
def require_isolation() -> str:
    """The level code rewards will use, logged once per process.

    Without real isolation, raise unless the user opted in.
    """
    level = isolation_level()
    if level == "none" and os.environ.get(OPT_IN) != "1":
        isolation_level.cache_clear()  # installing bubblewrap and retrying must work without a restart
        raise ConfigError(f"code sandbox: no OS isolation here (bubblewrap 'bwrap' is missing or fails), so model "
                          f"code could read and change what the trainer can; {INSTALL_HINT}, or set {OPT_IN}=1 to "
                          f"run it unisolated on a machine where that is acceptable")
    if level == "bwrap":
        log.info("code sandbox: isolation 'bwrap' (user/pid/mount/net namespaces, read-only /usr and Python, "
                 "private tmpfs, no process creation)")
    else:
        log.warning("code sandbox: isolation 'none' (%s=1): model code runs as a plain child process and can "
                    "read what the trainer can", OPT_IN)
    return level
