"""Calling the environment's user code in a pool of worker processes, each call with a time limit.

Each worker is a fresh interpreter (``python -m rl_lightning.envs.workers``, never a fork of the trainer and its
torch/vLLM threads) that imports only the environment file (and what it imports) and then answers calls one at a
time: ``reward_fn(messages, answer)`` (scoring) and ``interact(messages)`` (multi-turn tools). The trainer hands out
calls to idle workers and collects the results in order; a call still running after its function's time limit
(``reward_timeout_s``, ``interact_timeout_s``) has its worker killed (with its process group) and replaced, and comes
back as a timed-out `RewardFailure`. What a failure means is the environment's ``on_error`` policy, applied in the
trainer (`rl_lightning.envs.environment.Environment.judge` for rewards, ``Environment.interact_all`` for tools).

A worker also exits on its own when the trainer goes away (its command pipe closes, or its parent changes).

A worker starts with a minimal environment, not the trainer's (its tokens and credentials stay there): the variables
of `WORKER_ENV` and `WORKER_ENV_PREFIXES` (locale, paths, thread counts, offline caches, ``RL_LIGHTNING_*``) plus
those the user names in ``model.rollout.worker_env`` (e.g. an LLM judge's API key).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

STARTUP_LIMIT_S = 120.0  # a worker importing the environment file longer than this is reported, not waited on
WORKER_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP", "PYTHONPATH",
              "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONUTF8",
              "PYTHONWARNINGS", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "TOKENIZERS_PARALLELISM",
              "CUDA_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE",
              "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR")
WORKER_ENV_PREFIXES = ("LC_", "RL_LIGHTNING_", "COV_CORE_", "COVERAGE_")  # locale, ours, coverage of the workers


def worker_environment(names: list[str] | None = None) -> dict[str, str]:
    """The environment a worker starts with: the allow-list (`WORKER_ENV`, `WORKER_ENV_PREFIXES`) plus `names`.

    Raises a `ConfigError` naming a variable of `names` the trainer does not have.
    """
    missing = [name for name in names or [] if name not in os.environ]
    if missing:
        from rl_lightning.errors import ConfigError

        raise ConfigError(f"model.rollout.worker_env: {', '.join(missing)} not set in the trainer's environment; set "
                          "it or remove it from the list")
    return {name: value for name, value in os.environ.items()
            if name in WORKER_ENV or name.startswith(WORKER_ENV_PREFIXES) or name in (names or [])}


@dataclass
class RewardFailure:
    """A ``reward_fn`` (or ``interact``) call that returned nothing.

    It raised (`error`: ``"TypeName: first line"``), ran past the time limit (`timed_out`), or its worker died;
    `config`: it raised a `ConfigError` (e.g. the code sandbox refusing to run without isolation), which stops
    training whatever the ``on_error`` policy.
    """

    error: str
    timed_out: bool = False
    config: bool = False


def describe(error: BaseException) -> str:
    """``TypeName: first line of the message`` (the type alone when the message is empty)."""
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def env_module_name(env_path: str) -> str:
    """The name an environment file is imported under, in the trainer and in the workers alike."""
    return f"rl_lightning_env_{os.path.splitext(os.path.basename(env_path))[0]}"


class _Worker:
    def __init__(self, env_path: str, module_name: str, environment: dict[str, str]) -> None:
        to_child, to_worker = os.pipe()
        from_worker, from_child = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rl_lightning.envs.workers", str(to_child), str(from_child)],
            pass_fds=(to_child, from_child), start_new_session=True,  # its own group: killed with its children
            env=environment)
        os.close(to_child)
        os.close(from_child)
        self.commands = Connection(to_worker, readable=False)
        self.connection = Connection(from_worker, writable=False)
        self.commands.send((sys.path, env_path, module_name))
        self.ready, self.started = False, time.monotonic()
        self.task: tuple[int, float, float | None] | None = None  # (call index, when handed out, its limit)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.connection.close()
        self.commands.close()


def start_pool(env_path: str, workers: int | None, timeout_s: float | None, processes_per_node: int,
               interact_timeout_s: float | None = None, worker_env: list[str] | None = None) -> RewardPool | None:
    """The pool for the rollout callback's ``reward_workers``.

    None: this machine's CPUs shared among the node's training processes, at most 16; 0: no pool, score (and call
    ``interact``) in the trainer without a time limit (and with the trainer's environment). `worker_env`: variables
    the workers get besides the allow-list (checked here, at start-up).
    """
    if workers is None:
        workers = max(1, min(16, len(os.sched_getaffinity(0)) // max(1, processes_per_node)))
    return RewardPool(env_path, workers, timeout_s, interact_timeout_s, worker_env) if workers > 0 else None


class RewardPool:
    """`workers` processes calling `env_path`'s ``reward_fn`` and ``interact``, each call cut at its time limit.

    Args:
        env_path: the environment file (already checked by `rl_lightning.envs.environment.load_environment`).
        workers: number of processes (>= 1), started on the first `map`.
        timeout_s: per-call wall-clock limit of ``reward_fn`` in seconds, or None.
        interact_timeout_s: the same for ``interact``.
        worker_env: variables of the trainer's environment the workers get besides the allow-list (see the module
            docstring); a name the trainer does not have is a `ConfigError`, here.
    """

    def __init__(self, env_path: str, workers: int, timeout_s: float | None,
                 interact_timeout_s: float | None = None, worker_env: list[str] | None = None) -> None:
        self.env_path, self.size, self.timeout_s = env_path, workers, timeout_s
        self.environment = worker_environment(worker_env)
        self.limits = {"reward_fn": timeout_s, "interact": interact_timeout_s}
        self.module_name = env_module_name(env_path)
        self.workers: list[_Worker] = []
        # one caller at a time: the workers' pipes carry one call each, and a second thread's `map` would read the
        # first one's replies (two rollouts in flight score from two threads)
        self._lock = threading.Lock()

    def map(self, calls: list[tuple[Any, ...]], function: str = "reward_fn") -> list[Any]:
        """`function` (``reward_fn`` or ``interact``) of each call's arguments, in order.

        ``(messages, answer)`` for ``reward_fn``, ``(messages,)`` for ``interact``. A call that raised, timed out or
        lost its worker gives a `RewardFailure` in its place. Safe to call from several threads: calls take turns.
        """
        with self._lock:
            return self._map(calls, function)

    def _map(self, calls: list[tuple[Any, ...]], function: str) -> list[Any]:
        limit = self.limits[function]
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.env_path, self.module_name, self.environment))
        results: list[Any] = [None] * len(calls)
        pending, done = deque(range(len(calls))), 0
        while done < len(calls):
            for worker in self.workers:
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    worker.commands.send((index, function, calls[index]))
                    worker.task = (index, time.monotonic(), limit)
            for connection in wait([w.connection for w in self.workers], self._next_deadline()):
                done += self._receive(self._owner(connection), results)
            done += self._cut_overdue(results)
        return results

    def close(self) -> None:
        """Kill every worker process (the next `map` starts new ones)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []

    def _owner(self, connection: object) -> _Worker:
        return next(w for w in self.workers if w.connection is connection)

    def _next_deadline(self) -> float | None:
        now, deadlines = time.monotonic(), []
        for worker in self.workers:
            if not worker.ready:
                deadlines.append(worker.started + STARTUP_LIMIT_S)
            elif worker.task is not None and worker.task[2] is not None:
                deadlines.append(worker.task[1] + worker.task[2])
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _receive(self, worker: _Worker, results: list[Any]) -> int:
        """Take one message from `worker`; returns how many calls it finished (0 or 1)."""
        try:
            message = worker.connection.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            code = worker.process.wait()
            if not worker.ready:  # e.g. the env file calls sys.exit at import in a fresh process
                self._started(worker, f"the worker exited with code {code}")
            task, worker.task = worker.task, None
            self._replace(worker)
            if task is None:
                return 0  # died while idle (e.g. the OOM killer): replaced, nothing lost
            results[task[0]] = RewardFailure(f"the environment worker died (exit code {code})")
            return 1
        if not worker.ready:
            self._started(worker, message)
            return 0
        index, kind, value = message  # the worker sends plain values: its classes live in its __main__
        results[index] = value if kind == "ok" else RewardFailure(value, config=kind == "config")
        worker.task = None
        return 1

    def _started(self, worker: _Worker, message: Any) -> None:
        if message != "ready":
            from rl_lightning.errors import ConfigError

            self._close()
            raise ConfigError(f"env_path '{self.env_path}' failed to import in a reward worker ({message}); it must "
                              "import in a fresh Python process too")
        worker.ready = True

    def _cut_overdue(self, results: list[Any]) -> int:
        now, cut = time.monotonic(), 0
        for worker in list(self.workers):
            if not worker.ready and now - worker.started > STARTUP_LIMIT_S:
                from rl_lightning.errors import ConfigError

                self._close()
                raise ConfigError(f"env_path '{self.env_path}': a reward worker did not import it within "
                                  f"{STARTUP_LIMIT_S:.0f} s")
            limit = None if worker.task is None else worker.task[2]
            if worker.task is not None and limit is not None and now - worker.task[1] >= limit:
                results[worker.task[0]] = RewardFailure(f"timed out after {limit} s", timed_out=True)
                self._replace(worker)
                cut += 1
        return cut

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker(self.env_path, self.module_name, self.environment)


