"""Command-line mistakes (a typo, a bad value, a class that does not import) end in ONE line on stderr with exit status
2: the key as the user writes it, the value, where it was set, the closest valid key and the --help command to run.
And --help tells the truth: no --optimizer/--lr_scheduler, the task classes named, short class names accepted."""

import subprocess
import sys
import typing

import pytest
import yaml
from conftest import REPO

import rl_lightning.data
import rl_lightning.tasks
from rl_lightning.cli.config_check import hint_name
from rl_lightning.cli.config_errors import Problem, first_line, locate, one_line_error, parse_message, suggest
from rl_lightning.cli.main import main

HELP_SFT = "`python -m rl_lightning fit --model.help SFT`"
HELP_FIT = "`python -m rl_lightning fit --help`"


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])  # LightningCLI warns when pytest's own argv is present


def _error_line(args, capsys):
    """Run the CLI on the SFT recipe plus ``args``; the one stderr line it ends with (asserting there is one)."""
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/sft.yaml", *args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines[:5]
    assert lines[0].startswith("rl_lightning: error: ") and "usage:" not in lines[0]
    return lines[0]


# (args, the key and what is wrong, the value, the suggestion or None, the help command)
COMMAND_LINE = {
    "typo": (["--model.lrr", "1"], "model.lrr: not an option of SFT", "'1'", "model.optim.lr", HELP_SFT),
    "typo-in-group": (["--model.optim.lrr", "1"], "model.optim.lrr: not an option of SFT", "'1'", "model.optim.lr",
                      HELP_SFT),
    "bad-value": (["--model.optim.lr", "abc"], "model.optim.lr: expected float", "'abc'", None, HELP_SFT),
    "bad-data-value": (["--data.max_length", "abc"], "data.max_length: expected int", "'abc'", None,
                       "`python -m rl_lightning fit --data.help SFTDataModule`"),
    "unknown-top-level": (["--trainr.max_steps", "3"], "trainr.max_steps: unknown option", "'3'", "trainer.max_steps",
                          HELP_FIT),
    "trainer-typo": (["--trainer.max_stepz", "3"], "trainer.max_stepz: unknown option", "'3'", "trainer.max_steps",
                     HELP_FIT),
    "bad-trainer-value": (["--trainer.max_steps", "abc"], "trainer.max_steps: expected int", "'abc'", None, HELP_FIT),
    "class-not-found": (["--model", "rl_lightning.tasks.SFTT"],
                        "model: class not found: module 'rl_lightning.tasks' has no attribute 'SFTT'",
                        "'rl_lightning.tasks.SFTT'", "SFT", HELP_FIT),
    "short-class-not-found": (["--data", "PromptDataModul"], "data: class not found", "'PromptDataModul'",
                              "PromptDataModule", HELP_FIT),
    "help-of-unknown-class": (["--model.help", "SFTT"], "model.help: class not found", "'SFTT'", "SFT", HELP_FIT),
    "optimizer-flag": (["--optimizer", "Adam"], "optimizer: unknown option", "'Adam'", None, HELP_FIT),
}


@pytest.mark.parametrize("case", list(COMMAND_LINE))
def test_command_line_mistake_is_one_line(case, workdir, capsys):
    args, problem, value, suggestion, help_command = COMMAND_LINE[case]
    line = _error_line(args, capsys)
    assert line.startswith(f"rl_lightning: error: {problem} ("), line
    assert f"value {value} on the command line" in line, line
    if suggestion:
        assert f"did you mean '{suggestion}'?" in line, line
    else:
        assert "did you mean" not in line, line
    assert line.endswith(f"— see {help_command}"), line


YAML = {
    "typo": ({"data": {"init_args": {"max_lenght": 10}}}, "data.max_lenght: not an option of SFTDataModule",
             "value 10", "data.max_length", "`python -m rl_lightning fit --data.help SFTDataModule`"),
    "typo-without-init-args": ({"data": {"max_lenght": 10}}, "data.max_lenght: not an option of SFTDataModule",
                               "value 10", "data.max_length", "`python -m rl_lightning fit --data.help SFTDataModule`"),
    "typo-in-group": ({"model": {"init_args": {"optim": {"lrr": 1}}}}, "model.optim.lrr: not an option of SFT",
                      "value 1", "model.optim.lr", HELP_SFT),
    "bad-value": ({"model": {"init_args": {"optim": {"lr": "abc"}}}}, "model.optim.lr: expected float",
                  "value 'abc'", None, HELP_SFT),
    "unknown-top-level": ({"trainr": {"max_steps": 3}}, "trainr.max_steps: unknown option", "value 3",
                          "trainer.max_steps", HELP_FIT),
    "class-not-found": ({"model": {"class_path": "SFTT"}}, "model: class not found", "value 'SFTT'", "SFT", HELP_FIT),
}


