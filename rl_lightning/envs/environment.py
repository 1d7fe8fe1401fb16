"""User environments: a Python file (``env_path``) with a reward function and, optionally, a tool-use step.

The file defines ``reward_fn(messages, answer) -> float`` and optionally ``interact(messages) -> list[message]`` for
multi-turn tool use (the seeds' API, as in RL2).

The file is imported once at start-up and checked, so a typo fails before any generation. Scoring applies a policy for
reward functions that raise or return non-numbers/non-finite values: fail fast naming the row, or score 0 and count it.

Several rewards: ``reward_fn`` may return a dict of named components (``{"correct": 1.0, "format": 0.5}``); the
configured ``reward_weights`` (one weight per component, the same names) combine them by weighted sum or weighted
Tchebycheff scalarisation (`rl_lightning.algorithms.reward_combination`), and each component is kept for logging.

A reward model (``model.rollout.reward_model``, `rl_lightning.rewards.reward_model`) adds one more component: each
rollout's conversations are scored by it once, batched, in the trainer process after ``reward_fn``; its score joins
the weighted combination of ``reward_fn``'s components, or is added (times its weight) to a scalar ``reward_fn``.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl_lightning.algorithms.reward_combination import tchebycheff, weighted_sum
from rl_lightning.data.rows import check_answer_type
from rl_lightning.envs.adapters import is_adapter, load_adapter
from rl_lightning.envs.workers import RewardFailure, describe, env_module_name
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.rewards.isolation import require_isolation

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "zero")
RM_KEY = "model.rollout.reward_model"
MAX_TOOL_CHARS = 8192
"""Default cap on the characters of content of one ``interact`` call's messages (``model.rollout.max_tool_chars``)."""
TRUNCATED = "\n[... {count} more characters cut: model.rollout.max_tool_chars]"
COMBINATIONS = ("weighted_sum", "tchebycheff")


