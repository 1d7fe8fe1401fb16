"""PPO-family policy optimisation from sampled trajectories: the `PPO` task.

The family: Dr. GRPO, GRPO, RLOO, REINFORCE++; with a critic: GAE, V-trace, Retrace, TD(lambda), n-step returns.

Each training batch is one rollout. The task's `RolloutCallback` (built from ``model.rollout``) has sampled
``responses_per_prompt`` completions per prompt and scored them; `PPO.training_step` then runs the algorithm in six
phases:

1. **pack** this rank's trajectories into ``update_per_rollout`` minibatches (strided, so the global minibatch k is
   the same trajectories whatever the data-parallel size) of balanced packed micro-batches, each a context-parallel
   shard under ``strategy.context_parallel_size`` > 1;
2. **score** them without gradients: the sampling policy's log-probabilities (``old_logprobs``, before any update of
   this rollout), the frozen reference's (``ref_logprobs``) and the critic's values. The first minibatch needs no
   extra pass for ``old_logprobs``: nothing has changed the policy before its update, so its training forward's
   detached log-probabilities are the sampling policy's (with ``update_per_rollout: 1``, the whole pass is saved),
   unless the advantages need them first (KL as a reward, ``vtrace``, ``retrace``);
3. **advantages** from one pure function, `rl_lightning.algorithms.advantages.estimate_advantages`, on this rank's
   trajectories, with statistics that must be global (REINFORCE++ whitening) summed over data-parallel ranks.
   ``vtrace`` and ``retrace`` correct for the engine having sampled from a distribution mu other than the
   trainer's pi at score time: mu = the engine's log-probabilities (``target_engine_logprobs``), pi =
   ``old_logprobs`` (engine/trainer mismatch, an engine lagging the trainer's weights, reused trajectories). They do
   not correct the later minibatches' staleness (``update_per_rollout`` > 1): PPO's ratio pi_theta / pi_old does;
4. **update**: one optimizer step per minibatch on the surrogate (``policy_loss``: PPO's clipped surrogate with
   asymmetric ``clip_low``/``clip_high`` and optional dual clip, GSPO-token or CISPO; ``correction``: importance
   weights against the engine's log-probabilities, truncated or masked, per token or sequence), plus ``kl.coef`` x
   KL(policy || reference) (``kl.type: loss``), minus ``entropy_coef`` x entropy, plus the Lagrangian constraint
   terms, aggregated as ``aggregation`` says; the critic takes its own step on the clipped value loss;
5. **controllers**: the KL coefficient and the Lagrange multipliers move once, from the rollout's global per-token
   KL and entropy (`rl_lightning.algorithms.controllers.Controllers`);
6. **log** global means.

Aggregations (how per-token losses become the minibatch loss; every count is global, over all ranks):

- ``token_mean`` (default): the sum over completion tokens / the number of completion tokens (DAPO's token-level
  mean, TRL's ``dapo``): every token weighs the same, long completions are not down-weighted;
- ``sequence_mean``: each completion's token mean, averaged over completions (the original GRPO);
- ``token_sum``: the sum over completion tokens / (completions x the generation budget, ``rollout.max_new_tokens`` x
  ``rollout.max_turns``), a constant per completion (Dr. GRPO's, TRL's ``dr_grpo``).

KL to the frozen reference is either a loss term (``kl.type: loss``, GRPO's choice) or a per-token reward penalty
(``kl.type: reward``, InstructGPT/REINFORCE++: -coef x KL_t of the sampling policy, entering the advantages as its
reward-to-go, or the GAE rewards). DAPO's dynamic sampling and overlong shaping live in the rollout settings.

A run is counted in rollouts: ``model.max_rollouts`` bounds it and sizes the learning-rate schedules (the actor takes
``update_per_rollout`` optimizer steps per rollout after ``freeze_steps`` critic-only rollouts); ``trainer.max_steps``
is refused because it counts optimizer steps of both optimizers.

What lives here, one module per concept: `config` (the argument groups ``model.kl``, ``model.constraints``,
``model.correction`` and the argument checks), `module` (the `PPO` LightningModule, whose ``training_step`` reads as
the six phases), `minibatches` (phase 1 and the packed <-> per-trajectory mapping), `scoring` (phases 2 and 3),
`update` (phase 4's optimizer steps and the out-of-memory back-off, driving `losses`: a micro-batch's forwards and
losses, built once by the task), `objective` (phase 4's policy objective, composed at start-up from the `terms` the
run enabled, each calling `rl_lightning.algorithms`), `metrics` (phase 6 and the validation means), `networks` (loading and sharding the
policy, critic, reference and teacher), `validation` (the held-out sums, logged as means). The maths lives in
`rl_lightning.algorithms`; these modules orchestrate.

Imports: `rl_lightning.algorithms`, `models`, `parallel`, `data`, `rollout` and `errors`; never `cli` or `tracking`
(which sit above the tasks).
"""

from rl_lightning.tasks.ppo.config import (
    AGGREGATIONS,
    KL_TYPES,
    POLICY_LOSSES,
    ConstraintConfig,
    CorrectionConfig,
    KLConfig,
)
from rl_lightning.tasks.ppo.module import PPO

__all__ = ["AGGREGATIONS", "KL_TYPES", "POLICY_LOSSES", "PPO", "ConstraintConfig", "CorrectionConfig", "KLConfig"]
