"""Run untrusted (model-generated) Python code outside the trainer, contained by the operating system.

The boundary is OS isolation (`rl_lightning.rewards.isolation`: bubblewrap namespaces, a read-only view of ``/usr``
and the Python installation, a private tmpfs work directory, no process creation, nothing inherited from the
trainer's environment). On top of it, each call has:

- **resource limits** set before the program starts (hard limits, which the program cannot raise): address space
  (`memory_mb`), CPU seconds, file size, open files, processes, no core dumps;
- **a wall-clock limit**: the sandbox is killed at `timeout_s`, and with it every process it holds;
- **an output cap**: stdout and stderr are read as they arrive, and a program writing more than `max_output_bytes`
  is killed, so the trainer never holds more than the cap;
- **an audit hook** (PEP 578) refusing sockets, process creation, ctypes and writes outside the work directory:
  defence in depth only. It runs inside the untrusted interpreter, so a determined program can get around it; the
  namespaces are what hold.

The first call logs the isolation level; without real isolation it refuses unless the user opted in (see
`rl_lightning.rewards.isolation.require_isolation`).
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rl_lightning.rewards import confine as confine_module
from rl_lightning.rewards import isolation

# Runs inside the sandboxed interpreter before the untrusted code (argv: memory MiB, CPU s, audit hook 1/0, the seccomp
# filter in hex or "-", the parent's pid, the program's file): unisolated, confine itself (die with the parent, the
# seccomp filter: `rl_lightning.rewards.confine`, whose source precedes this one then); lower the hard resource limits,
# install the audit hook, then run the program as __main__. The hook's state lives in
# its closure, not in globals the program can reach through ``import __main__``.
_PRELUDE = r'''
import os, resource, sys
def _install(memory, cpu_seconds, audit):
    for name, value in (("RLIMIT_AS", memory), ("RLIMIT_CPU", cpu_seconds), ("RLIMIT_FSIZE", 16 << 20),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_NPROC", 64), ("RLIMIT_CORE", 0), ("RLIMIT_MSGQUEUE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    root = os.path.realpath(os.getcwd())
    blocked = ("socket.", "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn",
               "os.system", "os.kill", "os.killpg", "ctypes.", "_ctypes", "os.startfile", "pty.spawn",
               "gc.get_objects", "gc.get_referrers", "gc.get_referents")
    paths = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.symlink": 2, "os.link": 2,
             "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "shutil.rmtree": 1, "os.utime": 1}
    realpath, join, fsdecode, sep = os.path.realpath, os.path.join, os.fsdecode, os.sep
    flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    def inside(path):
        if isinstance(path, int):
            return False  # a file descriptor may point anywhere
        try:
            full = realpath(join(root, fsdecode(path)))
        except TypeError:
            return False
        return full == root or full.startswith(root + sep)
    def hook(event, args):
        if event.startswith(blocked) or (event == "import" and args and str(args[0]).split(".")[0] in
                                         ("ctypes", "_ctypes")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args:
            mode = args[1] if len(args) > 1 else "r"
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((args[2] or 0) & flags)
            if writing and not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory is not allowed")
        count = paths.get(event)
        if count is not None:  # every path argument (rename/link: source and destination), and no dir_fd tricks
            dir_fds = [a for a in args[count:] if isinstance(a, int) and a >= 0]
            if dir_fds or not all(inside(a) for a in args[:count]):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
    if audit:
        sys.addaudithook(hook)
if sys.argv[4] != "-":
    die_with_parent(int(sys.argv[5]))
    apply_seccomp(bytes.fromhex(sys.argv[4]))
_install(int(sys.argv[1]) << 20, int(sys.argv[2]), sys.argv[3] == "1")
del _install
_source = open(sys.argv[6]).read()
sys.argv = [sys.argv[6]]
exec(compile(_source, "<generated>", "exec"), {"__name__": "__main__"})
'''
_WORKDIR_PREFIX = "rl_sandbox_"  # unisolated work directories: rl_sandbox_<pid of the caller>_<random>
WORKDIR_BYTES = 64 << 20  # tmpfs size of the work directory (files the program writes live in memory)
_CHUNK = 1 << 16


@dataclass
class SandboxResult:
    """What the untrusted program did: its output and why it stopped (`reason` is empty on a clean exit 0)."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    reason: str
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """A clean exit: status 0, no timeout and an empty `reason`."""
        return self.returncode == 0 and not self.timed_out and not self.reason


