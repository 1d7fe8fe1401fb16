"""PPO task with the HF rollout engine: the first update is on-policy (ratio 1), packing does not change the gradient,
log-probabilities are recomputed at the rollout's temperature, the run is counted in rollouts (schedules too), and
misconfiguration stops the run at start-up."""

import types
from unittest import mock

import lightning as L
import pytest
import torch
from conftest import REPO, TINY_MODEL, assert_close
from helpers import GradientRecorder, Metrics, fit, ppo_task, prompts, run_ppo

from rl_lightning.errors import ConfigError
from rl_lightning.models.optim import lr_factor
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.rollout.callback import RolloutConfig
from rl_lightning.tasks import PPO

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
_ppo = run_ppo  # env defaults to ENV, the arithmetic example


def test_first_update_is_on_policy_and_logs_rollout_metrics():
    metrics = Metrics()
    model, trainer = _ppo(callbacks=[metrics], kl={"coef": 0.1})
    first = metrics.history[0]
    assert first["train/clipped"] == 0.0 and abs(first["train/approx_kl"]) < 1e-6  # old == current policy
    assert abs(first["train/kl"]) < 1e-6  # policy == reference before the first step
    assert first["train/rollouts"] == 1.0 and model.rollouts == 1 and trainer.global_step == 1
    assert 1.0 <= first["train/completion_length"] <= 8.0 and first["train/entropy"] > 0
    assert first["train/micro_batches"] == 1.0


def test_the_trainer_recomputes_log_probs_at_the_rollout_temperature(parity_env):
    """One source of truth for the temperature (model.rollout.temperature): the engine's log-probabilities of the
    sampled tokens equal the trainer's old log-probabilities, so TIS weights are 1 and the first update is on-policy.
    (Before, the task had its own `temperature`, and a recipe setting only the callback's got 1.0 here.)"""
    metrics = Metrics()
    _ppo(parity_env, rollouts=2, callbacks=[metrics], rollout={"temperature": 0.6}, correction={"high": 2.0})
    for h in metrics.history:
        assert h["train/engine_logprob_diff"] < 1e-5, metrics.history
    assert metrics.history[0]["train/clipped"] == 0.0 and metrics.history[0]["train/approx_kl"] < 1e-7


class ForwardCounter(L.Callback):
    """Counts the policy's forward passes over packed training rows (generation passes carry an attention mask),
    split by whether they record gradients."""

    def __init__(self):
        self.counts = {True: 0, False: 0}

    def on_fit_start(self, trainer, pl_module):
        def count(module, args, kwargs):
            if kwargs.get("attention_mask") is None:
                self.counts[torch.is_grad_enabled()] += 1
        pl_module.model.register_forward_pre_hook(count, with_kwargs=True)


@pytest.mark.parametrize("updates", [1, 2])
def test_the_first_minibatch_takes_its_old_log_probs_from_its_training_forward(parity_env, updates):
    """Nothing moves the policy between sampling and the first minibatch's update, so its training forward's
    detached log-probabilities are the sampling policy's: the extra no-grad pass runs only for later minibatches
    (none with one update per rollout). They equal the engine's (reused or recomputed), and the second minibatch is
    off-policy."""
    counter, metrics = ForwardCounter(), Metrics()
    _ppo(parity_env, batch_size=4, callbacks=[counter, metrics], update_per_rollout=updates, correction={"high": 2.0},
         optim={"lr": 1e-2})
    steps = metrics.history[0]["train/micro_batches"]  # one per minibatch here
    assert steps == updates and counter.counts == {True: updates, False: updates - 1}
    assert metrics.history[0]["train/engine_logprob_diff"] < 1e-5
    if updates == 2:
        assert metrics.history[0]["train/approx_kl"] > 1e-7  # the second minibatch's old policy is the sampler


