"""In-flight weight updates (partial rollouts) for one-step-off-policy rollouts.

With ``model.rollout.inflight_segment_tokens: N`` (and ``async_steps: 1``, ``engine: vllm``) the colocated engine
generates in segments of at most N tokens per request (`rl_lightning.engines.segmented.SegmentedEngine`): every unfinished request of every caller
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
from collections.abc import Callable
from typing import Any

import lightning as L

from rl_lightning.engines.segmented import SegmentedEngine
from rl_lightning.rollout.async_rollout import ThreadGenerator, read_ahead
from rl_lightning.rollout.callback import PolicyTask, RolloutCallback
from rl_lightning.rollout.config import RolloutConfig


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
