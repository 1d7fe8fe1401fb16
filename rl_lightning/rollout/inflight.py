"""In-flight weight updates (partial rollouts) for one-step-off-policy rollouts.

With ``model.rollout.inflight_segment_tokens: N`` (and ``async_steps: 1``, ``engine: vllm``) the colocated engine
generates in segments of at most N tokens per request (`SegmentedEngine`): every unfinished request of every caller
(the rollout being finished, the one read ahead, a validation) is generated together for N more tokens, then the
engine stops at the boundary, where new weights may load and requests submitted meanwhile join. A request continues
from its prefix (prompt + its tokens so far): the prefix's KV cache is recomputed under the weights then loaded, so
every token is sampled by exactly one policy version, whose log-probability the engine reports. vLLM 0.32's
``LLM.sleep(level=0, mode="keep")`` would keep the old KV cache instead (tokens sampled by new weights attending to
activations of old ones, a policy no trainer can score) and pauses an engine core driven by one thread only.

At the start of training batch k the callback (`InflightRolloutCallback`):

1. pushes the policy of version k into the engine at the next segment boundary, while rollout k (read ahead during
   step k-1 by version k-1) may still be generating its long completions: their remaining tokens are version k's;
2. submits rollout k+1 at once, so that its requests fill the engine while rollout k's tail finishes (without
   in-flight updates the engine waits for that tail, then for the weight push, before rollout k+1 starts);
3. takes rollout k (waiting for its last tokens) and stamps its trajectories with the trained version k.

Each completion token records its version (`rl_lightning.rollout.trajectory.Trajectory.policy_versions`); the task
trains on ``policy_lags`` = trained version - token version (0 or 1 here) and its correction weighs every token
against the engine log-probability of the version that sampled it
(`rl_lightning.algorithms.staleness.versioned_mismatch_weights`). Runs are not reproducible bit for bit: which
segment a weight push lands between depends on timing (the trainer's step vs the engine's progress).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import lightning as L
import torch

from rl_lightning.rollout.async_rollout import ThreadGenerator, read_ahead
from rl_lightning.rollout.callback import PolicyTask, RolloutCallback
from rl_lightning.rollout.config import RolloutConfig
from rl_lightning.rollout.engine import Completion, SamplingParams


@dataclass
class _Request:
    """One completion being generated segment by segment."""

    prompt: list[int]
    params: SamplingParams  # n=1, this completion's own seed
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    done: bool = False
    finished: bool = False
    error: BaseException | None = None

    def segment_params(self, segment_tokens: int) -> SamplingParams:
        """Sampling parameters of the next segment: at most `segment_tokens`, a seed of its own per segment."""
        seed = self.params.seed
        return replace(self.params, max_new_tokens=min(segment_tokens, self.params.max_new_tokens - len(self.tokens)),
                       seed=None if seed is None else seed + 104_729 * self.segments)

    def extend(self, completion: Completion, asked: int, stopped: bool, version: int) -> None:
        """Append a segment's output; done at a stop, at the token budget or when the engine stopped it early."""
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs or [0.0] * len(completion.token_ids)
        self.versions += [version] * len(completion.token_ids)
        self.segments += 1
        self.finished = completion.finished
        self.done = stopped or len(completion.token_ids) < asked or len(self.tokens) >= self.params.max_new_tokens


class SegmentedEngine:
    """A `rl_lightning.rollout.vllm.VLLMEngine` that generates in segments and takes new weights between them.

    `generate` may be called from several threads at once: their requests share the segments (one thread drives
    each segment, the others wait). Weight loads (`update_weights`, `update_adapter`, or anything under `paused`)
    wait for the current segment's end and hold the next one back until they are done. Anything else is the
    wrapped engine's.

    Args:
        engine: the colocated engine (``engine_tp_size: 1``).
        segment_tokens: tokens per request per segment.
    """

    def __init__(self, engine: Any, segment_tokens: int) -> None:
        self.engine, self.segment_tokens = engine, segment_tokens
        self.version = 0  # the policy version of the engine's weights (set by `paused`)
        self.segments = 0  # segments generated so far
        self.after_segment: Callable[[int], None] | None = None  # called after each segment (tests, benchmarks)
        self._cond = threading.Condition()
        self._pool: list[_Request] = []  # unfinished requests of every caller
        self._driving = False
        self._pauses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @contextmanager
    def paused(self, version: int | None = None) -> Iterator[None]:
        """No segment runs inside (entered at a segment boundary); the weights then carry `version` (if given)."""
        with self._cond:
            self._pauses += 1
            while self._driving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                if version is not None:
                    self.version = version
                self._pauses -= 1
                self._cond.notify_all()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`VLLMEngine.update_weights` at a segment boundary."""
        with self.paused():
            self.engine.update_weights(named_tensors)

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> None:
        """`VLLMEngine.update_adapter` at a segment boundary."""
        with self.paused():
            self.engine.update_adapter(named_tensors, config)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt, each token tagged with the version that sampled it."""
        requests = [_Request(list(prompt), _one(params, index, sample))
                    for index, prompt in enumerate(prompts) for sample in range(params.n)]
        with self._cond:
            self._pool += requests
            while not all(r.done for r in requests):
                if self._driving or self._pauses:
                    self._cond.wait()
                    continue
                self._drive()
        failed = next((r.error for r in requests if r.error is not None), None)
        if failed is not None:
            raise failed
        completions = [Completion(r.tokens, r.logprobs, r.finished, r.versions) for r in requests]
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _drive(self) -> None:
        """Generate one segment of every pooled request (called holding the lock; runs without it)."""
        self._driving, batch, version = True, [r for r in self._pool if not r.done], self.version
        self._cond.release()
        try:
            self._segment(batch, version)
        except BaseException as e:  # every caller waiting on these requests raises it
            for r in batch:
                r.error, r.done = e, True
        finally:
            self._cond.acquire()
            self._driving, self.segments = False, self.segments + 1
            self._pool = [r for r in self._pool if not r.done]
            self._cond.notify_all()
        if self.after_segment is not None:
            self._cond.release()
            try:
                self.after_segment(self.segments)
            finally:
                self._cond.acquire()

    def _segment(self, batch: list[_Request], version: int) -> None:
        from rl_lightning.rollout.vllm import _completion, _sampling_params

        params = [r.segment_params(self.segment_tokens) for r in batch]
        inputs = [{"prompt_token_ids": r.prompt + r.tokens} for r in batch]
        outputs = self.engine.llm.generate(inputs, [_sampling_params(p, 0) for p in params], use_tqdm=False,
                                           lora_request=self.engine.lora_request)
        for r, p, output in zip(batch, params, outputs, strict=True):
            sample = output.outputs[0]
            r.extend(_completion(sample, p.stop_token_ids), p.max_new_tokens, sample.finish_reason == "stop", version)