@pytest.mark.parametrize("budget", [160, 320])
def test_packing_does_not_change_the_ppo_gradient(budget):
    """Same seeded rollouts, one micro-batch vs several: the first optimizer step's gradient is the same."""
    reference, other = GradientRecorder(), GradientRecorder()
    one, several = Metrics(["train/micro_batches"]), Metrics(["train/micro_batches"])
    _ppo(max_length_per_device=100_000, callbacks=[reference, one])
    _ppo(max_length_per_device=budget, callbacks=[other, several])
    assert one.history[0]["train/micro_batches"] == 1 and several.history[0]["train/micro_batches"] >= 2
    for name, grad in reference.grads[0].items():
        assert_close(other.grads[0][name], grad, atol=1e-6)


def test_learning_rate_schedules_span_the_run_in_rollouts():
    """A cosine schedule over max_rollouts x update_per_rollout actor steps (after the critic-only warm-up) ends at
    min_lr_ratio exactly on the last step, for the actor and the critic alike; trainer.global_step counts both
    optimizers' steps, which is why the run is not bounded by it."""
    lrs = []

    class LR(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lrs.append([s.get_last_lr()[0] for s in pl_module.lr_schedulers()])

    model, trainer = _ppo(rollouts=4, callbacks=[LR()], advantage_estimator="gae", freeze_steps=1,
                          update_per_rollout=2, critic_lr=1e-3, optim={"lr_schedule": "cosine", "min_lr_ratio": 0.1})
    assert model.rollouts == 4 and trainer.global_step == 2 + 3 * 2 * 2  # critic alone, then actor + critic
    actor, critic = zip(*lrs, strict=True)
    # after rollout r: the actor has taken 2r steps of 6 (frozen for rollout 0), the critic 2(r + 1) of 8
    for r in range(4):
        assert actor[r] == pytest.approx(1e-3 * lr_factor(2 * r, 0, 6, "cosine", 0.1), rel=1e-9)
        assert critic[r] == pytest.approx(1e-3 * lr_factor(2 * (r + 1), 0, 8, "cosine", 0.1), rel=1e-9)
    assert actor[-1] == pytest.approx(1e-4) and critic[-1] == pytest.approx(1e-4)  # the floor, reached at the end
    assert actor[-2] > 1e-4 * 1.01 and critic[-2] > 1e-4 * 1.01  # and not before


@pytest.mark.parametrize(
    ("task_kwargs", "match"),
    [
        ({"update_per_rollout": 3}, "model.update_per_rollout=3 must divide the 8 trajectories per rank"),
    ],
)
def test_misconfiguration_stops_at_start_up(task_kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _ppo(**task_kwargs)


def test_a_budget_too_small_for_a_trajectory_stops_at_start_up():
    """Not mid-run (nor in an endless search for a packing that cannot exist)."""
    with pytest.raises(ConfigError, match=r"model.max_length_per_device=40 cannot hold the longest trajectory, \d+ "
                                          r"tokens \(the longest training prompt \+ model.rollout.max_new_tokens\)"):
        _ppo(max_length_per_device=40)


def test_max_steps_is_refused():
    L.seed_everything(0)
    with pytest.raises(ConfigError, match=r"PPO counts its run in rollouts: set model.max_rollouts instead of "
                                          r"trainer.max_steps=3"):
        fit(ppo_task(ENV, max_rollouts=2), prompts(), 3)


def test_bad_environment_and_estimator_fail_at_construction(tmp_path):
    with pytest.raises(ConfigError, match="env_path '.*nope.py' does not exist"):
        ppo_task(tmp_path / "nope.py")
    with pytest.raises(ConfigError, match="model.rollout.max_turns=2 needs interact"):
        ppo_task(ENV, rollout={"max_turns": 2})
    with pytest.raises(ConfigError, match="model.advantage_estimator must be one of drgrpo, grpo, rloo, reinforce_pp, "
                                          "gae, vtrace, retrace, td_lambda, nstep, got 'a2c'"):
        ppo_task(ENV, advantage_estimator="a2c")
    with pytest.raises(ConfigError, match=r"set model.rollout.responses_per_prompt >= 2 \(got 1\)"):
        ppo_task(ENV, rollout={"responses_per_prompt": 1})
    with pytest.raises(ConfigError, match="model.rollout.temperature must be > 0"):
        RolloutConfig(ENV, temperature=0.0)
    with pytest.raises(ConfigError, match="model.kl.controller must be one of fixed, adaptive, linear, pid, scheduled"):
        ppo_task(ENV, kl={"controller": "magic"})


@pytest.mark.parametrize("cpu_offload", [True, False])
def test_reference_stays_where_fsdp_offload_keeps_it(cpu_offload):
    """Under `strategy.cpu_offload` FSDP2 streams the offloaded reference's shards in; moving it to the accelerator
    would defeat (or break) the offload. Without offload it goes to the training device."""
    model = ppo_task(ENV, kl={"coef": 0.1})
    reference = mock.Mock()
    object.__setattr__(model, "_reference", reference)
    model._trainer = types.SimpleNamespace(strategy=ParallelStrategy(cpu_offload=cpu_offload))
    model.on_fit_start()
    assert reference.to.called is not cpu_offload


def test_gae_critic_trains_and_its_value_loss_falls():
    """Critic warm-up (`freeze_steps`) then joint training: the actor does not move while frozen, the value loss
    falls over rollouts."""
    metrics = Metrics()
    model, _ = _ppo(advantage_estimator="gae", freeze_steps=2, critic_lr=2e-4, rollouts=7, callbacks=[metrics])
    history = metrics.history
    assert len(history) == 7 and model.critic is not None
    assert "train/grad_norm" not in history[0] and "train/grad_norm" not in history[1]  # frozen actor
    assert history[2]["train/grad_norm"] > 0.0
    losses = [h["train/value_loss"] for h in history]
    # Per-rollout values are noisy (fresh samples every rollout): compare the means of the first and last three.
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses


def _parity_run(env, callbacks=(), **dapo):
    metrics, captured = Metrics(), []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            captured.append(batch["rollout"].trajectories)

    model, _ = _ppo(env, rollouts=2, batch_size=4, callbacks=[Capture(), metrics, *callbacks], update_per_rollout=2,
                    rollout={"responses_per_prompt": 2, "max_new_tokens": 6}, dapo=dapo)
    return model, metrics, captured


def test_dapo_dynamic_sampling_keeps_only_informative_groups_and_refills(parity_env):
    """Reward = completion-length parity: groups whose two completions agree carry no signal and are dropped, then
    refilled from fresh prompts (the refill rounds are counted and logged)."""
    model, metrics, captured = _parity_run(parity_env, filter_range=(0.0, 1.0), max_refill_rounds=8)
    refills = model.rollout_callback.refills
    assert refills > 0 and metrics.history[-1]["train/refills"] == refills
    for trajectories in captured:
        assert 0 < len(trajectories) <= 8 and len(trajectories) % 2 == 0
        for i in range(0, len(trajectories), 2):
            assert trajectories[i].reward != trajectories[i + 1].reward


def test_overlong_shaping_and_truncation_masking(parity_env, tmp_path):
    """max_new_tokens 6, cache 2: completions of 5 and 6 tokens lose 0.5 and 1; truncated ones leave the loss."""
    _, _, captured = _parity_run(parity_env, overlong_cache_length=2)
    lengths = {t.completion_length for ts in captured for t in ts}
    assert max(lengths) == 6  # some completions were cut at max_new_tokens
    for t in (t for ts in captured for t in ts):
        penalty = max(0.0, (t.completion_length - 4) / 2)
        assert t.reward + penalty in (0.0, 1.0)
    from rl_lightning.callbacks.rollout_dump import RolloutDump
    from rl_lightning.rollout.replay import _read_rollouts

    _, metrics, captured = _parity_run(parity_env, [RolloutDump(str(tmp_path / "dump"))], mask_truncated=True)
    cut = [t for ts in captured for t in ts if not t.finished]
    assert cut  # some completions were cut at max_new_tokens
    for t in (t for ts in captured for t in ts):
        assert sum(t.completion_mask) == t.loss_tokens == (0 if not t.finished else t.completion_length)
    # the loss drops a cut completion, but its length is still what was generated, in the trajectory and the metric
    assert {t.completion_length for t in cut} == {6}
    assert len(metrics.history) == len(captured)
    for history, trajectories in zip(metrics.history, captured, strict=True):
        generated = [len(t.input_ids) - len(t.prompt.prompt_ids) for t in trajectories]  # single turn
        assert [t.completion_length for t in trajectories] == generated
        assert history["train/completion_length"] == pytest.approx(sum(generated) / len(generated))
    # the dump keeps the cut completions' lengths beside their zeroed masks, and a replay reads them back
    dumped = _read_rollouts(tmp_path / "dump", 0)
    assert [[line["completion_length"] for line in dumped[k + 1]] for k in range(len(captured))] == [
        [t.completion_length for t in trajectories] for trajectories in captured]


def test_kl_controller_moves_the_coefficient_by_its_rule(parity_env):
    """Linear controller: coef_{k+1} = coef_k + rate * (measured KL_k - target), applied after each rollout; the first
    rollout's KL is 0 (policy == reference), so the coefficient first moves by -rate * target."""
    metrics = Metrics()
    _ppo(parity_env, rollouts=3, callbacks=[metrics],
         kl={"coef": 0.1, "controller": "linear", "target": 0.001, "rate": 2.0})
    coefs = [h["train/kl_coef"] for h in metrics.history]
    kls = [h["train/kl"] for h in metrics.history]
    assert coefs[0] == pytest.approx(0.1 + 2.0 * (kls[0] - 0.001))
    for k in (1, 2):
        assert coefs[k] == pytest.approx(max(0.0, coefs[k - 1] + 2.0 * (kls[k] - 0.001)), rel=1e-5)
    assert kls[2] > 0


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_sum"])
def test_aggregations_scale_the_gradient_as_documented(aggregation, parity_env):
    """First update (ratio 1, no KL, no entropy term): the gradient is sum_i sum_t A_i grad log p_it / N with N the
    completion-token count (token_mean) or completions x the generation budget (token_sum, Dr. GRPO's constant), so
    token_sum's gradient is token_mean's times tokens / (completions x max_new_tokens) exactly; sequence_mean weighs
    each completion's token mean, which differs when lengths differ. The SFT'd tiny model stops at EOS, so completion
    lengths vary."""
    runs = {}
    for name in ("token_mean", aggregation):
        grads, metrics = GradientRecorder(), Metrics()
        _ppo(parity_env, callbacks=[grads, metrics], aggregation=name, lm={"name": str(TINY_MODEL) + "-sft"}, batch_size=4,
             rollout={"max_new_tokens": 16})
        runs[name] = grads.grads[0], metrics.history[0]
    (reference, h), (grads, _) = runs["token_mean"], runs[aggregation]
    tokens, completions = h["train/completion_length"] * h["train/trajectories"], h["train/trajectories"]
    assert h["train/completion_length"] < 15 and h["train/grad_norm"] > 0  # lengths differ (EOS), a real gradient
    for name, grad in reference.items():
        if aggregation == "token_sum":
            assert_close(grads[name], grad * tokens / (completions * 16), atol=1e-7)
    if aggregation == "sequence_mean":
        assert max((grads[n] - g).abs().max() for n, g in reference.items()) > 1e-6


def test_task_owns_its_rollout_callback():
    model = ppo_task(ENV, rollout={"responses_per_prompt": 3, "engine": "hf"}, advantage_estimator="gae")
    from rl_lightning.rollout.shaping_monitor import ShapingMonitorCallback

    callback, monitor = model.configure_callbacks()  # the rollout, then the reward-hacking monitor that reads it
    assert callback is model.rollout_callback and callback.config.responses_per_prompt == 3
    assert isinstance(monitor, ShapingMonitorCallback) and monitor.config is callback.config
    assert isinstance(model, PPO) and model.lm.name == str(TINY_MODEL)
    assert model.hparams.rollout["responses_per_prompt"] == 3  # checkpoints keep plain data
