"""One-step-off-policy (asynchronous) rollouts: rollout k+1 is generated while the trainer updates on rollout k.

With ``model.rollout.async_steps: 1`` the rollout callback, at the start of training batch k:

1. takes rollout k, generated in the background during step k-1 by the policy of version k-1 (the policy after k-1
   rollouts' updates); the first rollout of a fit and of each epoch has nothing generated ahead and is sampled there
   and then, by the current policy;
2. pushes the current policy (version k) into the engine, in the training thread, while no generation uses it;
3. submits rollout k+1 (the next batch's prompts, read ahead with `rl_lightning.data.prompts.PromptBatches.share`)
   unless it would never be trained (``model.max_rollouts`` reached, or the epoch's last batch);
4. hands rollout k to the trainer.

Every read-ahead rollout is thus trained on by a policy one update newer than the one that sampled it
(``rollout/staleness`` 1). Its trajectories carry the sampling policy's log-probabilities (the engine's), which the
task's mismatch correction weighs against; the trainer's ``old_logprobs`` are recomputed by the current policy, as in
decoupled PPO (Hilton et al. 2021, https://arxiv.org/abs/2110.00641).

A rollout submitted is keyed by its rollout index and prompt rows; one taken under a different key (a batch the
trainer skipped) is discarded and the batch sampled synchronously. A checkpoint holds every rank's in-flight rollout
(`pending_state`: the save waits for it to finish, and it stays pending): a run resumed from it takes that rollout,
sampled by the policy that sampled it in the uninterrupted run, and goes on bit for bit (CPU; the timings excepted).

Generators (the `Generator` protocol): `ThreadGenerator`, the rank's engine thread in the training process that drives
the engine and the reward workers; it selects the rank's device and its engine stream before its first call, and
every engine call of the mode runs there, the fit's first (synchronous) rollout and the weight pushes included
(`rl_lightning.rollout.engine_thread`). With the in-process vLLM engine this is the colocated mode: the engine's forward and the
trainer's kernels share the process (both release the GIL in their kernels, not in their Python). With
`rl_lightning.engines.process.EngineProcess` as the engine the same thread only waits on a pipe while a
separate engine process generates (disaggregated; weights broadcast over a process group of its own); that engine is
not selectable from the config yet. A generator keeping several rollouts in flight (``async_steps`` > 1) or feeding
engines shared by several trainer ranks would implement the same protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from rl_lightning.data.prompts import Prompt
from rl_lightning.engines.registry import kinds_with
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.engine_thread import handed_over, run_ordered, select_device, taken_back
from rl_lightning.rollout.trajectory import Trajectory


@dataclass
class Finished:
    """A background rollout taken by the trainer.

    It holds what `work` returned, the policy version that generated it, how long the trainer waited for it and how
    long generating it took.
    """

    value: Any
    version: int
    wait_s: float
    generate_s: float


class Generator(Protocol):
    """Runs one rollout at a time in the background, keyed by the batch it is for."""

    def submit(self, key: Hashable, version: int, work: Callable[[], Any]) -> None:
        """Start generating (`work`) in the background with the engine's current weights, policy `version`."""

    def take(self, key: Hashable) -> Finished | None:
        """Wait for the pending rollout and return it if it was submitted under `key`, else drop it (None)."""

    def run(self, work: Callable[[], Any]) -> Any:
        """`work()` where the engine's calls run (its thread), waited for: a weight push, a synchronous rollout."""

    def idle(self) -> None:
        """Wait until no generation uses the engine (before a weight push or a validation rollout)."""

    def close(self) -> None:
        """Wait for and drop any pending rollout; release the generator's resources."""


def _timed(work: Callable[[], Any], ready: Any, device: Any) -> tuple[Any, float, Any]:
    """On the engine thread: `work`'s result, its seconds, and the event the trainer's stream waits for."""
    start = time.perf_counter()
    value, done = run_ordered(work, ready, device)
    return value, time.perf_counter() - start, done


