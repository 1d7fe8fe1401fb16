"""PPO under ParallelStrategy on CPU/gloo gives the single-process run: the same sampled completions (per-prompt
seeds, whatever rank holds the prompt), rewards, KL, entropy and gradient norms per rollout, for data, tensor and
context parallelism, and for the critic (GAE) under data parallelism."""

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL
from helpers import fit, run_on_cpu_ranks

from rl_lightning.data import PromptDataModule
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.rollout.callback import RolloutCallback
from rl_lightning.tasks import PPO

PROMPTS_PER_ROLLOUT = 4
COMPARED = ("train/reward", "train/completion_length", "train/entropy", "train/kl", "train/grad_norm",
            "train/approx_kl", "train/value_loss", "train/critic_grad_norm")
PARITY_ENV = '''
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)
'''


class Metrics(L.Callback):
    def __init__(self):
        self.history = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in COMPARED})


def _ppo(env, dp=1, cp=1, tp=1, model_kwargs=None, rollouts=3):
    L.seed_everything(0)
    data = PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL),
                            batch_size=PROMPTS_PER_ROLLOUT // dp, shuffle=True)
    kwargs = {"lr": 2e-3, "max_grad_norm": 1.0, "kl_coef": 0.05, "update_per_rollout": 2,
              "max_length_per_device": 256, **(model_kwargs or {})}
    model = PPO(str(TINY_MODEL), **kwargs)
    metrics = Metrics()
    rollout = RolloutCallback(env, responses_per_prompt=4, max_new_tokens=8)
    strategy = {}
    if dp * cp * tp > 1:
        strategy["strategy"] = ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp,
                                                tensor_parallel_size=tp)
    steps_per_rollout = kwargs["update_per_rollout"] * (2 if kwargs.get("advantage_estimator") == "gae" else 1)
    fit(model, data, rollouts * steps_per_rollout, [rollout, metrics], devices=dp * cp * tp, **strategy)
    return metrics.history


def _worker(rank, env, sizes, model_kwargs, out_path):
    history = _ppo(env, *sizes, model_kwargs=model_kwargs)
    if rank == 0:
        torch.save(history, out_path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "parity.py"
    path.write_text(PARITY_ENV)  # graded reward with variance, so every rollout has non-zero advantages
    return str(path)


SINGLE = {}  # single-process histories, shared by the layouts that compare against them


@pytest.mark.parametrize(
    ("sizes", "model_kwargs"),
    [((2, 1, 1), {}), ((1, 1, 2), {}), ((1, 2, 1), {}),
     ((2, 1, 1), {"advantage_estimator": "gae", "kl_coef": 0.0, "critic_lr": 1e-3})],
    ids=["dp2", "tp2", "cp2", "dp2-gae"],
)
def test_ppo_parallel_equals_single_process(sizes, model_kwargs, env, tmp_path):
    key = repr(sorted(model_kwargs.items()))
    if key not in SINGLE:
        SINGLE[key] = _ppo(env, model_kwargs=model_kwargs)
    single = SINGLE[key]
    run_on_cpu_ranks(_worker, sizes[0] * sizes[1] * sizes[2], env, sizes, model_kwargs, tmp_path / "h.pt")
    parallel = torch.load(tmp_path / "h.pt")
    assert len(parallel) == len(single) == 3 and set(parallel[0]) == set(single[0])
    for step, (a, b) in enumerate(zip(parallel, single, strict=True)):
        for name in a:
            assert abs(a[name] - b[name]) < 1e-5, (step, name, parallel, single)
    # not a vacuous match: gradients flow, and each rollout's second minibatch is off-policy (approx KL > 0)
    assert all(h["train/grad_norm"] > 0 and h["train/approx_kl"] > 1e-7 for h in single)
