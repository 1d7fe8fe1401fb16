"""How a command-line mistake is read: jsonargparse's message text parsed into a `Problem` (the fallback), the first
line of a union report, the closest key, where a key was set, type names; and the message shapes of the installed
jsonargparse, so a release that words them differently fails here (the CLI end to end is in test_config_errors.py)."""

import typing

import pytest
from conftest import REPO

import rl_lightning.tasks
from rl_lightning.cli.config_check import hint_name
from rl_lightning.cli.config_errors import Problem, first_line, locate, one_line_error, parse_message, suggest

HELP_FIT = "`python -m rl_lightning fit --help`"


# jsonargparse 4.53's messages, as the `fit` parser reports them (the nested one is a task's message inside).
NESTED_VALUE = (
    'Parser key "model":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class '
    "'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]\n  Errors:\n    - Problem with given "
    "class_path 'rl_lightning.tasks.SFT':\n        Parser key \"lm.optim.lr\":\n          Expected a <class 'float'>. "
    "Got value: abc\n    - Expected a <class 'NoneType'>\n  Given value type: <class "
    "'jsonargparse._util.NestedArg'>\n  Given value: NestedArg(key='lm.optim.lr', val='abc')"
)
CLASS_IMPORT = (
    'Parser key "trainer.logger":\n\n  - Expected a path but foo.Bar either not accessible or invalid\n  - Does not '
    "validate against any of the Union subtypes\n  Subtypes: [<class 'lightning.pytorch.loggers.logger.Logger'>, "
    "<class 'bool'>, <class 'NoneType'>]\n  Errors:\n    - Problem with given class_path 'foo.Bar':\n        No module "
    "named 'foo'\n    - Expected a <class 'bool'>\n    - Expected a <class 'NoneType'>\n  Given value type: <class "
    "'str'>\n  Given value: foo.Bar"
)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (NESTED_VALUE, Problem("model.lm.optim.lr", "expected float", "abc", "value", "rl_lightning.tasks.SFT", "model")),
        (CLASS_IMPORT, Problem("trainer.logger", "class not found: No module named 'foo'", "foo.Bar", "class")),
        ("unrecognized arguments: --trainr.max_steps 3", Problem("trainr.max_steps", "unknown option", "3", "option")),
        ("unrecognized arguments: --optim.lrr=1", Problem("optim.lrr", "unknown option", "1", "option")),
        ("Group 'optim' does not accept option 'lrr'", Problem("optim.lrr", "unknown option", kind="option")),
        ("Subcommand 'fit' does not accept option 'trainr.max_steps'",
         Problem("trainr.max_steps", "unknown option", kind="option")),
        ('Parser key "trainer.precision":\n  Does not validate against any of the Union subtypes\n  Errors:\n'
         "    - Expected a typing.Literal[64, 32]\n    - Expected a typing.Literal['bf16-true']\n"
         "    - Expected a <class 'NoneType'>\n  Given value type: <class 'str'>\n  Given value: 17",
         Problem("trainer.precision", "expected one of 64, 32, 'bf16-true'", "17")),
        ("argument subcommand: invalid choice: 'fitt' (choose from 'fit')", None),
    ],
    ids=["nested-value", "class-import", "unrecognized", "unrecognized-inline", "group", "subcommand", "literals",
         "unknown-format"],
)
def test_parse_message(message, expected):
    assert parse_message(message) == expected


def test_first_line_skips_the_union_report():
    assert first_line(CLASS_IMPORT) == "Problem with given class_path 'foo.Bar': No module named 'foo'"
    assert first_line("\n\nsomething odd\nmore detail") == "something odd"


def test_unrecognised_message_is_its_first_line():
    from jsonargparse import ArgumentParser

    line = one_line_error("something odd\n  more detail", ArgumentParser(), [])
    assert line == f"something odd — see {HELP_FIT}"


def test_suggest():
    keys = ["model.lm.name", "model.lm.optim.lr", "model.lm.optim.warmup_steps", "trainer.max_steps"]
    assert suggest("model.lrr", keys) == "model.lm.optim.lr"
    assert suggest("model.lm.optim.lrr", keys) == "model.lm.optim.lr"
    assert suggest("trainr.max_steps", keys) == "trainer.max_steps"
    assert suggest("completely.different", keys) is None


