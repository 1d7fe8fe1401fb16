"""What fits: the largest token budget under a memory limit, and the one-line refusal naming the keys that would fit.

Pure functions of a `rl_lightning.memory.plan.TrainSetup`; the task start-up hook
(`rl_lightning.tasks.memory_check`) calls them with the device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rl_lightning.memory.plan import (
    BUDGET_STEP,
    GIB,
    MAX_BUDGET,
    MemoryPlan,
    TrainSetup,
    micro_batch_tokens,
    plan_memory,
)


def largest_budget(s: TrainSetup, limit: float, minimum: int = 1, maximum: int = MAX_BUDGET,
                   step: int = BUDGET_STEP) -> int | None:
    """The largest token budget in [`minimum`, `maximum`] whose predicted peak is at most `limit` bytes, or None.

    A multiple of `step` tokens unless only `minimum` fits; the peak grows with the budget, so this is a bisection.
    """
    def fits(tokens: int) -> bool:
        return plan_memory(replace(s, tokens=tokens)).peak <= limit

    if not fits(minimum):
        return None
    if fits(maximum):
        return maximum
    low, high = 0, maximum // step  # multiples of `step`: low * step fits (or is below minimum), high does not
    while high - low > 1:
        mid = (low + high) // 2
        if mid * step < minimum or fits(mid * step):
            low = mid
        else:
            high = mid
    return max(minimum, low * step)


@dataclass(frozen=True)
class Keys:
    """The config keys a refusal names for this task (they differ between the packed DataModules and PPO)."""

    budget: str = "data.max_length_per_device"
    checkpointing: str = "model.lm.gradient_checkpointing"
    chunk: str = "model.lm.lm_head_chunk"
    check: str = "model.lm.memory_check"


def fit_suggestions(s: TrainSetup, keys: Keys, minimum: int = 1) -> list[str]:
    """``key: value`` changes that each make `s` fit `s.device_memory` (empty: none on its own or together).

    The largest budget that fits (not below `minimum`, the longest sequence), gradient checkpointing, the chunked
    head; if none fits alone, checkpointing and chunking together with the largest budget that then fits.
    """
    limit = s.device_memory
    out = []
    budget = largest_budget(s, limit, minimum, maximum=s.tokens - 1) if s.tokens > minimum else None
    if budget is not None:
        out.append(f"{keys.budget}: {budget}")
    if not s.gradient_checkpointing and plan_memory(replace(s, gradient_checkpointing=True)).peak <= limit:
        out.append(f"{keys.checkpointing}: true")
    if s.lm_head_chunk is None and s.lm_head and plan_memory(replace(s, lm_head_chunk=1024)).peak <= limit:
        out.append(f"{keys.chunk}: 1024")
    if out:
        return out
    both = replace(s, gradient_checkpointing=True, lm_head_chunk=s.lm_head_chunk or 1024)
    budget = largest_budget(both, limit, minimum, maximum=s.tokens)
    if budget is None:
        return []
    changes = [f"{keys.checkpointing}: true"] + ([f"{keys.chunk}: 1024"] if s.lm_head_chunk is None else [])
    return [" with ".join(changes + ([f"{keys.budget}: {budget}"] if budget < s.tokens else []))]


def refusal(plan: MemoryPlan, keys: Keys, minimum: int = 1) -> str:
    """One line: the predicted peak, the device's memory, and the keys that would make the run fit."""
    s = plan.setup
    fixes = fit_suggestions(s, keys, minimum)
    where = "available host memory" if s.device == "cpu" else "free CUDA memory"
    head = (f"predicted peak memory {plan.peak / GIB:.2f} GiB per device exceeds the device's {where}, "
            f"{s.device_memory / GIB:.2f} GiB ({micro_batch_tokens(s)} tokens per micro-batch)")
    if fixes:
        fix = "to fit, set " + " or ".join(fixes)
    else:
        smallest = plan_memory(replace(s, tokens=minimum, gradient_checkpointing=True,
                                       lm_head_chunk=s.lm_head_chunk or 1024)).peak
        fix = (f"even {minimum} tokens with {keys.checkpointing}: true need {smallest / GIB:.2f} GiB: use model.lm.lora, "
               "shard the model (trainer.strategy: rl_lightning.parallel.ParallelStrategy) or a smaller model")
    return f"{head}; {fix} ({keys.check}: false runs it anyway)"
