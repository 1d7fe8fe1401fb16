"""Difficulty curriculum state: each prompt's recent pass rate and the pool it belongs to.

A prompt whose ``G`` completions all pass (or all fail) gives every completion the same reward, so a group baseline
(GRPO, Dr. GRPO, RLOO) gives it zero advantage: it costs a rollout and teaches nothing (the observation behind DAPO's
dynamic sampling, Yu et al. 2025, https://arxiv.org/abs/2503.14476, and behind difficulty pools in online RL
trainers). These functions keep the per-prompt statistics a sampler needs to spend its rollouts on the others:

- `prompt_pass_rates`: this rollout's pass rate of every prompt, ``c_p / n_p`` (completions with reward at or above
  the threshold over completions sampled for prompt p);
- `update_pass_rates`: an exponential moving average over the rollouts that saw the prompt,
  ``r <- r + (1 - decay) * (x - r)`` (the first observation sets ``r = x``; ``decay = 0`` keeps the latest alone);
- `curriculum_pools`: ``ACTIVE``, ``SOLVED`` (``r >= solved_at``) or ``HOPELESS`` (``r <= hopeless_at``), a parked
  prompt returning to ``ACTIVE`` once ``readmit_after`` rollouts have passed since it was last seen;
- `pass_rate_histogram`: how the seen prompts' pass rates spread (for logging).

The update is written as ``r + (1 - decay) (x - r)`` rather than ``decay r + (1 - decay) x`` so that a rate of
exactly 1 (or 0) observed again stays exactly 1 (or 0) in floating point: pool membership compares with ``>=``/``<=``.
"""

from __future__ import annotations

import torch

ACTIVE, SOLVED, HOPELESS = 0, 1, 2
HISTOGRAM_BINS = ("0", "0-25", "25-50", "50-75", "75-100", "100")  # percent; "0" and "100" exactly


def prompt_pass_rates(prompt_index: torch.Tensor, rewards: torch.Tensor, threshold: float, num_prompts: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Passing and sampled completions per prompt: ``(c, n)``, both (P,) float64.

    Args:
        prompt_index: (N,) the prompt (0..P-1) each completion was sampled for.
        rewards: (N,) each completion's reward.
        threshold: a completion passes when its reward is at least this.
        num_prompts: P.

    Returns:
        ``c`` (P,) completions at or above `threshold`, ``n`` (P,) completions; the pass rate is ``c / n`` where
        ``n > 0``. Sums, so the counts of several data-parallel ranks add up before dividing.
    """
    passed = (rewards >= threshold).to(torch.float64)  # (N,)
    c = torch.zeros(num_prompts, dtype=torch.float64).index_add_(0, prompt_index, passed)  # (P,)
    n = torch.zeros(num_prompts, dtype=torch.float64).index_add_(0, prompt_index, torch.ones_like(passed))  # (P,)
    return c, n


def update_pass_rates(pass_rates: torch.Tensor, seen: torch.Tensor, passed: torch.Tensor, sampled: torch.Tensor,
                      decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one rollout's counts into the pass-rate moving average.

    Args:
        pass_rates: (P,) float64 moving averages (any value where ``seen == 0``).
        seen: (P,) int64 rollouts that observed each prompt so far.
        passed: (P,) passing completions this rollout (`prompt_pass_rates`' ``c``).
        sampled: (P,) completions this rollout (``n``; 0: not observed, left unchanged).
        decay: weight of the previous average, in [0, 1).

    Returns:
        New ``(pass_rates, seen)``: where ``n > 0`` and the prompt was seen, ``r + (1 - decay)(c / n - r)``; seen for
        the first time, ``c / n``; elsewhere unchanged.
    """
    observed = sampled > 0
    x = passed / sampled.clamp(min=1)  # (P,) this rollout's rate where observed
    # r <- r + (1 - decay) (x - r): exact fixed points at x == r (a rate of 1 stays 1)
    moved = torch.where(seen > 0, pass_rates + (1.0 - decay) * (x - pass_rates), x)
    return torch.where(observed, moved, pass_rates), seen + observed.to(seen.dtype)


def curriculum_pools(pass_rates: torch.Tensor, seen: torch.Tensor, last_seen: torch.Tensor, step: int,
                     solved_at: float, hopeless_at: float, readmit_after: int | None) -> torch.Tensor:
    """(P,) int64 pool of every prompt at rollout `step`: `ACTIVE`, `SOLVED` or `HOPELESS`.

    A seen prompt with ``r >= solved_at`` is solved, with ``r <= hopeless_at`` hopeless (solved wins if both hold),
    unless ``step - last_seen >= readmit_after`` (re-admitted: active again until its next observation). Unseen
    prompts are active.

    Args:
        pass_rates: (P,) moving-average pass rates.
        seen: (P,) observations per prompt.
        last_seen: (P,) the rollout index of each prompt's latest observation.
        step: the rollout being drawn.
        solved_at: pass rate from which a prompt is parked as solved.
        hopeless_at: pass rate up to which a prompt is parked as hopeless.
        readmit_after: rollouts a parked prompt stays parked; None: for good.
    """
    seen_ = seen > 0
    pools = torch.full_like(seen, ACTIVE)
    pools = torch.where(seen_ & (pass_rates <= hopeless_at), HOPELESS, pools)
    pools = torch.where(seen_ & (pass_rates >= solved_at), SOLVED, pools)
    if readmit_after is not None:
        pools = torch.where(step - last_seen >= readmit_after, ACTIVE, pools)
    return pools


def pass_rate_histogram(pass_rates: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """(6,) int64 counts of the seen prompts' pass rates in `HISTOGRAM_BINS`.

    The bins: exactly 0, (0, .25], (.25, .5], (.5, .75], (.75, 1), exactly 1.
    """
    r = pass_rates[seen > 0]
    inner = (r > 0) & (r < 1)
    edges = torch.tensor([0.25, 0.5, 0.75], dtype=r.dtype)
    middle = torch.bucketize(r[inner], edges, right=False)  # (0, .25] -> 0, ..., (.75, 1) -> 3
    counts = torch.zeros(6, dtype=torch.int64)
    counts[0], counts[5] = int((r <= 0).sum()), int((r >= 1).sum())
    counts[1:5] = torch.bincount(middle, minlength=4)
    return counts
