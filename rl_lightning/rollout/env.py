"""User environments: a Python file (``env_path``) defining ``reward_fn(messages, answer) -> float`` and optionally
``interact(messages) -> list[message]`` for multi-turn tool use (the seeds' API, as in RL2).

The file is imported once at start-up and checked, so a typo fails before any generation. Scoring applies a policy
for reward functions that raise or return non-numbers/non-finite values: fail fast naming the row, or score 0 and
count it — never a silent NaN in the loss.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_lightning.errors import ConfigError, DataError

ON_ERROR = ("raise", "zero")


@dataclass
class Environment:
    """A loaded environment; `failures` counts rewards replaced by 0 under ``on_error: zero``."""

    reward_fn: Callable[[list[dict], Any], float]
    interact: Callable[[list[dict]], list[dict]] | None
    path: str
    on_error: str = "raise"
    failures: int = 0

    def score(self, messages: list[dict], answer: Any, where: str) -> float:
        """The reward of one trajectory; `where` names the prompt row for errors."""
        try:
            value = self.reward_fn(messages, answer)
            reward = float(value)
            if not math.isfinite(reward):
                raise ValueError(f"returned a non-finite value {value!r}")
        except Exception as e:  # noqa: BLE001 - user code may raise anything; the policy decides
            if self.on_error == "raise":
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DataError(
                    f"{where}: reward_fn from {self.path} failed ({type(e).__name__}: {first}); fix it or set "
                    "rollout on_error: zero to score such trajectories 0"
                ) from None
            self.failures += 1
            return 0.0
        return reward


def load_environment(env_path: str, on_error: str = "raise", key: str = "env_path") -> Environment:
    """Import `env_path` and check it defines ``reward_fn(messages, answer)`` (and ``interact(messages)`` if any)."""
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}, got '{on_error}'")
    path = Path(env_path)
    if not path.is_file():
        raise ConfigError(f"{key} '{env_path}' does not exist (resolved to {path.resolve()})")
    spec = importlib.util.spec_from_file_location(f"rl_lightning_env_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - report any import-time failure of user code as one line
        raise ConfigError(f"{key} '{env_path}' failed to import: {type(e).__name__}: {e}") from None
    reward_fn = getattr(module, "reward_fn", None)
    if not callable(reward_fn):
        raise ConfigError(f"{key} '{env_path}' must define reward_fn(messages, answer) -> float")
    _check_arity(reward_fn, 2, f"{key} '{env_path}': reward_fn must take (messages, answer)")
    interact = getattr(module, "interact", None)
    if interact is not None:
        if not callable(interact):
            raise ConfigError(f"{key} '{env_path}': interact must be a function interact(messages) -> list of messages")
        _check_arity(interact, 1, f"{key} '{env_path}': interact must take (messages)")
    return Environment(reward_fn, interact, str(path), on_error)


def _check_arity(fn: Callable, count: int, message: str) -> None:
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        raise ConfigError(message) from None
    except ValueError:  # builtins without a signature: accept
        pass
