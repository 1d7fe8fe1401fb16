"""One seed: ``seed_everything`` drives the data order and every sampling seed of the rollouts. The CLI hands it to
the DataModule as a plain int (`rl_lightning.cli.run_seed`); the rollout callback takes it from there at setup;
nothing outside the CLI reads Lightning's ``PL_GLOBAL_SEED`` environment variable."""

import ast
import logging

import lightning as L
from conftest import REPO, TINY_MODEL
from helpers import fit, parse_cli, ppo_task, prompts

from rl_lightning.data.prompts import PromptBatches
from rl_lightning.engines.hf import HFEngine
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.rollout.callback import RolloutCallback

SMALL = ["--model.rollout.engine", "hf", "--model.rollout.responses_per_prompt", "2", "--data.batch_size", "2"]


def test_no_module_outside_the_cli_reads_the_seed_from_the_environment():
    """``PL_GLOBAL_SEED`` is Lightning's hidden global: the data order and the rollouts get the seed as an int."""
    readers = []
    for path in sorted((REPO / "rl_lightning").rglob("*.py")):
        if path.relative_to(REPO / "rl_lightning").parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "PL_GLOBAL_SEED":
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert readers == []


def test_seed_everything_reaches_the_datamodule(workdir, caplog):
    """``--seed_everything 7``: the DataModule's seed is 7. ``false``: one seed drawn at random, logged, handed on."""
    cli = parse_cli(["--config", "recipes/grpo.yaml", *SMALL, "--seed_everything", "7"])
    assert cli.datamodule.seed == 7
    with caplog.at_level(logging.WARNING, logger="rl_lightning.cli.run_seed"):
        cli = parse_cli(["--config", "recipes/grpo.yaml", *SMALL, "--seed_everything", "false"])
    drawn = cli.datamodule.seed
    assert isinstance(drawn, int) and f"seed_everything: {drawn} repeats them" in caplog.text


def test_the_data_order_and_the_sampling_seeds_follow_the_datamodules_seed():
    """A one-rollout GRPO fit (HF engine) whose DataModule has seed 7, as the CLI hands it: the batch is the seed-7
    permutation's first (not seed 8's), the callback took seed 7 at setup, and the completions are what the engine
    samples from the tiny model with the seed-7 sampling parameters."""
    env = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
    data = prompts(2, shuffle=True)
    data.seed = 7
    batches = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            batches.append(batch["rollout"].trajectories)

    model = ppo_task(env, rollout={"reward_workers": 0, "responses_per_prompt": 2, "max_new_tokens": 6},
                     max_rollouts=1)
    trainer = fit(model, data, -1, [Record()])
    (trajectories,) = batches
    seeded = [[p.index for p in b] for b in PromptBatches(data.prompts["train"], 2, 0, 1, True, seed=7)][0]
    other = [[p.index for p in b] for b in PromptBatches(data.prompts["train"], 2, 0, 1, True, seed=8)][0]
    assert [t.prompt.index for t in trajectories[::2]] == seeded != other
    callback = next(c for c in trainer.callbacks if isinstance(c, RolloutCallback))
    assert callback.seed == 7
    chosen = [t.prompt for t in trajectories[::2]]
    params = callback.sampling_params(0, chosen, data.tokenizer.eos_token_id)
    engine = HFEngine(load_causal_lm(str(TINY_MODEL)), data.tokenizer.pad_token_id)
    expected = [c.token_ids for group in engine.generate([p.prompt_ids for p in chosen], params) for c in group]
    assert [t.input_ids[len(t.prompt.prompt_ids):] for t in trajectories] == expected
