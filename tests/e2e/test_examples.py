"""The example environments and recipes: the calculator tool answers calls safely, and every example recipe parses
and instantiates with the real CLI."""

import pytest
from conftest import REPO

from rl_lightning.envs.environment import load_environment

DEMO = REPO / "rl_lightning" / "cli" / "demo.yaml"  # make demo's overlay on recipes/real/grpo.yaml (rl_lightning/cli/demo.py)
EXAMPLE_RECIPES = sorted(p for p in (REPO / "examples").rglob("*.yaml") if p.parent.name != "gpu" and p != DEMO)
GPU_SMOKE = REPO / "examples" / "gpu" / "smoke.yaml"  # an overlay on recipes/real/grpo.yaml (docs/gpu.md)


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
        assert cli.model.lm.name == cli.datamodule.hparams.tokenizer_name


def test_gpu_smoke_overlay_instantiates_on_the_real_recipe(workdir):
    """The GPU checklist's smoke command parses and builds (here with the CPU accelerator: the overlay's values, the
    strategy and the engine are what the GPU run gets)."""
    from helpers import parse_cli as _cli

    from rl_lightning.parallel import ParallelStrategy

    cli = _cli(["--config", "recipes/real/grpo.yaml", "--config", str(GPU_SMOKE), "--trainer.accelerator", "cpu"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ParallelStrategy)
    assert strategy.dp_size == 2
    assert strategy.mixed_precision == "bf16"
    rollout = cli.model.hparams.rollout  # as parsed: a dict of the rollout config's keys
    assert (rollout["engine"], cli.model.hparams.max_rollouts) == ("hf", 3)  # the overlay's shorthand
    assert cli.model.rollout_config.engine_spec.kind == "hf"  # the real recipe's vLLM group replaced whole
    assert cli.model.lm.name == "asset:SmolLM2-135M-Instruct"


def test_demo_overlay_instantiates_on_the_real_recipe(workdir):
    """``make demo``'s training command parses and builds with the overlay's values over the real recipe's."""
    from helpers import parse_cli as _cli

    cli = _cli(["--config", "recipes/real/grpo.yaml", "--config", str(DEMO)])
    hp = cli.model.hparams
    optim = hp.lm["optim"]  # as kept: plain data
    assert (hp.max_rollouts, hp.max_length_per_device, optim["lr"], optim["warmup_steps"]) == (10, 4096, 2e-5, 2)
    assert cli.datamodule.hparams.batch_size == 16 and cli.trainer.val_check_interval == 10
    # the recipe's reward, chosen on the panel (benchmarks/results/panel_cpu.md): correctness alone, no length
    # punishment, with the gate on for any shaping a user adds; the demo's 16 prompts x 4
    rollout = hp.rollout
    assert rollout["reward_weights"] == {"correct": 1.0, "format": 0.0} and hp.dapo["overlong_cache_length"] is None
    assert rollout["gate_shaping"] is True
    assert (rollout["responses_per_prompt"], rollout["max_new_tokens"], rollout["temperature"]) == (4, 32, 0.7)
    assert hp.lm["name"] == "asset:SmolLM2-135M-Instruct" and hp.rollout["engine"]["kind"] == "vllm"
