"""Bundled recipes by name (`rl_lightning.cli.recipes`), the package files they name
(`rl_lightning.assets.package_files`), and the old top-level ``callbacks.*`` paths (`rl_lightning.cli.moved_paths`)."""

import pytest

from rl_lightning.assets.package_files import PACKAGE, resolve_reference, shown_path
from rl_lightning.cli.moved_paths import find_moved
from rl_lightning.cli.recipes import find_config, recipe_names, resolve_config_args, resolve_references
from rl_lightning.errors import ConfigError

RECIPES = PACKAGE / "recipes"


@pytest.fixture
def empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_recipes_are_named_by_their_path_in_the_package():
    assert recipe_names() == ["dapo", "distill", "dpo", "grpo", "ppo", "real/dpo", "real/grpo", "real/sft", "rm",
                              "sft"]


@pytest.mark.parametrize("value", ["grpo", "grpo.yaml", "recipes/grpo.yaml", "rl_lightning/recipes/grpo.yaml"])
def test_a_recipe_name_or_its_repository_path_names_the_bundled_file(empty, value):
    assert find_config(value) == str(RECIPES / "grpo.yaml")
    assert find_config(value.replace("grpo", "real/grpo", 1)) == str(RECIPES / "real" / "grpo.yaml")


def test_the_users_own_file_wins(empty):
    (empty / "recipes").mkdir()
    for path in ("grpo.yaml", "recipes/grpo.yaml"):
        (empty / path).write_text("seed_everything: 1\n")
        assert find_config(path) == path
    assert find_config("grpo") == str(RECIPES / "grpo.yaml")  # no file called `grpo`: the bundled one


def test_an_unknown_name_is_one_line_naming_the_bundled_recipes(empty):
    assert find_config("my/missing.yaml") == "my/missing.yaml"  # a path: the parser says it does not exist
    with pytest.raises(ConfigError) as info:
        resolve_config_args(["fit", "--config", "gpro"])
    assert str(info.value) == ("config: no such file and no bundled recipe of that name (value 'gpro'); bundled "
                               "recipes: dapo, distill, dpo, grpo, ppo, real/dpo, real/grpo, real/sft, rm, sft, or give "
                               "the path of your own YAML file")


def test_config_arguments_are_resolved_in_both_spellings(empty):
    args = resolve_config_args(["fit", "--config", "real/grpo", "--config=rl_lightning/cli/demo.yaml", "--x", "grpo"])
    assert args == ["fit", "--config", str(RECIPES / "real" / "grpo.yaml"),
                    f"--config={PACKAGE / 'cli' / 'demo.yaml'}", "--x", "grpo"]


def test_package_paths_resolve_to_the_installed_files_unless_the_working_folder_has_them(empty):
    assert resolve_reference("rl_lightning/assets/tiny-qwen2") == str(PACKAGE / "assets" / "tiny-qwen2")
    assert resolve_reference("verifiers:rl_lightning/recipes/envs/verifiers_arithmetic.py") == (
        f"verifiers:{RECIPES / 'envs' / 'verifiers_arithmetic.py'}")
    for unchanged in ("rl_lightning/assets/no-such-model", "asset:SmolLM2-135M-Instruct", "my/data.jsonl",
                      "rl_lightning.tasks.PPO", "reasoning_gym:chain_sum"):
        assert resolve_reference(unchanged) == unchanged
    (empty / "rl_lightning" / "assets" / "data").mkdir(parents=True)
    (empty / "rl_lightning" / "assets" / "data" / "easy.jsonl").write_text("{}\n")
    assert resolve_reference("rl_lightning/assets/data/easy.jsonl") == "rl_lightning/assets/data/easy.jsonl"


