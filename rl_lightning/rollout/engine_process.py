"""A vLLM engine in a process of its own (disaggregated generation), fed weights over a process group of its own.

`EngineProcess` is a `rl_lightning.rollout.engine.RolloutEngine` whose `rl_lightning.rollout.vllm.VLLMEngine` runs in
a spawned process (not a trainer rank: it joins no trainer group). Prompts, sampling parameters and completions
travel over a pipe; weights are broadcast from the trainer process over a two-member gloo group built from a
`TCPStore` of its own, separate from the trainer's default group (on GPU the same scheme works with NCCL between the
trainer's rank 0 and engine GPUs). The trainer waiting on the pipe holds no GIL, so with the asynchronous rollouts
of `rl_lightning.rollout.async_rollout` the engine generates truly in parallel with the update.

Selected with ``model.rollout.engine: vllm_process`` (one training process and one engine for now: several trainer
ranks would broadcast from the gathered weights, and adapter-only sync is not wired through the pipe). Tested on CPU:
log-probabilities equal the trainer's, and an asynchronous run samples the same tokens as with the colocated engine.
The weights of one push are staged in host memory before the broadcast (one extra copy of the model on the host).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rl_lightning.rollout.engine import Completion, SamplingParams

TIMEOUT = timedelta(minutes=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights_group(port: int, rank: int) -> Any:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    return store, dist.ProcessGroupGloo(dist.PrefixStore("rl_lightning-weights", store), rank, 2, TIMEOUT)


def _serve(connection: Any, port: int, engine_kwargs: dict[str, Any]) -> None:
    """The engine process: join the weights group, build the engine, answer commands until ``close``."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})  # vLLM's own one-rank group
    from rl_lightning.rollout.vllm import VLLMEngine

    _store, group = _weights_group(port, 1)
    engine = VLLMEngine(**engine_kwargs, rank=0, local_rank=0, world_size=1)
    connection.send(("ready", str(engine.dtype)))
    while True:
        command, payload = connection.recv()
        if command == "close":
            engine.shutdown()
            connection.send(("closed", None))
            return
        if command == "generate":
            connection.send(("completions", engine.generate(*payload)))
        elif command == "weights":  # [(name, shape, dtype)], then one broadcast per tensor, in that order
            tensors = []
            for name, shape, dtype in payload:
                tensor = torch.empty(shape, dtype=dtype)
                group.broadcast(tensor, 0).wait()
                tensors.append((name, tensor))
            engine.update_weights(tensors)
            connection.send(("loaded", len(tensors)))


class EngineProcess:
    """A `VLLMEngine` (built with `engine_kwargs`) in a spawned process; the same methods as the in-process one."""

    def __init__(self, **engine_kwargs: Any) -> None:
        port = _free_port()
        self.connection, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=_serve, args=(child, port, engine_kwargs), daemon=True)
        self.process.start()
        self._store, self.group = _weights_group(port, 0)
        _, dtype = self._receive("ready")
        self.dtype = getattr(torch, dtype.removeprefix("torch."))
        self.needs_weights = True

    def _receive(self, expected: str) -> Any:
        kind, payload = self.connection.recv()
        if kind != expected:
            raise RuntimeError(f"EngineProcess: expected '{expected}' from the engine process, got '{kind}'")
        return kind, payload

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt, generated in the engine process (prompts and completions go by pipe)."""
        self.connection.send(("generate", (prompts, params)))
        return self._receive("completions")[1]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors by Hugging Face name: the names, shapes and dtypes over the pipe, the data broadcast."""
        tensors = [(name, tensor.detach().to("cpu", self.dtype).contiguous()) for name, tensor in named_tensors]
        self.connection.send(("weights", [(name, tuple(t.shape), t.dtype) for name, t in tensors]))
        for _, tensor in tensors:
            self.group.broadcast(tensor, 0).wait()
        self._receive("loaded")
        self.needs_weights = False

    def wake(self) -> None:
        """The engine owns its device: nothing to wake."""

    def sleep(self) -> None:
        """The engine owns its device: it never sleeps."""

    def shutdown(self) -> None:
        """Close the engine and wait (up to 60 s) for its process to exit."""
        if self.process.is_alive():
            self.connection.send(("close", None))
            self._receive("closed")
        self.process.join(timeout=60)
