"""The code sandbox caps what it promises (issue 36.3): only the size-capped work folder takes writes, the ``bwrap``
found at start-up is the one that runs, and the opt-in unisolated mode leaves nothing behind when its caller is killed.

The hostile programs run with the audit hook off: the operating system holds on its own.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rl_lightning.rewards import isolation
from rl_lightning.rewards.sandbox import WORKDIR_BYTES, run_sandboxed

needs_bwrap = pytest.mark.skipif(isolation.isolation_level() != "bwrap",
                                 reason=f"no bubblewrap isolation on this machine; {isolation.INSTALL_HINT}")

_FILL = """
import ctypes, errno, os
from multiprocessing import shared_memory
CAP, CHUNK = {cap}, b"x" * (1 << 20)
def fill(folder):  # files of 16 MiB (the per-file limit) until past the cap
    written = 0
    try:
        os.makedirs(folder, exist_ok=True)
        for i in range(CAP // (16 << 20) + 2):
            fd = os.open(os.path.join(folder, f"fill{{i}}"), os.O_WRONLY | os.O_CREAT)
            try:
                for _ in range(16):
                    written += os.write(fd, CHUNK)
            finally:
                os.close(fd)
    except OSError as e:
        return written, errno.errorcode[e.errno]
    return written, "none"
for folder in ["/", "/tmp", "/dev/shm", "/dev", "/work"]:
    print(folder, *fill(folder))
for name, attempt in [("memfd", lambda: os.memfd_create("fill")),
                      ("posix_shm", lambda: shared_memory.SharedMemory(create=True, size=CAP * 2)),
                      ("sysv_shm", lambda: ctypes.CDLL(None, use_errno=True).shmget(0, CAP * 2, 0o1600))]:
    try:
        result = attempt()
        print(name, "refused" if result == -1 else "created", errno.errorcode.get(ctypes.get_errno(), "none"))
    except OSError as e:
        print(name, "refused", errno.errorcode[e.errno])
"""


@needs_bwrap
def test_nothing_but_the_work_folder_takes_writes():
    result = run_sandboxed(_FILL.format(cap=WORKDIR_BYTES), timeout_s=20.0, audit_hook=False)
    assert result.ok, result
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    for folder in ("/", "/tmp", "/dev/shm", "/dev"):
        written, error = lines[folder].split()
        assert int(written) == 0 and error in ("EROFS", "EACCES"), (folder, lines[folder])
    written, error = lines["/work"].split()
    assert 0 < int(written) <= WORKDIR_BYTES and error in ("ENOSPC", "EFBIG"), lines["/work"]
    assert lines["memfd"] == "refused EPERM" and lines["sysv_shm"] == "refused EPERM"
    assert lines["posix_shm"].startswith("refused") and lines["posix_shm"] != "refused none"


@needs_bwrap
def test_the_bwrap_found_at_start_up_is_the_one_that_runs(tmp_path, monkeypatch):
    real, log = shutil.which("bwrap"), tmp_path / "runs.log"
    folder = tmp_path / "bin"
    folder.mkdir()
    wrapper = folder / "bwrap"
    wrapper.write_text(f'#!/bin/sh\necho run >> {log}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    isolation.isolation_level.cache_clear()
    isolation.require_isolation.cache_clear()
    try:
        result = run_sandboxed("print(6 * 7)")
        assert result.ok and result.stdout == "42\n", result
        assert log.read_text().split() == ["run", "run"]  # the probe and the call: both through the one found
        assert isolation.bwrap_path() == str(wrapper)
    finally:
        isolation.isolation_level.cache_clear()
        isolation.require_isolation.cache_clear()


def _children(parent: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_unisolated_calls_leave_nothing_behind_a_killed_caller(tmp_path):
    """A reward worker killed mid-call (SIGKILL to its group, as the pool does): its sandboxed child dies with it,
    and the work folder it left is removed by the next process that runs an unisolated call."""
    env = {**os.environ, isolation.OPT_IN: "1", "PATH": "/nonexistent", "TMPDIR": str(tmp_path)}
    call = "from rl_lightning.rewards.sandbox import run_sandboxed\nprint(run_sandboxed({!r}, timeout_s=60).stdout)"
    child = None
    caller = subprocess.Popen([sys.executable, "-c", call.format("import time\ntime.sleep(600)")], env=env,
                              start_new_session=True)
    try:
        assert _wait_for(lambda: _children(caller.pid), 30.0), "the sandboxed program never started"
        (child,) = _children(caller.pid)
        left = [p.name for p in tmp_path.iterdir()]
        os.killpg(caller.pid, signal.SIGKILL)
        caller.wait()
        assert _wait_for(lambda: not _running(child), 2.0), "the sandboxed program outlived its caller"
        assert [p.name for p in tmp_path.iterdir()] == left and len(left) == 1  # SIGKILL: no clean-up ran
        after = subprocess.run([sys.executable, "-c", call.format("print('fresh')")], env=env, capture_output=True,
                               text=True, timeout=60)
        assert after.stdout == "fresh\n\n", after.stderr
        assert list(tmp_path.iterdir()) == []
    finally:
        for pid in _children(caller.pid) + ([child] if child and _running(child) else []):
            os.kill(pid, signal.SIGKILL)
        if caller.poll() is None:
            caller.kill()
