"""Command-line mistakes (a typo, a bad value, a class that does not import) end in ONE line on stderr with exit status
2: the key as the user writes it, the value, where it was set, the closest valid key and the --help command to run.
And --help tells the truth: no --optimizer/--lr_scheduler, the task classes named, short class names accepted."""

import subprocess
import sys

import pytest
import yaml

import rl_lightning.data
import rl_lightning.tasks
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
