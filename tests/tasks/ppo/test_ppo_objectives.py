"""PPO objectives beyond the clipped surrogate, checked inside real training runs against closed forms: reward-type KL
(advantages gain the reward-to-go of -coef x KL_t), REINFORCE++ global whitening, Lagrangian multipliers' dual ascent,
multi-component rewards' logging, and the greedy held-out validation reward."""

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, PARITY_ENV, TINY_MODEL
from helpers import Metrics, fit, ppo_task, prompts
from lightning.pytorch.loggers import Logger

from rl_lightning.algorithms import KL_ESTIMATORS, group_advantages
from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.envs.environment import load_environment
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.rollout.trajectory import rollout
from rl_lightning.tasks import PPO

# Two graded components (so rewards vary with the text and means are informative): completion length and a checksum.
COMPONENT_ENV = """
def reward_fn(messages, answer):
    text = messages[-1]["content"]
    return {"length": len(text) / 8.0, "checksum": (sum(map(ord, text)) % 13) / 13}
"""


class Captured(PPO):
    """Keeps every rollout's trajectories and micro-batches (the dicts the loss reads, advantages assigned)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captured = []

    def assign_advantages(self, rollout, micro_batches):
        sums = super().assign_advantages(rollout, micro_batches)
        self.captured.append((rollout.trajectories, micro_batches))
        return sums


def _run(tmp_path, task_kwargs, rollouts=2, rollout_kwargs=None, env_source=PARITY_ENV, callbacks=()):
    env = tmp_path / "env.py"
    env.write_text(env_source)
    L.seed_everything(0)
    model = ppo_task(env, rollout=rollout_kwargs, task_class=Captured, max_rollouts=rollouts, **task_kwargs)
    fit(model, prompts(2), -1, callbacks)
    return model


def _sequences(mb):
    """(sequence id, completion-token positions) of a packed micro-batch (1, N)."""
    mask = mb["target_mask"][0] > 0
    for s in range(int(mb["num_sequences"])):
        idx = ((mb["seq_index"][0] == s) & mask).nonzero().flatten()
        if len(idx):
            yield s, idx


def test_reward_type_kl_adds_the_reward_to_go_of_the_penalty(tmp_path):
    """kl_type: reward: A_t = A_group - coef * sum_{k >= t} KL_k(old || ref). On the second rollout the policy has
    moved, so the penalty is non-zero; the loss does not carry the KL term itself."""
    metrics = Metrics()
    model = _run(tmp_path, {"kl": {"coef": 0.5, "type": "reward", "estimator": "k1"}, "optim": {"lr": 5e-3}},
                 callbacks=[metrics])
    trajectories, micro_batches = model.captured[1]
    group_values = group_advantages(torch.tensor([t.reward for t in trajectories]), 4).tolist()
    checked = 0
    for mb in micro_batches:
        kl = KL_ESTIMATORS["k1"](mb["old_logprobs"], mb["ref_logprobs"])[0]
        for _, idx in _sequences(mb):
            to_go = torch.flip(torch.cumsum(torch.flip(kl[idx], [0]), 0), [0])
            base = mb["advantages"][0, idx] + 0.5 * to_go  # must be this sequence's group advantage
            assert torch.allclose(base, base[0].expand_as(base), atol=1e-5)
            assert min(abs(float(base[0]) - g) for g in group_values) < 1e-5
            checked += float(to_go.abs().max() > 1e-4)
    assert checked > 0  # the penalty really was non-zero somewhere
    assert metrics.history[1]["train/kl"] > 0


def test_reinforce_pp_whitens_advantages_over_all_tokens(tmp_path):
    """reinforce_pp: every completion token of trajectory i gets (R_i - mu) / sigma, with mu, sigma the token-weighted
    mean and (population) std of the rewards over the rollout."""
    model = _run(tmp_path, {"advantage_estimator": "reinforce_pp", "update_per_rollout": 2}, rollouts=1)
    trajectories, micro_batches = model.captured[0]
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    lengths = torch.tensor([t.completion_length for t in trajectories], dtype=torch.float64)
    mu = (rewards * lengths).sum() / lengths.sum()
    sigma = ((rewards - mu) ** 2 * lengths).sum().div(lengths.sum()).sqrt()
    assert sigma > 0
    expected = ((rewards - mu) / (sigma + 1e-8)).tolist()
    tokens = []
    assert len(micro_batches) >= 2  # two minibatches: the whitening spans the whole rollout, not each minibatch
    for mb in micro_batches:
        for _, idx in _sequences(mb):
            values = mb["advantages"][0, idx]
            assert torch.allclose(values, values[0].expand_as(values), atol=1e-6)
            assert min(abs(float(values[0]) - e) for e in expected) < 1e-5
            tokens.append(values)
    tokens = torch.cat(tokens)
    assert abs(float(tokens.mean())) < 1e-5 and abs(float(tokens.std(unbiased=False)) - 1) < 1e-4


def test_lagrangian_multipliers_follow_dual_ascent(tmp_path):
    """log lambda_{k+1} = log lambda_k + lr * lambda_k * g_k with g = target - entropy (entropy floor) and
    g = KL - kl_max (KL ceiling), from the rollout's measured per-token means."""
    metrics = Metrics()
    _run(tmp_path, {"constraints": {"entropy_min": 10.0, "kl_max": 0.05, "multiplier_lr": 0.5,
                                    "multiplier_init": 0.2}}, rollouts=3, callbacks=[metrics])
    history = metrics.history
    for name, violation in (("entropy", lambda h: 10.0 - h["train/entropy"]),
                            ("kl", lambda h: h["train/kl"] - 0.05)):
        previous = 0.2
        for h in history:
            expected = previous * torch.exp(torch.tensor(0.5 * previous * violation(h))).item()
            assert h[f"train/{name}_multiplier"] == pytest.approx(expected, rel=1e-5)
            previous = h[f"train/{name}_multiplier"]
    # the entropy floor (10 nats > log(vocab)) is always violated: its multiplier only grows; KL starts below its cap
    assert history[0]["train/entropy_multiplier"] > 0.2 and history[0]["train/kl_multiplier"] < 0.2