def _select(device: Any) -> None:
    if device is not None:  # None: a generator no callback started (its threads use no device)
        select_device(device)


class ThreadGenerator:
    """Colocated generation: rollouts on the rank's engine thread(s), taken in submission order.

    Each engine thread selects `device` (and the rank's engine stream) before running anything
    (`rl_lightning.rollout.engine_thread.select_device`); set `device` before the first `submit` or `run`.

    Args:
        max_pending: rollouts generating at once (1: one engine thread; 2 with in-flight weight updates, where rollout
            k+1 is submitted while rollout k finishes, both on one engine: `rl_lightning.rollout.inflight`).
        device: the rank's device (``trainer.strategy.root_device``; None: the threads select none).
    """

    def __init__(self, max_pending: int = 1, device: Any = None) -> None:
        self.max_pending = max_pending
        self.device = device
        self._executor: ThreadPoolExecutor | None = None
        self._queue: list[tuple[Hashable, int, Future]] = []  # (key, version, future), oldest first

    @property
    def pending(self) -> bool:
        """Whether a submitted rollout has not been taken yet."""
        return bool(self._queue)

    @property
    def _pending(self) -> tuple[Hashable, int, Future] | None:
        """The oldest pending rollout (the one a checkpoint holds), or None."""
        return self._queue[0] if self._queue else None

    def submitted(self, key: Hashable) -> bool:
        """Whether the oldest pending rollout was submitted under `key`."""
        return bool(self._queue) and self._queue[0][0] == key

    def submit(self, key: Hashable, version: int, work: Callable[[], Any]) -> None:
        """Run `work` on a background thread for batch `key`, policy `version`; `max_pending` rollouts at most."""
        if len(self._queue) >= self.max_pending:
            raise RuntimeError(f"ThreadGenerator.submit: {len(self._queue)} rollout(s) still pending; take one first")
        self._queue.append((key, version, self._start(work)))

    def run(self, work: Callable[[], Any]) -> Any:
        """`work()` on an engine thread, waited for.

        An engine call of the training thread's (a weight push, a first rollout, a validation): every engine call of
        the mode runs on the engine's device and stream.
        """
        value, _, done = self._start(work).result()
        taken_back(done, self.device)
        return value

    def _start(self, work: Callable[[], Any]) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_pending, thread_name_prefix="rl_lightning-engine",
                                                initializer=_select, initargs=(self.device,))
        return self._executor.submit(_timed, work, handed_over(self.device), self.device)

    def take(self, key: Hashable) -> Finished | None:
        """Wait for the oldest pending rollout; returns it if submitted under `key`, else drops it (None; also if none)."""
        if not self._queue:
            return None
        submitted, version, future = self._queue.pop(0)
        start = time.perf_counter()
        value, seconds, done = future.result()  # a failed generation raises here, in the training thread
        waited = time.perf_counter() - start
        taken_back(done, self.device)
        return Finished(value, version, waited, seconds) if submitted == key else None

    def idle(self) -> None:
        """Wait until the pending generations (if any) have finished with the engine."""
        if self._queue:
            wait_for([future for _, _, future in self._queue])

    def close(self) -> None:
        """Wait for and drop any pending rollout; shut the background threads down."""
        self.idle()  # the generation may still use the engine and the reward workers
        self._queue = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _encode(value: Any) -> dict[str, Any]:
    trajectories, metrics = value
    return {"trajectories": [asdict(t) for t in trajectories], "metrics": metrics}


