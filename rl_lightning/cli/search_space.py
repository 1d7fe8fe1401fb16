"""The search space of ``rl_lightning tune``: a YAML mapping of dotted config keys to how each is sampled.

```yaml
model.lm.optim.lr: {type: float, low: 1.0e-5, high: 1.0e-2, log: true}
model.update_per_rollout: {type: int, low: 1, high: 4}          # inclusive; optional step
model.advantage_estimator: {type: categorical, choices: [drgrpo, grpo]}
```

Validated before any trial runs (`parse_space`): every problem is listed on one line. The keys themselves are checked
by the CLI (``rl_lightning.cli.tune`` dry-parses the config with the overrides).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import yaml

from rl_lightning.errors import ConfigError

TYPES = ("float", "int", "categorical")
FIELDS = {"float": {"type", "low", "high", "step", "log"}, "int": {"type", "low", "high", "step", "log"},
          "categorical": {"type", "choices"}}


@dataclass(frozen=True)
class Param:
    """One searched config key.

    A float or int range (``low``..``high`` inclusive, optional ``step``/``log``) or a list of categorical ``choices``.
    """

    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    choices: tuple = ()

    def suggest(self, trial: Any) -> Any:
        """This key's value for the Optuna `trial` (``suggest_categorical``/``suggest_int``/``suggest_float``)."""
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        suggest = trial.suggest_int if self.type == "int" else trial.suggest_float
        return suggest(self.key, self.low, self.high, step=self.step or (1 if self.type == "int" else None),
                       log=self.log)

    def grid(self) -> list:
        """Every value, for the grid sampler (a float range needs a ``step``: checked by `parse_space`)."""
        if self.type == "categorical":
            return list(self.choices)
        count = int(math.floor((self.high - self.low) / (self.step or 1) + 1e-9)) + 1
        values = [self.low + i * (self.step or 1) for i in range(count)]
        return values if self.type == "int" else [round(v, 12) for v in values]

    def first(self) -> Any:
        """A valid value without sampling: the first choice, or ``low`` (the config is dry-parsed with it)."""
        return self.choices[0] if self.type == "categorical" else self.low


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(key: str, spec: Any, grid: bool) -> list[str]:
    """The problems with one key's spec (empty when it is valid)."""
    if not isinstance(spec, dict):
        return [f"{key}: expected {{type: float|int|categorical, ...}}, got {spec!r}"]
    kind = spec.get("type")
    if kind not in TYPES:
        return [f"{key}: unknown type {kind!r} (allowed: {', '.join(TYPES)})"]
    errors = [f"{key}: unknown field {name!r} for type {kind} (allowed: {', '.join(sorted(FIELDS[kind]))})"
              for name in spec if name not in FIELDS[kind]]
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            errors.append(f"{key}: categorical needs a non-empty list `choices`, got {choices!r}")
        elif len({json.dumps(c, sort_keys=True, default=str) for c in choices}) < len(choices):
            errors.append(f"{key}: duplicate choices in {choices!r}")
        return errors
    low, high, step, log = spec.get("low"), spec.get("high"), spec.get("step"), spec.get("log", False)
    for name, value in (("low", low), ("high", high)):
        if not _is_number(value) or (kind == "int" and not isinstance(value, int)):
            errors.append(f"{key}: `{name}` must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
    if step is not None and (not _is_number(step) or step <= 0 or (kind == "int" and not isinstance(step, int))):
        errors.append(f"{key}: `step` must be a positive {'integer' if kind == 'int' else 'number'}, got {step!r}")
    if not isinstance(log, bool):
        errors.append(f"{key}: `log` must be true or false, got {log!r}")
    if errors:
        return errors
    if low >= high:
        errors.append(f"{key}: low ({low}) must be below high ({high})")
    if log and low <= 0:
        errors.append(f"{key}: a log range needs low > 0, got {low}")
    if log and step is not None:
        errors.append(f"{key}: `log` and `step` cannot be combined (drop one)")
    if grid and log:
        errors.append(f"{key}: the grid sampler cannot sample a log range (use categorical choices)")
    elif grid and kind == "float" and step is None:
        errors.append(f"{key}: the grid sampler needs a `step` for a float range (or use categorical choices)")
    return errors


def parse_space(raw: Any, source: str = "search space", grid: bool = False) -> list[Param]:
    """The `Param` list of a loaded search-space mapping; raises `ConfigError` listing every problem on one line."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{source}: expected a non-empty mapping of dotted config keys to "
                          f"{{type: float|int|categorical, ...}}, got {raw!r}")
    errors = [error for key, spec in raw.items() for error in _check(str(key), spec, grid)]
    errors += [f"{key}: not a dotted config key (e.g. model.lm.optim.lr)" for key in raw
               if not isinstance(key, str) or key.startswith("-") or " " in key]
    if errors:
        raise ConfigError(f"{source}: " + "; ".join(errors))
    return [Param(key=key, type=spec["type"], low=spec.get("low"), high=spec.get("high"), step=spec.get("step"),
                  log=spec.get("log", False), choices=tuple(spec.get("choices") or ())) for key, spec in raw.items()]


def load_space(path: str, grid: bool = False) -> list[Param]:
    """Read and validate a search-space YAML file (see `parse_space`)."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--search {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--search {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_space(raw, f"search space {path}", grid)


def overrides(values: dict[str, Any]) -> list[str]:
    """CLI arguments setting each dotted key (``--model.lm.optim.lr 0.003``); lists and mappings as flow YAML."""
    args = []
    for key, value in values.items():
        text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
        args += [f"--{key}", text.removesuffix("\n...").strip()]
    return args