@dataclass
class Environment:
    """A loaded environment.

    `failures` counts rewards replaced by 0 under ``on_error: zero`` (`timeouts` those cut at the time limit, under
    either policy), `reward_seconds` the time spent scoring; `interact_failures` counts ``interact`` calls that ended
    their conversation under ``on_error: zero`` (`interact_timeouts` those cut at the time limit). With `weights`,
    ``reward_fn`` returns named components combined by `combination` (Tchebycheff measures gaps to `ideal`).
    ``interact``'s messages of one call hold at most `max_tool_chars` characters of content together (None: no cap;
    the rest is cut with a note saying so, counted in `tool_truncations`); `overlong_conversations` counts those the
    rollout ended because the next turn would not fit the engine's ``max_model_len``.
    """

    reward_fn: Callable[[list[dict], Any], Any]
    interact: Callable[[list[dict]], list[dict]] | None
    path: str
    on_error: str = "raise"
    failures: int = 0
    timeouts: int = 0
    reward_seconds: float = 0.0
    interact_failures: int = 0
    interact_timeouts: int = 0
    scorer: Any = None  # a `rl_lightning.envs.workers.RewardPool`, or None to score in this process
    weights: dict[str, float] | None = None
    combination: str = "weighted_sum"
    ideal: dict[str, float] | None = None
    reward_model: Any = None  # the scorer `reward_model_config` builds (`RewardModelClient`/`LocalRewardModel`)
    reward_model_config: Any = None
    max_tool_chars: int | None = MAX_TOOL_CHARS
    answer_types: tuple[type, ...] | None = None  # what ``reward_fn`` declares it reads (its ``answer_types``)
    answer_check: Callable[[Any, str], None] | None = None  # ``reward_fn.check_answer(answer, where)``, if declared
    tool_truncations: int = 0
    overlong_conversations: int = 0
    # whole score_all / interact_all calls take turns on it (in-flight rollouts score from two threads)
    turns: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def component_names(self) -> list[str]:
        """Every logged component: ``reward_fn``'s and the reward model's."""
        extra = [] if self.reward_model_config is None else [self.reward_model_config.name]
        return sorted([*self._fn_names, *extra])

    @property
    def _fn_names(self) -> list[str]:
        return sorted(self.weights or {})

    def check_answers(self, prompts: Iterable[Any]) -> None:
        """A `DataError` naming the first prompt row whose ``answer`` is not of the `answer_types` ``reward_fn`` reads.

        Nothing to check when ``reward_fn`` declares none (its ``answer_types``); its ``check_answer(answer, where)``,
        if any, then sees every row (reasoning-gym refuses a task whose scorer needs the sandbox where none runs).
        """
        if self.answer_types is None and self.answer_check is None:
            return
        reward = f"the reward_fn of {self.path}"
        for prompt in prompts:
            if self.answer_types is not None:
                check_answer_type(prompt.answer, prompt.where, self.answer_types, reward)
            if self.answer_check is not None:
                self.answer_check(prompt.answer, prompt.where)

    def score(self, messages: list[dict], answer: Any, where: str) -> tuple[float, dict[str, float]]:
        """The reward of one trajectory and its named components ({} for a single reward).

        Computed in this process without a time limit (``reward_fn`` only: the reward model scores in `score_all`);
        `where` names the prompt row for errors.
        """
        try:
            value = self.reward_fn(messages, answer)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - user code may raise anything; the policy decides
            value = RewardFailure(describe(e))
        return self.judge(value, where)

    def score_all(self, calls: list[tuple[list[dict], Any, str]]) -> list[tuple[float, dict[str, float]]]:
        """`score` for each ``(messages, answer, where)``, in order.

        Scored in the `scorer` pool when there is one (parallel, each call cut at its time limit), else here. The time
        taken is added to `reward_seconds`.
        """
        with self.turns:
            start = time.perf_counter()
            if self.scorer is None:
                scores = [self.score(*call) for call in calls]
            else:
                values = self.scorer.map([(messages, answer) for messages, answer, _ in calls])
                scores = [self.judge(value, where) for value, (_, _, where) in zip(values, calls, strict=True)]
            if self.reward_model is not None:
                scores = self._add_reward_model(calls, scores)
            self.reward_seconds += time.perf_counter() - start
            return scores

    def interact_all(self, calls: list[tuple[list[dict], str]]) -> list[list[dict]]:
        """``interact(messages)`` for each ``(messages, where)``, in order: the tool messages to append.

        Called in the `scorer` pool when there is one (each call cut at ``interact_timeout_s``), else here. A call that
        raised, timed out, lost its worker or returned something other than a list of messages follows ``on_error``:
        ``raise`` stops with one line naming the row; ``zero`` ends that conversation (``[]``), logs a warning and
        counts it.
        """
        if self.interact is None:
            return [[] for _ in calls]
        with self.turns:
            if self.scorer is None:
                values = [_interact_here(self.interact, messages) for messages, _ in calls]
            else:
                values = self.scorer.map([(messages,) for messages, _ in calls], function="interact")
            return [self._judge_tools(value, where) for value, (_, where) in zip(values, calls, strict=True)]

    def _judge_tools(self, value: Any, where: str) -> list[dict]:
        if not isinstance(value, RewardFailure) and not (
                isinstance(value, list) and all(isinstance(m, Mapping) for m in value)):
            value = RewardFailure(f"returned {type(value).__name__} {value!r:.80}, not a list of messages")
        if not isinstance(value, RewardFailure):
            capped, cut = cap_tool_messages(value, self.max_tool_chars)
            self.tool_truncations += cut
            return capped
        if value.config:
            raise ConfigError(value.error) from None
        self.interact_timeouts += value.timed_out
        what = f"{value.error} (interact_timeout_s)" if value.timed_out else f"failed ({value.error})"
        if self.on_error == "raise":
            raise DataError(f"{where}: interact from {self.path} {what}; "
                            f"{'make it faster or raise interact_timeout_s' if value.timed_out else 'fix it'}, "
                            "or set model.rollout.on_error: zero to end such conversations there")
        self.interact_failures += 1
        log.warning("%s: interact from %s %s; the conversation ends at this turn (on_error: zero)", where, self.path, what)
        return []

    def judge(self, value: Any, where: str) -> tuple[float, dict[str, float]]:
        """Apply the checks and the ``on_error`` policy to what ``reward_fn`` gave for the row `where`.

        That is its return value, or a `RewardFailure` when it raised, timed out or its worker died.
        """
        try:
            if isinstance(value, RewardFailure):
                raise _Failed(value)
            components = self._components(value)
            reward = self._combine(components) if components else _real(value, "a value")
        except _WrongComponents as e:  # a configuration mismatch, not a flaky row: always stop
            raise ConfigError(f"{where}: reward_fn from {self.path} {e}") from None
        except Exception as e:  # noqa: BLE001 - user code may raise anything; the policy decides
            failure = e.args[0] if isinstance(e, _Failed) else RewardFailure(describe(e))
            if failure.config:
                raise ConfigError(failure.error) from None
            self.timeouts += failure.timed_out
            if self.on_error == "raise":
                raise DataError(f"{where}: reward_fn from {self.path} {_what(failure)}; "
                                f"{'make it faster or raise reward_timeout_s' if failure.timed_out else 'fix it'}, "
                                "or set model.rollout.on_error: zero to score such trajectories 0") from None
            self.failures += 1
            return 0.0, dict.fromkeys(self._fn_names, 0.0)
        return reward, components

    def _add_reward_model(self, calls: list[tuple[list[dict], Any, str]], scores: list[tuple[float, dict[str, float]]]
                          ) -> list[tuple[float, dict[str, float]]]:
        """Score every conversation with the reward model (one batched call) and fold its score into each reward."""
        from rl_lightning.rewards.reward_model import RewardModelError

        config = self.reward_model_config
        values = self.reward_model.score_each([messages for messages, _, _ in calls])
        combined = []
        for (reward, components), value, (_, _, where) in zip(scores, values, calls, strict=True):
            if not isinstance(value, RewardModelError) and not math.isfinite(value):  # as reward_fn's: the policy
                value = RewardModelError(f"{where}: the reward model ({config.name}) scored it {value}, not a finite "
                                         f"number; check the reward model, or set {RM_KEY}.on_error: zero to score "
                                         "such trajectories 0 for it")
                if config.on_error == "raise":
                    raise DataError(str(value))
            if isinstance(value, RewardModelError):
                self.timeouts += value.timed_out
                if config.on_error == "raise":
                    raise value
                self.failures, value = self.failures + 1, 0.0
            components = {**components, config.name: float(value)}
            if self._fn_names:  # one more component of the combination; else its weight x score joins a scalar reward
                reward = self._combine(components)
            else:
                reward += config.weight * float(value)
            combined.append((reward, components))
        return combined

    def _components(self, value: Any) -> dict[str, float]:
        names = self._fn_names
        if not isinstance(value, Mapping):
            if names:
                raise _WrongComponents(f"returned {type(value).__name__} {value!r}, but reward_weights names "
                                       f"components {names}: return a dict with those keys")
            return {}
        if sorted(value) != names:
            fix = "set model.rollout.reward_weights" if not names else "make reward_weights and its keys agree"
            raise _WrongComponents(f"returned components {sorted(value)} but reward_weights has {names}: {fix}")
        return {k: _real(v, f"component {k!r}") for k, v in value.items()}

    def _combine(self, components: dict[str, float]) -> float:
        names = sorted(components)
        all_weights = {**(self.weights or {}), **({} if self.reward_model_config is None else {
            self.reward_model_config.name: self.reward_model_config.weight})}
        values = torch.tensor([[components[n] for n in names]], dtype=torch.float64)
        weights = torch.tensor([all_weights[n] for n in names], dtype=torch.float64)
        if self.combination == "weighted_sum":
            return float(weighted_sum(values, weights)[0])
        ideal = torch.tensor([(self.ideal or {}).get(n, 1.0) for n in names], dtype=torch.float64)
        return float(tchebycheff(values, weights, ideal)[0])


