"""OS isolation for the code sandbox: which level this machine offers, and the command that applies it.

Levels, strongest first:

- ``bwrap``: bubblewrap (``apt-get install bubblewrap``) puts the program in fresh user, PID, mount, network, IPC,
  UTS and cgroup namespaces with every capability dropped and no way to create further user namespaces. Its filesystem
  is a private, read-only root holding read-only binds of ``/usr`` (and the ``/lib*``/``/bin`` links into it) and of
  the Python installation only, a ``/proc`` that shows only the sandbox's own processes, a minimal read-only ``/dev``
  (no writable ``/dev/shm``) and a size-capped tmpfs work directory (``/work``, the only writable place); no variable of
  the trainer's environment reaches it. A seccomp filter refuses to create processes (``fork``, ``vfork``, ``clone``
  without ``CLONE_THREAD``; threads still work) and anonymous memory files that would escape the address-space limit
  (``memfd_create``, System V ``shmget``), and killing the sandbox's first process tears the whole PID namespace down,
  so nothing outlives a call. The ``bwrap`` found on ``PATH`` at the first probe is the one every call runs (by its
  absolute path).
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


def _read_only_paths(extra: tuple[str, ...] = ()) -> list[str]:
    paths = ["/usr", os.path.realpath(sys.base_prefix), os.path.dirname(interpreter()), *map(os.path.realpath, extra)]
    kept: list[str] = []
    for path in sorted(set(paths), key=len):  # a path inside one already bound needs no bind of its own
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def bwrap_path() -> str:
    """The absolute path of the ``bwrap`` the probe found (probing first if it has not run); every call runs it."""
    if _found["bwrap"] is None:
        isolation_level()
    return _found["bwrap"] or "bwrap"


def bwrap_command(python_args: list[str], workdir_bytes: int, seccomp_fd: int | None = None,
                  files: dict[str, int] | None = None, read_only: tuple[str, ...] = (),
                  bwrap: str | None = None, workdir: str = WORKDIR) -> list[str]:
    """The bubblewrap command line running ``interpreter() *python_args`` in the isolation described above.

    `files` (name in the work directory -> readable fd, passed to the child) are copied into the work directory;
    `read_only` names more directories to bind read-only at the same path (e.g. a ``site-packages``); `bwrap` is the
    executable (default: `bwrap_path`); `workdir` the work directory (it must not hold a `read_only` folder).
    """
    # --unshare-user explicitly: --unshare-all only tries it, and as root would otherwise skip it
    command = [bwrap or bwrap_path(), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
               "--new-session", "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox"]
    for path in _read_only_paths(read_only):
        command += ["--ro-bind", path, path]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            command += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            command += ["--ro-bind", path, path]
    # /dev and then / read-only once everything is in place: only the size-capped work directory takes writes
    # (tmpfs pages are not counted in the program's address space, so an uncapped one could fill the host's memory)
    command += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--size", str(workdir_bytes), "--tmpfs",
                workdir, "--chdir", workdir, "--clearenv"]
    for name, value in (("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8"), ("HOME", workdir), ("TMPDIR", workdir),
                        ("PYTHONDONTWRITEBYTECODE", "1")):
        command += ["--setenv", name, value]
    for name, fd in (files or {}).items():
        command += ["--file", str(fd), f"{workdir}/{name}"]
    command += ["--remount-ro", "/"]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    return command + ["--", interpreter(), *python_args]


# Seccomp BPF (linux/filter.h, linux/seccomp.h): refuse process creation (and more, see `seccomp_program`).
_AUDIT_ARCH = {
    "x86_64": (0xC000003E, {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "memfd_create": 319, "shmget": 29,
                            "kill": 62, "tkill": 200, "tgkill": 234, "ptrace": 101, "process_vm_readv": 310,
                            "process_vm_writev": 311, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438}),
    "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435, "memfd_create": 279, "shmget": 194, "kill": 129,
                             "tkill": 130, "tgkill": 131, "ptrace": 117, "process_vm_readv": 270,
                             "process_vm_writev": 271, "pidfd_send_signal": 424, "pidfd_open": 434,
                             "pidfd_getfd": 438})}
_DENIED = ("fork", "vfork", "memfd_create", "shmget")
_OTHER_PROCESSES = ("kill", "tkill", "tgkill", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_send_signal",
                    "pidfd_open", "pidfd_getfd")
_CLONE_THREAD = 0x00010000
_EPERM, _ENOSYS = 1, 38
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000


def seccomp_program(other_processes: bool = False) -> bytes | None:
    """A compiled filter for this architecture (None where unknown).

    ``fork``/``vfork``, ``clone`` without ``CLONE_THREAD``, ``memfd_create`` and ``shmget`` fail with EPERM;
    ``clone3`` fails with ENOSYS so the C library falls back to ``clone``, whose flags a filter can read (threads keep
    working). `other_processes`: also refuse signalling, tracing or reading/writing the memory of any process
    (``kill``, ``tgkill``, ``ptrace``, ``process_vm_*``, ``pidfd_*``), for a child that shares its sandbox with the
    process that forked it.
    """
    if platform.machine() not in _AUDIT_ARCH:
        return None
    arch, numbers = _AUDIT_ARCH[platform.machine()]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    # (code, jump if true, jump if false, k); jumps skip that many instructions
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, _ERRNO | _EPERM),  # another ABI (i386): refuse
               (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, _ERRNO | _EPERM),  # x32 numbering: refuse
               (jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, _ERRNO | _ENOSYS)]
    for name in _DENIED + (_OTHER_PROCESSES if other_processes else ()):
        if name in numbers:
            program += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, _ERRNO | _EPERM)]
    program += [(jeq, 0, 3, numbers["clone"]), (ld, 0, 0, 16),  # args[0] (flags), low 32 bits (little-endian)
                (jset, 1, 0, _CLONE_THREAD), (ret, 0, 0, _ERRNO | _EPERM), (ret, 0, 0, _ALLOW)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


_found: dict[str, str | None] = {"bwrap": None}  # what the last probe found


@functools.lru_cache(maxsize=1)
def isolation_level() -> str:
    """``bwrap`` when bubblewrap works here (tried once), else ``none``.

    ``bwrap`` is looked up on the trainer's ``PATH`` once; the probe and every later call run that absolute path.
    """
    found = shutil.which("bwrap")
    _found["bwrap"] = os.path.abspath(found) if found else None
    if found is None:
        return "none"
    try:
        probe = subprocess.run(bwrap_command(["-I", "-c", "pass"], 1 << 20, None, bwrap=_found["bwrap"]),
                               capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
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
