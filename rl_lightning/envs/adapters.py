"""Standard environments as ``env_path``: a verifiers taskset or an OpenEnv environment, without a ``reward_fn`` file.

``model.rollout.env_path`` takes, besides a file defining ``reward_fn``/``interact`` (`rl_lightning.envs.environment`),

- ``verifiers:<taskset>``: a verifiers 0.4 (``verifiers.v1``) taskset, named as verifiers names it (an installed
  package exporting its ``Taskset`` subclass in ``__all__``) or as a ``.py`` file;
- ``openenv:http://HOST:PORT``: an OpenEnv environment served by its own server (its container, a Space, or
  ``uvicorn``), played over OpenEnv's WebSocket client: the preferred form, nothing of the environment runs here;
- ``openenv:<module>``: an OpenEnv (``openenv-core``) ``Environment`` subclass in a module or ``.py`` file, run
  in-process (one fresh instance per episode): an explicit opt-in, said once in the log;

either followed by ``:<Name>`` to pick one class where the module defines several. The same key everywhere (the
recipe, ``--model.rollout.env_path``, ``rl_lightning eval --env``, the reward workers, which build the adapter in their
own process) is why a prefix and not a new key.

Mapping (what the adapter returns is what a ``reward_fn`` file would):

- verifiers: each ``@vf.reward`` method of the task is a reward component named after it, with its ``weight`` as the
  component's default weight, so the weighted sum is the trace's own ``reward``. The conversation becomes a
  ``vf.Trace`` (assistant turns sampled) and the task scores it with ``Task.score`` (rewards that need a sandbox
  runtime are skipped, as verifiers skips them without one). The task's data: the row's ``answer`` when it is a dict
  (the task data, as `export_rows` writes it), else the prompt messages plus ``answer``. Tools: the task's and
  taskset's toolsets, called in-process; ``interact`` answers each ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` block of the last assistant turn (the Hermes/Qwen form) with a ``tool`` message, and ends the
  conversation when there is none.
- OpenEnv: the environment owns the task. A row is an episode: its prompt is the ``reset`` observation's text and a
  prompt message (the first that has one) keeps the ``reset`` arguments under ``"reset"`` (`export_rows` writes such
  rows; chat templates ignore the key). Our protocol is stateless (``interact`` gets only the conversation, and it and ``reward_fn`` may
  run in different processes), so every call replays the episode: ``reset(**reset)``, then one ``step`` per
  assistant turn with the completion text in the action's one ``str`` field. The reward is the episode's return (the
  sum of its steps' ``observation.reward``; the row's ``answer`` is not used); with a ``WeightedSum`` rubric its
  children are the components (named after their classes, summed over steps, weighted by the rubric's weights),
  else one component ``reward``. ``interact`` returns the last observation's text as a ``user`` turn, ``[]`` once it
  is ``done``. The environment must be deterministic given the ``reset`` arguments (a seed, say) for the replay to
  be the episode the model saw.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from rl_lightning.errors import ConfigError

PREFIXES = {"verifiers": "verifiers", "openenv": "openenv-core"}
SERVER_SCHEMES = ("http://", "https://", "ws://", "wss://")


@dataclass
class Adapter:
    """What `load_adapter` builds: the ``reward_fn``/``interact`` pair and the default component weights."""

    reward_fn: Callable[[list[dict], Any], dict[str, float]]
    interact: Callable[[list[dict]], list[dict]] | None
    weights: dict[str, float]
    trust: str = "in-process"  # where the environment's code and the model-chosen actions run: or "server"

    def resolve_weights(self, weights: dict[str, float] | None, where: str) -> dict[str, float]:
        """The weights: the environment's when `weights` (``reward_weights``) is None or ``{}``, else `weights`.

        ``{}`` because the command line cannot say null here; given weights must name the same components.
        """
        if not weights:
            return dict(self.weights)
        if sorted(weights) != sorted(self.weights):
            raise ConfigError(f"model.rollout.reward_weights {weights} does not name the components of {where} "
                              f"{sorted(self.weights)}: set it to {{}} (or null in YAML) for the environment's own "
                              f"weights {self.weights}, or give one weight for each")
        return weights


AdapterBuilder = Callable[[str, str], Adapter]
"""``build(target, where)``: the `Adapter` of ``<prefix>:<target>``; `where` names the key and value for errors."""

ADAPTERS: dict[str, AdapterBuilder] = {}  # env_path prefix -> builder (`register_adapter`)


def register_adapter(prefix: str, build: AdapterBuilder) -> None:
    """Make ``env_path: <prefix>:<target>`` build its environment with ``build(target, where)``.

    The built-in prefixes (``verifiers``, ``openenv``) are registered here; a new kind of environment is a module with
    its builder and one call of this (see docs/contributing.md, "How to add an environment adapter"). A registration
    holds in the process that made it: the reward and interact workers are fresh interpreters, so an adapter
    registered outside this module scores in the trainer (``model.rollout.reward_workers: 0``).
    """
    if not prefix.isidentifier():
        raise ValueError(f"an env_path prefix is a name (letters, digits, _), got {prefix!r}")
    ADAPTERS[prefix] = build


def is_adapter(env_path: str) -> bool:
    """Whether `env_path` names an adapted environment (``verifiers:...``, ``openenv:...``) rather than a file."""
    return env_path.split(":", 1)[0] in ADAPTERS and ":" in env_path


def load_adapter(env_path: str, key: str = "env_path") -> Adapter:
    """Import the environment `env_path` names and adapt it; any mistake is one `ConfigError` naming `key`."""
    kind, target = env_path.split(":", 1)
    return ADAPTERS[kind](target, f"{key}={env_path!r}")


def _standard(kind: str, target: str, where: str) -> Adapter:
    """A verifiers taskset or an OpenEnv environment (`kind`), served or imported from `target`."""
    try:
        importlib.import_module("verifiers.v1" if kind == "verifiers" else "openenv.core.env_server")
    except ImportError as e:
        raise ConfigError(f"{where} needs {PREFIXES[kind]} ({e}): pip install -e '.[envs]'") from None
    if kind == "openenv" and target.startswith(SERVER_SCHEMES):
        from rl_lightning.envs.openenv import OpenEnvServerAdapter

        served = OpenEnvServerAdapter(target, where)
        return Adapter(served.reward_fn, served.interact, served.weights, served.trust)
    target, _, name = target.partition(":") if not target.endswith(".py") else (target, "", "")
    module = _import_target(target, where)
    if kind == "verifiers":
        from verifiers.v1 import Taskset

        from rl_lightning.envs.verifiers import VerifiersAdapter

        found = VerifiersAdapter(_pick_class(module, Taskset, name, where), where)
        return Adapter(found.reward_fn, found.interact if found.tools else None, found.weights, found.trust)
    from openenv.core.env_server import Environment

    from rl_lightning.envs.openenv import OpenEnvAdapter

    env = OpenEnvAdapter(_pick_class(module, Environment, name, where), where)
    return Adapter(env.reward_fn, env.interact, env.weights, env.trust)


def _verifiers(target: str, where: str) -> Adapter:
    return _standard("verifiers", target, where)


def _openenv(target: str, where: str) -> Adapter:
    return _standard("openenv", target, where)


register_adapter("verifiers", _verifiers)
register_adapter("openenv", _openenv)


def _import_target(target: str, where: str) -> ModuleType:
    """A ``.py`` file (imported under a stable name, registered so pydantic resolves its annotations) or a module."""
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ConfigError(f"{where}: the file '{target}' does not exist (resolved to {path.resolve()})")
            name = f"rl_lightning_env_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None  # a .py file always has a source loader
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target.replace("-", "_"))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - report any import-time failure of user code as one line
        raise ConfigError(f"{where} failed to import: {type(e).__name__}: {e}; fix it, or name an importable "
                          "module (on sys.path; the CLI adds the working directory) or a .py file") from None


def _pick_class(module: ModuleType, base: type, name: str, where: str) -> type:
    """The `base` subclass `name` in `module`, else the one it exports (``__all__``) or defines."""
    if name:
        found = getattr(module, name, None)
        if isinstance(found, type) and issubclass(found, base):
            return found
        raise ConfigError(f"{where}: {name!r} is not a {base.__module__}.{base.__qualname__} subclass in "
                          f"{module.__name__}; name one that is")
    names = getattr(module, "__all__", None) or [n for n, v in vars(module).items()
                                                 if getattr(v, "__module__", None) == module.__name__]
    found_classes = [v for n in names if isinstance(v := getattr(module, n, None), type) and issubclass(v, base)
                     and v is not base and not inspect.isabstract(v)]
    if len(found_classes) != 1:
        what = "no" if not found_classes else f"{len(found_classes)} ({[c.__name__ for c in found_classes]})"
        raise ConfigError(f"{where}: {module.__name__} defines {what} {base.__module__}.{base.__qualname__} "
                          f"subclasses; {'write one' if not found_classes else 'pick one with :<Name>'}")
    return found_classes[0]


def export_rows(env_path: str, path: str, resets: list[dict] | None = None, limit: int | None = None) -> int:
    """Write an environment's tasks as prompt rows (``{"messages": [...], "answer": ...}``) to the JSONL file `path`.

    verifiers: the taskset's tasks (the first `limit`), ``answer`` = the task data, from which the adapter rebuilds the
    task. OpenEnv: one row per `resets` entry (``reset`` arguments, e.g. ``{"seed": 3}``): the reset observation's text
    as the user message, which keeps the arguments under ``"reset"``. Returns the number of rows written.
    """
    kind, target = env_path.split(":", 1) if is_adapter(env_path) else ("", env_path)
    if not kind or (kind == "openenv") != (resets is not None):
        raise ConfigError(f"export_rows takes verifiers:<taskset>, or openenv:<module> with resets, got {env_path!r}")
    load_adapter(env_path)  # the one-line errors for a bad env_path
    target, _, name = target.partition(":") if not target.endswith(".py") else (target, "", "")
    module = _import_target(target, env_path)
    if kind == "openenv":
        from openenv.core.env_server import Environment

        from rl_lightning.envs.openenv import observation_text

        env_class = _pick_class(module, Environment, name, env_path)
        rows = [{"messages": [{"role": "user", "content": observation_text(env_class().reset(**r)), "reset": r}],
                 "answer": r} for r in resets or []]
    else:
        from verifiers.v1 import Taskset

        from rl_lightning.envs.verifiers import VerifiersAdapter

        taskset = VerifiersAdapter(_pick_class(module, Taskset, name, env_path), env_path).taskset
        rows = [_task_row(task.data) for task in (taskset.take(limit) if limit is not None else taskset)]
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def _task_row(data: Any) -> dict:
    """A verifiers task's prompt row: its system prompt and prompt as messages, its data as the answer."""
    prompt = [{"role": "user", "content": data.prompt}] if isinstance(data.prompt, str) else [
        m.model_dump(exclude_none=True) for m in data.prompt or []]
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return {"messages": system + prompt, "answer": data.model_dump(mode="json", include=data.model_fields_set)}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a standard environment's tasks as prompt rows (JSONL).")
    parser.add_argument("env", help="verifiers:<taskset> or openenv:<module>")
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--limit", type=int, default=None, help="verifiers: the first N tasks")
    parser.add_argument("--resets", type=json.loads, default=None, help='openenv: a JSON list, e.g. \'[{"seed": 0}]\'')
    args = parser.parse_args()
    print(f"{export_rows(args.env, args.out, args.resets, args.limit)} rows -> {args.out}")
