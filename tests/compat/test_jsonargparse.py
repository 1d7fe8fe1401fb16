"""Pins `rl_lightning.compat.jsonargparse`: each private name it uses still exists, with the shape it relies on.

A failure names the private name, the versions tested and the module to update (`_pinned`).
"""

import argparse
import inspect
from importlib.metadata import version

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningCLI

from rl_lightning.compat import jsonargparse as compat


def _pinned(condition: object, name: str, change: str = "is gone") -> None:
    assert condition, (f"{compat.TESTED} (installed {version('jsonargparse')}): {name} {change}; "
                       "update rl_lightning/compat/jsonargparse.py")


@pytest.fixture
def parser():
    parser = ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    commands = parser.add_subcommands(required=False)
    fit = ArgumentParser()
    fit.add_argument("--steps", type=int | None, default=None)
    commands.add_subcommand("fit", fit)
    return parser


def test_a_parsers_actions_and_option_strings(parser):
    _pinned(isinstance(getattr(parser, "_actions", None), list), "ArgumentParser._actions")
    dests = [action.dest for action in compat.parser_actions(parser)]
    _pinned("lr" in dests, "ArgumentParser._actions", "no longer lists the parser's actions")
    _pinned(isinstance(getattr(parser, "_option_string_actions", None), dict), "ArgumentParser._option_string_actions")
    assert compat.option_actions(parser)["--lr"].dest == "lr"


def test_a_subcommand_actions_parsers_by_name(parser):
    found = [compat.subcommand_parsers(action) for action in compat.parser_actions(parser)]
    commands = [each for each in found if each]
    _pinned(len(commands) == 1 and "fit" in commands[0], "subcommands action's _name_parser_map")
    assert [action.dest for action in compat.parser_actions(commands[0]["fit"]) if action.dest == "steps"] == ["steps"]
    assert compat.subcommand_parsers(compat.option_actions(parser)["--lr"]) is None


def test_a_typed_actions_hint_and_the_value_check(parser):
    fit = next(each for each in map(compat.subcommand_parsers, compat.parser_actions(parser)) if each)["fit"]
    steps = compat.option_actions(fit)["--steps"]
    _pinned(hasattr(steps, "_typehint"), "a typed action's _typehint")
    assert compat.type_hint(steps) == int | None
    _pinned(callable(getattr(fit, "_check_value_key", None)), "ArgumentParser._check_value_key")
    compat.check_value(fit, steps, 3, "steps")  # accepted: no error
    with pytest.raises((TypeError, ValueError)):
        compat.check_value(fit, steps, "three", "steps")
    assert compat.type_hint(argparse.Action(["--x"], "x", type=str)) is str  # a plain argparse action: its type


def test_lightning_clis_subcommand_parsers_attribute():
    source = inspect.getsource(LightningCLI)
    _pinned("self._subcommand_parsers" in source, "LightningCLI._subcommand_parsers")
    holder = type("CLI", (), {"_subcommand_parsers": {"fit": 1}})()
    assert compat.cli_subcommand_parsers(holder) == {"fit": 1}
    assert compat.cli_subcommand_parsers(object()) == {}


def test_the_private_loader_helpers():
    try:
        loader, exceptions = compat.omegaconf_loader("omegaconf+"), compat.loader_exceptions("yaml")
    except ImportError as error:
        _pinned(False, f"jsonargparse._optionals / _loaders_dumpers ({error})")
    assert loader("a: 1\nb: [x]\n") == {"a": 1, "b": ["x"]}
    _pinned(exceptions and all(issubclass(e, Exception) for e in exceptions),
            "jsonargparse._loaders_dumpers.get_loader_exceptions", "no longer returns exception types")


def test_nested_nulls_become_a_json_object_for_their_group():
    from rl_lightning.compat.jsonargparse import nested_nulls

    assert nested_nulls(["fit", "--model.lm.lm_head_chunk", "null", "--model.lm.lora.r", "4"]) == [
        "fit", "--model.lm", '{"lm_head_chunk": null}', "--model.lm.lora.r", "4"]
    assert nested_nulls(["--model.lm.lora.dropout=null"]) == ["--model.lm.lora", '{"dropout": null}']
    kept = ["--model.max_rollouts", "null", "--trainer.max_epochs", "null", "--model.lm.name", "x"]
    assert nested_nulls(kept) == kept  # top-level task arguments and other groups parse null themselves


def test_the_nested_null_quirk_still_needs_its_workaround():
    """jsonargparse refuses ``null`` for a nested dataclass field of a subclass-mode group; when a release stops
    refusing it, `rl_lightning.compat.jsonargparse.nested_nulls` can go."""
    import lightning as L
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(L.LightningModule, "model")
    base = ["--model", "rl_lightning.tasks.SFT", "--model.lm.name", "a"]
    with pytest.raises(Exception, match="NoneType"):
        parser.parse_args([*base, "--model.lm.lm_head_chunk", "null"])
    from rl_lightning.compat.jsonargparse import nested_nulls

    parsed = parser.parse_args(nested_nulls([*base, "--model.lm.lm_head_chunk", "null"]))
    assert parsed.model.init_args.lm.lm_head_chunk is None and parsed.model.init_args.lm.name == "a"
