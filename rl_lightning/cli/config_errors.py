"""One-line command-line errors: what is wrong with a config, found from the parser's structure, as one line.

jsonargparse reports a typo or a bad value as a multi-line message (a task's own message indented inside the
``Parser key "model"`` one) after the full usage (~60 lines). `one_line_error` replaces it with::

    model.lrr: not an option of SFT (value '1' on the command line); did you mean 'model.lm.optim.lr'? — see `...`

naming the key as the user writes it (no ``init_args``), the value, where it was set (the ``--config`` YAML that holds
the key, or the command line), the closest valid key (difflib over the valid dotted keys of that class) and the
``--help`` command that lists the options.

What is wrong is found from the parser's structure first (`rl_lightning.cli.config_check.diagnose`: the parser's
actions and their types, the configs as the user wrote them, class paths resolved by import, the table of moved
paths). Only what that does not find is read from jsonargparse's message (`parse_message`); those message shapes are
pinned by the jsonargparse version range in pyproject.toml, with one test per shape run against the installed
jsonargparse. A message of no known shape is reduced to its first meaningful line.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Sequence
from typing import Any

from rl_lightning.cli.config_check import (
    COMMAND_LINE,
    Problem,
    diagnose,
    import_class,
    read_settings,
    user_key,
)
from rl_lightning.compat.jsonargparse import parser_actions, subcommand_parsers

__all__ = ["Problem", "first_line", "locate", "one_line_error", "parse_message", "suggest"]

PROG = "python -m rl_lightning"
SUBCOMMAND = "fit"
CLASS_KEYS = {"model": "lightning.pytorch.LightningModule", "data": "lightning.pytorch.LightningDataModule"}
_NOT_FOUND = object()
_NOT_KEYS = ("help", "config", "print_config", argparse.SUPPRESS)  # parser actions that are not config keys
# lines of jsonargparse's union/subclass report that say nothing about what is wrong
_NOISE = re.compile(r'Parser key "[^"]+":|Does not validate against|Subtypes:|Errors:|Given value|Expected a path but')


# --- reading jsonargparse's message: what the structured check does not find --------------------------------------


def parse_message(message: str) -> Problem | None:
    """The `Problem` described by a jsonargparse error message, or None when its format is not recognised."""
    text = message.strip()
    patterns = [
        (r'Parser key "([^"]+)":\s*(.*)', lambda m: _parse_key_report(m[1], m[2])),
        (r"unrecognized arguments: --?([^\s=]+)(?:=(\S*)|\s+(?!--)(\S+))?",
         lambda m: Problem(m[1], "unknown option", m[2] if m[2] is not None else m[3], kind="option")),
        (r"Subcommand '[^']+' does not accept option '([^']+)'",
         lambda m: Problem(m[1], "unknown option", kind="option")),
        (r"Group '([^']+)' does not accept option '([^']+)'",
         lambda m: Problem(f"{m[1]}.{m[2]}", "unknown option", kind="option")),
        (r"Option '([^']+)' is not accepted", lambda m: Problem(m[1], "unknown option", kind="option")),
        (r"the following arguments are required: ([^\s,]+)", lambda m: Problem(m[1], "is required but not set")),
        (r"--(\S+): Expected a dot import path string: (\S+)",
         lambda m: Problem(m[1], "class not found", m[2], kind="class")),
        (r"argument --(\S+): (.+)", lambda m: Problem(m[1], m[2])),
    ]
    for pattern, build in patterns:
        if match := re.match(pattern, text, re.S):
            return build(match)
    return None


def _parse_key_report(key: str, report: str) -> Problem:
    """Parse what follows ``Parser key "<key>":``: a class's own nested message, a bad class path or a bad value."""
    lines = report.splitlines()
    for i, line in enumerate(lines):
        if match := re.match(r"(\s*)- Problem with given class_path '([^']+)':\s*$", line):
            indent, class_path = len(match[1]), match[2]
            inner = [x for x in lines[i + 1 :] if x.strip()]
            inner = inner[: next((j for j, x in enumerate(inner) if len(x) - len(x.lstrip()) <= indent), len(inner))]
            inner_text = "\n".join(x[indent:] for x in inner).strip()
            problem = parse_message(inner_text)
            if problem is None:  # the class itself is the problem (it does not import)
                return Problem(key, f"class not found: {first_line(inner_text)}", class_path, "class")
            if problem.class_path is None:
                problem.class_path = class_path
            problem.prefix = f"{key}.{problem.prefix}" if problem.prefix else key
            problem.key = f"{key}.{problem.key}" if problem.key else key
            return problem
    if match := re.search(r"Expected a dot import path string: (\S+)", report):
        return Problem(key, "class not found", match[1], "class")
    given = re.search(r"^\s*Given value: (.*)$", report, re.M)
    value = given[1] if given else None
    if value is not None and (nested := re.fullmatch(r"NestedArg\(key='[^']*', val=(.*)\)", value)):
        value = nested[1].strip("'\"")
    if match := re.search(r"Expected a (.+?)\. Got value: (.*)", report):
        return Problem(key, f"expected {type_name(match[1])}", match[2])
    expected = re.findall(r"^\s*- Expected a (.+)$", report, re.M)
    if expected:
        return Problem(key, f"expected {' or '.join(union_names(expected))}", value)
    return Problem(key, first_line(report), value)


