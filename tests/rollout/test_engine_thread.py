"""The rank's engine thread (issue 39.1): every thread that drives the engine off the training thread selects the
rank's device before its first engine or tensor call, the GPU's rule checked on CPU by `ThreadDeviceRules` (a CUDA
host thread starts on device 0; the old ``ThreadPoolExecutor`` without an initializer never left it)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import TINY_MODEL
from device_rules import DeviceRuleError, ThreadDeviceRules

from rl_lightning.engines.hf import HFEngine
from rl_lightning.engines.protocol import SamplingParams
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.rollout.async_rollout import ThreadGenerator
from rl_lightning.rollout.engine_thread import engine_stream, handed_over, select_device, selected_device, taken_back

ROOT = torch.device("cpu", 0)  # the rank's device, named with an index as a GPU rank's is


@pytest.fixture(scope="module")
def engine(tokenizer):
    return HFEngine(load_causal_lm(str(TINY_MODEL)), tokenizer.pad_token_id, ROOT)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer("1 + 2 =")["input_ids"], tokenizer("3 + 4 = ")["input_ids"]]


PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seeds=[5, 6])


def test_engine_calls_run_on_the_engine_thread_after_it_selected_the_device(engine, prompts):
    """A weight push (wake), a synchronous first rollout and a background one all run on the one engine thread, which
    selected the rank's device first; what it samples is what the training thread samples (same seeds)."""
    expected = engine.generate(prompts, PARAMS)
    generator = ThreadGenerator(device=ROOT)
    with ThreadDeviceRules(ROOT) as rules:
        rules.watch(engine)
        generator.run(engine.wake)
        first = generator.run(lambda: engine.generate(prompts, PARAMS))
        generator.submit("ahead", 0, lambda: engine.generate(prompts, PARAMS))
        ahead = generator.take("ahead")
    generator.close()
    rules.check()
    assert first == expected and ahead.value == expected
    assert [(thread, method, device) for thread, method, device in rules.engine_calls] == [
        ("rl_lightning-engine_0", "wake", ROOT), ("rl_lightning-engine_0", "generate", ROOT),
        ("rl_lightning-engine_0", "generate", ROOT)]
    assert rules.tensor_calls["rl_lightning-engine_0"] > 100  # the sampling's own tensor calls, all on ROOT
    assert selected_device() is None  # the training thread keeps Lightning's device, untouched


def test_the_old_rollout_thread_never_selected_a_device_and_is_caught(engine, prompts):
    """The pool as it was (no initializer) generates on a thread that never selected a device: on CUDA, device 0."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="rl_lightning-rollout")
    with ThreadDeviceRules(ROOT) as rules:
        rules.watch(engine)
        pool.submit(engine.generate, prompts, PARAMS).result()
    pool.shutdown()
    with pytest.raises(DeviceRuleError, match=r"thread rl_lightning-rollout_0 called engine\.generate with device None "
                                              r"selected, not cpu:0: on CUDA its kernels would run on device 0"):
        rules.check()
    assert any("made a tensor call with device None selected" in v for v in rules.violations)


def test_an_engine_call_from_the_training_thread_is_caught_where_the_engine_thread_owns_the_engine(engine, prompts):
    with ThreadDeviceRules(ROOT) as rules:
        rules.watch(engine)
        engine.generate(prompts, PARAMS)
    with pytest.raises(DeviceRuleError, match=r"the training thread called engine\.generate"):
        rules.check()
    with ThreadDeviceRules(ROOT, main_thread_engine_calls=True) as sync:  # the synchronous mode: Lightning's device
        sync.watch(engine)
        engine.generate(prompts, PARAMS)
    sync.check()
    assert engine.generate.__func__ is HFEngine.generate  # the watch ends with the check


def test_selection_is_per_thread_and_cpu_needs_no_stream_or_events():
    seen = {}

    def probe():
        seen["before"] = selected_device()
        select_device(ROOT)
        seen["after"] = selected_device()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    assert seen == {"before": None, "after": ROOT} and selected_device() is None
    assert engine_stream(ROOT) is None and handed_over(ROOT) is None
    taken_back(None, ROOT)  # no event: nothing to wait for


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_thread_runs_on_its_device_and_stream_after_the_trainers_work():
    """The engine thread's current device is the rank's and its current stream the engine stream (not the default
    one the trainer uses); a tensor the trainer filled on its stream just before the hand-over is read complete, and
    the trainer reads the engine's result after the engine's own stream finished it."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # the last GPU: a fresh thread starts on 0
    torch.cuda.set_device(device)
    generator = ThreadGenerator(device=device)
    trainer_side = torch.zeros(1 << 24, device=device)
    torch.cuda._sleep(50_000_000)  # keep the trainer's stream busy, so unordered reads would see zeros
    trainer_side.fill_(1.0)

    def engine_work():
        stream = torch.cuda.current_stream(device)
        return torch.cuda.current_device(), stream == engine_stream(device), stream == torch.cuda.default_stream(
            device), trainer_side.sum() * 2

    (current, on_engine_stream, on_default, total) = generator.run(engine_work)
    generator.close()
    assert (current, on_engine_stream, on_default) == (device.index, True, False)
    assert total.item() == 2.0 * (1 << 24)
