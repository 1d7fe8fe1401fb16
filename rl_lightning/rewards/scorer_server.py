"""The sandboxed reasoning-gym scorer: a process that imports reasoning-gym once and forks one child per answer.

Its source runs inside the code sandbox (`rl_lightning.rewards.scorer_sandbox` starts it under bubblewrap), after the
source of `rl_lightning.rewards.confine`; it imports nothing of rl_lightning. Arguments: the seccomp filter for the
children in hex (or ``-``), the caller's pid (unisolated: die with it; ``0`` under bubblewrap), then the folders to
import reasoning-gym from. Requests and replies are length-prefixed JSON on stdin/stdout.

Each answer is scored in a forked child that, before it touches the answer: points its standard streams at
``/dev/null`` and closes every other descriptor but its reply pipe, lowers its hard resource limits, installs the
seccomp filter (no process creation, no signals, tracing or memory access to other processes) and an audit hook that
refuses to compile any text beyond arithmetic on literals and a fixed list of math names (`SAFE_NAMES`). So nothing
an answer does persists into the scorer for later answers, nothing can fork, and text that would run code is refused
(scored 0) before any of it runs: an answer cannot run code to report its own score. The parent is not dumpable, so
a child cannot open its memory or descriptors either.
"""

import ast
import json
import math
import os
import resource
import select
import signal
import struct
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time the source of rl_lightning.rewards.confine precedes this one (no rl_lightning import)
    from rl_lightning.rewards.confine import apply_seccomp, die_with_parent, not_dumpable

# Names sympy's parser leaves in the code it evaluates (numbers, symbols, and the functions of the answers of the
# integration/polynomial/arithmetic tasks); none of them runs code given text (a string argument is sympified, which
# compiles it, which this hook checks again).
SAFE_NAMES = frozenset("""
    Symbol Integer Float Rational Function Number I E pi oo zoo nan True False None
    sqrt cbrt root exp log ln sin cos tan cot sec csc asin acos atan acot asec acsc atan2 sinh cosh tanh coth sech
    csch asinh acosh atanh acoth Abs abs sign floor ceiling factorial binomial gamma erf erfc Max Min max min Mod Pow
    Mul Add Eq Heaviside LambertW Si Ci Ei li polylog
""".split())
_SAFE_NODES = (ast.Expression, ast.Module, ast.Expr, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict,
               ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.Call, ast.keyword, ast.Name, ast.Load,
               ast.operator, ast.unaryop, ast.boolop, ast.cmpop)
_TRUSTED_SOURCES = frozenset({"from sympy import *"})  # sympy's parse_expr fills its namespace so, on every call
_REPLY_CAP = 1 << 16


def refusal(tree: ast.AST) -> str | None:
    """Why `tree` may run code (None: only literals, arithmetic, one-letter names and calls of `SAFE_NAMES`).

    One-letter names are the scorers' own variables (``x``, the integration constant ``C``); sympy's are harmless
    (``S``, ``N``: a string argument is compiled, and checked, again).
    """
    for node in ast.walk(tree):
        if not isinstance(node, _SAFE_NODES):
            return f"{type(node).__name__} is not allowed"
        if isinstance(node, ast.Name) and node.id not in SAFE_NAMES and not (len(node.id) == 1 and node.id.isalpha()):
            return f"the name {node.id!r} is not allowed"
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            return "only calls of plain names are allowed"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (str, int, float, complex, bool, type(None))):
            return f"the constant {type(node.value).__name__} is not allowed"
    return None


def _install_gate() -> None:
    """Audit hook: refuse to compile text (``eval``/``exec``/``compile`` of a string) that `refusal` refuses.

    Modules imported from files are compiled under their path and pass; everything else (``<string>``) is checked.
    """
    busy: list[int] = []

    def gate(event: str, args: tuple) -> None:
        if event != "compile" or busy:
            return
        source, filename = args
        if isinstance(filename, (str, bytes)) and not os.fsdecode(filename).startswith("<"):
            return
        if isinstance(source, (str, bytes)) and (os.fsdecode(source) if isinstance(source, bytes) else source) in \
                _TRUSTED_SOURCES:
            return
        busy.append(1)
        try:
            tree = source if isinstance(source, ast.AST) else ast.parse(source)
        except (SyntaxError, ValueError, TypeError):
            return  # compile itself will refuse it
        finally:
            busy.clear()
        why = refusal(tree)
        if why:
            raise PermissionError(f"scorer: refused to evaluate text: {why}")

    sys.addaudithook(gate)