def run_sandboxed(code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
                  max_output_bytes: int = 1 << 20, audit_hook: bool = True) -> SandboxResult:
    """Run Python `code` with `stdin` in the sandbox.

    Args:
        code: the program (untrusted).
        stdin: text fed to its standard input.
        timeout_s: wall-clock limit; the sandbox and everything in it is killed after it (CPU time is limited to the
            same, rounded up, plus a second: a backstop behind the wall clock, so a single-threaded busy loop is
            reported as ``timeout``, not as a kill; a program burning several cores can still reach it first).
        memory_mb: address-space limit of the interpreter (Python itself needs ~30 MB).
        max_output_bytes: a program writing more than this to stdout or stderr is killed (reason ``output limit``).
        audit_hook: install the in-interpreter audit hook (defence in depth; the tests switch it off to show that the
            OS isolation holds on its own).
    """
    level = isolation.require_isolation()
    start = time.monotonic()
    limits = [str(memory_mb), str(max(1, int(timeout_s + 0.999)) + 1), str(int(audit_hook))]
    if level == "bwrap":
        process, cleanup = _start_bwrap(code, ["-I", "-c", _PRELUDE, *limits, "-", "0"])
    else:
        program = isolation.seccomp_program()
        confine = Path(confine_module.__file__).read_text() + _PRELUDE
        process, cleanup = _start_unisolated(code, ["-I", "-c", confine, *limits, program.hex() if program else "-",
                                                    str(os.getpid())])
    try:
        out, err, why = _communicate(process, stdin.encode(), start + timeout_s, max_output_bytes)
    finally:
        _kill(process)
        cleanup()
    stderr = err.decode(errors="replace")
    returncode = None if why == "timeout" else process.returncode
    return SandboxResult(out.decode(errors="replace"), stderr, returncode, why == "timeout",
                         why or _reason(process.returncode, stderr), time.monotonic() - start)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # not inherited by default (CLOEXEC unless passed)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _start_bwrap(code: str, args: list[str]) -> tuple[subprocess.Popen, Callable[[], None]]:
    fds = {"code.py": _memfd("code", code.encode())}
    program = isolation.seccomp_program()
    seccomp = _memfd("seccomp", program) if program is not None else None
    passed = list(fds.values()) + ([seccomp] if seccomp is not None else [])
    command = isolation.bwrap_command([*args, "code.py"], WORKDIR_BYTES, seccomp, files=fds)
    try:
        # bwrap's own process (PID 1 in the sandbox, /proc/1/environ) must not carry the trainer's environment either
        process = _popen(command, cwd="/", pass_fds=passed, env={"PATH": "/usr/bin:/bin"})
    finally:
        for fd in passed:
            os.close(fd)
    return process, lambda: None


def _start_unisolated(code: str, args: list[str]) -> tuple[subprocess.Popen, Callable[[], None]]:
    """A plain child process, killed when this process dies, in a work directory removed after it.

    The directory's name carries this process's pid, so one left behind by a killed process is removed by the next
    process that runs an unisolated call (`_remove_stale_workdirs`).
    """
    _remove_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}_")
    with open(os.path.join(workdir, "code.py"), "w") as f:
        f.write(code)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "HOME": workdir,
           "TMPDIR": workdir}
    return _popen([isolation.interpreter(), *args, "code.py"], cwd=workdir, env=env), \
        lambda: shutil.rmtree(workdir, ignore_errors=True)


@functools.cache
def _remove_stale_workdirs() -> None:
    """Remove this user's unisolated work directories whose process is gone (once per process)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(_WORKDIR_PREFIX):].partition("_")[0]
        path = os.path.join(root, name)
        if not name.startswith(_WORKDIR_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            if os.lstat(path).st_uid == os.getuid() and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _popen(command: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **kwargs)


def _communicate(process: subprocess.Popen, data: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """Feed stdin and collect stdout/stderr as they come, until both close, the deadline passes or a stream is full.

    The deadline is ``timeout``, a full stream one that passes `cap` bytes (``output limit``); the trainer never
    buffers more than `cap` + one chunk.
    """
    outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    selector = selectors.DefaultSelector()
    for fd in outputs:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    stdin, sent = process.stdin.fileno(), 0
    if data:
        os.set_blocking(stdin, False)
        selector.register(stdin, selectors.EVENT_WRITE)
    else:
        process.stdin.close()
    why = ""
    while selector.get_map() and not why:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = "timeout"
            break
        for key, _ in selector.select(remaining):
            if key.fd == stdin:
                try:
                    sent += os.write(stdin, data[sent : sent + _CHUNK])
                except BlockingIOError:
                    continue
                except BrokenPipeError:  # the program stopped reading: the rest of its input is dropped
                    sent = len(data)
                if sent >= len(data):
                    selector.unregister(stdin)
                    process.stdin.close()
                continue
            chunk = os.read(key.fd, _CHUNK)
            if not chunk:
                selector.unregister(key.fd)
            outputs[key.fd] += chunk
            if len(outputs[key.fd]) > cap:
                why = f"output limit: more than {cap} bytes"
                break
    selector.close()
    if not why:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            why = "timeout"
    out, err = (bytes(outputs[f.fileno()][:cap]) for f in (process.stdout, process.stderr))
    return out, err, why


def _kill(process: subprocess.Popen) -> None:
    """Kill the sandbox's process group.

    Under bwrap its first process dying tears the PID namespace down (every process in it is killed by the kernel), so
    nothing survives and no pipe stays open.
    """
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None and not stream.closed:
            try:
                stream.close()
            except BrokenPipeError:
                pass


def _reason(returncode: int | None, stderr: str) -> str:
    if returncode == 0:
        return ""
    if returncode is not None and returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else f"exit code {returncode}"