def _decode(state: dict[str, Any]) -> Any:
    trajectories = [Trajectory(**{**t, "prompt": Prompt(**t["prompt"])}) for t in state["trajectories"]]
    return trajectories, state["metrics"]


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def pending_state(generator: ThreadGenerator) -> list[dict[str, Any] | None]:
    """Every rank's pending rollout ``(trajectories, metrics)`` as plain data (None: none), indexed by global rank.

    Waits for this rank's generation to finish; the rollout stays pending. A collective when several processes run:
    Lightning builds the checkpoint on every rank. Between training batches at most one rollout is pending (with
    in-flight updates the second one is only submitted at a batch's start).
    """
    if len(generator._queue) > 1:
        raise RuntimeError("pending_state: a checkpoint holds one pending rollout; save between training batches")
    pending = generator._pending
    mine = None
    if pending is not None:
        key, version, future = pending
        value, seconds, _ = future.result()
        keys: tuple[int, ...] = key  # type: ignore[assignment]  # the callback keys by (rollout, *prompt rows)
        mine = {"key": list(keys), "version": version, "generate_s": seconds, **_encode(value)}
    _, world_size = _world()
    if world_size == 1:
        return [mine]
    import torch.distributed as dist

    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, mine)
    return states


def restore_pending(generator: ThreadGenerator, states: list[dict[str, Any] | None]) -> None:
    """Make this rank's rollout of `pending_state` the generator's pending one (nothing when it had none)."""
    rank, _ = _world()
    state = states[rank] if rank < len(states) else None
    if state is None:
        return
    future: Future = Future()
    future.set_result((_decode(state), state["generate_s"], None))
    generator._queue = [(tuple(state["key"]), state["version"], future)]


def async_errors(config: Any) -> list[str]:
    """What a `RolloutConfig` cannot do with ``async_steps`` (messages without the ``model.rollout.`` prefix)."""
    c = config
    if c.async_steps not in (0, 1):
        return [f"async_steps must be 0 (synchronous) or 1 (one-step-off-policy), got {c.async_steps}; more steps "
                "off policy are not supported yet"]
    spec, tp = c.engine_spec, getattr(c.engine_settings, "tp_size", 1)
    if c.async_steps and (not spec.async_rollout or tp > 1):
        # the background thread must issue no collective: the HF engine generates with the (sharded) policy being
        # trained, and the ranks of a tensor-parallel engine pool their prompts with all_gather_object
        return [f"async_steps=1 needs an engine kind that generates in the background ({kinds_with('async_rollout')}) "
                f"with tp_size: 1 (got kind '{spec.kind}', tp_size {tp}); set them, or async_steps: 0"]
    segment = getattr(c, "inflight_segment_tokens", None)
    if segment is not None and (segment < 1 or not c.async_steps or not spec.inflight or c.replay is not None):
        # the segments are generated through the colocated engine's vllm.LLM, between the trainer's weight pushes
        return [f"inflight_segment_tokens={segment} needs async_steps: 1, an engine kind that takes weights in "
                f"flight ({kinds_with('inflight')}) and no replay, and must be >= 1 (got async_steps {c.async_steps}, "
                f"engine kind '{spec.kind}', replay {c.replay}); set them, or inflight_segment_tokens: null"]
    return []


def read_ahead(trainer: Any, pl_module: Any, batch_idx: int) -> list | None:
    """This rank's prompts of the training batch after `batch_idx`, or None when there is none to read ahead.

    None when that batch would not be trained (``model.max_rollouts`` reached) or belongs to the next epoch (the
    read-ahead does not cross epochs). Read from the prompt dataset (`rl_lightning.data.prompts.PromptBatches.share`),
    not from Lightning's prefetching fetcher.
    """
    share = getattr(getattr(trainer.train_dataloader, "dataset", None), "share", None)
    if share is None:
        raise ConfigError("model.rollout.async_steps=1 reads the next batch of prompts ahead, which needs the prompts "
                          "of rl_lightning.data.PromptDataModule; use it, or set async_steps: 0")
    max_rollouts = getattr(pl_module, "hparams", {}).get("max_rollouts")
    if batch_idx + 1 >= trainer.num_training_batches or (max_rollouts is not None and
                                                          pl_module.rollouts + 1 >= max_rollouts):
        return None
    return share(trainer.current_epoch, batch_idx + 1)
