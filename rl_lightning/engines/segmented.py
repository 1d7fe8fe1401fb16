"""Segmented generation: a colocated vLLM engine that generates in segments and takes new weights between them.

`SegmentedEngine` wraps a `rl_lightning.engines.vllm.VLLMEngine` (``model.rollout.inflight_segment_tokens: N``): every
unfinished request of every caller (the rollout being finished, the one read ahead, a validation) is generated together
for N more tokens, then the engine stops at the boundary, where new weights may load and requests submitted meanwhile
join. A request continues from its prefix (prompt + its tokens so far): the prefix's KV cache is recomputed under the
weights then loaded, so every token is sampled by exactly one policy version, whose log-probability the engine reports.
vLLM 0.32's ``LLM.sleep(level=0, mode="keep")`` would keep the old KV cache instead (tokens sampled by new weights
attending to activations of old ones, a policy no trainer can score) and pauses an engine core driven by one thread
only. The rollout side of in-flight updates is `rl_lightning.rollout.inflight`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rl_lightning.engines.protocol import Completion, SamplingParams, derive_seed


@dataclass
class _Request:
    """One completion being generated segment by segment."""

    prompt: list[int]
    params: SamplingParams  # n=1, `seed` this completion's own seed
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    done: bool = False
    finished: bool = False
    error: BaseException | None = None

    def segment_params(self, segment_tokens: int) -> SamplingParams:
        """Sampling parameters of the next segment: at most `segment_tokens`, a seed of its own per segment.

        The segment's seed is ``derive_seed(completion's seed, segment)``: no two segments share a random stream.
        """
        seed = self.params.seed
        return replace(self.params, max_new_tokens=min(segment_tokens, self.params.max_new_tokens - len(self.tokens)),
                       seed=None if seed is None else derive_seed(seed, self.segments))

    def extend(self, completion: Completion, asked: int, stopped: bool, version: int) -> None:
        """Append a segment's output; done at a stop, at the token budget or when the engine stopped it early."""
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs or [0.0] * len(completion.token_ids)
        self.versions += [version] * len(completion.token_ids)
        self.segments += 1
        self.finished = completion.finished
        self.done = stopped or len(completion.token_ids) < asked or len(self.tokens) >= self.params.max_new_tokens


class SegmentedEngine:
    """A `rl_lightning.engines.vllm.VLLMEngine` that generates in segments and takes new weights between them.

    `generate` may be called from several threads at once: their requests share the segments (one thread drives
    each segment, the others wait). Weight loads (`update_weights`, `update_adapter`, or anything under `paused`)
    wait for the current segment's end and hold the next one back until they are done. Anything else is the
    wrapped engine's.

    Args:
        engine: the colocated engine (``tp_size: 1``).
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
        from rl_lightning.engines.vllm import _completion, _sampling_params

        params = [r.segment_params(self.segment_tokens) for r in batch]
        inputs = [{"prompt_token_ids": r.prompt + r.tokens} for r in batch]
        outputs = self.engine.llm.generate(inputs, [_sampling_params(p, p.seed) for p in params], use_tqdm=False,
                                           lora_request=self.engine.lora_request)
        for r, p, output in zip(batch, params, outputs, strict=True):
            sample = output.outputs[0]
            r.extend(_completion(sample, p.stop_token_ids), p.max_new_tokens, sample.finish_reason == "stop", version)


def _one(params: SamplingParams, index: int, sample: int) -> SamplingParams:
    """Sample `sample` of prompt `index` as a request of its own (seed: ``params.sample_seed(index, sample)``)."""
    return replace(params, n=1, seeds=None, seed=params.sample_seed(index, sample))
