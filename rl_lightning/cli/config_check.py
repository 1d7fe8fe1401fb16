"""What the user set, checked against the parser's own structure: the one-line errors' diagnosis.

`diagnose` reads the command line and each ``--config`` file (`read_settings`) and checks every setting, in order,
against the parser that takes it, without reading jsonargparse's message:

- a key is one of the parser's actions, or an init arg of the class given at a key that takes a class (jsonargparse
  gives those a ``--<key>.help``), that class's parser built as jsonargparse builds it (linked targets left out);
- a value is what jsonargparse's own check accepts for the key (`rl_lightning.compat.jsonargparse.check_value`); the
  expected type is named from the action's type hint (`hint_name`);
- a class path resolves as jsonargparse resolves it (short names included); when it does not, the reason is Python's
  own ``ImportError`` / ``AttributeError``; a path of a module that moved gets its new path
  (`rl_lightning.cli.moved_paths`);
- every required init arg of a given class is set somewhere.

`rl_lightning.cli.config_errors` turns the `Problem` into the line, and reads the message only when this finds none.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from rl_lightning.cli.moved_paths import find_moved
from rl_lightning.compat.jsonargparse import check_value, option_actions, parser_actions, subcommand_parsers, type_hint

COMMAND_LINE = "command line"
_NOT_KEYS = ("help", "config", "print_config", argparse.SUPPRESS)  # parser actions that are not config keys
_SPEC_KEYS = ("class_path", "init_args", "dict_kwargs", "__path__")  # the keys of a class spec that are not init args


@dataclasses.dataclass
class Problem:
    """What is wrong with a config.

    Attributes:
        key: The key as the user writes it (``model.lm.optim.lr``; empty when the message names none).
        what: What is wrong with it (``expected float``).
        value: The value the user gave, when known.
        kind: ``"option"`` (no such key), ``"class"`` (a class path that does not resolve), ``"moved"`` (a path of a
            module that moved) or ``"value"``.
        class_path: The class whose arguments ``key`` belongs to (``rl_lightning.tasks.SFT``).
        prefix: Where that class sits (``model``), so ``key`` minus ``prefix`` is an argument of the class.
        where: Where the value was set (``command line`` or a config file), when known.
    """

    key: str
    what: str
    value: Any = None
    kind: Literal["value", "option", "class", "moved"] = "value"
    class_path: str | None = None
    prefix: str = ""
    where: str | None = None


@dataclasses.dataclass(frozen=True)
class Setting:
    """One thing the user set: a command-line option, or a whole ``--config`` file (``key`` empty)."""

    key: str
    value: Any
    where: str


@dataclasses.dataclass(frozen=True)
class Scope:
    """The parser that owns a level of keys: the command's, or a class's (then ``class_path`` is that class)."""

    parser: argparse.ArgumentParser
    shown: str = ""  # how the user names this level ("model."), prepended to its keys
    class_path: str | None = None
    prefix: str = ""


def read_settings(argv: Sequence[str]) -> list[Setting]:
    """What the command line sets, in order: each option (its text, None when none follows) and each config file."""
    settings, argv = [], list(argv)
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            continue
        name, has_inline, inline = arg.lstrip("-").partition("=")
        following = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        value = _inline_yaml(inline if has_inline else following)
        if name in ("config", "c"):  # a file, or a mapping given as text; else a problem for `diagnose`
            is_file = isinstance(value, str) and os.path.isfile(value)
            loaded = read_yaml(value) if is_file else value
            settings.append(Setting("", loaded, value if is_file else COMMAND_LINE) if isinstance(loaded, dict) else
                            Setting("config", value, COMMAND_LINE))
        else:
            settings.append(Setting(name, value, COMMAND_LINE))
    return settings


def _inline_yaml(text: str | None) -> Any:
    """A mapping or a list given as text (``--trainer.callbacks '[...]'``) loaded; any other text as it is."""
    import yaml

    try:
        return yaml.safe_load(text) if text and text.lstrip().startswith(("{", "[")) else text
    except yaml.YAMLError:
        return text


def config_trouble(path: Any) -> str:
    """Why a ``--config`` value is no config: no value, no such file, or not YAML (the YAML parser's own reason)."""
    import yaml

    if path is None or not os.path.isfile(str(path)):
        return "expected one argument" if path is None else "file does not exist"
    try:
        with open(path) as f:
            loaded = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        mark = getattr(e, "problem_mark", None)
        return f"cannot read it: {getattr(e, 'problem', None) or e}" + (f" (line {mark.line + 1})" if mark else "")
    return f"not a mapping of keys (a YAML {type(loaded).__name__})"


def user_key(key: str) -> str:
    """``model.init_args.optim.lr`` / ``trainer.callbacks+`` -> the key as we name it."""
    return ".".join(part for part in key.rstrip("+").split(".") if part != "init_args")


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser_actions(parser)}


