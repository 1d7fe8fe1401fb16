"""PPO task with the HF rollout engine: the first update is on-policy (ratio 1), packing does not change the gradient,
and misconfiguration stops the run at start-up."""

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, REPO, TINY_MODEL, assert_close
from helpers import fit

from rl_lightning.data import PromptDataModule
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.callback import RolloutCallback
from rl_lightning.tasks import PPO

ENV = str(REPO / "examples" / "envs" / "arithmetic.py")


class Gradients(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()})


class Metrics(L.Callback):
    def __init__(self):
        self.history = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _ppo(model_kwargs=None, rollout_kwargs=None, batch_size=2, max_steps=1, callbacks=(), env=ENV):
    L.seed_everything(0)
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL),
                            batch_size=batch_size, shuffle=False)
    model = PPO(str(TINY_MODEL), lr=1e-3, max_grad_norm=0.0, **(model_kwargs or {}))
    rollout = RolloutCallback(env, **{"responses_per_prompt": 4, "max_new_tokens": 8, **(rollout_kwargs or {})})
    trainer = fit(model, data, max_steps, [rollout, *callbacks])
    return model, trainer


def test_first_update_is_on_policy_and_logs_rollout_metrics():
    metrics = Metrics()
    model, _ = _ppo(callbacks=[metrics], model_kwargs={"kl_coef": 0.1})
    first = metrics.history[0]
    assert first["train/clipped"] == 0.0 and abs(first["train/approx_kl"]) < 1e-6  # old == current policy
    assert abs(first["train/kl"]) < 1e-6  # policy == reference before the first step
    assert first["train/rollouts"] == 1.0 and model.rollouts == 1
    assert 1.0 <= first["train/completion_length"] <= 8.0 and first["train/entropy"] > 0


@pytest.mark.parametrize("budget", [4096, 160])
def test_packing_does_not_change_the_ppo_gradient(budget):
    """Same seeded rollouts, one micro-batch vs several: the first optimizer step's gradient is the same."""
    reference, other = Gradients(), Gradients()
    _ppo(model_kwargs={"max_length_per_device": 100_000}, callbacks=[reference])
    _ppo(model_kwargs={"max_length_per_device": budget}, callbacks=[other])
    for name, grad in reference.grads[0].items():
        assert_close(other.grads[0][name], grad, atol=1e-6)


