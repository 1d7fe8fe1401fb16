"""The real LightningCLI: every recipe parses and instantiates, help documents every argument, overrides apply, and
bad input ends in one clear line."""

import dataclasses
import inspect
import json
import re
import subprocess
import sys
import typing

import pytest
import yaml
from conftest import REPO, TINY_MODEL
from helpers import parse_cli

from rl_lightning.cli.main import flatten_config, main
from rl_lightning.data import SFTDataModule
from rl_lightning.tasks import PPO, SFT


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])  # LightningCLI warns when pytest's own argv is present


RECIPES = sorted((REPO / "rl_lightning" / "recipes").rglob("*.yaml"))


def test_recipe_count():
    assert len(RECIPES) == 10, [r.name for r in RECIPES]  # raise with every recipe added; catches a broken glob


_cli = parse_cli


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_instantiates(recipe, workdir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].startswith("rl_lightning.tasks.")
    assert printed["seed_everything"] == 42
    cli = _cli(["--config", str(recipe)])
    assert cli.model.lm.name == cli.datamodule.hparams.tokenizer_name  # linked


def test_dotted_overrides_apply(workdir):
    cli = _cli(["--config", "recipes/sft.yaml", "--model.lm.optim.lr", "1e-5", "--trainer.max_steps", "5",
                "--data.max_length", "77", "--model.lm.name", str(TINY_MODEL)])
    assert cli.model.lm.optim.lr == 1e-5 and cli.model.lm.optim.warmup_steps == 5  # the rest of the recipe's group stays
    assert cli.trainer.max_steps == 5
    assert cli.datamodule.hparams.max_length == 77
    assert cli.datamodule.hparams.tokenizer_name == str(TINY_MODEL)  # linked from the override


