"""Scoring reasoning-gym answers whose scorer may evaluate text, inside the code sandbox's isolation.

One scorer process per scoring process (a reward worker, or the trainer with ``reward_workers: 0``), started on the
first such answer: `rl_lightning.rewards.scorer_server` under bubblewrap (`rl_lightning.rewards.isolation`: fresh
user/PID/mount/network namespaces, no environment, a read-only root, ``/usr``, the Python installation and the
folders reasoning-gym and its dependencies are imported from bound read-only, a size-capped work folder the only
writable place). It imports reasoning-gym once and forks one confined child per answer (see its docstring), so an
answer costs a fork, not an interpreter start. Opted-in unisolated (``RL_LIGHTNING_UNISOLATED_CODE=1``, no
bubblewrap) the same process runs as a plain child: the children are still confined, the filesystem and network are
not.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import logging
import os
import re
import selectors
import signal
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rl_lightning.rewards import confine, isolation, scorer_server

log = logging.getLogger(__name__)
STARTUP_LIMIT_S = 120.0  # importing reasoning-gym in the sandbox: seconds on a loaded machine
REPLY_MARGIN_S = 30.0  # beyond an answer's own limit: the scorer's first import of a task's modules
WORKDIR_BYTES = 16 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ScorerError(RuntimeError):
    """The scorer process failed (not the answer): it died, hung or never started."""


def import_roots() -> tuple[str, ...]:
    """The folders reasoning-gym and its dependencies (transitively) are imported from, bound read-only in the sandbox."""
    roots, todo, seen = set(), ["reasoning-gym"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        roots.add(os.path.realpath(str(distribution.locate_file(""))))
        for line in distribution.requires or []:
            match = _NAME.match(line)
            if match and "extra ==" not in line:
                todo.append(match.group(0).lower().replace("_", "-"))
    return tuple(sorted(roots))


class SandboxedScorer:
    """A reasoning-gym scorer process in the sandbox; `score` is safe to call from several threads (they take turns).

    Args:
        timeout_s: wall-clock (and CPU) limit of one answer's scoring; past it the answer scores 0.
        memory_mb: address space one answer's scoring may add to the scorer's own.
    """

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024) -> None:
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.process: subprocess.Popen | None = None
        self._stderr: Any = None  # the scorer process's stderr (a temporary file), for the reason it stopped
        self._lock = threading.Lock()

    def score(self, task: str, answer: str, entry: dict[str, Any], audit_gate: bool = True) -> float:
        """The task's score of `answer` (0.0 when the scoring failed because of the answer: refused, timed out...).

        Raises ValueError when the task has no scorer here, `ScorerError` when the scorer process failed.
        `audit_gate`: refuse to compile text beyond arithmetic (`scorer_server.refusal`); the tests switch it off to
        show that the OS isolation holds on its own.
        """
        request = {"task": task, "answer": answer, "entry": entry, "timeout_s": self.timeout_s,
                   "memory_mb": self.memory_mb, "audit_gate": audit_gate}
        with self._lock:
            reply = self._ask(request)
        if "score" in reply:
            return float(reply["score"])
        if "error" in reply:
            raise ValueError(f"reasoning-gym task '{task}': {reply['error']}")
        log.info("reasoning-gym scorer (sandboxed): task %s, the answer scores 0: %s", task, reply.get("failure"))
        return 0.0

    def close(self) -> None:
        """Stop the scorer process (the next `score` starts a new one)."""
        with self._lock:
            self._stop()

    def _ask(self, request: dict) -> dict:
        if self.process is None or self.process.poll() is not None:
            self._start()
        assert self.process is not None and self.process.stdin is not None
        data = json.dumps(request).encode()
        try:
            self.process.stdin.write(struct.pack(">I", len(data)) + data)
            self.process.stdin.flush()
            return self._read(time.monotonic() + self.timeout_s + REPLY_MARGIN_S)
        except (OSError, ScorerError) as e:
            self._stop()
            raise ScorerError(f"reasoning-gym scorer sandbox: {e}") from None

    def _start(self) -> None:
        level = isolation.require_isolation()
        program = isolation.seccomp_program(other_processes=True)
        source = Path(confine.__file__).read_text() + Path(scorer_server.__file__).read_text()
        roots = import_roots()
        args = ["-I", "-c", source, program.hex() if program else "-"]
        self._stderr = tempfile.TemporaryFile()
        if level == "bwrap":
            workdir = next(w for w in ("/work", "/scratch", "/rl_scorer_work") if not any(
                (r + "/").startswith(w + "/") for r in roots))  # a tmpfs there would hide the roots
            command = isolation.bwrap_command([*args, "0", *roots], WORKDIR_BYTES, read_only=roots, workdir=workdir)
        else:
            command = [isolation.interpreter(), *args, str(os.getpid()), *roots]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                        cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                        start_new_session=True)
        try:
            ready = self._read(time.monotonic() + STARTUP_LIMIT_S)
        except ScorerError as e:
            self._stop()
            raise ScorerError(f"reasoning-gym scorer sandbox did not start: {e}") from None
        if not ready.get("ready"):
            self._stop()
            raise ScorerError(f"reasoning-gym scorer sandbox did not start: {ready}")
        log.info("reasoning-gym scorer: started in isolation '%s' (pid %d)", level, self.process.pid)

    def _read(self, deadline: float) -> dict:
        header = self._read_exactly(4, deadline)
        return json.loads(self._read_exactly(struct.unpack(">I", header)[0], deadline))

    def _read_exactly(self, size: int, deadline: float) -> bytes:
        assert self.process is not None and self.process.stdout is not None
        fd, data = self.process.stdout.fileno(), b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while len(data) < size:
                if not selector.select(max(0.0, deadline - time.monotonic())):
                    raise ScorerError("no reply in time")
                chunk = os.read(fd, size - len(data))
                if not chunk:
                    raise ScorerError(f"the scorer process exited ({self._last_words()})")
                data += chunk
        return data

    def _last_words(self) -> str:
        self._stderr.seek(0)
        lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else "no message"

    def _stop(self) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # its group: bwrap and what it holds
            except ProcessLookupError:
                pass
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            self.process = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


_shared: dict[str, SandboxedScorer] = {}
_shared_lock = threading.Lock()


def shared_scorer() -> SandboxedScorer:
    """This process's scorer (started on its first `score`, stopped at exit)."""
    with _shared_lock:
        if "scorer" not in _shared:
            _shared["scorer"] = SandboxedScorer()
            atexit.register(_shared["scorer"].close)
        return _shared["scorer"]
