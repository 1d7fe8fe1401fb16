"""`update.update` drives plain parts (`Learner`): a tiny model, a torch AdamW and ``loss.backward`` step it without
any LightningModule, and the parameters after the step are those of the task-driven path in a fit."""

import copy

import lightning as L
import torch
from helpers import Metrics, run_ppo

from rl_lightning.memory.backoff import TokenBudget
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.optim import SkippedSteps, configure_adamw
from rl_lightning.parallel.reductions import Groups
from rl_lightning.tasks.ppo import ConstraintConfig, KLConfig, minibatches, scoring, update
from rl_lightning.tasks.ppo.config import make_controllers
from rl_lightning.tasks.ppo.losses import MicroBatchLosses
from rl_lightning.tasks.ppo.objective import PolicyObjective


class Recorder(L.Callback):
    """The policy's weights before the fit's first step and its first rollout."""

    def on_train_start(self, trainer, pl_module):
        self.initial = copy.deepcopy(pl_module.model.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollout = batch["rollout"]


def test_update_steps_plain_parts_as_the_task_does(parity_env):
    recorder, metrics = Recorder(), Metrics(["train/grad_norm", "train/policy_loss"])
    task, _ = run_ppo(parity_env, callbacks=[recorder, metrics])  # drgrpo, token_mean: one rollout, one step

    lm, cpu, groups = task.lm, torch.device("cpu"), Groups()
    model = load_causal_lm(lm.name, attn_implementation=lm.attn_implementation,
                           gradient_checkpointing=lm.gradient_checkpointing, lean_activations=lm.lean_activations)
    model.load_state_dict(recorder.initial)
    model.train()
    optimizer, schedule = configure_adamw(model, lm.optim, 1)
    rollout, temperature, pad = recorder.rollout, task.rollout_config.temperature, task.tokenizer.pad_token_id
    packed = minibatches.minibatches(rollout.trajectories, 1, 8192, pad, groups, cpu)
    scoring.score(packed, model, None, None, temperature, False, lm.lm_head_chunk)
    scoring.assign_advantages(groups, rollout, [mb for _, mbs in packed for mb in mbs], cpu, estimator="drgrpo",
                              critic=False, kl_reward_coef=None, kl_estimator="k3", gamma=1.0, lam=1.0, rho_bar=1.0,
                              c_bar=1.0, nstep=5)
    losses = MicroBatchLosses(model, PolicyObjective(), make_controllers(KLConfig(), ConstraintConfig(), 1),
                              temperature, lm.lm_head_chunk)
    learner = update.Learner(losses, [optimizer], [schedule["scheduler"]], lambda loss: loss.backward(), lm.optim,
                             SkippedSteps(), TokenBudget(8192), pad, groups, cpu)
    sums, logged = update.update(learner, rollout, packed, True, "token_mean",
                                 task.rollout_config.max_completion_tokens)

    assert float(logged["train/grad_norm"]) == metrics.history[0]["train/grad_norm"]
    assert float(sums["policy_loss"] / sums["tokens"]) == metrics.history[0]["train/policy_loss"]
    assert logged["train/oom_retries"] == 0.0 and logged["train/max_length_per_device"] == 8192.0
    trained = dict(task.model.named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, trained[name]), name
    assert any(not torch.equal(p, recorder.initial[n]) for n, p in model.named_parameters())  # it stepped