@pytest.mark.parametrize(
    ("model_kwargs", "rollout_kwargs", "match"),
    [
        ({}, {"responses_per_prompt": 1}, "set the rollout callback's responses_per_prompt >= 2"),
        ({"update_per_rollout": 3}, {}, "model.update_per_rollout=3 must divide the 8 trajectories per rank"),
    ],
)
def test_misconfiguration_stops_at_start_up(model_kwargs, rollout_kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _ppo(model_kwargs, rollout_kwargs)


def test_bad_environment_and_estimator_fail_at_construction(tmp_path):
    with pytest.raises(ConfigError, match="env_path '.*nope.py' does not exist"):
        RolloutCallback(str(tmp_path / "nope.py"))
    with pytest.raises(ConfigError, match="max_turns=2 needs interact"):
        RolloutCallback(ENV, max_turns=2)
    with pytest.raises(ConfigError, match="model.advantage_estimator must be one of drgrpo, grpo, rloo, reinforce_pp, gae, got 'a2c'"):
        PPO(str(TINY_MODEL), advantage_estimator="a2c")


def test_rewards_and_advantages_are_zero_mean_per_group():
    model = PPO(str(TINY_MODEL))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    advantages = model.advantages(rewards, 4)
    assert advantages.view(2, 4).sum(1).abs().max() < 1e-6 and advantages[4:].abs().max() == 0


def test_gae_critic_trains_and_its_value_loss_falls():
    """Critic warm-up (`freeze_steps`) then joint training: the actor does not move while frozen, the value loss
    falls over rollouts, and GAE advantages with gamma = lambda = 1 equal return - value on the first update."""
    metrics = Metrics()
    model, _ = _ppo(model_kwargs={"advantage_estimator": "gae", "freeze_steps": 2, "critic_lr": 2e-4,
                                  "gamma": 1.0, "lam": 1.0}, batch_size=2, max_steps=12, callbacks=[metrics])
    history = metrics.history
    # trainer.global_step counts optimizer steps: 1 per frozen rollout (critic), then 2 (actor + critic): 12 = 2 + 5 x 2
    assert len(history) == 7 and model.critic is not None
    assert history[0]["train/grad_norm"] == 0.0 and history[1]["train/grad_norm"] == 0.0  # frozen actor
    assert history[2]["train/grad_norm"] > 0.0
    losses = [h["train/value_loss"] for h in history]
    # Per-rollout values are noisy (fresh samples every rollout): compare the means of the first and last three.
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses


PARITY_ENV = '''
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)
'''


def _parity_run(tmp_path, **rollout_kwargs):
    env = tmp_path / "parity.py"
    env.write_text(PARITY_ENV)
    metrics, captured = Metrics(), []

    class Capture(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            captured.append(batch["trajectories"])

    L.seed_everything(0)
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4,
                            shuffle=False)
    model = PPO(str(TINY_MODEL), lr=1e-3, update_per_rollout=2)
    rollout = RolloutCallback(str(env), responses_per_prompt=2, max_new_tokens=6, **rollout_kwargs)
    fit(model, data, 4, [rollout, Capture(), metrics])
    return rollout, metrics, captured


def test_dapo_dynamic_sampling_keeps_only_informative_groups_and_refills(tmp_path):
    """Reward = completion-length parity: groups whose two completions agree carry no signal and are dropped, then
    refilled from fresh prompts (the refill rounds are counted and logged)."""
    rollout, metrics, captured = _parity_run(tmp_path, filter_range=(0.0, 1.0), max_refill_rounds=8)
    assert rollout.refills > 0 and metrics.history[-1]["train/refills"] == rollout.refills
    for trajectories in captured:
        assert 0 < len(trajectories) <= 8 and len(trajectories) % 2 == 0
        for i in range(0, len(trajectories), 2):
            assert trajectories[i].reward != trajectories[i + 1].reward


def test_overlong_shaping_and_truncation_masking(tmp_path):
    """max_new_tokens 6, cache 2: completions of 5 and 6 tokens lose 0.5 and 1; truncated ones leave the loss."""
    _, _, captured = _parity_run(tmp_path, overlong_cache_length=2)
    lengths = {t.completion_length for ts in captured for t in ts}
    assert max(lengths) == 6  # some completions were cut at max_new_tokens
    for t in (t for ts in captured for t in ts):
        penalty = max(0.0, (t.completion_length - 4) / 2)
        assert t.reward + penalty in (0.0, 1.0)
    _, _, captured = _parity_run(tmp_path, mask_truncated=True)
    for t in (t for ts in captured for t in ts):
        assert t.finished or t.completion_length == 0


def test_kl_controller_moves_the_coefficient_by_its_rule(tmp_path):
    """Linear controller: coef_{k+1} = coef_k + rate * (measured KL_k - target), applied after each rollout; the first
    rollout's KL is 0 (policy == reference), so the coefficient first moves by -rate * target. (A reward with variance,
    completion-length parity, so the policy actually moves away from the reference.)"""
    env = tmp_path / "parity.py"
    env.write_text(PARITY_ENV)
    metrics = Metrics()
    _ppo(model_kwargs={"kl_coef": 0.1, "kl_controller": "linear", "kl_target": 0.001, "kl_rate": 2.0},
         max_steps=3, callbacks=[metrics], env=str(env))
    coefs = [h["train/kl_coef"] for h in metrics.history]
    kls = [h["train/kl"] for h in metrics.history]
    assert coefs[0] == pytest.approx(0.1 + 2.0 * (kls[0] - 0.001))
    for k in (1, 2):
        assert coefs[k] == pytest.approx(max(0.0, coefs[k - 1] + 2.0 * (kls[k] - 0.001)), rel=1e-5)
    assert kls[2] > 0
    with pytest.raises(ConfigError, match="model.kl_controller must be one of fixed, adaptive, linear, pid, scheduled"):
        PPO(str(TINY_MODEL), kl_controller="magic")
