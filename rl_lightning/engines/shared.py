"""One engine process serving every trainer rank: ``engine: vllm_process`` with ``trainer.devices`` (or nodes) > 1.

Global rank 0 spawns the engine process (`rl_lightning.engines.restart.RestartingEngine` around
`rl_lightning.engines.process.EngineProcess`); every rank holds a `SharedEngine`, the same `RolloutEngine`
methods as the process itself:

- **prompts**: each ``generate`` is a collective of the trainer ranks over a gloo group of their own (built once at
  the fit's start, separate from the training group, so a rollout read ahead in a background thread with
  ``async_steps: 1`` never interleaves with the update's collectives). Rank 0 gathers every rank's prompts and
  sampling parameters (``gather_object``), has the engine generate them in one batch (one call per distinct set of
  sampling parameters; each prompt keeps its own seed), and scatters each rank its completions, in order
  (``scatter_object_list``). So the ranks must call ``generate`` equally often: the rollout callback runs them in
  lockstep over the same group (`rl_lightning.engines.lockstep`: a rank whose multi-turn conversations have all
  ended, or whose refill share is empty, sends a one-token filler).
- **weights**: every rank walks the FSDP2/TP shards in the same order and gathers each bucket
  (``DTensor.full_tensor()``, a collective of the training mesh); rank 0 streams each bucket to the engine process
  over the engine's own two-member group as soon as it is gathered, the other ranks drop theirs. No rank holds more
  than a bucket of gathered weights (rank 0 also keeps the host copy that ``engine.restarts`` needs).

Why through rank 0 rather than every rank talking to the engine: the engine's group, its restarts and its timeouts
stay one two-member affair (a restarted engine process needs no new rendezvous with every rank), the engine sees one
large batch per round rather than one per rank, and the prompts and completions are small next to the weights.
The cost: every rank waits for the slowest rank's prompts each round, and tensor/context-parallel peers (which hold
the same prompts) send them again (the same seeds sample the same completions twice).

Errors: a failure on rank 0 (the engine process lost past ``engine.restarts``, an error it reported) is scattered to
every rank as one line before rank 0 raises it, so no rank is left waiting; the group's own timeout (the engine's
timeout times the restarts it may take, plus one) bounds the rest.

vLLM 0.32's weight-transfer API (``WeightTransferConfig``, ``vllm.distributed.weight_transfer``) has the same shape
(one sending trainer rank; the others only join the gathers) but its transports are NCCL, CUDA IPC and RDMA: none runs
on CPU/gloo, so the broadcast here is our own (see ``docs/rollout-engines.md`` for the GPU path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rl_lightning.engines.process import EngineProcessError
from rl_lightning.engines.protocol import Completion, SamplingParams

Request = tuple[list[list[int]], SamplingParams]


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def merged_generate(generate: Callable[[list[list[int]], SamplingParams], list[list[Completion]]],
                    requests: list[Request]) -> list[list[list[Completion]]]:
    """Every rank's request answered with as few engine calls as their sampling parameters allow.

    Requests whose parameters differ only in their seeds are generated in one call, each prompt with its own seed
    (``request_seed``), so a prompt samples what it would have sampled alone.

    Args:
        generate: the engine's ``generate(prompts, params)``.
        requests: (prompts, params) per rank.

    Returns:
        Per rank, per prompt, the ``params.n`` completions.
    """
    answers: list[list[list[Completion]]] = [[] for _ in requests]
    calls: dict[str, list[int]] = {}  # the parameters (seeds aside, seeded or not) -> ranks
    for rank, (prompts, params) in enumerate(requests):
        seeded = all(params.request_seed(i) is not None for i in range(len(prompts)))
        if prompts:
            calls.setdefault(repr((replace(params, seed=None, seeds=None), seeded)), []).append(rank)
    for ranks in calls.values():
        prompts = [p for r in ranks for p in requests[r][0]]
        params = requests[ranks[0]][1]
        seeds = [requests[r][1].request_seed(i) for r in ranks for i in range(len(requests[r][0]))]
        known = [s for s in seeds if s is not None]
        groups = generate(prompts, replace(params, seed=None, seeds=known if len(known) == len(seeds) else None))
        start = 0
        for r in ranks:
            answers[r] = groups[start : start + len(requests[r][0])]
            start += len(requests[r][0])
    return answers


class SharedEngine:
    """Rank 0's engine process, served to every trainer rank (build it with `start_shared_engine`).

    Args:
        engine: rank 0's engine (a `RestartingEngine`); None on the other ranks.
        group: the trainer ranks' gloo group for prompts and completions.
        dtype: the engine's weight dtype (what `rl_lightning.engines.weights.WeightSync` casts the shards to).
    """

    def __init__(self, engine: Any, group: Any, dtype: torch.dtype) -> None:
        self.engine, self.group, self.dtype = engine, group, dtype
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.needs_weights = True  # the engine never sleeps: true until the first push, on every rank alike

    @property
    def restarts(self) -> int:
        """Engine process restarts so far (rank 0's count; 0 elsewhere)."""
        return 0 if self.engine is None else int(self.engine.restarts)

    @property
    def process(self) -> Any:
        """Rank 0's engine process (None elsewhere)."""
        return None if self.engine is None else self.engine.process

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """This rank's `params.n` completions per prompt; a collective of every trainer rank (see the module)."""
        requests: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object((prompts, params), requests, dst=0, group=self.group)
        answers: list[Any] = [None]
        failure: BaseException | None = None
        if self.rank == 0:
            assert requests is not None
            try:
                scattered: list[Any] = [("ok", a) for a in merged_generate(self.engine.generate, requests)]
            except Exception as e:  # the peers hear of it before rank 0 raises it
                failure, scattered = e, [("error", _one_line(e))] * self.world_size
        else:
            scattered = []
        dist.scatter_object_list(answers, scattered if self.rank == 0 else None, src=0, group=self.group)
        if failure is not None:
            raise failure
        kind, payload = answers[0]
        if kind == "error":
            raise EngineProcessError(f"SharedEngine: rank 0's engine process failed this rollout: {payload}")
        completions: list[list[Completion]] = payload
        return completions

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every rank takes the whole stream (each bucket is gathered by all); rank 0 sends it to the engine."""
        if self.engine is not None:
            self.engine.update_weights(named_tensors)
        for _ in named_tensors:  # the other ranks (and whatever the engine left): gathered, dropped
            pass
        self.needs_weights = False

    def wake(self) -> None:
        """The engine process never sleeps."""

    def sleep(self) -> None:
        """The engine process never sleeps."""

    def shutdown(self) -> None:
        """Close the engine process (rank 0); nothing to close elsewhere."""
        if self.engine is not None:
            self.engine.shutdown()


def start_shared_engine(build: Callable[[], Any], timeout_s: float) -> SharedEngine:
    """Build the engine on global rank 0 (``build()``) and a `SharedEngine` on every rank; a collective.

    Args:
        build: starts rank 0's engine (a `RestartingEngine`).
        timeout_s: the longest any rank waits for rank 0 in one collective of the engine's group.

    Raises:
        EngineProcessError: on the other ranks, in one line, when rank 0's engine failed to start (rank 0 raises
            its own error).
    """
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    engine, failure = None, None
    box: list[str | None] = [None, None]
    if dist.get_rank() == 0:
        try:
            engine = build()
            box = [str(engine.dtype), None]
        except Exception as e:  # the peers hear of it before rank 0 raises it
            failure, box = e, [None, _one_line(e)]
    dist.broadcast_object_list(box, src=0, group=group)
    if failure is not None:
        raise failure
    if box[1] is not None:
        raise EngineProcessError(f"SharedEngine: rank 0's engine process failed to start: {box[1]}")
    return SharedEngine(engine, group, getattr(torch, str(box[0]).removeprefix("torch.")))
