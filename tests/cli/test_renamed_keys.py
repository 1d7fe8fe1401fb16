"""Renamed and moved config keys (issue 38): each line of `RENAMED` stops the real CLI, before jsonargparse parses,
with one line naming the old key, the new one and where it was written (command line or the --config file); a key
under a moved group moves with it; a checkpoint saved before a rename compares under the new names on resume."""

import sys

import pytest

from rl_lightning.cli.main import main
from rl_lightning.cli.renamed_keys import RENAMED, find_renamed, new_key, rename_hparams, renamed_error

TABLE = {"model.model_name": "model.lm.name", "model.lora": "model.lm.lora", "model.rollout.seed": "seed_everything",
         "model.group": "model.group.kind"}


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])


def _cli_error(capsys, *args):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "recipes/sft.yaml", *args, "--print_config"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, lines[-5:]
    return lines[0].removeprefix("rl_lightning: error: ")


@pytest.mark.parametrize(("old", "new"), list(RENAMED.items()))
def test_every_renamed_key_gives_its_line_from_the_cli(old, new, capsys, tmp_path):
    assert _cli_error(capsys, f"--{old}", "1") == (f"{old} was renamed: write --{new} on the command line "
                                                   "(see docs/configuration.md)")
    top, *rest = old.split(".")
    nested: object = 1
    for part in reversed(rest):
        nested = {part: nested}
    overlay = tmp_path / "old.yaml"
    overlay.write_text(__import__("yaml").safe_dump({top: {"init_args": nested} if top == "model" else nested}))
    assert _cli_error(capsys, "--config", str(overlay)) == (f"{old} was renamed: write {new} in {overlay} "
                                                            "(see docs/configuration.md)")


def test_a_renamed_key_stops_the_cli_before_parsing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("rl_lightning.cli.renamed_keys.RENAMED", {"model.lora": "model.lm.lora",
                                                                   "model.old_name": "model.lm.name"})
    assert _cli_error(capsys, "--model.lora.r", "8") == ("model.lora.r was renamed: write --model.lm.lora.r on the "
                                                         "command line (see docs/configuration.md)")
    (tmp_path / "old.yaml").write_text("model:\n  init_args:\n    old_name: asset:tiny-qwen3\n")
    assert _cli_error(capsys, "--config", str(tmp_path / "old.yaml")) == (
        f"model.old_name was renamed: write model.lm.name in {tmp_path / 'old.yaml'} (see docs/configuration.md)")


def test_new_key_moves_keys_under_a_group_and_leaves_new_ones():
    assert new_key("model.model_name", TABLE) == "model.lm.name"
    assert new_key("model.lora.r", TABLE) == "model.lm.lora.r"
    assert new_key("model.lora_r", TABLE) is None  # a prefix of the name is not the group
    assert new_key("model.group", TABLE) == "model.group.kind"
    assert new_key("model.group.kind", TABLE) is None  # already written the new way
    assert new_key("model.lm.name", TABLE) is None


def test_find_renamed_walks_a_config_file_without_init_args():
    config = {"model": {"class_path": "SFT", "init_args": {"lora": {"r": 8}, "rollout": {"seed": 3, "n": 2}}},
              "trainer": {"max_steps": 1}}
    assert list(find_renamed(config, table=TABLE)) == [("model.lora", "model.lm.lora"),
                                                       ("model.rollout.seed", "seed_everything")]


def test_renamed_error_names_the_first_renamed_setting(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  rollout:\n    seed: 3\n")
    argv = ["fit", "--model.help", "SFT", "--config", str(tmp_path / "a.yaml"), "--model.model_name", "x"]
    assert renamed_error(argv, TABLE) == (f"model.rollout.seed was renamed: write seed_everything in "
                                          f"{tmp_path / 'a.yaml'} (see docs/configuration.md)")
    assert renamed_error(["fit", "--model.lm.name", "x", "--trainer.max_steps", "1"], TABLE) is None


def test_old_checkpoint_hparams_compare_under_the_new_names():
    stored = {"_class_path": "rl_lightning.tasks.sft.SFT", "model_name": "m", "lora": {"r": 8},
              "rollout": {"seed": 3, "n": 2}, "max_steps": 4}
    assert rename_hparams(stored, TABLE) == {"_class_path": "rl_lightning.tasks.sft.SFT",
                                             "lm": {"name": "m", "lora": {"r": 8}}, "rollout": {"n": 2},
                                             "max_steps": 4}


def test_a_checkpoint_saved_before_the_rename_resumes_as_the_same_run():
    """`check_resume` compares an old checkpoint's hyperparameters under the new names: same model, no difference;
    another model, named by its new key."""
    from rl_lightning.cli.resume_check import compare

    old = {"_class_path": "rl_lightning.tasks.ppo.PPO", "model_name": "m", "lora": None,
           "rollout": {"engine": "hf", "async_steps": 0, "filter_range": [0.0, 1.0]}}
    current = {"lm": {"name": "m", "lora": None}, "rollout": {"engine": "hf", "async_steps": 0},
               "dapo": {"filter_range": [0.0, 1.0]}}
    assert rename_hparams(old)["dapo"] == {"filter_range": [0.0, 1.0]}
    assert compare(rename_hparams(old), current, "PPO") == []
    assert compare(rename_hparams({**old, "model_name": "other"}), current, "PPO") == ["model.lm.name 'other' -> 'm'"]