class _WrongComponents(Exception):
    pass


class _Failed(Exception):
    pass


def _interact_here(interact: Callable[[list[dict]], Any], messages: list[dict]) -> Any:
    """``interact(messages)`` in this process, an exception as a `RewardFailure` (a `ConfigError` stops: re-raised)."""
    try:
        return interact(messages)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - user code may raise anything; the policy decides
        return RewardFailure(describe(e))


def cap_tool_messages(messages: list[Mapping], max_chars: int | None) -> tuple[list[dict], bool]:
    """`messages` with at most `max_chars` characters of (string) content in all, and whether any was cut.

    Each content keeps what is left of the budget, and a cut one ends with a note the model reads (its length is not
    counted); every message is kept, so a tool call still gets its reply.
    """
    capped, left, cut = [], max_chars, False
    for message in messages:
        content = message.get("content")
        if left is not None and isinstance(content, str) and len(content) > left:
            content, cut = content[:left] + TRUNCATED.format(count=len(content) - left), True
        if left is not None and isinstance(content, str):
            left = max(0, left - len(content))
        capped.append({**message, "content": content} if "content" in message else dict(message))
    return capped, cut


def _real(value: Any, what: str) -> float:
    """`value` as a float if it is a finite real number (an int, float or bool, numpy's too), else a ValueError.

    A string such as ``"0.75"`` is refused, not parsed: a reward is a number, and text is a bug to report.
    """
    if not isinstance(value, numbers.Real):
        raise ValueError(f"returned {what} of type {type(value).__name__} ({value!r:.80}), not a number")
    if not math.isfinite(value):
        raise ValueError(f"returned {what} that is non-finite ({value!r})")
    return float(value)


def _what(failure: RewardFailure) -> str:
    return f"{failure.error} (reward_timeout_s)" if failure.timed_out else f"failed ({failure.error})"