def test_locate_reports_the_last_place_a_key_is_set(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("data:\n  init_args:\n    max_lenght: 1\n")
    second.write_text("model:\n  lr: 2\n")
    argv = ["fit", "--config", str(first), "--config", str(second)]
    assert locate("data.max_lenght", argv) == (str(first), 1)
    assert locate("data.max_lenght", [*argv, "--data.init_args.max_lenght=3"]) == ("command line", "3")
    assert locate("model.lr", argv) == (str(second), 2)
    assert locate("model.other", argv)[0] is None



def test_hint_name():
    assert hint_name(float) == "float" and hint_name(int | None) == "int"
    assert hint_name(typing.Literal[64, 32] | typing.Literal["bf16-true"] | None) == "one of 64, 32, 'bf16-true'"
    assert hint_name(typing.Union[float, int, None]) == "float or int"  # noqa: UP007 - the typing form, as Lightning's


# --- what the text fallback reads: each message shape, produced by the installed jsonargparse ---------------------
# A jsonargparse release that words one of these differently fails here: update `parse_message` (and this test's
# expectation) before widening the jsonargparse range pinned in pyproject.toml.


def _message(parse):
    """jsonargparse's error message for a parse that fails."""
    from jsonargparse import ArgumentError

    with pytest.raises(ArgumentError) as info:
        parse()
    return str(info.value)


def _parser(**types):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    for name, hint in types.items():
        parser.add_argument(f"--{name}", type=hint)
    return parser


def _class_parser(cls):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls)
    return parser


def _subcommand_parser():
    from jsonargparse import ArgumentParser

    root = _parser()
    fit = ArgumentParser(exit_on_error=False)
    fit.add_argument("--trainer.max_steps", type=int)
    root.add_subcommands().add_subcommand("fit", fit)
    return root


def _shapes():
    from lightning.pytorch import LightningModule
    from lightning.pytorch.loggers import Logger

    model, sft = typing.Optional[LightningModule], rl_lightning.tasks.SFT  # noqa: UP045 - as LightningCLI adds it
    task = ["--model", "rl_lightning.tasks.SFT", "--model.lm.name", "x"]
    return {
        "nested-value": (lambda: _parser(model=model).parse_args([*task, "--model.lm.optim.lr", "abc"]),
                         Problem("model.lm.optim.lr", "expected float", "abc", "value", "rl_lightning.tasks.SFT", "model")),
        "nested-option": (lambda: _parser(model=model).parse_args([*task, "--model.lrr", "1"]),
                          Problem("model.lrr", "unknown option", None, "option", "rl_lightning.tasks.SFT", "model")),
        "class-import": (lambda: _parser(logger=Logger | bool | None).parse_args(["--logger", "foo.Bar"]),
                         Problem("logger", "class not found: No module named 'foo'", "foo.Bar", "class")),
        "short-class": (lambda: _parser(model=model).parse_args(["--model", "SFTT"]),
                        Problem("model", "class not found", "SFTT", "class")),
        "help-class": (lambda: _parser(model=model).parse_args(["--model.help", "SFTT"]),
                       Problem("model.help", "class not found", "SFTT", "class")),
        "unrecognized": (lambda: _class_parser(sft).parse_args(["--lm.name", "x", "--nope", "3"]),
                         Problem("nope", "unknown option", "3", "option")),
        "group": (lambda: _class_parser(sft).parse_object({"lm": {"name": "x", "optim": {"lrr": 1}}}),
                  Problem("lm.optim.lrr", "unknown option", kind="option")),
        "option": (lambda: _class_parser(sft).parse_object({"lm": {"name": "x"}, "lrr": 1}),
                   Problem("lrr", "unknown option", kind="option")),
        "subcommand": (lambda: _subcommand_parser().parse_object({"fit": {"trainr": {"max_steps": 3}}}),
                       Problem("trainr.max_steps", "unknown option", kind="option")),
        "required": (lambda: _class_parser(sft).parse_args([]), Problem("lm.name", "is required but not set")),
        "literals": (lambda: _parser(precision=typing.Literal[64, 32] | typing.Literal["bf16-true"] | None)
                     .parse_args(["--precision", "17"]), Problem("precision", "expected one of 64, 32, 'bf16-true'", "17")),
        "no-value": (lambda: _class_parser(sft).parse_args(["--lm.name"]),
                     Problem("lm.name", "expected one argument")),
    }


@pytest.mark.parametrize("shape", ["nested-value", "nested-option", "class-import", "short-class", "help-class",
                                   "unrecognized", "group", "option", "subcommand", "required", "literals", "no-value"])
def test_message_shape_of_the_installed_jsonargparse(shape):
    parse, expected = _shapes()[shape]
    assert parse_message(_message(parse)) == expected


def test_union_report_shape_of_the_installed_jsonargparse():
    from lightning.pytorch.loggers import Logger

    message = _message(lambda: _parser(logger=Logger | bool | None).parse_args(["--logger", "foo.Bar"]))
    assert first_line(message) == "Problem with given class_path 'foo.Bar': No module named 'foo'"


def test_installed_jsonargparse_is_in_the_pinned_range():
    """The shapes above were checked against the installed jsonargparse: it must be one the pin allows."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in dependencies if Requirement(d).name == "jsonargparse"]
    assert pin.specifier.contains(version("jsonargparse")) and pin.specifier.contains("4.53.0")
    assert not pin.specifier.contains("4.54.0")  # widen only after the shape tests pass on the new release
