"""OpenEnv (``openenv-core`` 0.3) environments as ``reward_fn``/``interact``: ``env_path: openenv:<module>``.

The mapping is described in `rl_lightning.envs.adapters`; openenv is imported only when one is used.

Trust (`trust` on each adapter): `OpenEnvServerAdapter` (``openenv:http://HOST:PORT``) plays each episode against
the environment's own server (its container, Space or ``uvicorn`` process) over OpenEnv's WebSocket client: nothing
of the environment runs here, and the model's text reaches it only as the action's one string field. `OpenEnvAdapter`
(``openenv:<module>``) runs the environment class in-process (in the reward workers): its code and whatever it does
with the model's actions run with the worker's rights, so naming a module is the explicit opt-in, said once in the log
at start-up.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any

from rl_lightning.compat.openenv import weighted_sum_parts
from rl_lightning.errors import ConfigError

RESERVED_OBSERVATION = ("done", "reward", "metadata")


class OpenEnvAdapter:
    """An OpenEnv ``Environment`` class as ``reward_fn``/``interact`` (see the module docstring)."""

    trust = "in-process"

    def __init__(self, env_class: Any, where: str) -> None:
        self.env_class, self.where = env_class, where
        try:
            env = env_class()
        except Exception as e:  # noqa: BLE001 - user code may raise anything at construction
            raise ConfigError(f"{where}: {env_class.__name__}() failed: {type(e).__name__}: {e}; the adapter builds "
                              "it without arguments (name a subclass that sets them)") from None
        self.action_type = _action_type(env_class, where)
        fields = [n for n, f in self.action_type.model_fields.items() if n != "metadata" and f.annotation is str]
        if len(fields) != 1:
            raise ConfigError(f"{where}: its action {self.action_type.__name__} has {len(fields)} str fields "
                              f"{fields}; the adapter puts the completion text in exactly one: give it one")
        self.text_field = fields[0]
        self.parts = _weighted_parts(env.rubric)
        names = [_snake(type(r).__name__) for r, _ in self.parts] if self.parts else ["reward"]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.weights = {n: w for n, (_, w) in zip(self.names, self.parts, strict=True)} or {"reward": 1.0}

    def episode(self, messages: list[dict]) -> tuple[Any, dict[str, float]]:
        """Replay the conversation: ``reset``, then one ``step`` per assistant turn (stopping at ``done``).

        Returns the last observation (the reset's when no turn) and the components summed over the steps.
        """
        env = self.env_class()
        observation = env.reset(**next((m["reset"] for m in messages if m.get("reset")), {}))
        totals = dict.fromkeys(self.names, 0.0)
        for message in messages:
            if message["role"] != "assistant" or observation.done:
                continue
            observation = env.step(self.action_type(**{self.text_field: message["content"] or ""}))
            for name, score in zip(self.names, self._scores(_weighted_parts(env.rubric), observation), strict=True):
                totals[name] += score
        return observation, totals

    def _scores(self, parts: list[tuple[Any, float]], observation: Any) -> list[float]:
        """This step's component scores: the episode's ``WeightedSum`` children's, else the observation's reward."""
        if not self.parts:
            return [float(observation.reward or 0.0)]
        if len(parts) != len(self.parts) or any(r.last_score is None for r, _ in parts):
            raise ValueError(f"{self.env_class.__name__}.step did not run its WeightedSum rubric")
        scores = [float(r.last_score) for r, _ in parts]
        # the env must report its rubric's value as the reward, or the components could not add up to it
        if abs(sum(s * w for s, (_, w) in zip(scores, parts, strict=True)) - (observation.reward or 0.0)) > 1e-6:
            raise ValueError(f"step reward {observation.reward} is not its WeightedSum rubric's value {scores}")
        return scores

    def reward_fn(self, messages: list[dict], answer: Any) -> dict[str, float]:
        """The episode's return, by component (`answer` is not used: the ``reset`` arguments say the task)."""
        return self.episode(messages)[1]

    def interact(self, messages: list[dict]) -> list[dict]:
        """The last observation as a user turn, or [] once the episode is done."""
        observation, _ = self.episode(messages)
        return [] if observation.done else [{"role": "user", "content": observation_text(observation)}]


class OpenEnvServerAdapter:
    """An OpenEnv environment served at `url` (``openenv:http://HOST:PORT``) as ``reward_fn``/``interact``.

    The same replay as `OpenEnvAdapter`, each call one WebSocket session (``GenericEnvClient``: plain JSON, no
    environment code here). The server reports only each step's reward, so there is one component, ``reward``. Serve
    it with as many concurrent sessions (``max_concurrent_envs``) as there are reward workers.
    """

    trust = "server"

    def __init__(self, url: str, where: str, timeout_s: float = 60.0) -> None:
        import httpx

        self.url, self.where, self.timeout_s = url.rstrip("/"), where, timeout_s
        try:
            response = httpx.get(f"{self.url}/schema", timeout=timeout_s)
            response.raise_for_status()
            schema = response.json()["action"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{where}: no OpenEnv server answers {self.url}/schema ({type(e).__name__}: {e}); "
                              "start the environment's server (its container or uvicorn) there") from None
        properties = schema.get("properties", {})
        fields = [n for n, f in properties.items() if n != "metadata" and f.get("type") == "string"]
        if len(fields) != 1:
            raise ConfigError(f"{where}: the server's action has {len(fields)} string fields {fields}; the adapter "
                              "puts the completion text in exactly one")
        self.text_field = fields[0]
        self.names, self.weights = ["reward"], {"reward": 1.0}

    def episode(self, messages: list[dict]) -> tuple[Any, dict[str, float]]:
        """Replay the conversation on a fresh server session; the last step's result and the summed reward."""
        from openenv.core.generic_client import GenericEnvClient

        total = 0.0
        with GenericEnvClient(base_url=self.url, message_timeout_s=self.timeout_s).sync() as env:
            result = env.reset(**next((m["reset"] for m in messages if m.get("reset")), {}))
            for message in messages:
                if message["role"] == "assistant" and not result.done:
                    result = env.step({self.text_field: message["content"] or ""})
                    total += float(result.reward or 0.0)
        return result, {"reward": total}

    def reward_fn(self, messages: list[dict], answer: Any) -> dict[str, float]:
        """The episode's return (`answer` is not used: the ``reset`` arguments say the task)."""
        return self.episode(messages)[1]

    def interact(self, messages: list[dict]) -> list[dict]:
        """The last observation as a user turn, or [] once the episode is done."""
        result, _ = self.episode(messages)
        return [] if result.done else [{"role": "user", "content": observation_text(result.observation)}]


def _action_type(env_class: Any, where: str) -> Any:
    """The action class ``step`` takes (its annotation, else the ``Environment[Action, ...]`` parameter)."""
    from openenv.core.env_server import Action

    hint = typing.get_type_hints(env_class.step).get("action")
    if not (isinstance(hint, type) and issubclass(hint, Action)):
        for base in getattr(env_class, "__orig_bases__", ()):
            hint = next((a for a in typing.get_args(base) if isinstance(a, type) and issubclass(a, Action)), None)
            if hint is not None:
                break
    if hint is None or hint is Action:
        raise ConfigError(f"{where}: {env_class.__name__}.step does not say its action class: annotate "
                          "`step(self, action: MyAction, ...)`")
    return hint


def _weighted_parts(rubric: Any) -> list[tuple[Any, float]]:
    """A ``WeightedSum`` rubric's (child, weight) pairs, [] for any other rubric (or none)."""
    from openenv.core.rubrics import WeightedSum

    if not isinstance(rubric, WeightedSum):
        return []
    return weighted_sum_parts(rubric)  # no public accessor in openenv-core 0.3


def observation_text(observation: Any) -> str:
    """An observation's text: its one ``str`` field, else its fields (no done/reward/metadata) as JSON.

    `observation` is an ``Observation`` or, from a server, its fields as a dict.
    """
    values = observation if isinstance(observation, dict) else observation.model_dump()
    fields = {n: v for n, v in values.items() if n not in RESERVED_OBSERVATION}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(fields) == 1 and texts else json.dumps(fields, default=str)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