def load_environment(env_path: str, on_error: str = "raise", key: str = "env_path",
                     weights: dict[str, float] | None = None, combination: str = "weighted_sum",
                     ideal: dict[str, float] | None = None, reward_model: Any = None,
                     max_tool_chars: int | None = MAX_TOOL_CHARS) -> Environment:
    """Import `env_path` and check it defines ``reward_fn(messages, answer)`` (and ``interact(messages)`` if any).

    `weights`/`combination`/`ideal` configure multi-component rewards (see `Environment`), `reward_model` (a
    `rl_lightning.rewards.reward_model.RewardModelConfig`) adds a reward-model component (its scorer is built here and
    started with `Environment.reward_model.start(device)`), `max_tool_chars` caps each ``interact`` result.
    """
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}, got '{on_error}'")
    if max_tool_chars is not None and max_tool_chars < 0:
        raise ConfigError(f"max_tool_chars must be >= 0 (characters) or null (no cap), got {max_tool_chars}")
    if combination not in COMBINATIONS:
        raise ConfigError(f"reward_combination must be one of {', '.join(COMBINATIONS)}, got '{combination}'")
    adapter = load_adapter(env_path, key) if is_adapter(env_path) else None  # verifiers:/openenv: environments
    if adapter is not None:
        weights = adapter.resolve_weights(weights, f"{key}={env_path!r}")
        if adapter.trust == "in-process":
            log.warning("%s=%s runs in-process (the reward workers): its code and the tools or actions the model "
                        "chooses run with their rights; serve an OpenEnv environment and name its URL "
                        "(openenv:http://HOST:PORT) to keep them apart", key, env_path)
    if weights is not None and (not weights or any(not math.isfinite(w) or w < 0 for w in weights.values())):
        raise ConfigError(f"reward_weights must map each component name to a finite weight >= 0, got {weights}")
    names = sorted(weights or {})
    if reward_model is not None and reward_model.name in names:
        raise ConfigError(f"model.rollout.reward_model.name={reward_model.name!r} is also a component of "
                          f"reward_weights {names}: rename one")
    if reward_model is not None and weights is not None:
        names = sorted([*names, reward_model.name])
    if ideal is not None and sorted(ideal) != names:
        raise ConfigError(f"reward_ideal must name the same components as reward_weights {names} (with the reward "
                          f"model's, if any), got {sorted(ideal)}")
    module = adapter if adapter is not None else _import_file(env_path, key)
    if _uses_code_sandbox(module):
        require_isolation()  # logs the isolation level once; refuses code rewards without it unless opted in
    reward_fn = getattr(module, "reward_fn", None)
    if not callable(reward_fn):
        raise ConfigError(f"{key} '{env_path}' must define reward_fn(messages, answer) -> float")
    _check_arity(reward_fn, 2, f"{key} '{env_path}': reward_fn must take (messages, answer)")
    interact = getattr(module, "interact", None)
    if interact is not None:
        if not callable(interact):
            raise ConfigError(f"{key} '{env_path}': interact must be a function interact(messages) -> list of messages")
        _check_arity(interact, 1, f"{key} '{env_path}': interact must take (messages)")
    answer_types = getattr(reward_fn, "answer_types", None)
    if answer_types is not None and not (isinstance(answer_types, tuple) and answer_types
                                         and all(isinstance(t, type) for t in answer_types)):
        raise ConfigError(f"{key} '{env_path}': reward_fn.answer_types must be a tuple of types, e.g. (str, int, "
                          f"float), got {answer_types!r}")
    answer_check = getattr(reward_fn, "check_answer", None)
    if answer_check is not None and not callable(answer_check):
        raise ConfigError(f"{key} '{env_path}': reward_fn.check_answer must be a function (answer, where), got "
                          f"{answer_check!r}")
    return Environment(reward_fn, interact, env_path if adapter else str(Path(env_path)), on_error, weights=weights,
                       combination=combination, ideal=ideal, reward_model=reward_model and reward_model.build(),
                       reward_model_config=reward_model, max_tool_chars=max_tool_chars, answer_types=answer_types,
                       answer_check=answer_check)


def _import_file(env_path: str, key: str) -> Any:
    """Import the environment file `env_path` (the module), any failure one `ConfigError` naming `key`."""
    path = Path(env_path)
    if not path.is_file():
        raise ConfigError(f"{key} '{env_path}' does not exist (resolved to {path.resolve()})")
    spec = importlib.util.spec_from_file_location(env_module_name(str(path)), path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{key} '{env_path}' is not a Python file (importlib finds no loader for it)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - report any import-time failure of user code as one line
        raise ConfigError(f"{key} '{env_path}' failed to import: {type(e).__name__}: {e}") from None
    return module


def _uses_code_sandbox(module: Any) -> bool:
    """Whether the environment file imported the code sandbox (or the code reward built on it)."""
    sandbox = ("rl_lightning.rewards.code", "rl_lightning.rewards.sandbox")
    return any(getattr(value, "__module__", None) in sandbox or getattr(value, "__name__", None) in sandbox
               for value in vars(module).values())


def _check_arity(fn: Callable, count: int, message: str) -> None:
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        raise ConfigError(message) from None
    except ValueError:  # builtins without a signature: accept
        pass
