"""OpenEnv (``openenv-core`` 0.3) environments as ``reward_fn``/``interact``: ``env_path: openenv:<module>``.

The mapping is described in `rl_lightning.rollout.env_adapters`; openenv is imported only when one is used.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any

from rl_lightning.errors import ConfigError

RESERVED_OBSERVATION = ("done", "reward", "metadata")


class OpenEnvAdapter:
    """An OpenEnv ``Environment`` class as ``reward_fn``/``interact`` (see the module docstring)."""

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
    # WeightedSum keeps its children and weights in these attributes (openenv-core 0.3.0, no public accessor).
    return list(zip(rubric._rubric_list, (float(w) for w in rubric._weights), strict=True))


def observation_text(observation: Any) -> str:
    """An observation's text: its one ``str`` field, else its fields (no done/reward/metadata) as JSON."""
    fields = {n: v for n, v in observation.model_dump().items() if n not in RESERVED_OBSERVATION}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(fields) == 1 and texts else json.dumps(fields, default=str)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
