"""The critic estimators beyond GAE in the PPO task (``vtrace``, ``retrace``, ``td_lambda``, ``nstep``): each loads
the critic, runs rollouts and moves the policy; with the HF engine (engine log-probs == trainer's, rho = 1) the
off-policy ones give GAE's advantages; they run from the CLI; bad settings stop at construction."""

import sys

import lightning as L
import pytest
import torch
from conftest import REPO
from helpers import Metrics, fit, ppo_task, prompts

from rl_lightning.cli.main import main
from rl_lightning.errors import ConfigError

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
NEW_ESTIMATORS = ("vtrace", "retrace", "td_lambda", "nstep")


class PolicyWatch(L.Callback):
    """The policy's parameters at the start and end of the run, and the no-grad policy forwards over packed rows."""

    def __init__(self):
        self.start, self.end, self.scoring_passes = {}, {}, 0

    def on_fit_start(self, trainer, pl_module):
        self.start = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

        def count(module, args, kwargs):
            if kwargs.get("attention_mask") is None and not torch.is_grad_enabled():  # not generation, not training
                self.scoring_passes += 1
        pl_module.model.register_forward_pre_hook(count, with_kwargs=True)

    def on_fit_end(self, trainer, pl_module):
        self.end = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}


def _ppo(rollouts=2, callbacks=(), **task_kwargs):
    L.seed_everything(0)
    model = ppo_task(ENV, max_rollouts=rollouts, **task_kwargs)
    fit(model, prompts(2), -1, callbacks)
    return model


@pytest.mark.parametrize("estimator", NEW_ESTIMATORS)
def test_each_critic_estimator_trains_the_critic_and_moves_the_policy(estimator):
    """Two rollouts of two minibatches: the critic is loaded and trained, the policy moves; the off-policy estimators
    need the trainer's log-probs before the first update, so every minibatch is scored (one no-grad pass each),
    the others leave the first minibatch's to its training forward."""
    watch, metrics = PolicyWatch(), Metrics()
    model = _ppo(callbacks=[watch, metrics], advantage_estimator=estimator, update_per_rollout=2, lam=0.9, nstep=3)
    assert model.critic is not None and model.rollouts == 2
    assert all(h["train/critic_grad_norm"] > 0 and h["train/grad_norm"] > 0 for h in metrics.history)
    assert max((watch.end[n] - p).abs().max() for n, p in watch.start.items()) > 0
    assert watch.scoring_passes == 2 * (2 if estimator in ("vtrace", "retrace") else 1)


def test_off_policy_estimators_with_equal_policies_give_gae_advantages():
    """The HF engine's log-probs are the trainer's (rho = 1): on the same seeded first rollout, V-trace and Retrace at
    lam = 1 (and TD(lambda)) give GAE's advantages and returns."""
    runs = {}
    for estimator in ("gae", "vtrace", "retrace", "td_lambda"):
        metrics = Metrics(["train/advantage_mean", "train/advantage_std", "train/returns"])
        _ppo(rollouts=1, callbacks=[metrics], advantage_estimator=estimator, vtrace_rho_bar=2.0)
        runs[estimator] = metrics.history[0]
    assert runs["gae"]["train/advantage_std"] > 1e-3  # non-trivial advantages
    for estimator, history in runs.items():
        for key, value in history.items():
            assert value == pytest.approx(runs["gae"][key], abs=1e-4), (estimator, key)  # rho = 1 up to ~1e-6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"vtrace_rho_bar": 0.5}, r"model.vtrace_c_bar=1.0 must be > 0 and <= model.vtrace_rho_bar=0.5 \(V-trace's "
                               r"truncation levels; 1.0 each is the paper's\)"),
     ({"vtrace_c_bar": 0.0}, r"model.vtrace_c_bar=0.0 must be > 0"),
     ({"nstep": 0}, "model.nstep must be >= 1, got 0")],
)
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ppo_task(ENV, **kwargs)


@pytest.mark.parametrize("estimator", NEW_ESTIMATORS)
def test_critic_estimators_from_the_cli(estimator, workdir, capsys, monkeypatch):
    """The GAE recipe with ``--model.advantage_estimator <estimator>`` and the HF engine: two rollouts, actor and
    critic."""
    monkeypatch.setattr(sys, "argv", ["rl_lightning"])  # LightningCLI warns when pytest's own argv is present
    main(["fit", "--config", "recipes/ppo.yaml", "--model.advantage_estimator", estimator, "--model.rollout.engine",
          "hf", "--model.max_rollouts", "2", "--model.freeze_steps", "0", "--model.vtrace_rho_bar", "2.0",
          "--model.rollout.max_new_tokens", "8", "--trainer.logger", "false", "--trainer.limit_val_batches", "0"])
    assert "finished: 2 rollouts" in capsys.readouterr().out