def _takes_class(parser: argparse.ArgumentParser, dest: str) -> bool:
    """Whether the key takes a class (``class_path`` + ``init_args``): jsonargparse gives such keys a ``.help``."""
    return f"--{dest}.help" in option_actions(parser)


def hint_name(hint: Any) -> str:
    """A type hint as a user reads it: ``float``, ``int`` (for ``int | None``), ``one of 64, 32, 'bf16-true'``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return f"one of {', '.join(map(repr, args))}"
    if origin in (typing.Union, types.UnionType):
        names = [hint_name(arg) for arg in args if arg is not type(None)] or ["None"]
        choices = [n.removeprefix("one of ") for n in names if n.startswith("one of ")]
        names = [n for n in names if not n.startswith("one of ")] + ([f"one of {', '.join(choices)}"] if choices else [])
        return " or ".join(dict.fromkeys(names))
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "") if hint is not None else "a valid value"


def _classes_in(hint: Any) -> set[type]:
    """The classes a type hint names, through unions and containers: ``list[Callback] | None`` -> Callback, None."""
    if isinstance(hint, type) and not typing.get_args(hint):
        return {hint}
    return {cls for arg in typing.get_args(hint) for cls in _classes_in(arg)}


def _subclasses(bases: set[type]) -> list[type]:
    """The imported subclasses of `bases` (not of builtins), at any depth."""
    found: list[type] = []
    stack: list[type] = []
    for base in bases:
        stack += base.__subclasses__() if base.__module__ != "builtins" else []
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack += cls.__subclasses__()
    return found


def resolve_class(class_path: str, hint: Any) -> tuple[str | None, str | None]:
    """What a class path names at a key of type `hint`: ``(full path, None)`` or ``(None, why it names no class)``.

    A short name is looked up among the imported subclasses of the hint's classes, as jsonargparse does
    (``SFT`` -> ``rl_lightning.tasks.sft.SFT``); a dotted one is imported, and Python's reason is why it did not.
    ``(None, None)``: text the key takes as text (``ddp``, a config file), or a function (not walked).
    """
    bases = _classes_in(hint)
    found, trouble = None, "class not found"
    if "." in class_path:
        try:
            found = import_class(class_path)
        except (ImportError, AttributeError, ValueError) as e:
            trouble = f"class not found: {e}"
    else:
        found = next((cls for cls in _subclasses(bases) if cls.__name__ == class_path), None)
    if found is None:
        return None, None if str in bases or os.path.isfile(class_path) else trouble
    if not inspect.isclass(found):
        return None, None
    targets = tuple(base for base in bases if base.__module__ != "builtins")
    try:
        if targets and not issubclass(found, targets):
            return None, f"expected {hint_name(hint)}"
    except TypeError:  # a protocol jsonargparse checks its own way
        pass
    return (class_path if "." in class_path else f"{found.__module__}.{found.__qualname__}"), None


def _first_leaf(key: str, value: Any) -> tuple[str, Any]:
    """The first leaf under a mapping given for an unknown key (``trainr: {max_steps: 3}`` -> ``trainr.max_steps``)."""
    while isinstance(value, dict) and value:
        name, value = next(iter(value.items()))
        key = f"{key}.{name}"
    return key, value


class _Walk:
    """The settings checked in order, remembering the class given for each key and every key given a value."""

    def __init__(self) -> None:
        self.classes: dict[str, str] = {}  # key -> class path last given there ("model" -> "rl_lightning.tasks.SFT")
        self.scopes: dict[str, Scope] = {}  # key -> the scope of that class's init args
        self.given: set[str] = set()

    def check(self, scope: Scope, key: str, value: Any, where: str) -> Problem | None:
        """The problem with setting `key` (relative to `scope`) to `value`, or None."""
        key = user_key(key)
        if not key or isinstance(value, str) and "${" in value:  # an interpolation: resolved after parsing
            return self.each(scope, "", value, where) if not key and isinstance(value, dict) else None
        actions = _actions(scope.parser)
        if key in actions:
            return self.check_action(scope, key, value, where)
        base = next((dest for dest in actions if key.startswith(dest + ".") and _takes_class(scope.parser, dest)), None)
        if base is not None:  # model.lm.optim.lr: an init arg of the class at `model`
            return self.check_class(scope, base, {key[len(base) + 1 :]: value}, where)
        if isinstance(value, dict) and any(dest.startswith(key + ".") for dest in actions):  # a group of keys
            return self.each(scope, key + ".", value, where)
        if key.rpartition(".")[2] in _SPEC_KEYS:  # the class_path of a dataclass group (`optim`)
            return None
        key, value = _first_leaf(key, value)
        return Problem(scope.shown + key, "unknown option", value, "option", scope.class_path, scope.prefix, where)

    def each(self, scope: Scope, prefix: str, mapping: dict, where: str) -> Problem | None:
        """The first problem among the keys of a mapping (a config file, a group, a class's init args)."""
        for name, value in mapping.items():
            if name != "__path__" and (problem := self.check(scope, f"{prefix}{name}", value, where)):
                return problem
        return None

    def check_action(self, scope: Scope, key: str, value: Any, where: str) -> Problem | None:
        """The problem with a value for one of the parser's own keys."""
        action, shown = _actions(scope.parser)[key], scope.shown + key
        if key.endswith(".help") and _takes_class(scope.parser, key.removesuffix(".help")):  # --model.help SFTT
            found = self.resolve(scope, key.removesuffix(".help"), str(value), shown, where)
            return found if isinstance(found, Problem) else None
        if action.dest in _NOT_KEYS:
            return None
        if value is None and action.nargs is None and where == COMMAND_LINE:
            return Problem(shown, "expected one argument", None, "value", scope.class_path, scope.prefix, where)
        if _takes_class(scope.parser, key):
            return self.check_class(scope, key, value, where)
        if any(dest.startswith(key + ".") for dest in _actions(scope.parser)):  # a group: its keys, or a file
            if isinstance(value, dict):
                return self.each(scope, key + ".", value, where)
            self.given.add(shown)
            return None
        return self.check_value(scope, key, value, shown, where)

    def check_value(self, scope: Scope, key: str, value: Any, shown: str, where: str) -> Problem | None:
        """Whether jsonargparse's own check of the key's type accepts the value."""
        action = _actions(scope.parser)[key]
        try:
            check_value(scope.parser, action, value, key)
        except (TypeError, ValueError):
            return Problem(shown, f"expected {hint_name(type_hint(action))}", value, "value", scope.class_path,
                           scope.prefix, where)
        self.given.add(shown)
        return None

    def check_class(self, scope: Scope, key: str, value: Any, where: str) -> Problem | None:
        """The problem with a class spec (or a list of them: ``trainer.callbacks``) for a key that takes a class."""
        shown = scope.shown + key
        if not isinstance(value, list):
            return self.check_spec(scope, key, value, shown, where)
        for index, item in enumerate(value):
            if problem := self.check_spec(scope, key, item, f"{shown}[{index}]", where):
                return problem
        return None

    def check_spec(self, scope: Scope, key: str, value: Any, shown: str, where: str) -> Problem | None:
        """One class spec: a class path, ``{class_path, init_args}``, or init args of the class given before."""
        action = _actions(scope.parser)[key]
        spec = {"class_path": value} if isinstance(value, str) else value
        if not isinstance(spec, dict):  # false, null: the whole value against the type
            return self.check_value(scope, key, value, shown, where)
        if "class_path" in spec:
            class_path = self.resolve(scope, key, str(spec["class_path"]), shown, where)
            if not isinstance(class_path, str):  # a problem, or a string that is not a class ("ddp")
                return class_path
            if not shown.endswith("]"):
                self.classes[shown] = class_path
        else:
            class_path = self.classes.get(shown) or _default_class(action)
            if class_path is None:
                return None
        inner = self.scope_of(class_path, action, shown)
        init_args = {**{k: v for k, v in spec.items() if k not in _SPEC_KEYS}, **(spec.get("init_args") or {})}
        return None if inner is None else self.each(inner, "", init_args, where)

    def resolve(self, scope: Scope, key: str, class_path: str, shown: str, where: str) -> str | Problem | None:
        """The full path of the class `class_path` names at `key`, a `Problem`, or None (text, not a class)."""
        found, trouble = resolve_class(class_path, type_hint(_actions(scope.parser)[key]))
        return Problem(shown, trouble, class_path, "class", where=where) if trouble else found

    def scope_of(self, class_path: str, action: argparse.Action, shown: str) -> Scope | None:
        """The keys of a class's init args, parsed as jsonargparse parses them at `action` (linked ones left out)."""
        from jsonargparse import ArgumentParser

        try:
            cls = import_class(class_path)
            parser = ArgumentParser(exit_on_error=False)
            if not inspect.isclass(cls):  # a function that returns the instance: not walked
                return None
            parser.add_class_arguments(cls, **getattr(action, "sub_add_kwargs", {}))
        except Exception:  # noqa: BLE001 - a class jsonargparse cannot describe: its init args are not checked
            return None
        self.scopes[shown] = Scope(parser, shown + ".", class_path, shown)
        return self.scopes[shown]

    def missing_required(self) -> Problem | None:
        """The first required init arg of a given class that no setting gave."""
        for shown, scope in self.scopes.items():
            for action in parser_actions(scope.parser):
                key = f"{shown}.{action.dest}"
                if action.required and not any(key == g or key.startswith(g + ".") for g in self.given):
                    return Problem(key, "is required but not set", None, "value", scope.class_path, shown)
        return None


def _default_class(action: argparse.Action) -> str | None:
    """The class a key takes without a class_path: its default's, or the one dataclass its type allows."""
    default = action.default
    if hasattr(default, "get") and default.get("class_path"):
        return str(default.get("class_path"))
    hint = type_hint(action)
    members = [arg for arg in typing.get_args(hint) or (hint,) if arg is not type(None)]
    if len(members) == 1 and dataclasses.is_dataclass(members[0]) and isinstance(members[0], type):
        return f"{members[0].__module__}.{members[0].__qualname__}"
    return None


def command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[Any, list[str]] | None:
    """The parser of the subcommand `argv` runs (``fit``) and the arguments after it; None when it names none."""
    for action in parser_actions(parser):
        commands = subcommand_parsers(action)
        if commands:
            at = next((i for i, arg in enumerate(argv) if arg in commands), None)
            return None if at is None else (commands[argv[at]], list(argv[at + 1 :]))
    return parser, list(argv)


def diagnose(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Problem | None:
    """What is wrong with the settings of `argv`, found from the parser's structure; None when nothing is found.

    Args:
        parser: The parser that reports the error (the root parser or the ``fit`` one).
        argv: The command line.
    """
    found = command_parser(parser, argv)
    if found is None:
        return None
    command, args = found
    settings = read_settings(args)
    for setting in settings:
        if setting.key == "config":  # a --config that is neither a file nor a mapping
            return Problem("config", config_trouble(setting.value), setting.value, where=COMMAND_LINE)
        for key, old, new in find_moved(setting.value, user_key(setting.key)):
            return Problem(key, f"{old} moved to {new}", old, "moved", where=setting.where)
    walk, top = _Walk(), Scope(command)
    for setting in settings:
        if problem := walk.check(top, setting.key, setting.value, setting.where):
            return problem
    return walk.missing_required()


def import_class(class_path: str) -> Any:
    """The class at a dotted path (``rl_lightning.tasks.SFT``)."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def read_yaml(path: str) -> Any:
    """The content of a YAML file, or None when it cannot be read or parsed."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
