"""The rank's engine thread: its device and stream selected before any engine call, ordered against the trainer.

A host thread starts on CUDA device 0 with the default stream. The generations that run off the training thread
(one-step-off and in-flight rollouts) would launch their kernels there: vLLM 0.32's V2 runner launches Triton kernels
on the calling thread's current device (ranks 1-7 would compute on GPU 0 against GPU N's memory), and it caches one
``main_stream`` from the first thread that steps it, making it current after every step (a first rollout on the
training thread puts every later generation on the trainer's stream). PyTorch's and vLLM's own threads select their
device first for that reason.

So every thread that drives the engine starts with `select_device`: the rank's device, and one engine stream per
rank and device, made current. Work handed to it is ordered by events: the engine stream waits for what the trainer
queued before the hand-over (`handed_over`), and the trainer's stream waits for what the engine queued before it
takes the result (`taken_back`). On CPU there are no streams: the events are None and ordering is the threads' own.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["engine_stream", "handed_over", "select_device", "selected_device", "taken_back"]

_thread = threading.local()  # this thread's selected device
_streams: dict[torch.device, Any] = {}  # one engine stream per device (CUDA only)
_streams_lock = threading.Lock()


def engine_stream(device: torch.device) -> Any:
    """The rank's engine stream on `device` (made once; shared by its engine threads), None off CUDA."""
    if device.type != "cuda":
        return None
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        return _streams[device]


def select_device(device: torch.device) -> None:
    """Make `device` this thread's current device and the engine stream its current stream (the thread's first call).

    Args:
        device: the rank's device (``trainer.strategy.root_device``).
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(engine_stream(device))
    _thread.device = device


def selected_device() -> torch.device | None:
    """The device this thread selected with `select_device` (None: it never did)."""
    return getattr(_thread, "device", None)


def _record(device: torch.device | None) -> Any:
    """An event recorded on this thread's current stream of `device` (None off CUDA)."""
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait(event: Any, device: torch.device | None) -> None:
    if event is not None and device is not None:
        torch.cuda.current_stream(device).wait_event(event)


def handed_over(device: torch.device | None) -> Any:
    """On the trainer's thread, before handing engine work over: an event after everything queued so far."""
    return _record(device)


def run_ordered(work: Any, ready: Any, device: torch.device | None) -> tuple[Any, Any]:
    """On the engine thread: wait for `ready` (the trainer's event), run `work`, record the engine's event.

    Returns:
        `work`'s result, and the event `taken_back` waits for.
    """
    _wait(ready, device)
    value = work()
    return value, _record(device)


def taken_back(done: Any, device: torch.device | None) -> None:
    """On the trainer's thread, before using the engine's result: its stream waits for the engine's event `done`."""
    _wait(done, device)
