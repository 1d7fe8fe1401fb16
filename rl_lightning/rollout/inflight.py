"""In-flight weight updates (partial rollouts) for one-step-off-policy rollouts.

With ``model.rollout.inflight_segment_tokens: N`` (and ``async_steps: 1``, ``engine: vllm``) the colocated engine
generates in segments of at most N tokens per request (`rl_lightning.engines.segmented.SegmentedEngine`): every unfinished request of every caller
(the rollout being finished, the one read ahead, a validation) is generated together for N more tokens, then the
engine stops at the boundary, where new weights may load and requests submitted meanwhile join. A request continues
from its prefix (prompt + its tokens so far): the prefix's KV cache is recomputed under the weights then loaded, so
every token is sampled by exactly one policy version, whose log-probability the engine reports. vLLM 0.32's
``LLM.sleep(level=0, mode="keep")`` would keep the old KV cache instead (tokens sampled by new weights attending to
activations of old ones, a policy no trainer can score) and pauses an engine core driven by one thread only.

At the start of training batch k the scheduling policy (`InFlight`, which the callback holds):

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

from typing import Any

from rl_lightning.engines.segmented import SegmentedEngine
from rl_lightning.rollout.async_rollout import read_ahead
from rl_lightning.rollout.schedule import Background, RolloutSteps, rollout_key, submit_ahead
from rl_lightning.rollout.trajectory import Rollout


class InFlight(Background):
    """One-step-off rollouts whose weights load in flight: a `rl_lightning.rollout.schedule.SchedulingPolicy`.

    See the module's docstring.

    Two rollouts in flight score (and interact) from two threads: the environment's whole calls take turns on its
    own lock (`rl_lightning.envs.environment.Environment.turns`), so its counters and its reward model see one caller
    at a time (``rollout/reward_s`` counts the other rollout's scoring too).

    Args:
        segment_tokens: tokens per request per segment (``model.rollout.inflight_segment_tokens``).
    """

    def __init__(self, segment_tokens: int) -> None:
        super().__init__(max_pending=2)  # rollout k+1 starts while rollout k finishes
        self.segment_tokens = segment_tokens

    def wrap_engine(self, engine: Any) -> SegmentedEngine:
        """`engine` generating in segments that take new weights between them."""
        return SegmentedEngine(engine, self.segment_tokens)

    def rollout(self, steps: RolloutSteps, trainer: Any, task: Any, batch: dict, batch_idx: int) -> Rollout:
        """Push version k at the next segment boundary, submit rollout k+1, then take rollout k."""
        generator, index, prompts = self.generator, task.rollouts, batch["prompts"]
        key = rollout_key(index, prompts)
        with steps.engine.paused(index):  # rollout k's unfinished completions continue with version k
            generator.run(lambda: steps.prepare_engine(trainer, task))
        ahead = read_ahead(trainer, task, batch_idx)
        if not generator.submitted(key):  # nothing read ahead (a fit's or an epoch's first batch): sampled now
            generator.take(key)  # drops a rollout read ahead for another batch
            trajectories, metrics = generator.run(lambda: steps.sample(trainer, task, prompts, index))
            version, waited = index, 0.0
            submit_ahead(generator, steps, trainer, task, ahead, index)
        else:
            submit_ahead(generator, steps, trainer, task, ahead, index)
            finished = generator.take(key)
            if finished is None:  # submitted under `key`: `take` returns it
                raise RuntimeError(f"InFlight.rollout: the rollout submitted under {key} was not taken")
            (trajectories, metrics), version, waited = finished.value, finished.version, finished.wait_s
        for t in trajectories:
            t.trained_version = index
        versions = [v for t in trajectories if t.policy_versions is not None
                    for v, m in zip(t.policy_versions, t.completion_mask, strict=True) if m]
        metrics.update({"rollout/staleness": float(index - version), "rollout/wait_s": waited,
                        # completion tokens sampled by an older policy than the one trained (the rest: in flight)
                        "rollout/stale_token_share": sum(v < index for v in versions) / max(1, len(versions))})
        return steps.finish(trainer, task, trajectories, metrics)