def test_a_parsed_config_is_resolved_in_place_through_namespaces_and_lists(empty):
    from jsonargparse import Namespace

    config = Namespace(model=Namespace(init_args=Namespace(lm=Namespace(name="rl_lightning/assets/tiny-qwen2"), lr=0.1)),
                       trainer=Namespace(callbacks=[Namespace(init_args=Namespace(path="rl_lightning/cli/demo.yaml"))]),
                       data={"path": "rl_lightning/assets/data/easy.jsonl", "other": ["x"]})
    resolve_references(config)
    assert config.model.init_args.lm.name == str(PACKAGE / "assets" / "tiny-qwen2")
    assert config.model.init_args.lr == 0.1
    assert config.trainer.callbacks[0].init_args.path == str(PACKAGE / "cli" / "demo.yaml")
    assert config.data == {"path": str(PACKAGE / "assets" / "data" / "easy.jsonl"), "other": ["x"]}


def test_logs_show_bundled_files_from_the_package_not_the_machines_folders():
    assert shown_path(str(RECIPES / "real" / "grpo.yaml")) == "rl_lightning/recipes/real/grpo.yaml"
    assert shown_path("my.yaml") == "my.yaml"


def test_the_old_top_level_callbacks_name_their_new_path(empty):
    config = {"trainer": {"callbacks": [{"class_path": "callbacks.rollout_samples.RolloutSamples"},
                                        {"class_path": "rl_lightning.callbacks.memory_stats.MemoryStats"}]}}
    assert list(find_moved(config)) == [("trainer.callbacks[0].class_path", "callbacks.rollout_samples.RolloutSamples",
                                         "rl_lightning.callbacks.rollout_samples.RolloutSamples")]


def _forget_callbacks():
    import sys

    for name in [n for n in sys.modules if n == "callbacks" or n.startswith("callbacks.")]:
        del sys.modules[name]  # tests/callbacks/ is on the suite's path: a namespace package of that name


def test_a_users_own_callbacks_package_is_not_a_moved_path(empty, monkeypatch):
    (empty / "callbacks").mkdir()
    (empty / "callbacks" / "__init__.py").write_text("")
    (empty / "callbacks" / "mine.py").write_text("class Mine:\n    pass\n")
    monkeypatch.syspath_prepend(str(empty))
    _forget_callbacks()
    try:
        assert list(find_moved({"class_path": "callbacks.mine.Mine"})) == []
    finally:
        _forget_callbacks()


def test_lineage_names_the_bundled_files_by_their_package_path_not_this_machines(empty):
    """A bundled recipe run from any folder resolves its files to the installed package (an absolute path in a
    virtualenv); the lineage tags (and so the model card) show them as rl_lightning/..., with the real files' hashes."""
    import types

    from rl_lightning.tracking.lineage import collect, sha256

    data, env = PACKAGE / "assets" / "data" / "easy.jsonl", RECIPES / "envs" / "arithmetic.py"
    trainer = types.SimpleNamespace(callbacks=[], datamodule=types.SimpleNamespace(hparams={"path": str(data)}))
    module = types.SimpleNamespace(lm=types.SimpleNamespace(name=str(PACKAGE / "assets" / "tiny-qwen2-sft")),
                                   rollout_config=types.SimpleNamespace(env_path=str(env)))
    tags = collect(trainer, module)
    assert (tags["base_model"], tags["data"], tags["env"]) == ("rl_lightning/assets/tiny-qwen2-sft",
                                                               "rl_lightning/assets/data/easy.jsonl",
                                                               "rl_lightning/recipes/envs/arithmetic.py")
    assert tags["env_sha256"] == sha256(env) and len(tags["data_sha256"]) == 64


def test_tune_takes_bundled_recipes_by_name_too(empty):
    from rl_lightning.cli.tune import run

    with pytest.raises(ConfigError, match=r"no bundled recipe of that name \(value 'gpro'\); bundled recipes: dapo"):
        run(["--config", "gpro", "--search", "space.yaml"])


def test_a_folder_of_the_recipes_name_does_not_hide_it(empty):
    (empty / "grpo").mkdir()  # e.g. the user's own run folder
    assert find_config("grpo") == str(RECIPES / "grpo.yaml")