def _one(params: SamplingParams, index: int, sample: int) -> SamplingParams:
    """Sample `sample` of prompt `index` as a request of its own (seed: the prompt's + the sample's index)."""
    seed = params.request_seed(index)
    return replace(params, n=1, seeds=None, seed=None if seed is None else seed + sample)


class InflightRolloutCallback(RolloutCallback):
    """`RolloutCallback` whose one-step-off rollouts take new weights in flight (see the module's docstring)."""

    def __init__(self, config: RolloutConfig) -> None:
        super().__init__(config)
        if self.generator is not None:  # rollout k+1 starts while rollout k finishes
            self.generator = ThreadGenerator(max_pending=2)
        # two rollouts in flight score (and interact) from two threads: whole calls take turns, so the env's
        # counters and its reward model see one caller at a time (the reward pool is itself safe across threads;
        # ``rollout/reward_s`` counts the other rollout's scoring too)
        lock = threading.Lock()
        for name in ("score_all", "interact_all"):
            setattr(self.env, name, _taking_turns(getattr(self.env, name), lock))

    def _vllm_engine(self, trainer: L.Trainer, task: PolicyTask) -> Any:
        segment = self.config.inflight_segment_tokens
        assert segment is not None  # built by `rollout_callback` only when set
        return SegmentedEngine(super()._vllm_engine(trainer, task), segment)

    def _async_rollout(self, generator: ThreadGenerator, trainer: L.Trainer, task: PolicyTask, batch: dict,
                       batch_idx: int) -> None:
        """Push version k at the next segment boundary, submit rollout k+1, then take rollout k."""
        index, prompts = task.rollouts, batch["prompts"]
        key = (index, *(p.index for p in prompts))
        with self.engine.paused(index):  # rollout k's unfinished completions continue with version k
            self._prepare_engine(trainer, task)
        ahead = read_ahead(trainer, task, batch_idx)
        if not generator.submitted(key):  # nothing read ahead (a fit's or an epoch's first batch): sampled now
            generator.take(key)  # drops a rollout read ahead for another batch
            trajectories, metrics = self._sample(trainer, task, prompts, index)
            version, waited = index, 0.0
            self._submit(generator, trainer, task, ahead, index)
        else:
            self._submit(generator, trainer, task, ahead, index)
            finished = generator.take(key)
            assert finished is not None  # submitted under `key`
            (trajectories, metrics), version, waited = finished.value, finished.version, finished.wait_s
        for t in trajectories:
            t.trained_version = index
        versions = [v for t in trajectories if t.policy_versions is not None
                    for v, m in zip(t.policy_versions, t.completion_mask, strict=True) if m]
        metrics.update({"rollout/staleness": float(index - version), "rollout/wait_s": waited,
                        # completion tokens sampled by an older policy than the one trained (the rest: in flight)
                        "rollout/stale_token_share": sum(v < index for v in versions) / max(1, len(versions))})
        batch["rollout"] = self._finish(trainer, task, trajectories, metrics)

    def _submit(self, generator: ThreadGenerator, trainer: L.Trainer, task: PolicyTask, ahead: list | None,
                index: int) -> None:
        if ahead is not None:
            generator.submit((index + 1, *(p.index for p in ahead)), index,
                             lambda: self._sample(trainer, task, ahead, index + 1))


def _taking_turns(method: Callable[..., Any], lock: threading.Lock) -> Callable[..., Any]:
    def serialised(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return method(*args, **kwargs)

    return serialised


def rollout_callback(config: RolloutConfig) -> RolloutCallback:
    """The rollout callback `config` asks for: `InflightRolloutCallback` with ``inflight_segment_tokens`` set."""
    if config.inflight_segment_tokens is not None:
        return InflightRolloutCallback(config)
    return RolloutCallback(config)