def test_reward_components_are_logged_and_combined(tmp_path):
    """train/reward = sum_k w_k train/reward/<k> (a weighted sum is linear, so it holds for the means)."""
    metrics = Metrics()
    _run(tmp_path, {}, rollouts=2, env_source=COMPONENT_ENV, callbacks=[metrics],
         rollout_kwargs={"reward_weights": {"length": 1.0, "checksum": 0.25}})
    for h in metrics.history:
        assert h["train/reward"] == pytest.approx(h["train/reward/length"] + 0.25 * h["train/reward/checksum"], rel=1e-5)
        assert h["train/reward/length"] > 0


class CaptureLogger(Logger):
    def __init__(self):
        super().__init__()
        self.logged = []

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def _val_reward(model, tokenizer, prompts, env, temperature, n):
    from rl_lightning.engines.protocol import derive_seed
    from rl_lightning.rollout.callback import VALIDATION

    params = SamplingParams(n=n, temperature=temperature, max_new_tokens=8, stop_token_ids=[tokenizer.eos_token_id],
                            seeds=[derive_seed(0, VALIDATION, p.index) for p in prompts])  # the callback's (seed 0)
    trajectories = rollout(HFEngine(model, tokenizer.pad_token_id), prompts, env, tokenizer, params)
    return sum(t.reward for t in trajectories) / len(trajectories)


@pytest.mark.parametrize(("temperature", "n"), [(0.0, 1), (1.0, 3)], ids=["greedy", "sampled"])
def test_validation_scores_completions_of_held_out_prompts(tmp_path, temperature, n):
    """val/reward is the mean reward of the completions of the held-out prompts (greedy, or n seeded samples): at
    step 0 (sanity check over the whole set, logged directly) it equals an independent scoring of the initial model,
    and after training the same scoring of the trained policy."""
    env_path = tmp_path / "env.py"
    env_path.write_text(COMPONENT_ENV)
    weights = {"length": 1.0, "checksum": 0.25}
    L.seed_everything(0)
    data = prompts(2, val_path=str(DEMO_DATA / "arithmetic_test.jsonl"))
    model = ppo_task(env_path, optim={"lr": 5e-3}, max_rollouts=2, rollout={
        "reward_weights": weights, "val_temperature": temperature, "val_responses_per_prompt": n})
    logger = CaptureLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=3,
                        num_sanity_val_steps=3, val_check_interval=2)
    trainer.fit(model, datamodule=data)
    env = load_environment(str(env_path), weights=weights)
    held_out = data.prompts["val"][:6]  # 3 batches of 2, unshuffled
    initial = _val_reward(load_causal_lm(str(TINY_MODEL)), model.tokenizer, held_out, env, temperature, n)
    trained = _val_reward(model.model, model.tokenizer, held_out, env, temperature, n)
    validations = [(step, m) for step, m in logger.logged if "val/reward" in m]
    assert [step for step, _ in validations] == [0, 1]  # sanity check at step 0, then after 2 optimizer steps
    assert validations[0][1]["val/reward"] == pytest.approx(initial, abs=1e-6)
    assert validations[1][1]["val/reward"] == pytest.approx(trained, abs=1e-6)
    assert initial != trained  # training moved the greedy completions
    assert "val/reward/checksum" in validations[1][1]