def _confine_child(reply: int, timeout_s: float, memory_mb: int, program: bytes | None, gate: bool) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, reply)
    os.closerange(reply + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    with open("/proc/self/statm") as f:  # the pages inherited from the scorer count too
        inherited = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cpu = max(1, math.ceil(timeout_s))
    for name, value in (("RLIMIT_AS", inherited + (memory_mb << 20)), ("RLIMIT_CPU", cpu),
                        ("RLIMIT_FSIZE", 16 << 20), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0),
                        ("RLIMIT_MSGQUEUE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    if program:
        apply_seccomp(program)
    if gate:  # off only in tests, to show that the OS isolation holds on its own
        _install_gate()


def _child(scorer, request: dict, reply: int, program: bytes | None) -> None:
    message: dict[str, Any]
    try:
        _confine_child(reply, request["timeout_s"], request["memory_mb"], program, request.get("audit_gate", True))
        message = {"score": float(scorer(request["answer"], request["entry"]))}
    except BaseException as e:  # noqa: BLE001 - the answer's doing: reported, scored by the caller
        message = {"failure": f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        os.write(reply, json.dumps(message).encode())
    finally:
        os._exit(0)


def score(scorer, request: dict, program: bytes | None) -> dict:
    """``{"score": float}`` or ``{"failure": why}`` for one answer, computed in a confined child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _child(scorer, request, write, program)
    os.close(write)
    data, deadline = b"", time.monotonic() + request["timeout_s"]
    try:
        while len(data) <= _REPLY_CAP:
            ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return {"failure": f"timed out after {request['timeout_s']} s"}
            chunk = os.read(read, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    try:
        message = json.loads(data)
        return message if isinstance(message, dict) else {"failure": "a malformed reply"}
    except ValueError:
        why = f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "no reply"
        return {"failure": why}


def _warm(rg, task: str, scorer) -> None:
    """Score one locally generated entry's own answer here, so the children inherit every module it imports."""
    try:
        entry = rg.create_dataset(task, seed=0, size=1)[0]
        scorer(entry["answer"], entry)
    except Exception:  # noqa: BLE001, S110 - a task that needs a config (composite): its children import lazily
        pass


def _receive(stream) -> dict | None:
    header = stream.read(4)
    if len(header) < 4:
        return None
    return json.loads(stream.read(struct.unpack(">I", header)[0]))


def _send(stream, message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def main(argv: list[str]) -> None:
    """Serve requests ``{"task", "answer", "entry", "timeout_s", "memory_mb", "audit_gate"}`` until stdin closes.

    Replies: ``{"score": float}``, ``{"failure": why}`` (the answer made the scoring fail) or ``{"error": why}`` (the
    task has no scorer here).
    """
    program = bytes.fromhex(argv[0]) if argv[0] != "-" else None
    if int(argv[1]):
        die_with_parent(int(argv[1]))
    not_dumpable()
    sys.dont_write_bytecode = True
    sys.path[:0] = argv[2:]
    import reasoning_gym as rg
    import sympy.parsing.sympy_parser  # noqa: F401 - imported lazily by the sympy-based scorers

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    scorers = {}
    _send(stdout, {"ready": True})
    while (request := _receive(stdin)) is not None:
        task = request["task"]
        if task not in scorers:
            try:
                scorers[task] = rg.get_score_answer_fn(task)
            except Exception as e:  # noqa: BLE001 - no such task, or one that needs a config: the caller raises
                _send(stdout, {"error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            _warm(rg, task, scorers[task])
        _send(stdout, score(scorers[task], request, program))


if __name__ == "__main__":
    main(sys.argv[1:])