@pytest.mark.parametrize("case", list(YAML))
def test_yaml_mistake_names_the_file(case, workdir, capsys):
    content, problem, value, suggestion, help_command = YAML[case]
    (workdir / "overlay.yaml").write_text(yaml.safe_dump(content))
    line = _error_line(["--config", "overlay.yaml"], capsys)
    assert line.startswith(f"rl_lightning: error: {problem} ({value} in overlay.yaml)"), line
    assert (f"did you mean '{suggestion}'?" in line) if suggestion else ("did you mean" not in line), line
    assert line.endswith(f"— see {help_command}"), line


def test_missing_required_argument_is_one_line(workdir, capsys):
    (workdir / "bare.yaml").write_text("model:\n  class_path: SFT\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "bare.yaml"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"rl_lightning: error: model.model_name: is required but not set — see {HELP_SFT}"]


def test_typo_from_a_real_process_is_one_line(workdir):
    result = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/sft.yaml", "--model.lrr", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "usage:" not in result.stderr and "Traceback" not in result.stderr, lines[:5]
    assert lines[0] == ("rl_lightning: error: model.lrr: not an option of SFT (value '1' on the command line); "
                        f"did you mean 'model.optim.lr'? — see {HELP_SFT}")


def test_help_names_the_tasks_and_has_no_optimizer_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--optimizer" not in text and "--lr_scheduler" not in text
    data_modules = [n for n in rl_lightning.data.__all__ if n.endswith("DataModule")]
    assert len(rl_lightning.tasks.__all__) == 4 and len(data_modules) == 3
    for name in rl_lightning.tasks.__all__:
        assert f"rl_lightning.tasks.{name}" in text, name  # jsonargparse's "known subclasses"
    epilog = " ".join(text.split()).split("Tasks (--model): ")[-1]
    for name in [*rl_lightning.tasks.__all__, *data_modules]:
        assert name in epilog, name


@pytest.mark.parametrize(("flag", "short", "dotted"), [("--model.help", "SFT", "rl_lightning.tasks.SFT"),
                                                        ("--model.help", "PPO", "rl_lightning.tasks.PPO"),
                                                        ("--data.help", "PromptDataModule",
                                                         "rl_lightning.data.PromptDataModule")])
def test_help_of_a_class_accepts_its_short_name(flag, short, dotted, capsys):
    outputs = []
    for name in (short, dotted):
        with pytest.raises(SystemExit) as info:
            main(["fit", flag, name])
        assert info.value.code == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert f"{flag.removesuffix('.help')}.model_name " in outputs[0] or "--data.path " in outputs[0]


def test_short_class_path_in_yaml_resolves(workdir, capsys):
    (workdir / "short.yaml").write_text("model:\n  class_path: DPO\n  init_args:\n    model_name: tiny\n"
                                        "data:\n  class_path: PreferenceDataModule\n  init_args:\n    path: x.jsonl\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "short.yaml", "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "rl_lightning.tasks.DPO"
    assert printed["data"]["class_path"] == "rl_lightning.data.PreferenceDataModule"
    assert printed["model"]["init_args"]["model_name"] == "tiny"


# jsonargparse 4.53's messages, as the `fit` parser reports them (the nested one is a task's message inside).
NESTED_VALUE = (
    'Parser key "model":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class '
    "'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]\n  Errors:\n    - Problem with given "
    "class_path 'rl_lightning.tasks.SFT':\n        Parser key \"optim.lr\":\n          Expected a <class 'float'>. "
    "Got value: abc\n    - Expected a <class 'NoneType'>\n  Given value type: <class "
    "'jsonargparse._util.NestedArg'>\n  Given value: NestedArg(key='optim.lr', val='abc')"
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
        (NESTED_VALUE, Problem("model.optim.lr", "expected float", "abc", "value", "rl_lightning.tasks.SFT", "model")),
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
    keys = ["model.model_name", "model.optim.lr", "model.optim.warmup_steps", "trainer.max_steps"]
    assert suggest("model.lrr", keys) == "model.optim.lr"
    assert suggest("model.optim.lrr", keys) == "model.optim.lr"
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


# --- the line comes from the parser's structure, not from jsonargparse's message text ---------------------------------


def _without_message_text(monkeypatch):
    """Make reading jsonargparse's message a no-op that records each call: a line built without it is structured."""
    import rl_lightning.cli.config_errors as config_errors

    calls = []
    monkeypatch.setattr(config_errors, "parse_message", lambda message: calls.append(message))
    return calls


@pytest.mark.parametrize("case", list(COMMAND_LINE))
def test_command_line_mistake_without_the_message_text(case, workdir, capsys, monkeypatch):
    calls = _without_message_text(monkeypatch)
    test_command_line_mistake_is_one_line(case, workdir, capsys)
    assert calls == []


@pytest.mark.parametrize("case", list(YAML))
def test_yaml_mistake_without_the_message_text(case, workdir, capsys, monkeypatch):
    calls = _without_message_text(monkeypatch)
    test_yaml_mistake_names_the_file(case, workdir, capsys)
    assert calls == []


def test_missing_required_argument_without_the_message_text(workdir, capsys, monkeypatch):
    calls = _without_message_text(monkeypatch)
    test_missing_required_argument_is_one_line(workdir, capsys)
    assert calls == []


@pytest.mark.parametrize("recipe", sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.yaml")))
def test_every_recipe_passes_the_structured_check(recipe, workdir, capsys, monkeypatch):
    """No false alarm: walking a whole shipped recipe, the check passes every key and reports the one real mistake."""
    calls = _without_message_text(monkeypatch)
    line = _error_line(["--config", recipe, "--zz", "1"], capsys)
    assert line == f"rl_lightning: error: zz: unknown option (value '1' on the command line) — see {HELP_FIT}"
    assert calls == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "missing.yaml"], "config: file does not exist (value 'missing.yaml' on the command line)"),
        (["--config", "list.yaml"], "config: not a mapping of keys (a YAML list) (value 'list.yaml' on the command line)"),
        (["--model.model_name"], "model.model_name: expected one argument (on the command line)"),
        (["--config", "nested.yaml"], "model.lora.rr: not an option of LoRAConfig (value 4 in nested.yaml); did you "
                                      "mean 'model.lora.r'?"),
        (["--trainer.logger.init_args.run_namee", "x"], "trainer.logger.run_namee: not an option of "
         "MLFlowLogger (value 'x' on the command line); did you mean 'trainer.logger.run_name'?"),
        (["--config", "callback.yaml"], "trainer.callbacks[0].monitr: not an option of "
         "lightning.pytorch.callbacks.EarlyStopping (value 'x' in callback.yaml); did you mean "
         "'trainer.callbacks[0].monitor'?"),
        (["--model", "rl_lightning.data.SFTDataModule"], "model: expected LightningModule (value "
                                                         "'rl_lightning.data.SFTDataModule' on the command line)"),
    ],
    ids=["missing-config", "config-not-a-mapping", "no-value", "nested-class", "default-logger-class", "callback-item",
         "wrong-base-class"],
)
def test_more_mistakes_from_the_structure(args, expected, workdir, capsys, monkeypatch):
    (workdir / "list.yaml").write_text("- 1\n- 2\n")
    (workdir / "nested.yaml").write_text("model:\n  init_args:\n    lora:\n      rr: 4\n")
    (workdir / "callback.yaml").write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks."
                                           "EarlyStopping\n      init_args:\n        monitr: x\n")
    calls = _without_message_text(monkeypatch)
    line = _error_line(args, capsys)
    assert line.startswith(f"rl_lightning: error: {expected} — see `"), line
    assert calls == []


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
    task = ["--model", "rl_lightning.tasks.SFT", "--model.model_name", "x"]
    return {
        "nested-value": (lambda: _parser(model=model).parse_args([*task, "--model.optim.lr", "abc"]),
                         Problem("model.optim.lr", "expected float", "abc", "value", "rl_lightning.tasks.SFT", "model")),
        "nested-option": (lambda: _parser(model=model).parse_args([*task, "--model.lrr", "1"]),
                          Problem("model.lrr", "unknown option", None, "option", "rl_lightning.tasks.SFT", "model")),
        "class-import": (lambda: _parser(logger=Logger | bool | None).parse_args(["--logger", "foo.Bar"]),
                         Problem("logger", "class not found: No module named 'foo'", "foo.Bar", "class")),
        "short-class": (lambda: _parser(model=model).parse_args(["--model", "SFTT"]),
                        Problem("model", "class not found", "SFTT", "class")),
        "help-class": (lambda: _parser(model=model).parse_args(["--model.help", "SFTT"]),
                       Problem("model.help", "class not found", "SFTT", "class")),
        "unrecognized": (lambda: _class_parser(sft).parse_args(["--model_name", "x", "--nope", "3"]),
                         Problem("nope", "unknown option", "3", "option")),
        "group": (lambda: _class_parser(sft).parse_object({"model_name": "x", "optim": {"lrr": 1}}),
                  Problem("optim.lrr", "unknown option", kind="option")),
        "option": (lambda: _class_parser(sft).parse_object({"model_name": "x", "lrr": 1}),
                   Problem("lrr", "unknown option", kind="option")),
        "subcommand": (lambda: _subcommand_parser().parse_object({"fit": {"trainr": {"max_steps": 3}}}),
                       Problem("trainr.max_steps", "unknown option", kind="option")),
        "required": (lambda: _class_parser(sft).parse_args([]), Problem("model_name", "is required but not set")),
        "literals": (lambda: _parser(precision=typing.Literal[64, 32] | typing.Literal["bf16-true"] | None)
                     .parse_args(["--precision", "17"]), Problem("precision", "expected one of 64, 32, 'bf16-true'", "17")),
        "no-value": (lambda: _class_parser(sft).parse_args(["--model_name"]),
                     Problem("model_name", "expected one argument")),
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
