"""Run untrusted (model-generated) Python code outside the trainer process, contained.

Layers, each of which alone stops the common failure modes:

1. **Process**: a fresh ``python -I`` subprocess in its own session, in an empty temporary working directory that is
   deleted afterwards, with a minimal environment; the whole process group is killed on timeout.
2. **Resource limits** (``setrlimit`` before exec): address space (`memory_mb`), CPU seconds, file size, open files,
   number of processes (enforced for non-root users).
3. **Network**: a private network namespace with no interfaces (``unshare --net``) when the host allows it.
4. **In-interpreter audit hook** (PEP 578), installed before the untrusted code runs and impossible to remove from
   Python: refuses sockets, process creation (fork, exec, subprocess, os.system), ctypes/FFI, and file writes,
   deletions or renames outside the working directory.

This is a containment layer for reward computation, not a security boundary against a determined attacker (no
seccomp or container); run trainers on machines where that is acceptable.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Runs inside the child before the untrusted code: install the audit hook, then exec the code from stdin's first
# part. The code arrives in a file (code.py) in the working directory; stdin is the program's input.
_PRELUDE = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_blocked = ("socket.", "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn",
            "os.system", "os.kill", "os.killpg", "ctypes.", "_ctypes", "os.startfile", "pty.spawn")
_writes = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
           "os.truncate", "shutil.rmtree", "os.utime")
def _inside(path):
    try:
        path = os.fsdecode(path)
    except TypeError:
        return False
    full = os.path.realpath(os.path.join(_root, path))
    return full == _root or full.startswith(_root + os.sep)
def _hook(event, args):
    if event.startswith(_blocked) or (event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args:
        path, mode = args[0], args[1] if len(args) > 1 else "r"
        writing = isinstance(mode, str) and any(c in mode for c in "wax+")
        if isinstance(mode, int):
            writing = bool(mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
        if writing and not isinstance(path, int) and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
    if event in _writes and args and not isinstance(args[0], int) and not _inside(args[0]):
        raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
_source = open("code.py").read()
sys.addaudithook(_hook)
del _hook
exec(compile(_source, "<generated>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    """What the untrusted program did: its output and why it stopped (`reason` is empty on a clean exit 0)."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    reason: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether ``unshare --net`` works here (root or user namespaces enabled)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _limits(memory_mb: int, cpu_seconds: int) -> None:  # runs in the child between fork and exec
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024 * 1024, 16 * 1024 * 1024))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_sandboxed(code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
                  max_output_bytes: int = 1 << 20) -> SandboxResult:
    """Run Python `code` with `stdin` under the limits above.

    Args:
        code: the program (untrusted).
        stdin: text fed to its standard input.
        timeout_s: wall-clock limit; the process group is killed after it (CPU time is limited to the same).
        memory_mb: address-space limit of the interpreter (Python itself needs ~30 MB).
        max_output_bytes: stdout/stderr kept beyond this are cut.
    """
    workdir = tempfile.mkdtemp(prefix="rl_sandbox_")
    try:
        with open(os.path.join(workdir, "code.py"), "w") as f:
            f.write(code)
        command = [sys.executable, "-I", "-c", _PRELUDE]
        if network_namespace_available():
            command = ["unshare", "--net", *command]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "HOME": workdir}
        process = subprocess.Popen(
            command, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=functools.partial(_limits, memory_mb, max(1, int(timeout_s) + 1)),
        )
        try:
            out, err = process.communicate(stdin.encode(), timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            timed_out = True
        stdout = out[:max_output_bytes].decode(errors="replace")
        stderr = err[:max_output_bytes].decode(errors="replace")
        return SandboxResult(stdout, stderr, process.returncode, timed_out, _reason(process.returncode, timed_out,
                                                                                      stderr))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _reason(returncode: int | None, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return ""
    if returncode is not None and returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else f"exit code {returncode}"
