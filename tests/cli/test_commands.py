"""The ``rl-lightning`` / ``python -m rl_lightning`` dispatcher (`rl_lightning.cli.commands`): the overview, and help
that loads no training stack."""

import subprocess
import sys

import pytest

from rl_lightning.cli import commands
from rl_lightning.cli.eval import command
from rl_lightning.cli.recipes import recipe_names

# Runs `python -m rl_lightning <args>` in this interpreter and prints which heavy packages it imported.
IMPORTED = """
import runpy, sys
sys.argv = ["rl_lightning", *sys.argv[1:]]
try:
    runpy.run_module("rl_lightning", run_name="__main__")
except SystemExit:
    pass
print(sorted(m for m in ("torch", "lightning", "transformers", "vllm", "mlflow") if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["eval", "--help"], ["demo", "--help"], []])
def test_help_imports_no_training_stack(args):
    done = subprocess.run([sys.executable, "-c", IMPORTED, *args], capture_output=True, text=True, timeout=120)
    assert done.stderr.splitlines()[-1] == "[]", done.stderr[-2000:]
    if args == ["--help"]:
        assert done.stdout == commands.overview()
    elif args:
        assert done.stdout.startswith(f"usage: python -m rl_lightning {args[0]}")
    else:  # no command: the overview on stderr
        assert done.stderr.startswith("usage: python -m rl_lightning <command>")


def test_the_overview_names_the_commands_and_the_bundled_recipes(capsys):
    with pytest.raises(SystemExit) as info:
        commands.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")] == [
        "fit", "eval", "demo", "tune"]
    assert ", ".join(recipe_names()) in out.replace("\n         ", " ")
    commands.main(["--version"])
    assert capsys.readouterr().out == "rl_lightning 0.1.0\n"


def test_the_eval_commands_engines_are_the_evaluations():
    from rl_lightning.cli.eval.evaluate import ENGINES

    assert command.ENGINES == ENGINES


def test_eval_names_the_packages_own_files_from_any_folder(tmp_path, monkeypatch):
    from rl_lightning.assets.package_files import PACKAGE

    monkeypatch.chdir(tmp_path)
    args = command.parse(["--model", "rl_lightning/assets/tiny-qwen2-sft", "--data", "rl_lightning/assets/data/"
                          "easy_test.jsonl", "--env", "rl_lightning/recipes/envs/arithmetic.py"])
    assert (args.model, args.data, args.env) == (str(PACKAGE / "assets" / "tiny-qwen2-sft"),
                                                 str(PACKAGE / "assets" / "data" / "easy_test.jsonl"),
                                                 str(PACKAGE / "recipes" / "envs" / "arithmetic.py"))
    assert command.parse(["--model", "asset:SmolLM2-135M-Instruct", "--data", "my.jsonl"]).env is None
