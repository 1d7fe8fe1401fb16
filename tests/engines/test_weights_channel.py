"""The weights channel of an engine process (`rl_lightning.engines.weights_channel`): buckets stay on the group's
device (a CUDA push never goes through the host), NCCL is chosen on CUDA, and a push arrives whole over a real pair."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from rl_lightning.engines import weights_channel
from rl_lightning.engines.local_channels import private_folder, private_store, remove_folder
from rl_lightning.engines.weights_channel import buckets, received, weights_device, weights_group


def _named(device="cpu"):
    torch.manual_seed(0)
    return [("a.weight", torch.randn(3, 4, device=device)), ("b.bias", torch.randn(5, device=device)),
            ("c.weight", torch.randn(2, 2, 2, device=device))]


def test_buckets_stay_on_the_groups_device_and_keep_order_and_size():
    """On a device other than the host (meta here; CUDA in a real push) no bucket is copied to the host: before, every
    tensor went through ``.to("cpu")`` on the trainer and again to the GPU in the engine."""
    named = [(name, t.to("meta")) for name, t in _named()]
    out = list(buckets(named, bucket_bytes=40, dtype=torch.bfloat16, device=torch.device("meta")))
    assert [[name for name, _ in bucket] for bucket in out] == [["a.weight", "b.bias"], ["c.weight"]]  # 24+10, 16 B
    assert {t.device.type for bucket in out for _, t in bucket} == {"meta"}
    assert {t.dtype for bucket in out for _, t in bucket} == {torch.bfloat16}


def test_nccl_on_cuda_the_host_otherwise(monkeypatch):
    assert weights_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(weights_channel.dist, "is_nccl_available", lambda: False)
    assert weights_device("cuda") == torch.device("cpu")  # a torch without NCCL: gloo through host memory
    monkeypatch.setattr(weights_channel.dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(weights_channel.torch.cuda, "current_device", lambda: 3)
    assert weights_device("cuda") == torch.device("cuda", 3)


def _push(connection, group, named, device, bucket_bytes):
    """The trainer's side of a push, as `EngineProcess.update_weights` sends it."""
    for bucket in buckets(named, bucket_bytes, torch.float32, device):
        connection.send(("bucket", [(name, tuple(t.shape), t.dtype) for name, t in bucket]))
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        group.broadcast(flat, 0).wait()
    connection.send(("end", len(named)))


def _engine_side(folder, connection, result):
    group = weights_group(private_store(folder, 2), 1, 60, torch.device("cpu"))
    got = {name: tensor.clone() for name, tensor in received(connection, group, torch.device("cpu"))}
    result.put((list(got), all(torch.equal(got[name], tensor) for name, tensor in _named()), connection.recv()))


def test_a_push_arrives_whole_over_a_real_gloo_pair():
    """The trainer's side here, the engine's in a process of its own: names in order, every value bit-equal."""
    folder = private_folder("rl_lightning-test-")
    context = mp.get_context("spawn")
    trainer_end, engine_end = context.Pipe()
    result = context.Queue()
    engine = context.Process(target=_engine_side, args=(folder, engine_end, result))
    engine.start()
    try:
        group = weights_group(private_store(folder, 2), 0, 60, torch.device("cpu"))
        _push(trainer_end, group, _named(), torch.device("cpu"), 60)
        trainer_end.send(("done", None))
        names, equal, last = result.get(timeout=60)
        assert names == ["a.weight", "b.bias", "c.weight"] and equal and last == ("done", None)
    finally:
        engine.join(timeout=30)
        remove_folder(folder)


def _nccl_side(rank, folder, result):
    torch.cuda.set_device(rank)
    device = weights_device("cuda")
    group = weights_group(private_store(folder, 2), rank, 60, device)
    named = _named(device)
    if rank == 0:
        for bucket in buckets(named, 60, torch.float32, device):
            group.broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket]), 0).wait()
        return
    sizes = [[t.numel() * 4 for _, t in bucket] for bucket in buckets(named, 60, torch.float32, device)]
    flats = []
    for bucket in sizes:
        flat = torch.empty(sum(bucket), dtype=torch.uint8, device=device)
        group.broadcast(flat, 0).wait()
        flats.append(flat)
    got = torch.cat(flats).view(torch.float32)
    result.put((str(got.device), torch.equal(got, torch.cat([t.reshape(-1) for _, t in named]))))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL pairs one process per device)")
def test_a_push_goes_device_to_device_over_nccl():
    folder = private_folder("rl_lightning-test-")
    context = mp.get_context("spawn")
    result = context.Queue()
    processes = [context.Process(target=_nccl_side, args=(r, folder, result)) for r in (0, 1)]
    try:
        for p in processes:
            p.start()
        device, equal = result.get(timeout=120)
        assert device == "cuda:1" and equal
    finally:
        for p in processes:
            p.join(timeout=30)
        remove_folder(folder)
    assert os.path.exists(folder) is False


class _NeverDone:
    """NCCL's work when the peer is gone: ``wait`` returns at once (it orders the stream), it never completes."""

    def is_completed(self):
        return False

    def wait(self):
        return True


class _PairStandIn:
    def __init__(self):
        self.calls = []

    def broadcast(self, flat, root):
        return _NeverDone()

    def abort(self):
        self.calls.append("abort")


def _idle(seconds):
    import time

    time.sleep(seconds)


@pytest.mark.parametrize("child", ["dies", "hangs"])
def test_a_push_to_a_lost_nccl_peer_ends_in_one_line_and_aborts_the_communicator(child):
    """Before, the trainer called ``wait()`` (which returns at once on NCCL) and went on: a lost child left a
    broadcast that never finished on the trainer's stream. Now the work is polled: a dead child is noticed at once,
    a hung one within ``timeout_s``; either way the communicator is aborted and the error is one line."""
    from rl_lightning.engines.process import EngineProcess, EngineProcessLost

    context = mp.get_context("spawn")
    engine = EngineProcess.__new__(EngineProcess)  # the trainer side only: no vLLM, a stand-in for the NCCL pair
    engine.connection, _ = context.Pipe()
    engine.process = context.Process(target=_idle, args=(0 if child == "dies" else 60,), daemon=True)
    engine.process.start()
    if child == "dies":
        engine.process.join(timeout=30)
    engine.group, engine.device, engine.timeout_s = _PairStandIn(), torch.device("cuda"), 1.0
    engine._remove_folder = lambda: None
    with pytest.raises(EngineProcessLost) as error:
        engine._guarded("receive the weights broadcast", lambda: engine._broadcast(torch.zeros(4, dtype=torch.uint8)))
    message = str(error.value)
    assert "\n" not in message and "receive the weights broadcast" in message
    assert ("exited with code 0" in message) if child == "dies" else ("within model.rollout.engine.timeout_s=1 s" in message)
    assert engine.group.calls[:1] == ["abort"] and not engine.process.is_alive()