def test_top_level_help_names_the_program_and_every_command():
    """``python -m rl_lightning --help`` (a real subprocess) is the entry a newcomer reads: it names the program as they
    type it and lists the commands that are not LightningCLI subcommands, each of which answers ``--help`` itself."""
    out = subprocess.run([sys.executable, "-m", "rl_lightning", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m rl_lightning <command> [options]\n")
    commands = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ") and line[2] != " "]
    assert commands == ["fit", "eval", "demo", "tune"]
    for command in ("demo", "eval", "tune"):
        sub = subprocess.run([sys.executable, "-m", "rl_lightning", command, "--help"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
        assert sub.returncode == 0 and "usage:" in sub.stdout, (command, sub.stderr[-500:])


@pytest.mark.parametrize(("flag", "cls"), [("--model.help", SFT), ("--model.help", PPO), ("--data.help", SFTDataModule)])
def test_help_documents_every_argument(flag, cls, capsys):
    """Every argument, and every field of an argument group (``model.lm.optim.lr``), is listed with its description."""
    with pytest.raises(SystemExit):
        main(["fit", flag, f"{cls.__module__}.{cls.__name__}"])
    text = capsys.readouterr().out
    prefix = flag.split(".")[0]
    def keys(name, hint):  # a group's fields, and the fields of a group inside it (model.lm.optim.lr)
        if not dataclasses.is_dataclass(hint):
            return [name]
        inner = typing.get_type_hints(hint)
        return [key for f in dataclasses.fields(hint) for key in keys(f"{name}.{f.name}", inner[f.name])]

    names, hints = [], typing.get_type_hints(cls.__init__)
    for name in inspect.signature(cls.__init__).parameters:
        if name != "self":
            names += keys(name, hints[name])
    assert len(names) >= 10
    for name in names:
        assert f"{prefix}.{name} " in text, name
    assert "(type: " in text and ("peak learning rate" in text or "conversations per optimizer step" in text)


def test_rollout_keys_override_from_the_command_line(workdir, tmp_path):
    """The task owns its rollout: any rollout key is a `--model.rollout.*` flag, and the task hands the Trainer a
    callback built from exactly those settings."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from rl_lightning.cli.outputs import RunOutputs
    from rl_lightning.rollout.callback import RolloutCallback
    from rl_lightning.tracking.export import HFExport

    env = tmp_path / "my_env.py"
    env.write_text("def reward_fn(messages, answer):\n    return 1.0\n")
    cli = _cli(["--config", "recipes/grpo.yaml", "--model.rollout.env_path", str(env), "--model.rollout.engine", "hf",
                "--model.rollout.responses_per_prompt", "3", "--model.rollout.temperature", "0.6"])
    callback, _monitor = cli.model.configure_callbacks()  # the rollout, then the reward-hacking monitor
    assert isinstance(callback, RolloutCallback) and callback.env.path == str(env)
    config = callback.config
    assert (config.engine.kind, config.responses_per_prompt, config.temperature) == ("hf", 3, 0.6)
    assert config.reward_weights == {"correct": 1.0, "format": 0.5}  # the recipe's other rollout keys stay
    # the run is named after the recipe and the settings the command line changed (MLflow's runs table, legends,
    # compare page); its output folder after the recipe only (made at setup: tests/test_cli_runs.py)
    assert cli.trainer.logger._run_name == "grpo env_path=my_env engine=hf responses_per_prompt=3 temperature=0.6"
    assert cli.trainer.logger._experiment_name == "rl_lightning/rl"
    (outputs,) = [c for c in cli.trainer.callbacks if isinstance(c, RunOutputs)]
    assert outputs.name == "grpo" and outputs.dirpath is None
    assert [c.dirpath for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint | HFExport)] == [None, None]


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["--trainer.max_steps", "5"], "PPO counts its run in rollouts: set model.max_rollouts instead of "
                                    "trainer.max_steps=5 (which counts optimizer steps"),
     (["--model.max_rollouts", "null", "--trainer.max_epochs", "-1"],
      "the run is unbounded (trainer.max_epochs=-1): set model.max_rollouts"),
     (["--model.rollout.responses_per_prompt", "1"], "model.advantage_estimator=drgrpo compares completions of a "
                                                     "prompt: set model.rollout.responses_per_prompt >= 2 (got 1)"),
     (["--model.aggregation", "token"], "model.aggregation must be one of token_mean, sequence_mean, token_sum, "
                                        "got 'token'")],
    ids=["max-steps", "unbounded", "group-of-one", "aggregation"],
)
def test_ppo_run_bounds_are_checked_at_start_up(args, expected, workdir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--trainer.logger", "false",
              *args])
    assert info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("rl_lightning: error: ") and expected in line, line


def test_flatten_config_drops_init_args():
    flat = flatten_config({"model": {"class_path": "a.B", "init_args": {"lm": {"optim": {"lr": 0.1,
                                                                                 "betas": [0.9, 0.95]}}}}})
    assert flat == {"model.class_path": "a.B", "model.lm.optim.lr": "0.1", "model.lm.optim.betas": "[0.9, 0.95]"}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


BAD_INPUTS = {
    "missing file": (lambda d: str(d / "nope.jsonl"), r"data file not found: '.*nope.jsonl'"),
    "unknown extension": (lambda d: str(d / "rl_lightning" / "recipes" / "sft.yaml"), r"unsupported data file extension '.yaml'"),
    "row missing messages": (lambda d: _write(d / "a.jsonl", [{"text": "hi"}]), r"a.jsonl line 1: missing 'messages'"),
    "unknown role": (
        lambda d: _write(d / "b.jsonl", [{"messages": [{"role": "assistant", "content": "a"}]},
                                         {"messages": [{"role": "robot", "content": "a"}]}]),
        r"b.jsonl line 2: messages\[0\] has unknown role 'robot'",
    ),
    "non-string content": (
        lambda d: _write(d / "c.jsonl", [{"messages": [{"role": "user", "content": ["q"]}]}]),
        r"c.jsonl line 1: messages\[0\] content must be a string, got list",
    ),
    "empty dataset": (lambda d: _write(d / "e.jsonl", []), r"dataset '.*e.jsonl' is empty"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_data_is_one_line_error(case, workdir, capsys):
    make_path, pattern = BAD_INPUTS[case]
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/sft.yaml", "--data.path", make_path(workdir), "--trainer.logger", "false"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("rl_lightning: error: ")
    assert re.search(pattern, lines[-1]), lines[-1]


def test_max_length_below_one_is_config_error(workdir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/sft.yaml", "--data.max_length", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rl_lightning: error: data.max_length must be >= 1, got 0"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data.path", "missing.jsonl"], "rl_lightning: error: data file not found: 'missing.jsonl'"),
        (["--model.lerning_rate", "1"], "lerning_rate"),
    ],
    ids=["missing-file", "unknown-key"],
)
def test_errors_from_a_real_process_have_no_traceback(args, expected, workdir):
    result = subprocess.run(
        [sys.executable, "-m", "rl_lightning", "fit", "--config", "recipes/sft.yaml", *args],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert expected in result.stderr


def test_parallel_strategy_from_the_command_line(workdir):
    from rl_lightning.parallel import ParallelStrategy

    cli = _cli(["--config", "recipes/sft.yaml", "--trainer.devices", "4",
                "--trainer.strategy", "rl_lightning.parallel.ParallelStrategy",
                "--trainer.strategy.data_parallel_size", "2", "--trainer.strategy.context_parallel_size", "2",
                "--trainer.strategy.cpu_offload", "true"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ParallelStrategy)
    assert (strategy.dp_size, strategy.cp_size, strategy.tp_size, strategy.cpu_offload) == (2, 2, 1, True)
