"""A vLLM engine in a process of its own (disaggregated generation), fed weights over a process group of its own.

`EngineProcess` is a `rl_lightning.engines.protocol.RolloutEngine` whose `rl_lightning.engines.vllm.VLLMEngine` runs in
a spawned process (not a trainer rank: it joins no trainer group). Prompts, sampling parameters and completions
travel over a pipe; weights are broadcast from the trainer process over a two-member group built from a
``FileStore`` of its own, separate from the trainer's default group: NCCL from the trainer's GPU to the engine's on
CUDA (device to device; with ``restarts`` a host copy is also kept for a fresh engine), loopback gloo through host memory on the CPU
(`rl_lightning.engines.weights_channel`). The trainer waiting on the pipe holds no GIL, so with the asynchronous
rollouts of `rl_lightning.rollout.async_rollout` the engine generates truly in parallel with the update.

Selected with ``model.rollout.engine: vllm_process``. Several trainer ranks share one engine process, spawned by
global rank 0 (`rl_lightning.engines.shared`); adapter-only sync is not wired through the pipe. Tested on CPU:
log-probabilities equal the trainer's, and an asynchronous run samples the same tokens as with the colocated engine.
A weight push is streamed: the tensors are taken a bucket (``model.rollout.engine.weight_bucket_mb``) at a time, each
bucket goes as one flat byte broadcast after its names, shapes and dtypes went by pipe, and the child hands vLLM
views of that buffer; neither side holds more than a bucket beyond the engine's own weights.

Devices: the engine owns its device, so it never sleeps (``VLLMEngine(sleep_mode=False)``: a sleeping vLLM 0.32
engine keeps its scheduler paused until fully awake). On CUDA the child sees only its own GPUs
(``CUDA_VISIBLE_DEVICES``, from ``model.rollout.engine.devices``: by default the first GPUs the trainer does not
use; see `rl_lightning.rollout.config.engine_process_devices`).

Local only: the store is a file in a folder only this user can enter and the gloo group binds ``127.0.0.1``
(`rl_lightning.engines.local_channels`); the child's own groups (vLLM's one-rank world, NCCL's bootstrap) are set up
on a file store and the loopback interface as well. The engine process opens no socket another host can reach (a
``TCPStore`` would listen on every interface, unauthenticated).

Waiting: every wait on the child (its start, the weights group, completions, a weight load, its close) is bounded by
``model.rollout.engine.timeout_s``, and a child that died is noticed at once (its exit code, and its error when it
could send one): either ends in one `EngineProcessError` line naming what the trainer waited for. Both mean the
process is gone (`EngineProcessLost`): the rollout callback wraps the engine in
`rl_lightning.engines.restart.RestartingEngine`, which starts a fresh one (``model.rollout.engine.restarts``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from rl_lightning.engines.local_channels import (
    private_folder,
    private_store,
    remove_folder,
)
from rl_lightning.engines.protocol import Completion, SamplingParams
from rl_lightning.engines.weights_channel import buckets, close_group, received, weights_device, weights_group
from rl_lightning.parallel.local_group import loopback_environment

DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_BUCKET_BYTES = 512 << 20
POLL_S = 0.2  # how often a wait checks that the child still lives
JOINED = "rl_lightning-engine-joined"  # the child's key in the store: it is joining the weights group
TIMEOUT_KEY = "model.rollout.engine.timeout_s"


class EngineProcessError(RuntimeError):
    """The engine process died, failed or did not answer in time (one line: what the trainer waited for, and why)."""


class EngineProcessLost(EngineProcessError):
    """The engine process is gone: it died, or it was stopped after it did not answer in time.

    A fresh one may work, unlike after an error the process reported itself (see `rl_lightning.engines.restart`).
    """


def visible_devices(devices: Sequence[int], parent_visible: str | None) -> str:
    """The child's ``CUDA_VISIBLE_DEVICES`` for `devices`, indices among the GPUs this process sees.

    Args:
        devices: GPU indices as this process numbers them (``cuda:<i>``).
        parent_visible: this process's ``CUDA_VISIBLE_DEVICES`` (None: unset, every GPU visible).

    Returns:
        The comma-separated ids to give the child: through `parent_visible` when it is set (``"4,5"`` and [1]:
        ``"5"``), else the indices themselves.
    """
    if parent_visible is None:
        return ",".join(str(d) for d in devices)
    ids = [part.strip() for part in parent_visible.split(",") if part.strip()]
    return ",".join(ids[d] for d in devices)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in this process's environment for the block (a spawned child inherits them), then restore."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _local_world(folder: str, device_type: str, timeout_s: float) -> None:
    """The child's default group (one rank, which vLLM takes as its world) on a file store, before vLLM makes one.

    vLLM's own would come from ``env://``: a ``TCPStore`` listening on every interface. Its gloo and NCCL sockets
    bind loopback (`loopback_environment`).
    """
    os.environ.update(loopback_environment())
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'world')}", rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _serve(connection: Any, folder: str, engine_kwargs: dict[str, Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """The engine process: join the weights group, build the engine (it never sleeps), answer until ``close``.

    A failure is sent to the trainer as one ``("error", line)`` message before the process exits with it.
    """
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    try:
        device_type = str(engine_kwargs.get("device_type", "cpu"))
        _local_world(folder, device_type, timeout_s)
        if device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.set_device(0)  # the first of its own GPUs (CUDA_VISIBLE_DEVICES)
        device = weights_device(device_type)
        store = private_store(folder, 2)
        store.set(JOINED, "1")
        group = weights_group(store, 1, timeout_s, device)
        from rl_lightning.engines.vllm import VLLMEngine

        # its device is its own: awake from the start (a sleeping vLLM 0.32 engine pauses its scheduler)
        engine = VLLMEngine(**engine_kwargs, rank=0, local_rank=0, world_size=1, sleep_mode=False)
        connection.send(("ready", {"dtype": str(engine.dtype),
                                   "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))
        _answer(connection, group, engine, device)
    except Exception as e:
        with contextlib.suppress(OSError):  # the trainer may be gone
            connection.send(("error", _one_line(e)))
        raise


def held_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A host copy of `model`'s weights by parameter name (vLLM's layout: fused ``qkv_proj``, ``gate_up_proj``).

    vLLM-CPU packs linear weights for its GEMM kernels and leaves an empty parameter; such a weight is read back
    through the layer's own kernel: ``I @ W^T`` (exact: every product is by 1 or 0).
    """
    held = {}
    for prefix, module in model.named_modules():
        for name, param in module.named_parameters(prefix=prefix, recurse=False):
            tensor = param.detach()
            if name.endswith(".weight") and tensor.numel() == 0 and hasattr(module, "cpu_linear"):
                eye = torch.eye(module.input_size_per_partition, dtype=tensor.dtype)  # (K, K)
                tensor = module.cpu_linear(eye, param, None).T  # (N, K)
            held[name] = tensor.to("cpu", copy=True)  # host copies: CUDA tensors must not cross the pipe
    return held


