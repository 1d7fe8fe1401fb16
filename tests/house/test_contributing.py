"""docs/contributing.md's walkthroughs, done: each builds what its section describes, plugged in the documented way,
and checks it works (an environment adapter scores a trajectory, an advantage estimator gives its closed-form
advantages through the PPO task, a task fits a step on the tiny model). The engine walkthrough is checked by
tests/engines/test_registry.py."""

import math

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, REPO, TINY_MODEL
from helpers import Metrics, fit, ppo_task, prompts

from rl_lightning.algorithms import advantages as advantage_estimators
from rl_lightning.algorithms import sft_loss
from rl_lightning.algorithms.advantages import register_estimator
from rl_lightning.data import SFTDataModule
from rl_lightning.envs import adapters
from rl_lightning.envs.adapters import Adapter, register_adapter
from rl_lightning.envs.environment import load_environment
from rl_lightning.errors import ConfigError
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import target_logprobs
from rl_lightning.parallel.reductions import data_parallel_sum, process_groups

# ------------------------------------------------------------------------------ How to add an environment adapter


def build_echo(target: str, where: str) -> Adapter:
    """``echo:<word>``: component ``said`` 1 when the last assistant turn says the word, ``short`` 1 under 20
    characters; weights 1 and 0.5."""
    if not target:
        raise ConfigError(f"{where}: name the word to listen for, e.g. echo:hello")

    def reward_fn(messages, answer):
        text = messages[-1]["content"]
        return {"said": float(target in text), "short": float(len(text) < 20)}

    return Adapter(reward_fn, None, {"said": 1.0, "short": 0.5})


def test_an_environment_adapter_registered_from_a_module_scores_a_trajectory(monkeypatch):
    """``register_adapter("echo", build_echo)``, then ``env_path: echo:hello`` is an environment: a trajectory that
    says hello in 11 characters scores 1 x 1 + 0.5 x 1 = 1.5, one that says more than 20 without it 0."""
    monkeypatch.setattr(adapters, "ADAPTERS", dict(adapters.ADAPTERS))  # the registration ends with the test
    register_adapter("echo", build_echo)
    env = load_environment("echo:hello")
    said = [{"role": "user", "content": "greet me"}, {"role": "assistant", "content": "hello there"}]
    silent = [{"role": "user", "content": "greet me"}, {"role": "assistant", "content": "good morning to you all!"}]
    assert env.component_names == ["said", "short"]
    assert env.score_all([(said, None, "row 1"), (silent, None, "row 2")]) == [
        (1.5, {"said": 1.0, "short": 1.0}), (0.0, {"said": 0.0, "short": 0.0})]
    with pytest.raises(ConfigError, match="env_path='echo:': name the word"):
        load_environment("echo:")


# ------------------------------------------------------------------------------ How to add an advantage estimator


def centred(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards -> (B,) reward minus 0.5: a fixed baseline (closed form, for the test)."""
    return rewards - 0.5


def test_an_advantage_estimator_registered_by_name_trains_the_ppo_task(monkeypatch):
    """``register_estimator("centred", centred)``, then ``model.advantage_estimator: centred``: one GRPO rollout of
    the tiny model (2 prompts x 4 completions) logs train/advantage_mean = sum_i (r_i - 0.5) L_i / sum_i L_i, the
    estimator's value on each of trajectory i's L_i completion tokens."""
    monkeypatch.setattr(advantage_estimators, "OUTCOME_ESTIMATORS", dict(advantage_estimators.OUTCOME_ESTIMATORS))
    register_estimator("centred", centred)
    metrics, seen = Metrics(), []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.extend(batch["rollout"].trajectories)

    L.seed_everything(0)
    model = ppo_task(str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"), rollout={"reward_workers": 0},
                     advantage_estimator="centred", max_rollouts=1)
    fit(model, prompts(2), -1, [metrics, Record()])
    lengths = [sum(t.completion_mask) for t in seen]
    expected = sum((t.reward - 0.5) * n for t, n in zip(seen, lengths, strict=True)) / sum(lengths)
    assert len(seen) == 8 and metrics.history[0]["train/advantage_mean"] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="built in"):
        register_estimator("rloo", centred)


# ---------------------------------------------------------------------------------------------- How to add a task


class NextToken(L.LightningModule):
    """Mean token NLL of the assistant tokens: the walkthrough's task (an SFT in a few lines).

    Args:
        model_name: Hugging Face model folder or hub name.
        lr: AdamW's learning rate.
    """

    def __init__(self, model_name: str, lr: float = 1e-3) -> None:
        super().__init__()
        if not lr > 0:
            raise ConfigError(f"model.lr must be > 0, got {lr}; e.g. 1e-5")
        self.save_hyperparameters(logger=False)
        self.automatic_optimization = False  # one optimizer step per batch of micro-batches, normalised globally
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = load_causal_lm(self.hparams.model_name)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr)

    def training_step(self, batch, batch_idx):
        micro_batches = batch["micro_batches"]
        groups = process_groups(self.trainer)  # a real task builds them once, in setup
        num_tokens = data_parallel_sum(groups, sum(mb["target_mask"].sum() for mb in micro_batches))
        nll = torch.zeros(())
        for micro_batch in micro_batches:
            logprobs = target_logprobs(self.model, micro_batch)[0]
            loss, metrics = sft_loss(logprobs, micro_batch["target_mask"], num_tokens)
            self.manual_backward(loss)
            nll += metrics["nll_sum"].detach()
        optimizer = self.optimizers()
        optimizer.step()
        optimizer.zero_grad()
        self.log("train/loss", nll / num_tokens)


def test_a_task_built_as_the_walkthrough_says_fits_a_step_on_the_tiny_model():
    """NextToken on the demo SFT rows: one optimizer step, a finite loss near log(vocabulary) or below, the weights
    moved; a bad argument is one ConfigError naming the key."""
    metrics = Metrics()
    model = NextToken(str(TINY_MODEL))
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4,
                         max_length_per_device=512)
    fit(model, data, 1, [metrics])
    initial = load_causal_lm(str(TINY_MODEL)).state_dict()
    loss = float(metrics.history[0]["train/loss"])
    assert math.isfinite(loss) and 0 < loss < 1.5 * math.log(model.model.config.vocab_size)
    assert any(not torch.equal(v, initial[k]) for k, v in model.model.state_dict().items())
    with pytest.raises(ConfigError, match="model.lr must be > 0, got 0"):
        NextToken(str(TINY_MODEL), lr=0)
