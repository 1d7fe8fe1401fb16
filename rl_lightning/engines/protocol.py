"""The rollout engine protocol: token ids in, token ids (+ log-probabilities) out.

Token-in/token-out means completions are never re-tokenised: the trainer scores exactly the tokens the engine
sampled, and the engine's per-token log-probabilities can correct for sampling mismatches (truncated importance
sampling). Engines: `rl_lightning.engines.hf.HFEngine` (transformers ``generate`` on the policy itself) and
`rl_lightning.engines.vllm.VLLMEngine` (vLLM colocated in the training processes, fed the policy's weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    """How to sample. `temperature` 0 is greedy; `seed` or per-prompt `seeds` make sampling reproducible."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    seeds: list[int] | None = None

    def request_seed(self, index: int) -> int | None:
        """The seed of the `index`-th prompt of a `generate` call.

        ``seeds[index]`` when given (the rollout callback derives them from the prompts' dataset rows, so a prompt
        samples the same completions on whichever rank it lands), else ``seed + index``; None samples freshly. The
        ``n`` samples of a prompt share its seed.
        """
        if self.seeds is not None:
            return self.seeds[index]
        return None if self.seed is None else self.seed + index


@dataclass
class Completion:
    """One sampled completion.

    Its token ids, the engine's log-probability of each (None if not provided), whether it ended with a stop token
    (False: truncated at `max_new_tokens`) and, from an engine updated in flight, the policy version that sampled
    each token (`rl_lightning.rollout.inflight`; None: one version, the engine's weights of the whole call).
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    versions: list[int] | None = None


class RolloutEngine(Protocol):
    """What the rollout needs from an engine: sampling from token ids, and taking the policy's current weights."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each prompt (a list of token ids), in prompt order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors by Hugging Face parameter name."""

    def wake(self) -> None:
        """Make weights and cache resident before generation (no-op where sleeping is not supported)."""

    def sleep(self) -> None:
        """Release generation memory for training (no-op where sleeping is not supported)."""
