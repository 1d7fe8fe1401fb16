"""jsonargparse's and argparse's private names the CLI's error rewording walks (tested on jsonargparse 4.40-4.53).

argparse keeps a parser's actions in ``_actions`` and ``_option_string_actions``, a subcommand action's parsers in
``_name_parser_map``; jsonargparse adds ``_typehint`` to typed actions, ``_check_value_key`` to its parser, keeps
LightningCLI's subcommand parsers in ``_subcommand_parsers`` and its loader helpers in two private modules.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from typing import Any

TESTED = "jsonargparse 4.40-4.53"


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action of `parser`, in the order added (``parser._actions``)."""
    return list(parser._actions)


def option_actions(parser: argparse.ArgumentParser) -> Mapping[str, argparse.Action]:
    """`parser`'s actions by option string (``--model.lr``) (``parser._option_string_actions``)."""
    return parser._option_string_actions


def subcommand_parsers(action: argparse.Action) -> dict[str, Any] | None:
    """The parsers of a subcommands action by name (``fit``), None for any other action (``_name_parser_map``)."""
    return getattr(action, "_name_parser_map", None) or None


def type_hint(action: argparse.Action) -> Any:
    """The type hint jsonargparse checks the action's values against (``_typehint``), else the action's type."""
    return getattr(action, "_typehint", None) or action.type


def check_value(parser: argparse.ArgumentParser, action: argparse.Action, value: Any, key: str) -> None:
    """Check `value` for `key` as jsonargparse does (``parser._check_value_key``); raises TypeError/ValueError."""
    parser._check_value_key(action, value, key, None)  # type: ignore[attr-defined]


def cli_subcommand_parsers(cli: Any) -> dict[str, Any]:
    """A LightningCLI's parsers per subcommand (``cli._subcommand_parsers``; empty before they are made)."""
    return dict(getattr(cli, "_subcommand_parsers", None) or {})


def omegaconf_loader(mode: str) -> Callable[[str], Any]:
    """The stock OmegaConf loader of jsonargparse for `mode` (``omegaconf+``) (``jsonargparse._optionals``)."""
    from jsonargparse._optionals import get_omegaconf_loader

    return get_omegaconf_loader(mode)


def loader_exceptions(mode: str) -> tuple[type[Exception], ...]:
    """The exceptions jsonargparse treats as "cannot load" for `mode` (``jsonargparse._loaders_dumpers``)."""
    from jsonargparse._loaders_dumpers import get_loader_exceptions

    return tuple(get_loader_exceptions(mode))


def nested_nulls(args: list[str]) -> list[str]:
    """``--model.lm.lm_head_chunk null`` as ``--model.lm '{"lm_head_chunk": null}'`` (jsonargparse 4.x quirk).

    In a subclass-mode group (LightningCLI's ``model``/``data``) jsonargparse refuses ``null`` for a field of a nested
    dataclass given on the command line ("Expected a <class 'NoneType'>", a ``NestedArg`` checked as the value),
    while a JSON object for the dataclass merges into it. Other arguments pass unchanged.
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if "=" in arg:
            key, value, step = *arg.split("=", 1), 1
        else:
            key, value, step = arg, args[i + 1] if i + 1 < len(args) else None, 2
        parts = key[2:].split(".") if key.startswith("--") else []
        if value == "null" and len(parts) >= 3 and parts[0] in ("model", "data") and parts[1] != "init_args":
            out += ["--" + ".".join(parts[:-1]), json.dumps({parts[-1]: None})]
            i += step
            continue
        out.append(arg)
        i += 1
    return out
