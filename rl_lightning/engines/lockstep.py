"""Generation rounds in step across ranks, for engines whose forward is a collective.

The HF engine samples from the policy itself; under FSDP2 / tensor parallelism every forward all-gathers parameters
with the other ranks, so all ranks must call ``generate`` equally often. Multi-turn rollouts decide per rank whether
another turn is needed (one rank's conversations may all have ended while a peer's go on), so each round the ranks
agree on "anyone still generating?" (one all-reduce of a flag) and a rank with nothing left generates a filler: one
one-token prompt, one completion, with the round's budget (so its decode loop runs as many steps as its peers'), whose
result is thrown away. The filler never becomes a trajectory, so it is in no loss, metric or reward.

The colocated vLLM engine (``tp_size: 1``) generates without collectives and needs none of this.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from rl_lightning.engines.protocol import Completion, RolloutEngine, SamplingParams

__all__ = ["Lockstep", "generate"]


class Lockstep:
    """Keeps the ranks' ``generate`` calls in step; counts this rank's real rounds and fillers.

    Args:
        device: where the flag meets the collective (the strategy's root device).
        filler_token: the filler prompt's one token (e.g. the pad token).
        group: the process group whose ranks must step together (None: the whole world, as the HF engine's decode
            loop agrees on its steps).
    """

    def __init__(self, device: torch.device, filler_token: int, group: Any = None) -> None:
        self.device, self.filler_token, self.group = device, filler_token, group
        self.rounds = 0  # generate calls with prompts of this rank's
        self.fillers = 0  # generate calls whose result was thrown away

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (the same answer on every rank)."""
        import torch.distributed as dist

        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item() > 0)

    def filler(self, engine: RolloutEngine, params: SamplingParams) -> None:
        """One generate call like the peers' (same budget and sampling), on a one-token prompt; nothing is kept.

        Seeded with its own generator, so it draws nothing from the default random stream.
        """
        engine.generate([[self.filler_token]], replace(params, n=1, seed=0, seeds=None))
        self.fillers += 1


def generate(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, lockstep: Lockstep | None
             ) -> list[list[Completion]]:
    """``engine.generate(prompts, params)``; a rank with no prompts generates a filler under `lockstep` instead.

    The caller has already agreed with its peers that this round runs (`Lockstep.any`).
    """
    if prompts:
        if lockstep is not None:
            lockstep.rounds += 1
        return engine.generate(prompts, params)
    if lockstep is not None:
        lockstep.filler(engine, params)
    return []
