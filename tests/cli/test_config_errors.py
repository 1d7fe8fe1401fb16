"""Command-line mistakes (a typo, a bad value, a class that does not import) end in ONE line on stderr with exit status
2: the key as the user writes it, the value, where it was set, the closest valid key and the --help command to run.
And --help tells the truth: no --optimizer/--lr_scheduler, the task classes named, short class names accepted.
How jsonargparse's messages are read (the text fallback and its shapes) is in test_config_error_messages.py."""

import subprocess
import sys

import pytest
import yaml
from conftest import REPO

import rl_lightning.data
import rl_lightning.tasks
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
    "typo": (["--model.lrr", "1"], "model.lrr: not an option of SFT", "'1'", "model.lm.optim.lr", HELP_SFT),
    "typo-in-group": (["--model.lm.optim.lrr", "1"], "model.lm.optim.lrr: not an option of SFT", "'1'", "model.lm.optim.lr",
                      HELP_SFT),
    "bad-value": (["--model.lm.optim.lr", "abc"], "model.lm.optim.lr: expected float", "'abc'", None, HELP_SFT),
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
    "typo-in-group": ({"model": {"init_args": {"lm": {"optim": {"lrr": 1}}}}}, "model.lm.optim.lrr: not an option of SFT",
                      "value 1", "model.lm.optim.lr", HELP_SFT),
    "bad-value": ({"model": {"init_args": {"lm": {"optim": {"lr": "abc"}}}}}, "model.lm.optim.lr: expected float",
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
    assert lines == [f"rl_lightning: error: model.lm.name: is required but not set — see {HELP_SFT}"]


def test_typo_from_a_real_process_is_one_line(workdir):
    result = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/sft.yaml", "--model.lrr", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "usage:" not in result.stderr and "Traceback" not in result.stderr, lines[:5]
    assert lines[0] == ("rl_lightning: error: model.lrr: not an option of SFT (value '1' on the command line); "
                        f"did you mean 'model.lm.optim.lr'? — see {HELP_SFT}")


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
    assert f"{flag.removesuffix('.help')}.lm.name " in outputs[0] or "--data.path " in outputs[0]


def test_model_help_shows_the_groups(capsys):
    """``--model.help PPO`` lists PPO's keys by group, each group under its own heading: the model (``model.lm``,
    ``model.lm.optim``), the rollout, DAPO, the KL term."""
    with pytest.raises(SystemExit) as info:
        main(["fit", "--model.help", "PPO"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    for group, key in [("model.lm.*", "--model.lm.name "), ("model.lm.optim.*", "--model.lm.optim.lr "),
                       ("model.rollout.*", "--model.rollout.responses_per_prompt "),
                       ("model.dapo.*", "--model.dapo.filter_range "), ("model.kl.*", "--model.kl.coef ")]:
        assert any(f"``{group}``" in heading for heading in headings) or f"``{group}``" in out, group
        assert key in out, key
    at = {key: out.index(key) for key in ("--model.lm.name ", "--model.dapo.filter_range ", "--model.kl.coef ")}
    assert "--model.model_name" not in out and "--model.rollout.filter_range" not in out  # the old places are gone
    assert len(set(at.values())) == 3


def test_short_class_path_in_yaml_resolves(workdir, capsys):
    (workdir / "short.yaml").write_text("model:\n  class_path: DPO\n  init_args:\n    lm:\n      name: tiny\n"
                                        "data:\n  class_path: PreferenceDataModule\n  init_args:\n    path: x.jsonl\n")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "short.yaml", "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "rl_lightning.tasks.DPO"
    assert printed["data"]["class_path"] == "rl_lightning.data.PreferenceDataModule"
    assert printed["model"]["init_args"]["lm"]["name"] == "tiny"


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


@pytest.mark.parametrize("recipe", sorted(str(p.relative_to(REPO)) for p in (REPO / "rl_lightning" / "recipes").rglob("*.yaml")))
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
        (["--model.lm.name"], "model.lm.name: expected one argument (on the command line)"),
        (["--config", "nested.yaml"], "model.lm.lora.rr: not an option of LoRAConfig (value 4 in nested.yaml); did you "
                                      "mean 'model.lm.lora.r'?"),
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
    (workdir / "nested.yaml").write_text("model:\n  init_args:\n    lm:\n      lora:\n        rr: 4\n")
    (workdir / "callback.yaml").write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks."
                                           "EarlyStopping\n      init_args:\n        monitr: x\n")
    calls = _without_message_text(monkeypatch)
    line = _error_line(args, capsys)
    assert line.startswith(f"rl_lightning: error: {expected} — see `"), line
    assert calls == []
