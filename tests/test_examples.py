"""The example environments and recipes: the calculator tool answers calls safely, and every example recipe parses
and instantiates with the real CLI."""

import pytest
from conftest import REPO

from rl_lightning.rollout.env import load_environment

EXAMPLE_RECIPES = sorted((REPO / "examples").rglob("*.yaml"))


@pytest.fixture(scope="module")
def calculator():
    return load_environment(str(REPO / "examples" / "calculator" / "env.py"))


def test_calculator_tool(calculator):
    said = lambda text: [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]  # noqa: E731
    assert calculator.interact(said("let me check <calc>12 * (3 + 4)</calc>")) == [{"role": "tool", "content": "84"}]
    assert calculator.interact(said("<calc>7 / 2</calc>"))[0]["content"] == "3.5"
    assert calculator.interact(said("<calc>__import__('os')</calc>"))[0]["content"].startswith("error: only numbers")
    assert calculator.interact(said("<calc>1 / 0</calc>"))[0]["content"].startswith("error:")
    assert calculator.interact(said("The answer is 84")) == []
    assert calculator.score(said(r"\boxed{84}"), "84", "row 1")[0] == 1.0


def test_example_recipes_instantiate(workdir):
    from helpers import parse_cli as _cli

    assert len(EXAMPLE_RECIPES) == 1, EXAMPLE_RECIPES
    for recipe in EXAMPLE_RECIPES:
        cli = _cli(["--config", str(recipe)])
        assert cli.model.hparams.model_name == cli.datamodule.hparams.tokenizer_name