def type_name(text: str) -> str:
    """``<class 'float'>`` -> ``float``, ``typing.Literal[1, 2]`` -> ``one of 1, 2``."""
    if match := re.fullmatch(r"<class '(?:builtins\.)?([^']+)'>", text.strip()):
        return match[1]
    if match := re.fullmatch(r"(?:typing\.)?Literal\[(.*)\]", text.strip()):
        return f"one of {match[1]}"
    return text.strip()


def union_names(expected: list[str]) -> list[str]:
    """The alternatives of a union, literals merged into one ``one of ...`` and None dropped when others remain."""
    names = [type_name(t) for t in expected]
    choices = [n.removeprefix("one of ") for n in names if n.startswith("one of ")]
    names = [n for n in names if not n.startswith("one of ")] + ([f"one of {', '.join(choices)}"] if choices else [])
    return [n for n in names if n != "NoneType"] or names


def first_line(message: str) -> str:
    """The first line of a message that says what is wrong (never a header of jsonargparse's union report)."""
    lines = [line.strip().lstrip("- ").strip() for line in message.splitlines()]
    meaningful = [line for line in lines if line and not _NOISE.match(line) and not line.startswith("usage:")]
    meaningful = meaningful or [line for line in lines if line] or ["invalid arguments"]
    if meaningful[0].endswith(":") and len(meaningful) > 1:  # "Problem with given class_path 'a.B':" + the problem
        return f"{meaningful[0]} {meaningful[1]}"
    return meaningful[0]


# --- the suggestion, the help command, where a key was set -------------------------------------------------------


