"""A run's name: its configs joined with ``+`` and the command line's settings as ``key=value`` (what MLflow's runs
table, chart legends and compare page show); its folder: the configs only."""

from __future__ import annotations

import pytest
from helpers import parse_cli

from rl_lightning.cli.run_names import command_line_settings, configs_name, recipe_name, run_name, show_value
from rl_lightning.tracking.lineage import model_name


@pytest.mark.parametrize(("path", "expected"), [("recipes/grpo.yaml", "grpo"), ("recipes/real/grpo.yaml", "real-grpo"),
                                                ("/x/recipes/real/grpo.yaml", "real-grpo"), ("rl_lightning/cli/demo.yaml", "demo"),
                                                ("my.yml", "my")])
def test_recipe_name(path, expected):
    assert recipe_name(path) == expected


def test_an_overlay_adds_to_the_name_instead_of_replacing_it():
    assert configs_name(["recipes/real/grpo.yaml", "rl_lightning/cli/demo.yaml"]) == "real-grpo+demo"


def test_command_line_settings_skip_the_configs_outputs_and_flags():
    argv = ["fit", "--config", "recipes/grpo.yaml", "--model.init_args.lm.optim.lr=2e-5", "--print_config",
            "--ckpt_path", "last", "--trainer.logger.init_args.run_id", "abc", "--trainer.max_steps", "3",
            "--trainer.devices", "2", "--trainer.precision", "bf16-true", "--data.batch_size", "4"]
    assert command_line_settings(argv) == [("model.lm.optim.lr", "2e-5"), ("trainer.precision", "bf16-true"),
                                           ("data.batch_size", "4")]


@pytest.mark.parametrize(("value", "expected"), [("2e-5", "2e-05"), ("0.0010", "0.001"), ("3", "3"), ("-2", "-2"),
                                                 ("hf", "hf"), ("data/my set.jsonl", "my set"), ("a/b/", "b"),
                                                 ("x" * 50, "x" * 39 + "…")])
def test_values_read_as_python_prints_numbers_and_paths_by_their_stem(value, expected):
    assert show_value(value) == expected


def test_two_runs_differing_in_lr_get_distinct_names_and_shared_keys_stay_whole():
    argv = ["fit", "--config", "recipes/grpo.yaml", "--model.lm.optim.lr", "1e-4"]
    assert run_name(["recipes/grpo.yaml"], argv) == "grpo lr=0.0001"
    assert run_name(["recipes/grpo.yaml"], [*argv[:-1], "2e-5"]) == "grpo lr=2e-05"
    both = ["--data.path", "a.jsonl", "--data.val_path", "b.jsonl", "--model.rollout.env_path", "e.py",
            "--model.lr", "1", "--model.critic.lr", "2"]
    assert run_name(["recipes/ppo.yaml"], both) == ("ppo path=a.jsonl val_path=b.jsonl env_path=e.py model.lr=1 "
                                                   "model.critic.lr=2")


def test_logged_model_names_drop_what_mlflow_refuses():
    assert model_name("grpo lr=0.001 path=a/b") == "grpo lr=0_001 path=a_b"
    assert model_name(None) == model_name("") == "model"


def test_the_cli_names_the_run_and_its_folder(tmp_path):
    from rl_lightning.cli.outputs import RunOutputs

    cli = parse_cli(["--config", "recipes/grpo.yaml", "--config", "rl_lightning/cli/demo.yaml", "--model.lm.optim.lr", "2e-5",
                     "--model.rollout.engine", "hf"])
    assert cli.trainer.logger._run_name == "grpo+demo lr=2e-05 engine=hf"
    (outputs,) = [c for c in cli.trainer.callbacks if isinstance(c, RunOutputs)]
    assert outputs.name == "grpo+demo"  # --ckpt_path last finds the same configs' latest run
    named = parse_cli(["--config", "recipes/grpo.yaml", "--trainer.logger.init_args.run_name", "mine",
                       "--model.rollout.engine", "hf"])
    assert named.trainer.logger._run_name == "mine"