def _answer(connection: Any, group: Any, engine: Any, device: torch.device) -> None:
    """Answer the trainer's commands until ``close``."""
    while True:
        command, payload = connection.recv()
        if command == "close":
            engine.shutdown()
            connection.send(("closed", None))
            return
        if command == "generate":
            connection.send(("completions", engine.generate(*payload)))
        elif command == "held":
            connection.send(("held", engine.llm.apply_model(held_weights)[0]))
        elif command == "weights":  # then ("bucket", [(name, shape, dtype)]) + one broadcast each, then ("end", n)
            pushed = received(connection, group, device)
            engine.update_weights(pushed)
            for _ in pushed:  # what vLLM left unread still arrives (the trainer sends it all)
                pass
            connection.send(("loaded", None))


class EngineProcess:
    """A `VLLMEngine` (built with `engine_kwargs`) in a spawned process; the same methods as the in-process one.

    Args:
        devices: GPUs of the engine, indices among those this process sees (the child gets them as its
            ``CUDA_VISIBLE_DEVICES``); None: the child inherits this process's devices (CPU).
        timeout_s: the longest wait for any answer of the engine process (its start, a generate, a weight load,
            its close) before it is stopped and `EngineProcessError` raised.
        bucket_bytes: a weight push goes in broadcasts of about this many bytes (a larger tensor goes alone).
        **engine_kwargs: passed to `VLLMEngine` in the child (rank, local_rank, world_size and sleep_mode are set
            there).
    """

    def __init__(self, *, devices: Sequence[int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, **engine_kwargs: Any) -> None:
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.folder = private_folder("rl_lightning-engine-")  # the stores' files: this user's only
        self._remove_folder = weakref.finalize(self, remove_folder, self.folder)
        context = mp.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, self.folder, engine_kwargs, timeout_s), daemon=True)
        child_env = {} if devices is None else {
            "CUDA_VISIBLE_DEVICES": visible_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))}
        with _environment(child_env):
            self.process.start()
        child.close()  # the child holds its end now: the pipe reads EOF once the child is gone
        self._store = private_store(self.folder, 2)
        self._wait("join the weights group", lambda: self._store.check([JOINED]))
        self.device = weights_device(str(engine_kwargs.get("device_type", "cpu")))  # the buckets' (NCCL or gloo)
        self.group = self._guarded("join the weights group",
                                   lambda: weights_group(self._store, 0, timeout_s, self.device))
        ready = self._receive("ready", "start (build its vLLM engine)")
        self.dtype = getattr(torch, ready["dtype"].removeprefix("torch."))
        self.cuda_visible_devices: str | None = ready["cuda_visible_devices"]  # as the child saw it
        self.needs_weights = True

    # ------------------------------------------------------------------------------------------------ waiting

    def _wait(self, what: str, done: Callable[[], bool]) -> None:
        """Until `done()`, checking every `POLL_S` that the child lives; at most `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if not self.process.is_alive():
                self._died(what)
            if time.monotonic() >= deadline:
                self._timed_out(what)
            time.sleep(POLL_S)

    def _receive(self, expected: str, what: str) -> Any:
        """The payload of the child's next message, which must be `expected` (waiting at most `timeout_s`)."""
        deadline = time.monotonic() + self.timeout_s
        while not self.connection.poll(POLL_S):
            if not self.process.is_alive() and not self.connection.poll(0):
                self._died(what)
            if time.monotonic() >= deadline:
                self._timed_out(what)
        try:
            kind, payload = self.connection.recv()
        except (EOFError, OSError):
            self._died(what)
        if kind == "error":
            self._stop(grace_s=5)  # it is exiting with the error (its traceback goes to stderr)
            raise EngineProcessError(f"EngineProcess: the engine process failed to {what}: {payload}")
        if kind != expected:
            raise EngineProcessError(f"EngineProcess: expected '{expected}' from the engine process (to {what}), "
                                     f"got '{kind}'")
        return payload

    def _send(self, message: tuple[str, Any], what: str) -> None:
        try:
            self.connection.send(message)
        except OSError:  # a broken pipe: the child is gone
            self._died(what)

    def _guarded(self, what: str, action: Callable[[], Any]) -> Any:
        """`action()`, a collective with the child (bounded by `timeout_s`); its failure in one line."""
        try:
            return action()
        except EngineProcessError:
            raise  # already one line: the child died or timed out while `action` waited
        except RuntimeError as e:
            if not self.process.is_alive():
                self._died(what)
            self._stop()
            raise EngineProcessLost(f"EngineProcess: the engine process did not {what} ({_one_line(e)}; it waited "
                                     f"up to {TIMEOUT_KEY}={self.timeout_s:g} s); it was stopped") from None

    def _died(self, what: str) -> NoReturn:
        self.process.join(timeout=5)
        code = self.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        error = ""
        with contextlib.suppress(EOFError, OSError, ValueError):
            if self.connection.poll(0):
                kind, payload = self.connection.recv()
                error = f": {payload}" if kind == "error" else ""
        raise EngineProcessLost(f"EngineProcess: the engine process {how} while the trainer waited for it to "
                                 f"{what}{error or ' (its traceback, if any, is on stderr above)'}")

    def _timed_out(self, what: str) -> NoReturn:
        self._stop()
        raise EngineProcessLost(f"EngineProcess: the engine process did not {what} within {TIMEOUT_KEY}="
                                 f"{self.timeout_s:g} s (it was stopped); raise {TIMEOUT_KEY} if it is merely slow "
                                 "(a large model's start-up, a long rollout)")

    def _stop(self, grace_s: float = 0) -> None:
        """Kill the child (it failed or hangs) unless it exits within `grace_s`, and reap it."""
        self.process.join(timeout=grace_s)
        if self.process.is_alive():
            self.process.kill()
        if getattr(self, "group", None) is not None:  # a NCCL pair's pending work would never finish
            close_group(self.group, self.device, abort=True)
        self.process.join(timeout=5)
        self._remove_folder()

    # ------------------------------------------------------------------------------------------------ engine

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt, generated in the engine process (prompts and completions go by pipe)."""
        self._send(("generate", (prompts, params)), "generate completions")
        completions: list[list[Completion]] = self._receive("completions", "generate completions")
        return completions

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors by Hugging Face name, streamed bucket by bucket (`bucket_bytes`).

        A bucket's names, shapes and dtypes go over the pipe, its data in one flat broadcast; the next bucket is
        taken from `named_tensors` (gathered, when it is a `rl_lightning.engines.weights.stream_weights` stream)
        only once this one was sent, so the trainer holds one bucket, never the whole model.
        """
        self._send(("weights", None), "receive weights")
        count = 0
        for bucket in buckets(named_tensors, self.bucket_bytes, self.dtype, self.device):
            self._send(("bucket", [(name, tuple(t.shape), t.dtype) for name, t in bucket]), "receive weights")
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])  # one dtype: aligned views
            self._guarded("receive the weights broadcast", partial(self._broadcast, flat))
            count += len(bucket)
            del bucket, flat
        self._send(("end", count), "receive weights")
        self._receive("loaded", "load the broadcast weights")
        self.needs_weights = False

    def held(self) -> dict[str, torch.Tensor]:
        """The weights the engine holds now, by vLLM's parameter names (`held_weights`): for tests and debugging."""
        self._send(("held", None), "send its weights")
        weights: dict[str, torch.Tensor] = self._receive("held", "send its weights")
        return weights

    def _broadcast(self, flat: torch.Tensor) -> None:
        """One bucket to the child, waited for on the host (the work is polled).

        NCCL's ``wait`` only orders the stream: polling makes a child that dies or hangs mid-push end in
        `EngineProcessLost` within `timeout_s`, its communicator aborted (gloo's own wait raises when the child dies).
        """
        work, what = self.group.broadcast(flat, 0), "receive the weights broadcast"
        deadline, pause = time.monotonic() + self.timeout_s, 1e-4
        while not work.is_completed():
            if not self.process.is_alive():
                close_group(self.group, self.device, abort=True)
                self._died(what)
            if time.monotonic() >= deadline:
                self._timed_out(what)  # stops the child and aborts the communicator
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
        work.wait()

    def wake(self) -> None:
        """The engine owns its device and never sleeps: nothing to wake."""

    def sleep(self) -> None:
        """The engine owns its device: it never sleeps."""

    def shutdown(self) -> None:
        """Close the engine and wait (up to `timeout_s` each) for its answer and for its process to exit."""
        if self.process.is_alive():
            self._send(("close", None), "close its engine")
            self._receive("closed", "close its engine")
            self.process.join(timeout=self.timeout_s)
            if self.process.is_alive():
                self._timed_out("exit after closing its engine")
            close_group(self.group, self.device, abort=False)
        self.process.join(timeout=5)
        self._remove_folder()
