"""PPO under ParallelStrategy on CPU/gloo gives the single-process run: the same sampled completions (per-prompt
seeds, whatever rank holds the prompt), rewards, KL, entropy, gradient norms, KL coefficient and Lagrange multipliers
per rollout, for data, tensor and context parallelism, with the critic (GAE), with CPU offload, and with a
distillation teacher (its reverse-KL reward under dp = 2, GKD's JSD loss under cp = 2).

Under context parallelism completions are 32 tokens, so every completion spans both zigzag shards: per-token sums
measured on one shard (KL, entropy, token counts) must be completed over the context-parallel group before they feed
the adaptive KL controller and the multipliers, or the peers' controllers diverge and the logs show one shard. The
other layouts use 8-token completions (the test's cost is mostly generation and updates of long completions)."""

import dataclasses
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import Metrics, fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.parallel import ParallelStrategy

PROMPTS_PER_ROLLOUT = 4
COMPARED = ("train/reward", "train/completion_length", "train/entropy", "train/kl", "train/grad_norm",
            "train/approx_kl", "train/value_loss", "train/critic_grad_norm", "train/kl_coef", "train/entropy_multiplier",
            "train/kl_multiplier", "train/advantage_mean", "train/advantage_std", "train/distill_reverse_kl",
            "train/distill_jsd")
PARITY_ENV = '''
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)
'''
# the adaptive controller moves by e * trajectories / horizon per rollout: a short horizon makes a wrong count visible
CONTROLLED = {"kl": {"coef": 0.05, "controller": "adaptive", "target": 0.001, "horizon": 20.0},
              "constraints": {"entropy_min": 10.0, "kl_max": 0.05, "multiplier_lr": 0.5}}
GAE = {"advantage_estimator": "gae", "critic_lr": 1e-3, "lam": 0.9, "gamma": 0.99}
TEACHER = str(Path(__file__).resolve().parents[3] / "rl_lightning" / "assets" / "tiny-qwen2-sft")
DISTILL = {"distill": {"teacher": TEACHER, "coef": 0.5}}  # the teacher's per-token reverse KL in the advantages
GKD = {"distill": {"teacher": TEACHER, "type": "loss", "beta": 0.5}}  # its JSD over the vocabulary as a loss


def _tokens(cp):
    return 32 if cp > 1 else 8


def _ppo(env, dp=1, cp=1, tp=1, task_kwargs=None, strategy_kwargs=None, rollouts=3, tokens=None):
    L.seed_everything(0)
    model = ppo_task(env, rollout={"max_new_tokens": tokens or _tokens(cp)}, optim={"lr": 2e-3, "max_grad_norm": 1.0},
                     update_per_rollout=2, max_length_per_device=256, max_rollouts=rollouts, **(task_kwargs or {}))
    metrics = Metrics(COMPARED)
    strategy = {}
    if dp * cp * tp > 1:
        strategy["strategy"] = ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp,
                                                tensor_parallel_size=tp, **(strategy_kwargs or {}))
    fit(model, prompts(PROMPTS_PER_ROLLOUT // dp, shuffle=True), -1, [metrics], devices=dp * cp * tp, **strategy)
    return metrics.history


def _sample_apart(out_path):
    """This rank's engine samples with other seeds than its peers' (issue 39.2); count the rollouts it then took
    from its group leader instead of its own (every one, if the sharing works and the seeds really differ)."""
    from rl_lightning.rollout.callback import RolloutCallback
    from rl_lightning.rollout.peer_share import trajectory_digest

    params, sample, finish = RolloutCallback.sampling_params, RolloutCallback.sample, RolloutCallback.finish
    own, replaced = [], [0]

    def apart(self, *args, **kwargs):
        p = params(self, *args, **kwargs)
        return p if p.seeds is None else dataclasses.replace(p, seeds=[s + 7 for s in p.seeds])

    def sampled(self, *args, **kwargs):
        trajectories, metrics = sample(self, *args, **kwargs)
        own.append(trajectory_digest(trajectories))
        return trajectories, metrics

    def finished(self, trainer, task, trajectories, metrics):
        rollout = finish(self, trainer, task, trajectories, metrics)
        replaced[0] += trajectory_digest(rollout.trajectories) != own[-1]
        torch.save(replaced[0], out_path)
        return rollout

    RolloutCallback.sampling_params, RolloutCallback.sample, RolloutCallback.finish = apart, sampled, finished


def _worker(rank, env, sizes, task_kwargs, strategy_kwargs, out_path):
    strategy_kwargs = dict(strategy_kwargs)
    if strategy_kwargs.pop("peers_sample_apart", False) and rank == 1:
        _sample_apart(out_path.with_suffix(".replaced"))
    history = _ppo(env, *sizes, task_kwargs=task_kwargs, strategy_kwargs=strategy_kwargs)
    if rank == 0:
        torch.save(history, out_path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "parity.py"
    path.write_text(PARITY_ENV)  # graded reward with variance, so every rollout has non-zero advantages
    return str(path)


SINGLE = {}  # single-process histories, shared by the layouts that compare against them


@pytest.mark.parametrize(
    ("sizes", "task_kwargs", "strategy_kwargs"),
    [((2, 1, 1), CONTROLLED, {}), ((1, 1, 2), CONTROLLED, {}), ((1, 2, 1), CONTROLLED, {}), ((2, 1, 1), GAE, {}),
     ((1, 2, 1), {**GAE, "kl": {"coef": 0.05, "type": "reward"}}, {}), ((2, 1, 1), CONTROLLED, {"cpu_offload": True}),
     ((2, 1, 1), DISTILL, {}), ((1, 2, 1), GKD, {}), ((1, 2, 1), CONTROLLED, {"peers_sample_apart": True})],
    ids=["dp2", "tp2", "cp2", "dp2-gae", "cp2-gae-kl-reward", "dp2-cpu-offload", "dp2-distill", "cp2-gkd",
         "cp2-peers-sample-apart"],
)
def test_ppo_parallel_equals_single_process(sizes, task_kwargs, strategy_kwargs, env, tmp_path):
    tokens = _tokens(sizes[1])
    key = (repr(task_kwargs), tokens)
    if key not in SINGLE:
        SINGLE[key] = _ppo(env, task_kwargs=task_kwargs, tokens=tokens)
    single = SINGLE[key]
    run_on_cpu_ranks(_worker, sizes[0] * sizes[1] * sizes[2], env, sizes, task_kwargs, strategy_kwargs,
                     tmp_path / "h.pt")
    parallel = torch.load(tmp_path / "h.pt")
    assert len(parallel) == len(single) == 3 and set(parallel[0]) == set(single[0])
    for step, (a, b) in enumerate(zip(parallel, single, strict=True)):
        for name in a:
            # 1e-5, relative above 1: gradient norms of ~4 summed in another float32 order per layout differ by ~1e-5
            assert abs(a[name] - b[name]) < 1e-5 * max(1.0, abs(b[name])), (step, name, parallel, single)
    # not a vacuous match: gradients flow, and each rollout's second minibatch is off-policy (approx KL > 0)
    assert all(h["train/grad_norm"] > 0 and h["train/approx_kl"] > 1e-7 for h in single)
    if strategy_kwargs.get("peers_sample_apart"):  # rank 1 sampled its own, other completions every rollout, and
        assert torch.load(tmp_path / "h.replaced") == 3  # trained on its leader's: the single-process losses
    if "constraints" in task_kwargs:  # the controllers really moved
        assert single[-1]["train/kl_coef"] != 0.05 and single[-1]["train/entropy_multiplier"] > 0.1