def _serve(commands: Connection, replies: Connection) -> None:
    """The worker: import the environment file, then answer calls until the trainer closes the pipe."""
    import importlib.util
    import threading

    search_path, env_path, module_name = commands.recv()
    sys.path[:] = search_path
    parent = os.getppid()

    def orphaned() -> None:  # the trainer died without closing the pipe (e.g. SIGKILL while we are in reward_fn)
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    try:
        from rl_lightning.envs.adapters import is_adapter, load_adapter

        if is_adapter(env_path):  # a verifiers:/openenv: environment, adapted in this process
            module: Any = load_adapter(env_path)
        else:
            spec = importlib.util.spec_from_file_location(module_name, env_path)
            assert spec is not None and spec.loader is not None  # `load_environment` imported this file already
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        functions = {"reward_fn": module.reward_fn, "interact": getattr(module, "interact", None)}
    except Exception as e:  # noqa: BLE001 - reported to the trainer as one line
        replies.send(describe(e))
        return
    replies.send("ready")
    while True:
        try:
            index, function, arguments = commands.recv()
        except EOFError:
            return
        replies.send((index, *_call(functions[function], arguments)))


def _call(function: Any, arguments: tuple) -> tuple[str, Any]:
    """``("ok", value)``, ``("error", description)`` or ``("config", message)``."""
    try:
        value = function(*arguments)
        pickle.dumps(value)
        return "ok", value
    except Exception as e:  # noqa: BLE001 - user code may raise anything; the trainer's policy decides
        from rl_lightning.errors import ConfigError

        return ("config", str(e)) if isinstance(e, ConfigError) else ("error", describe(e))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
