"""The prompt DataModule's difficulty curriculum (``data.curriculum``): rollouts go to prompts that carry signal.

Each rollout's rewards tell, per prompt, how many of its completions passed (reward at or above
``solved_threshold``); `rl_lightning.algorithms.curriculum` keeps a moving average of that pass rate per prompt and
sorts the prompts into three pools: *active*, *solved* (pass rate 1: every completion passes) and *hopeless* (pass
rate 0). Solved and hopeless prompts carry no group-baseline signal, so they are *parked*:

- the sampler walks a seeded permutation of the prompts (a new one each pass over them) and takes the next active
  prompts it meets; a parked prompt is taken only with probability ``parked_weight`` (0: skipped);
- a parked prompt is *re-admitted* (active again until it is next seen) ``readmit_after`` rollouts after it was
  last seen, so a prompt solved early is checked again later (forgetting) and a hopeless one once the policy improved;
- when fewer active prompts are left than a rollout takes, the parked ones seen longest ago fill the batch.

Lightning's epochs keep their length (prompts / batch size rollouts); within them the curriculum decides which prompts
each rollout gets, so an active prompt may come back before every prompt was seen once. The draw happens in
`rl_lightning.data.prompts.PromptDataModule.on_before_batch_transfer`, when the batch is about to be used (after the
previous rollout was observed), not when Lightning prefetches it; the rollout callback reports every rollout with
`PromptCurriculum.observe` (counts summed over the data-parallel ranks, so every rank holds the same state and draws
the same prompts). The state (pass rates, counters, the walk's position) is the DataModule's ``state_dict``:
Lightning checkpoints it, and a resumed run draws what the uninterrupted run would have drawn.

Peers do the same with other mechanics: prime-rl labels each problem easy/normal/hard from its latest group and
draws fixed fractions from each pool; open-instruct's active sampling drops prompts whose pass rate reached a bound
for the rest of the run. Here the rate is a moving average, both ends are parked and parked prompts come back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.algorithms.curriculum import (
    ACTIVE,
    HISTOGRAM_BINS,
    HOPELESS,
    SOLVED,
    curriculum_pools,
    pass_rate_histogram,
    prompt_pass_rates,
    update_pass_rates,
)
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.reductions import Groups, data_parallel_sum

STATE_KEYS = ("pass_rates", "seen", "last_seen", "draws", "rollouts", "passes", "cursor", "fingerprint")


@dataclass(frozen=True)
class CurriculumConfig:
    """The difficulty curriculum: ``data.curriculum.*`` (see `rl_lightning.data.curriculum`).

    Args:
        solved_threshold: a completion passes when its reward (the combined reward the task trains on) is at least
            this; e.g. 1.0 with ``correct: 1.0, format: 0.5`` counts correct answers.
        decay: weight of a prompt's previous pass rate in its moving average, in [0, 1); 0 keeps the latest rollout's.
        solved_at: pass rate from which a prompt is parked as solved (1.0: every completion passed).
        hopeless_at: pass rate up to which a prompt is parked as hopeless (0.0: none passed).
        readmit_after: rollouts after its last observation at which a parked prompt becomes active again; null:
            parked for the rest of the run.
        parked_weight: chance that the sampler takes a parked prompt it meets anyway, in [0, 1] (0: skipped,
            0.1: down-weighted ten times).
    """

    solved_threshold: float = 1.0
    decay: float = 0.0
    solved_at: float = 1.0
    hopeless_at: float = 0.0
    readmit_after: int | None = 50
    parked_weight: float = 0.0

    def __post_init__(self) -> None:
        errors = []
        if not 0.0 <= self.decay < 1.0:
            errors.append(f"data.curriculum.decay must be in [0, 1), got {self.decay}")
        if not 0.0 <= self.hopeless_at < self.solved_at <= 1.0:
            errors.append(f"data.curriculum needs 0 <= hopeless_at < solved_at <= 1, got hopeless_at={self.hopeless_at}"
                          f", solved_at={self.solved_at}")
        if self.readmit_after is not None and self.readmit_after < 1:
            errors.append(f"data.curriculum.readmit_after must be >= 1 rollouts or null (never), got "
                          f"{self.readmit_after}")
        if not 0.0 <= self.parked_weight <= 1.0:
            errors.append(f"data.curriculum.parked_weight must be in [0, 1], got {self.parked_weight}")
        if errors:
            raise ConfigError("; ".join(errors))


def check_curriculum_task(task: Any) -> None:
    """Refuse, at start-up, a curriculum on a task that samples no groups (or reads its prompts ahead).

    Raises:
        ConfigError: one line naming the key, its value and the fix.
    """
    rollout = getattr(task, "rollout_config", None)
    if rollout is None:
        raise ConfigError(f"data.curriculum needs a task that samples groups of completions per prompt (model: "
                          f"rl_lightning.tasks.PPO), got {type(task).__name__}; set data.curriculum: null")
    if rollout.responses_per_prompt < 2:
        raise ConfigError(f"data.curriculum measures each prompt's pass rate over its group, but "
                          f"model.rollout.responses_per_prompt={rollout.responses_per_prompt}; set it >= 2 (e.g. 8) "
                          "or data.curriculum: null")
    if getattr(rollout, "async_steps", 0):
        raise ConfigError(f"data.curriculum draws each rollout's prompts from the previous rollout's pass rates, but "
                          f"model.rollout.async_steps={rollout.async_steps} reads them ahead; set async_steps: 0 or "
                          "data.curriculum: null")


class PromptCurriculum:
    """Per-prompt pass rates, pools and the seeded walk that draws each rollout's prompts (state in `state_dict`).

    Args:
        config: the ``data.curriculum`` settings.
        num_prompts: P, the training prompts (indexed by `rl_lightning.data.prompts.Prompt.index`).
        seed: base seed of the walk's permutations (the run's seed, ``seed_everything``).
    """

    def __init__(self, config: CurriculumConfig, num_prompts: int, seed: int = 0) -> None:
        self.config, self.num_prompts = config, num_prompts
        self.seed = seed
        self.pass_rates = torch.zeros(num_prompts, dtype=torch.float64)
        self.seen = torch.zeros(num_prompts, dtype=torch.int64)  # rollouts that observed each prompt
        self.last_seen = torch.zeros(num_prompts, dtype=torch.int64)  # the latest of them
        self.draws = torch.zeros(num_prompts, dtype=torch.int64)  # times drawn
        self.rollouts = 0  # rollouts observed: the curriculum's clock
        self.passes, self.cursor = 0, 0  # the walk: which permutation, where in it
        self.fingerprint = 0  # a running hash of every draw (index and order), to compare runs
        self._cached_walk: tuple[int, list[int], list[float]] = (-1, [], [])

    # ------------------------------------------------------------------------------------------------- drawing

    def pools(self) -> torch.Tensor:
        """(P,) pool of every prompt for the next draw (`ACTIVE`, `SOLVED`, `HOPELESS`)."""
        c = self.config
        return curriculum_pools(self.pass_rates, self.seen, self.last_seen, self.rollouts, c.solved_at,
                                c.hopeless_at, c.readmit_after)

    def _walk(self, index: int) -> tuple[list[int], list[float]]:
        """Permutation `index` of the prompts and the coins the walk tosses for parked prompts along it."""
        if self._cached_walk[0] != index:  # a pass is walked over many draws: build it once
            # the plain loader's seed for epoch `index`: unobserved, the walk draws what the plain run draws
            generator = torch.Generator().manual_seed(self.seed + index)
            order = torch.randperm(self.num_prompts, generator=generator).tolist()
            coins = torch.rand(self.num_prompts, generator=generator, dtype=torch.float64).tolist()
            self._cached_walk = (index, order, coins)
        return self._cached_walk[1], self._cached_walk[2]

    def draw(self, rows: int) -> list[int]:
        """The next `rows` distinct prompt indices (every rank's share, in rank order); advances the walk."""
        if rows > self.num_prompts:
            raise ConfigError(f"data.curriculum: a rollout takes {rows} prompts, more than the {self.num_prompts} "
                              "training prompts; lower data.batch_size")
        parked = (self.pools() != ACTIVE).tolist()  # (P,)
        short = rows - parked.count(False)
        if short > 0:  # too few active prompts: the parked ones seen longest ago come back first
            last_seen = self.last_seen.tolist()
            for i in sorted((i for i, p in enumerate(parked) if p), key=lambda i: (last_seen[i], i))[:short]:
                parked[i] = False
        chosen: list[int] = []
        order, coins = self._walk(self.passes)
        while len(chosen) < rows:
            if self.cursor == self.num_prompts:
                self.passes, self.cursor = self.passes + 1, 0
                order, coins = self._walk(self.passes)
            i, coin = order[self.cursor], coins[self.cursor]
            self.cursor += 1
            if i not in chosen and (not parked[i] or coin < self.config.parked_weight):
                chosen.append(i)
        for i in chosen:
            self.draws[i] += 1
            self.fingerprint = (self.fingerprint * 1_000_003 + i + 1) % (1 << 61)
        return chosen

    # ----------------------------------------------------------------------------------------------- observing

    def observe(self, groups: Groups, prompt_index: list[int], rewards: list[float]) -> dict[str, float]:
        """Fold one rollout's rewards into the pass rates (summed over data-parallel ranks) and return the metrics.

        Args:
            groups: the parallel layout (its data-parallel group; every rank must call this once per rollout).
            prompt_index: (N,) the prompt index of each of this rank's trajectories.
            rewards: (N,) their rewards.

        Returns:
            ``curriculum/active``, ``curriculum/solved``, ``curriculum/hopeless`` (pool sizes for the next draw) and
            ``curriculum/pass_rate/<bin>`` (the seen prompts' pass-rate histogram, `HISTOGRAM_BINS`).
        """
        c, n = prompt_pass_rates(torch.tensor(prompt_index, dtype=torch.int64),
                                 torch.tensor(rewards, dtype=torch.float64), self.config.solved_threshold,
                                 self.num_prompts)
        device = groups.device
        # whole counts: exact in the all-reduce's float32 up to 2**24 completions per prompt and rollout
        counts = data_parallel_sum(groups, torch.stack([c, n]).to(device)).cpu().to(torch.float64)  # (2, P)
        self.pass_rates, self.seen = update_pass_rates(self.pass_rates, self.seen, counts[0], counts[1],
                                                       self.config.decay)
        self.last_seen = torch.where(counts[1] > 0, self.rollouts, self.last_seen)
        self.rollouts += 1
        return self.metrics()

    def metrics(self) -> dict[str, float]:
        """Pool sizes for the next draw and the seen prompts' pass-rate histogram."""
        pools = self.pools()
        out = {f"curriculum/{name}": float((pools == code).sum())
               for name, code in (("active", ACTIVE), ("solved", SOLVED), ("hopeless", HOPELESS))}
        histogram = pass_rate_histogram(self.pass_rates, self.seen).tolist()
        out.update({f"curriculum/pass_rate/{name}": float(v) for name, v in zip(HISTOGRAM_BINS, histogram,
                                                                                  strict=True)})
        out["curriculum/unseen"] = float((self.seen == 0).sum())
        return out

    # ---------------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Everything the next draws depend on (tensors cloned, counters as ints)."""
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k in STATE_KEYS
                for v in (getattr(self, k),)} | {"num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s state; a different number of prompts is a one-line `ConfigError`."""
        if state["num_prompts"] != self.num_prompts:
            raise ConfigError(f"the checkpoint's data.curriculum tracks {state['num_prompts']} training prompts, "
                              f"data.path has {self.num_prompts}: resume with the same data (or data.curriculum: null)")
        for k in STATE_KEYS:
            setattr(self, k, state[k].clone() if isinstance(state[k], torch.Tensor) else state[k])
