"""Confining the current process from inside it (standard library only: its source also runs in sandboxed children).

Used where bubblewrap cannot apply a filter itself: by the unisolated code sandbox's prelude and by the sandboxed
reasoning-gym scorer's per-answer children (`rl_lightning.rewards.scorer_sandbox`), which are forked from a process
that must keep the right to fork.
"""

import ctypes
import os
import signal

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 1, 4, 38, 22, 2


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _prctl(*args: int | ctypes.c_void_p) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(*args) != 0:
        raise OSError(ctypes.get_errno(), f"prctl{args[:1]} failed: {os.strerror(ctypes.get_errno())}")


def apply_seccomp(program: bytes) -> None:
    """Install the compiled BPF `program` (8-byte instructions) on this thread, for good (no new privileges either)."""
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _Program(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(fprog)), 0, 0)


def die_with_parent(parent: int) -> None:
    """Get SIGKILL when the parent (`parent`, its pid) exits; exit now if it already has."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def not_dumpable() -> None:
    """Refuse other processes of the same user (a forked child included) ptrace and ``/proc/<pid>/{mem,fd,environ}``."""
    _prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
