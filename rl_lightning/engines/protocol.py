"""The rollout engine protocol: token ids in, token ids (+ log-probabilities) out.

Token-in/token-out means completions are never re-tokenised: the trainer scores exactly the tokens the engine
sampled, and the engine's per-token log-probabilities can correct for sampling mismatches (truncated importance
sampling). Engines: `rl_lightning.engines.hf.HFEngine` (transformers ``generate`` on the policy itself) and
`rl_lightning.engines.vllm.VLLMEngine` (vLLM colocated in the training processes, fed the policy's weights).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that is a stable hash of `keys` (e.g. the run's seed, the rollout, the round, the row, the turn).

    BLAKE2b of the keys packed as signed 64-bit integers: the same keys give the same seed in every process and
    Python version (unlike ``hash``), and two different key tuples share a seed with probability about 2^-63, where
    sums such as ``seed + row`` collide as soon as two offsets line up.
    """
    packed = struct.pack(f"<{len(keys)}q", *((k + 2**63) % 2**64 - 2**63 for k in keys))
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1


@dataclass
class SamplingParams:
    """How to sample. `temperature` 0 is greedy; `seed` or per-prompt `seeds` make sampling reproducible.

    Every completion (prompt ``i``, sample ``j``) is drawn from a random stream of its own, seeded
    `sample_seed` ``(i, j)``: engines pass that seed to each sample explicitly.
    """

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
        samples the same completions on whichever rank it lands), else ``derive_seed(seed, index)``; None samples
        freshly. Each of the prompt's ``n`` samples has its own seed, derived from this one (`sample_seed`).
        """
        if self.seeds is not None:
            return self.seeds[index]
        return None if self.seed is None else derive_seed(self.seed, index)

    def sample_seed(self, index: int, sample: int) -> int | None:
        """The seed of sample `sample` of the `index`-th prompt: ``derive_seed(request_seed(index), sample)``.

        None when sampling is unseeded.
        """
        seed = self.request_seed(index)
        return None if seed is None else derive_seed(seed, sample)


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
