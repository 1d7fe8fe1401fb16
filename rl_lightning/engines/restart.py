"""An engine process that comes back: ``model.rollout.engine.restarts`` for ``engine: vllm_process``.

`RestartingEngine` wraps the `rl_lightning.engines.process.EngineProcess` the rollout callback builds. When
the engine process is lost while the trainer waits on it (killed, crashed, or stopped after
``model.rollout.engine.timeout_s``: an `EngineProcessLost`), it starts a fresh one, pushes it the weights the lost one
held, and repeats the call that failed (the generate, or the weight load). Sampling seeds travel with every generate
call, so a retried rollout samples exactly what the lost engine would have: the same tokens and engine log-probabilities
as a run nobody interrupted.

The weights pushed again are those of the last push, kept as a host copy in the engine's dtype (one extra copy of
the model in host memory, held for the whole run; none with ``restarts: 0``; the colocated engines keep
none). They are the trainer's current weights in a synchronous run; with ``async_steps: 1`` they are the version the
background rollout was sampling with, which the trainer may already have updated, so staleness stays exactly one step.

A fresh process that vLLM refuses to start because the device's memory is not free yet (the driver still releasing
the lost process's memory) is started again, waiting 1, 2, 4... s, for up to ``start_wait_s`` (60 s) in all; that is
not a restart.

Bounded: after ``engine.restarts`` restarts the next loss stops the run with one `TrainingError` line naming the key,
how many times the engine was lost and the last reason. An error the engine process reported itself (an exception in
vLLM: a fresh engine would fail the same way) is not retried. The count is logged as ``rollout/engine_restarts``
once it is non-zero.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, TypeVar

import torch

from rl_lightning.compat.vllm import memory_not_free_yet
from rl_lightning.engines.process import EngineProcess, EngineProcessError, EngineProcessLost
from rl_lightning.engines.protocol import Completion, SamplingParams
from rl_lightning.errors import TrainingError

log = logging.getLogger(__name__)
RESTARTS_KEY = "model.rollout.engine.restarts"
Result = TypeVar("Result")


class RestartingEngine:
    """An `EngineProcess` built with `process_kwargs`, restarted (its weights pushed again) up to `restarts` times.

    Args:
        restarts: how many times a lost engine process is replaced before the run stops (0: never).
        start_wait_s: how long a fresh process is started again while vLLM finds the device's memory not free yet.
        **process_kwargs: the `EngineProcess` arguments (each fresh process gets the same).

    Attributes:
        restarts: restarts so far (``rollout/engine_restarts``).
        busy: a generate call is waiting on the engine process.
    """

    def __init__(self, restarts: int, start_wait_s: float = 60.0, **process_kwargs: Any) -> None:
        if restarts < 0:
            raise ValueError(f"restarts must be >= 0, got {restarts}")
        self._start, self.max_restarts = partial(EngineProcess, **process_kwargs), restarts
        self.start_wait_s = start_wait_s
        self.restarts, self.busy = 0, False
        self._weights: dict[str, torch.Tensor] = {}  # by Hugging Face name: what the engine holds
        self.engine = self._start()

    @property
    def process(self) -> Any:
        """The current engine process (a `multiprocessing` process)."""
        return self.engine.process

    @property
    def dtype(self) -> torch.dtype:
        """The engine's weight dtype (what `WeightSync` casts to)."""
        return self.engine.dtype

    @property
    def needs_weights(self) -> bool:
        """Whether the engine holds no pushed weights yet."""
        return bool(self.engine.needs_weights)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt; retried on a fresh engine process if this one is lost meanwhile."""
        self.busy = True
        try:
            return self._retried(lambda: self.engine.generate(prompts, params))
        finally:
            self.busy = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push full tensors by name as they come, each kept as a host copy for a restart (none with ``restarts`` 0).

        Lost mid-push, the rest of `named_tensors` is still taken (on several trainer ranks each tensor is gathered
        by all of them), then a fresh engine process gets the kept copies.
        """
        def kept(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                if self.max_restarts:
                    # a copy: on CPU the trainer's tensor is the parameter itself, which the optimizer changes in place
                    tensor = self._weights[name] = tensor.detach().to("cpu", self.dtype, copy=True)
                yield name, tensor

        self._weights = {}  # the last push's copies go first: at most one copy of the model on the host
        stream = kept(named_tensors)
        try:
            self.engine.update_weights(stream)
            return
        except EngineProcessLost as lost:
            for _ in stream:  # the rest of the push, kept for the fresh process
                pass
            self._count(lost)
        self._retried(lambda: None, fresh=True)

    def wake(self) -> None:
        """The engine process never sleeps."""

    def sleep(self) -> None:
        """The engine process never sleeps."""

    def shutdown(self) -> None:
        """Close the engine process."""
        self.engine.shutdown()

    def _retried(self, call: Callable[[], Result], fresh: bool = False) -> Result:
        """`call()`, again on a fresh engine process (given the kept weights) each time the current one is lost.

        A fresh process lost in its start or its weight push counts as one more loss. `fresh`: start one first.
        """
        while True:
            try:
                if fresh:
                    self.engine = self._start_when_free()
                    if self._weights:
                        self.engine.update_weights(list(self._weights.items()))
                return call()
            except EngineProcessLost as lost:
                self._count(lost)
                fresh = True

    def _start_when_free(self) -> EngineProcess:
        """A fresh engine process, started again (1, 2, 4... s apart) while vLLM finds the memory not free yet."""
        deadline, pause = time.monotonic() + self.start_wait_s, 1.0
        while True:
            try:
                return self._start()
            except EngineProcessLost:
                raise
            except EngineProcessError as refused:
                if not memory_not_free_yet(str(refused)) or time.monotonic() + pause > deadline:
                    raise
                log.warning("fresh engine process: the device's memory is not free yet; starting again in %.0f s",
                            pause)
                time.sleep(pause)
                pause *= 2

    def _count(self, lost: EngineProcessLost) -> None:
        """One more restart, or the run stopped in one line once `max_restarts` are spent."""
        if self.restarts >= self.max_restarts:
            raise TrainingError(
                f"{RESTARTS_KEY}={self.max_restarts}: the engine process was lost {self.restarts + 1} time(s), once "
                f"more than it may be restarted (last: {lost}); raise {RESTARTS_KEY} if it is lost only now and then, "
                "else see why it dies (memory, the engine's stderr above)") from None
        self.restarts += 1
        log.warning("engine process lost (%s); restart %d of %s=%d", lost, self.restarts, RESTARTS_KEY,
                    self.max_restarts)
        self.engine.process.join(timeout=5)  # reaped: a lost process is dead or was stopped