def suggest(word: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to ``word``, or None.

    Among the candidates whose difflib ratio to `word` is >= 0.6, the best mean of that ratio and the ratio of the
    last dotted parts (a typo is usually in the key's last part: ``model.lrr`` means ``model.lm.optim.lr`` more likely
    than ``model.lm.lora``).
    """

    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    leaf = word.rpartition(".")[2]
    scored = [(ratio(word, c), c) for c in dict.fromkeys(candidates)]
    scored = [((full + ratio(leaf, c.rpartition(".")[2])) / 2, c) for full, c in scored if full >= 0.6]
    return max(scored, key=lambda sc: sc[0])[1] if scored else None


def parser_keys(parser: argparse.ArgumentParser) -> list[str]:
    """The dotted keys a parser accepts (leaves only; a subcommand's keys included), without help/config actions."""
    keys = []
    for action in parser_actions(parser):
        subparsers = subcommand_parsers(action)
        if subparsers:
            keys += [k for sub in subparsers.values() for k in parser_keys(sub)]
        elif action.dest not in _NOT_KEYS and not action.dest.endswith(".help"):
            keys.append(action.dest)
    return [k for k in keys if not any(other.startswith(k + ".") for other in keys)]  # drop groups ("optim")




def class_keys(class_path: str) -> list[str]:
    """The dotted keys of a class's ``__init__`` (``optim.lr``), as jsonargparse derives them."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(import_class(class_path))
    return parser_keys(parser)


def known_classes(base_path: str) -> list[str]:
    """Short names of the imported, public subclasses of a base class (``SFT``, ``DPO``...)."""
    names, stack = [], list(import_class(base_path).__subclasses__())
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        if not cls.__name__.startswith("_"):
            names.append(cls.__name__)
    return names


def short_name(class_path: str) -> str:
    """``rl_lightning.tasks.SFT`` -> ``SFT`` (our classes resolve by name on the command line); others stay dotted."""
    return class_path.rsplit(".", 1)[-1] if class_path.startswith("rl_lightning.") else class_path


def suggestion_for(problem: Problem, parser: argparse.ArgumentParser) -> str | None:
    """The valid key (or class name) closest to what the user wrote."""
    if problem.kind == "class":
        base = CLASS_KEYS.get(problem.key.removesuffix(".help"))
        if base is None or not problem.value:
            return None
        return suggest(str(problem.value).rsplit(".", 1)[-1], known_classes(base))
    if problem.kind != "option":
        return None
    try:
        keys = class_keys(problem.class_path) if problem.class_path else parser_keys(parser)
    except Exception:  # noqa: BLE001 - a suggestion is a bonus: a class that does not load gets none
        return None
    return suggest(problem.key, [f"{problem.prefix}.{k}" for k in keys] if problem.class_path else keys)


def help_command(problem: Problem) -> str:
    """The ``--help`` command that lists the options around the bad key."""
    if problem.class_path and problem.prefix in CLASS_KEYS and problem.kind != "class":
        return f"{PROG} {SUBCOMMAND} --{problem.prefix}.help {short_name(problem.class_path)}"
    return f"{PROG} {SUBCOMMAND} --help"


def _yaml_lookup(node: Any, parts: list[str]) -> Any:
    """The value at dotted ``parts`` in a loaded YAML, looking through ``init_args`` levels; `_NOT_FOUND` if absent."""
    if not parts:
        return node
    if not isinstance(node, dict):
        return _NOT_FOUND
    if parts[0] in node:
        found = _yaml_lookup(node[parts[0]], parts[1:])
        if found is not _NOT_FOUND:
            return found
    return _yaml_lookup(node["init_args"], parts) if "init_args" in node else _NOT_FOUND




def locate(key: str, argv: Sequence[str]) -> tuple[str | None, Any]:
    """Where ``key`` was last set, ``("command line" | <yaml path> | None, value)``, scanning ``argv`` in order."""
    where, value = None, _NOT_FOUND
    for setting in read_settings(argv):
        if setting.where == COMMAND_LINE and user_key(setting.key).removesuffix(".class_path") == key:
            where, value = COMMAND_LINE, setting.value
        elif setting.where != COMMAND_LINE and key != "config":
            found = _yaml_lookup(setting.value, key.split("."))
            if found is not _NOT_FOUND:
                where, value = setting.where, found
    return where, value


def _dangling_option(group: str, argv: Sequence[str]) -> str:
    """The option under ``group`` that was given no value (``model.lm.name``), else ``group``."""
    argv = list(argv)
    for arg, following in zip(argv, [*argv[1:], None], strict=True):
        if arg.startswith(f"--{group}") and "=" not in arg and (following is None or following.startswith("--")):
            return arg[2:]
    return group


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def one_line_error(message: str, parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """The one line (without the ``rl_lightning: error:`` prefix) that replaces jsonargparse's usage + message.

    Args:
        message: jsonargparse's error message (read only when `diagnose` finds nothing).
        parser: The parser that reports it (the root parser or the ``fit`` one): its keys are the suggestions.
        argv: The command line, to tell where the bad key was set.
    """
    try:
        problem = diagnose(parser, argv)
    except Exception:  # noqa: BLE001 - the structured check is best effort: the message is the fallback
        problem = None
    if problem is not None and problem.kind == "moved":
        place = "on your command line" if problem.where == COMMAND_LINE else f"in your config ({problem.where})"
        return f"{problem.key}: {problem.what}; change it {place}"
    if problem is None:
        problem = parse_message(message)
        if problem is None or not problem.key:
            at_root = any(subcommand_parsers(action) for action in parser_actions(parser))
            return f"{first_line(message)} — see `{PROG}{'' if at_root else ' ' + SUBCOMMAND} --help`"
        if problem.what == "expected one argument":  # argparse names the group (--model) of `--model.lm.name`
            problem.key = _dangling_option(problem.key, argv)
    where, value = (problem.where, problem.value) if problem.where else locate(problem.key, argv)
    if problem.kind == "class" or value is _NOT_FOUND or isinstance(value, dict):
        value = problem.value
    what = problem.what
    if problem.kind == "option" and problem.class_path:
        what = f"not an option of {short_name(problem.class_path)}"
    details = [f"value {_show(value)}"] if value is not None else []
    if where:
        details.append("on the command line" if where == COMMAND_LINE else f"in {where}")
    line = f"{problem.key}: {what}" + (f" ({' '.join(details)})" if details else "")
    if suggestion := suggestion_for(problem, parser):
        line += f"; did you mean '{suggestion}'?"
    return f"{line} — see `{help_command(problem)}`"


def jsonargparse_debug() -> bool:
    """Whether ``JSONARGPARSE_DEBUG`` asks for jsonargparse's own exceptions (with tracebacks) instead of our line."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true"  # jsonargparse's own reading of it
