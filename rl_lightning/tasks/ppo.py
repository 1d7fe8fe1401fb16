"""Policy optimisation from sampled trajectories: the PPO family (Dr. GRPO, GRPO, RLOO, REINFORCE++; with a critic:
GAE, V-trace, Retrace, TD(lambda), n-step returns).

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
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Literal

import lightning as L
import torch

from rl_lightning.algorithms import KL_ESTIMATORS
from rl_lightning.algorithms.advantages import (
    CRITIC_ESTIMATORS,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    OFF_POLICY_ESTIMATORS,
    estimate_advantages,
)
from rl_lightning.algorithms.controllers import Controllers
from rl_lightning.algorithms.correction import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    mismatch_kl,
    mismatch_weights,
    sequence_log_ratios,
)
from rl_lightning.algorithms.kl import KL_CONTROLLERS
from rl_lightning.algorithms.policy import (
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_value_loss,
    gspo_policy_loss,
    skip_mask,
    token_mean,
)
from rl_lightning.data.packing import karmarkar_karp
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import ConfigError
from rl_lightning.models.loading import load_causal_lm, load_reward_model, load_tokenizer, model_inputs, target_logprobs
from rl_lightning.models.lora import AdaptersDisabled, LoRAConfig, apply_lora, lora_config
from rl_lightning.models.memory import (
    budget_errors,
    free_after_oom,
    initial_budget,
    oom_backoff_supported,
    smaller_budget,
)
from rl_lightning.models.optim import OptimConfig, configure_adamw, optimizer_step, typed
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.reductions import (
    data_parallel_max,
    data_parallel_sum,
    grad_average_size,
    local_micro_batch,
    parallel_layout,
    sequence_sums,
    shard_sum_dict,
)
from rl_lightning.parallel.strategy import ParallelStrategy
from rl_lightning.rollout.callback import RolloutCallback, RolloutConfig
from rl_lightning.rollout.trajectory import Rollout, Trajectory

log = logging.getLogger(__name__)

AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum")
KL_TYPES = ("loss", "reward")
POLICY_LOSSES = ("ppo", "gspo", "cispo")


@dataclass(frozen=True)
class KLConfig:
    """KL(policy || frozen reference): ``model.kl.*``. A reference model is loaded when `coef` > 0 or
    ``constraints.kl_max`` is set.

    Args:
        coef: (initial) weight of the KL term.
        type: ``loss`` (a loss term on the current policy) or ``reward`` (a per-token reward penalty of the sampling
            policy, fixed at rollout time).
        estimator: ``k1``, ``k2`` or ``k3`` (Schulman's estimators).
        controller: how `coef` moves after each rollout, from the measured per-token KL: ``fixed``, ``adaptive``
            (Ziegler et al.: towards `target` over `horizon` trajectories), ``linear`` (coef += `rate` x (KL -
            target)), ``pid`` (gains `pid`), ``scheduled`` (cosine from `coef` to `final_coef` over
            `total_rollouts`).
        target: target per-token KL of the adaptive, linear and PID controllers.
        horizon: adaptive controller horizon, in trajectories.
        rate: linear controller rate.
        pid: PID controller gains (kp, ki, kd).
        final_coef: scheduled controller end value.
        total_rollouts: scheduled controller length in rollouts; null: the run's (``model.max_rollouts``).
    """

    coef: float = 0.0
    type: str = "loss"
    estimator: str = "k3"
    controller: str = "fixed"
    target: float = 0.01
    horizon: float = 10000.0
    rate: float = 0.1
    pid: tuple[float, float, float] = (0.1, 0.01, 0.0)
    final_coef: float = 0.0
    total_rollouts: int | None = None

    def __post_init__(self) -> None:
        errors = []
        if self.coef < 0:
            errors.append(f"model.kl.coef must be >= 0, got {self.coef}")
        if self.type not in KL_TYPES:
            errors.append(f"model.kl.type must be one of {', '.join(KL_TYPES)}, got '{self.type}'")
        if self.estimator not in KL_ESTIMATORS:
            errors.append(f"model.kl.estimator must be one of {', '.join(KL_ESTIMATORS)}, got '{self.estimator}'")
        if self.controller not in KL_CONTROLLERS:
            errors.append(f"model.kl.controller must be one of {', '.join(KL_CONTROLLERS)}, got '{self.controller}'")
        if self.target <= 0 or self.horizon <= 0:
            errors.append(f"model.kl.target and model.kl.horizon must be > 0, got {self.target}, {self.horizon}")
        if errors:
            raise ConfigError("; ".join(errors))


@dataclass(frozen=True)
class ConstraintConfig:
    """Lagrangian constraints with learned multipliers (dual ascent once per rollout): ``model.constraints.*``.

    Args:
        entropy_min: keep the per-token entropy above this; null: off.
        kl_max: keep the per-token KL to the reference below this; null: off.
        multiplier_lr: step size of the log-multipliers.
        multiplier_init: initial multiplier value.
    """

    entropy_min: float | None = None
    kl_max: float | None = None
    multiplier_lr: float = 0.05
    multiplier_init: float = 0.1

    def __post_init__(self) -> None:
        errors = []
        if self.kl_max is not None and self.kl_max <= 0:
            errors.append(f"model.constraints.kl_max must be > 0 or null, got {self.kl_max}")
        if self.multiplier_lr <= 0 or self.multiplier_init <= 0:
            errors.append(f"model.constraints.multiplier_lr and model.constraints.multiplier_init must be > 0, got "
                          f"{self.multiplier_lr}, {self.multiplier_init}")
        if errors:
            raise ConfigError("; ".join(errors))


@dataclass(frozen=True)
class CorrectionConfig:
    """Rollout/trainer mismatch correction: ``model.correction.*`` (see `rl_lightning.algorithms.correction`). The
    per-token policy loss is multiplied by a detached weight from r = pi_old / pi_engine, the trainer's over the
    engine's probability of each sampled token.

    Args:
        level: ``token`` (each token its own r_t), ``sequence`` (prod_t r_t, the exact sequence weight) or
            ``geometric`` (exp(mean_t log r_t), length-normalised).
        mode: ``truncate`` (TIS: w = clamp(r, low, high)) or ``mask`` (MIS: w = r inside [low, high], 0 outside;
            at token level, IcePop).
        low: lower bound (null: none). IcePop and OpenRLHF use 0.5 with mode ``mask``.
        high: upper bound (> low). TIS (Yao et al.) uses 2; TRL 3 (sequence mask); IcePop and OpenRLHF 5.
    """

    level: str = "token"
    mode: str = "truncate"
    low: float | None = None
    high: float = 2.0

    def __post_init__(self) -> None:
        errors = []
        if self.level not in CORRECTION_LEVELS:
            errors.append(f"model.correction.level must be one of {', '.join(CORRECTION_LEVELS)}, got '{self.level}'")
        if self.mode not in CORRECTION_MODES:
            errors.append(f"model.correction.mode must be one of {', '.join(CORRECTION_MODES)}, got '{self.mode}'")
        if not self.high > (self.low or 0.0) >= 0:
            errors.append(f"model.correction.low={self.low} and model.correction.high={self.high} must satisfy "
                          "0 <= low < high (low null: no lower bound)")
        if errors:
            raise ConfigError("; ".join(errors))


class PPO(L.LightningModule):
    """PPO-family policy optimisation.

    Args:
        model_name: policy to train (HF folder, hub name, ``asset:<name>``); also the tokenizer and the reference.
        rollout: how trajectories are sampled and scored (``model.rollout.*``, see
            `rl_lightning.rollout.callback.RolloutConfig`).
        max_rollouts: length of the run in rollouts (it stops there); sizes the learning-rate schedules. Null: the
            run ends with ``trainer.max_epochs`` epochs of prompts.
        advantage_estimator: ``drgrpo`` (group mean baseline), ``grpo`` (mean and std), ``rloo`` (leave-one-out),
            ``reinforce_pp`` (REINFORCE++: global batch whitening); with a critic: ``gae`` (generalised advantage
            estimation), ``vtrace`` (V-trace, corrects engine != trainer), ``retrace`` (Retrace(lam), likewise),
            ``td_lambda`` (lambda-returns), ``nstep`` (n-step bootstrapped returns); see
            `rl_lightning.algorithms.offpolicy`.
        update_per_rollout: optimizer steps (minibatches) per rollout; must divide the trajectories per rank.
        policy_loss: ``ppo`` (the clipped surrogate on token ratios), ``gspo`` (the clipped surrogate on each
            sequence's ratio, the geometric mean of its token ratios: whole sequences clip; GSPO-token, see
            `rl_lightning.algorithms.policy.gspo_policy_loss`; the paper aggregates with ``sequence_mean``) or
            ``cispo`` (REINFORCE weighted by the clipped, stop-gradient token ratio: clipped tokens keep their
            gradient). `clip_low`/`clip_high` bound the ratio at [1 - clip_low, 1 + clip_high] in each.
        clip_low: lower ratio clip (1 - clip_low). ``gspo``: the paper's is 3e-4 (a sequence's geometric-mean
            ratio moves far less than a token's); ``cispo``: MiniMax-M1 sets no lower bound (clip_low >= 1).
        clip_high: upper ratio clip (1 + clip_high); DAPO's clip-higher uses 0.28; ``gspo``'s paper 4e-4;
            ``cispo``: ScaleRL's bound of 5 is clip_high 4.
        dual_clip: bound on the loss for negative advantages (c > 1), or null.
        aggregation: ``token_mean`` (DAPO), ``sequence_mean`` (GRPO) or ``token_sum`` (Dr. GRPO's constant
            normaliser); see the module docstring.
        correction: rollout/trainer mismatch correction (``model.correction.*``, see `CorrectionConfig`): importance
            weights pi_old / pi_engine per token or sequence, truncated (TIS) or masked (MIS, IcePop). Null
            (default): none, as in verl, OpenRLHF, NeMo-RL and slime (opt-in there; TRL alone defaults to a
            sequence mask with bound 3). ``train/mismatch_kl`` (k3 estimate of KL(engine || trainer) per token) and
            ``train/engine_logprob_diff`` are logged either way; with a correction, ``train/mismatch_masked`` (the
            fraction of tokens, or of trajectories at sequence levels, masked; 0 under ``truncate``).
        skip_threshold: skip (zero loss weight, normaliser unchanged) every trajectory whose sequence-level ratio
            pi_theta / pi_old, exp(its token mean of logprobs - old_logprobs), is above this or below its inverse;
            ``train/skipped`` logs the skipped fraction of trajectories (> 1; null: off).
        entropy_coef: entropy bonus weight.
        kl: the KL term and its coefficient controller (``model.kl.*``).
        constraints: Lagrangian entropy floor / KL ceiling (``model.constraints.*``).
        gamma: discount over completion tokens (the critic estimators, ``reinforce_pp``).
        lam: lambda of ``gae``, ``vtrace``, ``retrace``, ``td_lambda``.
        vtrace_rho_bar: ``vtrace`` clip of the importance weights of the TD errors (rho-bar).
        vtrace_c_bar: ``vtrace`` clip of the importance weights of the traces (c-bar, 0 < c-bar <= rho-bar).
        nstep: steps n of ``nstep`` returns (>= 1).
        critic_lr: peak learning rate of the critic (the critic estimators; it follows `optim`'s schedule).
        value_clip: clip of the value update around the rollout-time value (critic); null disables.
        freeze_steps: rollouts during which only the critic is trained (critic warm-up).
        max_length_per_device: token budget of one packed micro-batch, or ``auto`` (start from 65536 tokens and let
            the out-of-memory back-off find what fits). In a single process a micro-batch that runs out of memory
            halves the budget, is re-packed and redone (``train/oom_retries``, ``train/max_length_per_device``);
            see `rl_lightning.models.memory`.
        optim: AdamW and its schedule, in actor optimizer steps (``model.optim.*``).
        gradient_checkpointing: recompute activations in the backward pass.
        attn_implementation: ``rl_varlen`` or a transformers implementation.
        lora: train low-rank adapters on the frozen policy (``model.lora.*``, see `rl_lightning.models.lora.LoRAConfig`);
            the reference is then the policy with its adapters disabled (no second model is loaded). A critic
            stays a full model, fully trained. Null: full fine-tuning.
    """

    def __init__(
        self,
        model_name: str,
        rollout: RolloutConfig,
        max_rollouts: int | None = None,
        advantage_estimator: str = "drgrpo",
        update_per_rollout: int = 1,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = None,
        aggregation: str = "token_mean",
        policy_loss: str = "ppo",
        correction: CorrectionConfig | None = None,
        skip_threshold: float | None = None,
        entropy_coef: float = 0.0,
        kl: KLConfig = KLConfig(),
        constraints: ConstraintConfig = ConstraintConfig(),
        gamma: float = 1.0,
        lam: float = 1.0,
        vtrace_rho_bar: float = 1.0,
        vtrace_c_bar: float = 1.0,
        nstep: int = 5,
        critic_lr: float = 1e-5,
        value_clip: float | None = 0.2,
        freeze_steps: int = 0,
        max_length_per_device: int | Literal["auto"] = 8192,
        optim: OptimConfig = OptimConfig(lr=1e-6, lr_schedule="constant"),
        gradient_checkpointing: bool = False,
        attn_implementation: str = "rl_varlen",
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        rollout, kl = typed(RolloutConfig, rollout), typed(KLConfig, kl)
        constraints, optim = typed(ConstraintConfig, constraints), typed(OptimConfig, optim)
        correction = typed(CorrectionConfig, correction)
        errors = []
        if advantage_estimator not in ESTIMATORS:
            errors.append(f"model.advantage_estimator must be one of {', '.join(ESTIMATORS)}, got "
                          f"'{advantage_estimator}'")
        elif advantage_estimator in GROUP_ESTIMATORS and rollout.responses_per_prompt < 2:
            errors.append(f"model.advantage_estimator={advantage_estimator} compares completions of a prompt: set "
                          f"model.rollout.responses_per_prompt >= 2 (got {rollout.responses_per_prompt})")
        if aggregation not in AGGREGATIONS:
            errors.append(f"model.aggregation must be one of {', '.join(AGGREGATIONS)}, got '{aggregation}'")
        if update_per_rollout < 1 or (max_rollouts is not None and max_rollouts < 1):
            errors.append(f"model.update_per_rollout and model.max_rollouts must be >= 1, got {update_per_rollout}, "
                          f"{max_rollouts}")
        errors += budget_errors(max_length_per_device)
        if dual_clip is not None and dual_clip <= 1:
            errors.append(f"model.dual_clip must be > 1 or null, got {dual_clip}")
        if policy_loss not in POLICY_LOSSES:
            errors.append(f"model.policy_loss must be one of {', '.join(POLICY_LOSSES)}, got '{policy_loss}'")
        elif dual_clip is not None and policy_loss != "ppo":
            errors.append(f"model.dual_clip={dual_clip} applies to model.policy_loss=ppo only (got {policy_loss}): "
                          "set model.dual_clip=null")
        if not (clip_low >= 0 and clip_high >= 0):
            errors.append(f"model.clip_low and model.clip_high must be >= 0, got {clip_low}, {clip_high}")
        if skip_threshold is not None and skip_threshold <= 1:
            errors.append(f"model.skip_threshold must be > 1 or null, got {skip_threshold}")
        if not 0 < vtrace_c_bar <= vtrace_rho_bar:
            errors.append(f"model.vtrace_c_bar={vtrace_c_bar} must be > 0 and <= model.vtrace_rho_bar={vtrace_rho_bar} "
                          "(V-trace's truncation levels; 1.0 each is the paper's)")
        if nstep < 1:
            errors.append(f"model.nstep must be >= 1, got {nstep}")
        if errors:
            raise ConfigError("; ".join(errors))
        self.save_hyperparameters(logger=False)
        # checkpoints keep plain data: the argument groups as dicts (turned back into dataclasses above on loading)
        self.hparams.update({k: asdict(v) for k, v in self.hparams.items() if is_dataclass(v)})
        self.rollout_config, self.kl_config, self.optim = rollout, kl, optim
        self.correction: CorrectionConfig | None = correction
        self.automatic_optimization = False
        self.tokenizer = load_tokenizer(model_name)
        self.model: Any = None
        self.critic: Any = None
        self._reference: Any = None  # not a submodule: frozen, out of the optimizer and checkpoints
        self.rollouts = 0  # completed rollouts
        self.max_length_per_device = initial_budget(max_length_per_device)  # in use: halved on OOM, checkpointed
        self.controllers = Controllers(
            kl.controller, kl.coef, kl.target, kl.horizon, kl.rate, tuple(kl.pid), kl.final_coef,
            kl.total_rollouts or max_rollouts or 1, constraints.entropy_min, constraints.kl_max,
            constraints.multiplier_lr, constraints.multiplier_init)
        self.rollout_callback = RolloutCallback(rollout)
        self._val_sums: dict[int, torch.Tensor] | None = None  # per validation dataloader
        self._val_names: list[str] = []
        self.validation_metrics: dict[str, float] = {}  # the last validation, for the terminal

    @property
    def model_name(self) -> str:
        return self.hparams.model_name

    @property
    def needs_reference(self) -> bool:
        return self.kl_config.coef > 0 or self.hparams.constraints["kl_max"] is not None

    def configure_callbacks(self) -> list[L.Callback]:
        return [self.rollout_callback]

    def setup(self, stage: str) -> None:
        """Start-up checks that need the trainer and the data (before any model is loaded)."""
        hp, trainer = self.hparams, self.trainer
        errors = []
        if stage == "fit" and trainer.max_steps != -1:
            errors.append(f"PPO counts its run in rollouts: set model.max_rollouts instead of trainer.max_steps="
                          f"{trainer.max_steps} (which counts optimizer steps: update_per_rollout per rollout, plus "
                          "the critic's)")
        if stage == "fit" and hp.max_rollouts is None and trainer.max_epochs == -1:
            errors.append("the run is unbounded (trainer.max_epochs=-1): set model.max_rollouts")
        data, rollout = trainer.datamodule.hparams, self.rollout_config
        train_prompts = getattr(trainer.datamodule, "prompts", {}).get("train") or []
        longest = max((len(p.prompt_ids) for p in train_prompts), default=0) + rollout.max_completion_tokens
        if hp.max_length_per_device == "auto" and not oom_backoff_supported(trainer.world_size):
            errors.append(f"model.max_length_per_device=auto needs the out-of-memory back-off, which runs in a single "
                          f"process only (world size {trainer.world_size}): set an integer budget")
        if rollout.max_turns == 1 and longest > self.max_length_per_device:
            errors.append(f"model.max_length_per_device={self.max_length_per_device} cannot hold the longest trajectory, "
                          f"{longest} tokens (the longest training prompt + model.rollout.max_new_tokens): raise it to "
                          f"at least {longest}")
        per_rank = data.batch_size * rollout.responses_per_prompt
        if per_rank % hp.update_per_rollout:
            errors.append(f"model.update_per_rollout={hp.update_per_rollout} must divide the {per_rank} trajectories "
                          "per rank (data.batch_size x model.rollout.responses_per_prompt)")
        if errors:
            raise ConfigError("; ".join(errors))

    def configure_model(self) -> None:
        hp = self.hparams
        if self.model is None:
            self.model = load_causal_lm(hp.model_name, attn_implementation=hp.attn_implementation,
                                        gradient_checkpointing=hp.gradient_checkpointing)
            if hp.lora is not None:
                self.model = apply_lora(self.model, lora_config(hp.lora))
        self.model = parallelize_for(self, self.model)
        if hp.advantage_estimator in CRITIC_ESTIMATORS:
            if self.critic is None:
                self.critic = load_reward_model(hp.model_name, attn_implementation=hp.attn_implementation,
                                                gradient_checkpointing=hp.gradient_checkpointing)
            self.critic = parallelize_for(self, self.critic)
        if hp.lora is not None and self.needs_reference:  # the base model: the policy with its adapters disabled
            object.__setattr__(self, "_reference", AdaptersDisabled(self.model))
        if self._reference is None and self.needs_reference:
            reference = load_causal_lm(hp.model_name, attn_implementation=hp.attn_implementation)
            object.__setattr__(self, "_reference", parallelize_for(self, reference.eval().requires_grad_(False),
                                                                   trainable=False))

    def run_rollouts(self) -> int:
        """Rollouts this run takes: `max_rollouts`, or fewer when the trainer's epochs of prompts end first."""
        by_epochs = self.trainer.estimated_stepping_batches  # one training batch = one rollout
        total = min(self.hparams.max_rollouts or math.inf, by_epochs)
        if math.isinf(total):
            raise ConfigError("the run is unbounded (trainer.max_epochs=-1): set model.max_rollouts")
        return int(total)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        rollouts = self.run_rollouts()
        optimizer, schedule = configure_adamw(self.model, self.optim,
                                              max(0, rollouts - hp.freeze_steps) * hp.update_per_rollout)
        if self.critic is None:
            return [optimizer], [schedule]
        critic, critic_schedule = configure_adamw(self.critic, self.optim, rollouts * hp.update_per_rollout,
                                                  lr=hp.critic_lr)
        return [optimizer, critic], [schedule, critic_schedule]

    def on_fit_start(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, ParallelStrategy) and strategy.cpu_offload:
            return  # FSDP2 keeps the offloaded reference's shards on the CPU and streams them in
        if self._reference is not None:
            self._reference.to(self.device)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rollouts"] = self.rollouts
        checkpoint["controllers"] = self.controllers.state_dict()
        checkpoint["max_length_per_device"] = self.max_length_per_device

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.rollouts = checkpoint.get("rollouts", 0)
        self.controllers.load_state_dict(checkpoint.get("controllers", {}))
        self.max_length_per_device = min(self.max_length_per_device,  # a budget that ran out of memory stays down
                                         checkpoint.get("max_length_per_device", self.max_length_per_device))

    # ---------------------------------------------------------------------------------------------------- the step

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        rollout: Rollout = batch["rollout"]
        minibatches = self.pack(rollout.trajectories)  # 1. [(trajectory indices, micro-batches)] per minibatch
        micro_batches = [mb for _, mbs in minibatches for mb in mbs]
        self.score(minibatches)  # 2. old/ref log-probs, values
        advantage_sums = self.assign_advantages(rollout, micro_batches)  # 3.
        sums, logged = self.update(rollout, minibatches)  # 4. one optimizer step per minibatch
        totals = shard_sum_dict(self.trainer, sums)  # measured on this rank's tokens: over data x context ranks
        means = {k: v / totals["tokens"].clamp(min=1) for k, v in totals.items()}
        trajectories = int(data_parallel_sum(self.trainer, torch.tensor(float(len(rollout.trajectories)))))
        per_trajectory = ["skipped"]  # counts of trajectories, not per-token sums
        if self.correction is not None and self.correction.level != "token":
            per_trajectory.append("mismatch_masked")
        for k in per_trajectory:
            if k in totals:
                means[k] = totals[k] / max(1, trajectories)
        logged.update(self.controllers.update(  # 5. KL coefficient, Lagrange multipliers
            {k: float(means[k]) for k in ("kl", "entropy") if k in means}, trajectories,
            move_multipliers=self.rollouts >= self.hparams.freeze_steps))
        self.rollouts += 1
        self.log_rollout(rollout, means, advantage_sums, logged, len(micro_batches))  # 6.
        if self.hparams.max_rollouts is not None and self.rollouts >= self.hparams.max_rollouts:
            self.trainer.should_stop = True

    def pack(self, trajectories: list[Trajectory]) -> list[tuple[list[int], list[dict[str, Any]]]]:
        """Strided minibatches: minibatch k takes this rank's trajectories k, k + U, k + 2U, ... Since U divides every
        rank's share, the global minibatch k is the same set of trajectories whatever the data-parallel size. Each
        is packed into the same number of micro-batches on every rank (dynamic sampling can leave a rank with none:
        it still runs filler micro-batches so every rank takes the same optimizer steps). Every token carries its
        trajectory's index and its position among the trajectory's completion tokens (``target_trajectory``,
        ``target_slot``), which map packed tensors to per-trajectory ones and back."""
        steps = self.hparams.update_per_rollout
        parts = [list(range(k, len(trajectories), steps)) for k in range(steps)]
        return [(part, self._micro_batches(trajectories, part)) for part in parts]

    def _micro_batches(self, trajectories: list[Trajectory], part: list[int]) -> list[dict[str, Any]]:
        budget = self.max_length_per_device
        units = []
        for i in part:
            t = trajectories[i]
            slots = (torch.tensor(t.completion_mask).cumsum(0) - 1).clamp(min=0).tolist()
            units.append(t.example(trajectory=[float(i)] * len(t.input_ids), slot=[float(s) for s in slots]))
        if not units:
            units = [TokenizedExample([self.tokenizer.pad_token_id], [0], values={
                k: [0.0] for k in ("engine_logprobs", "trajectory", "slot")})]
        lengths = [len(u.input_ids) for u in units]
        if max(lengths) > budget:
            raise ConfigError(f"a trajectory of {max(lengths)} tokens (prompt + completion) does not fit "
                              f"model.max_length_per_device={budget}; raise it to at least {max(lengths)}")
        count = -(-sum(lengths) // budget)
        while True:  # the smallest count that fits locally, then the largest over ranks
            plan = karmarkar_karp(lengths, max(1, count))
            if all(sum(lengths[i] for i in p) <= budget for p in plan):
                break
            count += 1
        count = int(data_parallel_max(self.trainer, torch.tensor(float(max(1, count)))))
        layout = parallel_layout(self.trainer)
        return [local_micro_batch(layout, {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in
                                           pack([units[i] for i in p], self.tokenizer.pad_token_id).items()})
                for p in karmarkar_karp(lengths, count)]

    @torch.no_grad()
    def score(self, minibatches: list[tuple[list[int], list[dict[str, Any]]]]) -> None:
        """Record, on this rank's tokens, the log-probabilities of the policy that sampled (nothing has changed it
        since), the reference's, and the critic's values. The first minibatch's sampling log-probabilities are left
        to its training forward (`policy_loss`), unless the advantages need them first (KL as a reward, the
        off-policy estimators)."""
        temperature = self.rollout_config.temperature
        kl_reward = self.kl_config.type == "reward" and self._reference is not None
        needed_now = kl_reward or self.hparams.advantage_estimator in OFF_POLICY_ESTIMATORS
        for k, (_, micro_batches) in enumerate(minibatches):
            for mb in micro_batches:
                if k > 0 or needed_now:
                    mb["old_logprobs"] = target_logprobs(self.model, mb, temperature)[0]
                if self._reference is not None:
                    mb["ref_logprobs"] = target_logprobs(self._reference, mb, temperature)[0]
                if self.critic is not None:
                    mb["old_values"] = self._values(mb)

    def assign_advantages(self, rollout: Rollout, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """Per-token advantages (and returns) of this rank's trajectories from `estimate_advantages`, written into the
        micro-batches; returns their (sum, sum of squares, count) over data-parallel ranks for logging."""
        hp, trajectories = self.hparams, rollout.trajectories
        lengths = torch.tensor([t.completion_length for t in trajectories], dtype=torch.long)
        width = max(1, int(lengths.max())) if len(trajectories) else 1
        mask = (torch.arange(width)[None] < lengths[:, None]).float().to(self.device)  # (B, T)
        kl_penalty = values = logprobs = engine_logprobs = None
        if self.kl_config.type == "reward" and self._reference is not None:
            estimator = KL_ESTIMATORS[self.kl_config.estimator]
            kl_penalty = self.gather(micro_batches, [-self.controllers.kl_coef * estimator(
                mb["old_logprobs"], mb["ref_logprobs"]) for mb in micro_batches], mask)
        if self.critic is not None:
            values = self.gather(micro_batches, [mb["old_values"] for mb in micro_batches], mask)
        if hp.advantage_estimator in OFF_POLICY_ESTIMATORS:  # pi: the trainer at score time; mu: the engine
            logprobs = self.gather(micro_batches, [mb["old_logprobs"] for mb in micro_batches], mask)
            engine_logprobs = self.gather(micro_batches, [mb["target_engine_logprobs"] for mb in micro_batches], mask)
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=self.device)
        advantages, returns = estimate_advantages(
            hp.advantage_estimator, rewards, mask, rollout.group_size, kl_penalty, values, hp.gamma, hp.lam,
            global_sum=lambda x: data_parallel_sum(self.trainer, x), target_logprobs=logprobs,
            behaviour_logprobs=engine_logprobs, rho_bar=hp.vtrace_rho_bar, c_bar=hp.vtrace_c_bar, nstep=hp.nstep)
        for mb in micro_batches:
            mb["advantages"] = self.scatter(mb, advantages)
            if returns is not None:
                mb["returns"] = self.scatter(mb, returns)
        stats = torch.stack([advantages.sum(), advantages.pow(2).sum(), mask.sum()])
        return data_parallel_sum(self.trainer, stats)

    def gather(self, micro_batches: list[dict[str, Any]], packed: list[torch.Tensor], mask: torch.Tensor
               ) -> torch.Tensor:
        """Packed per-token values (one (1, N) tensor per micro-batch) -> (B, T) per trajectory and completion token;
        context-parallel peers each fill their shard's tokens, and a sum over the group completes the picture."""
        out = torch.zeros_like(mask)
        for mb, values in zip(micro_batches, packed, strict=True):
            at = mb["target_mask"][0] > 0
            out[mb["target_trajectory"][0, at].long(), mb["target_slot"][0, at].long()] = values[0, at].float()
        layout = parallel_layout(self.trainer)
        if layout.cp_size > 1:
            torch.distributed.all_reduce(out, group=layout.cp_group)
        return out

    @staticmethod
    def scatter(mb: dict[str, Any], per_trajectory: torch.Tensor) -> torch.Tensor:
        """(B, T) per trajectory and completion token -> this micro-batch's (1, N) packed tokens (0 off targets)."""
        at = mb["target_mask"] > 0
        out = torch.zeros(at.shape, dtype=torch.float32, device=per_trajectory.device)
        out[at] = per_trajectory[mb["target_trajectory"][at].long(), mb["target_slot"][at].long()]
        return out

    def update(self, rollout: Rollout, minibatches: list[tuple[list[int], list[dict[str, Any]]]]
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One actor (and critic) optimizer step per minibatch. Returns this rank's per-token metric sums (with
        ``tokens``, the target tokens they cover) and the grad norms."""
        hp = self.hparams
        train_actor = self.rollouts >= hp.freeze_steps
        sums: dict[str, torch.Tensor] = {"tokens": torch.zeros((), device=self.device)}
        schedules = self.lr_schedulers()
        actor_schedule = schedules[0] if isinstance(schedules, list) else schedules
        logged: dict[str, Any] = {"train/lr": actor_schedule.get_last_lr()[0]}  # this rollout's first actor step
        packed_at, retries = self.max_length_per_device, 0  # `pack` ran at this budget
        for part, micro_batches in minibatches:
            tokens, policy_count = self.loss_counts(rollout.trajectories, part)
            while True:  # out of memory: the minibatch is re-packed smaller and redone (single process only)
                if self.max_length_per_device < packed_at:
                    micro_batches = self._repack(rollout.trajectories, part, micro_batches)
                    packed_at = self.max_length_per_device
                try:
                    part_sums = self._backward(micro_batches, tokens, policy_count, train_actor)
                    break
                except torch.OutOfMemoryError:
                    if not oom_backoff_supported(self.trainer.world_size):
                        raise
                # out of the handler, so the failed attempt's frames (activations) are released
                retries += 1
                self._back_off(rollout.trajectories, part)
            for k, v in part_sums.items():
                sums[k] = sums.get(k, 0) + v
            if train_actor:
                logged["train/grad_norm"] = optimizer_step(self, self.optim.max_grad_norm,
                                                           None if self.critic is None else 0, self.model)
            if self.critic is not None:
                logged["train/critic_grad_norm"] = optimizer_step(self, self.optim.max_grad_norm, 1, self.critic)
        logged.update({"train/oom_retries": float(retries), "train/max_length_per_device": float(packed_at)})
        return sums, logged

    def _backward(self, micro_batches: list[dict[str, Any]], tokens: torch.Tensor, policy_count: torch.Tensor,
                  train_actor: bool) -> dict[str, torch.Tensor]:
        """Forward and backward of one minibatch's micro-batches (gradients accumulate); returns its metric sums."""
        size = grad_average_size(self.trainer)
        sums: dict[str, torch.Tensor] = {}
        for mb in micro_batches:
            metric_sums = {}
            if train_actor:
                loss, metric_sums = self.policy_loss(mb, policy_count / size)
                self.manual_backward(loss)
            if self.critic is not None:
                value_loss, value_sums = self.value_loss(mb, tokens / size)
                self.manual_backward(value_loss)
                metric_sums.update(value_sums)
            metric_sums["tokens"] = mb["target_mask"].sum().float()
            for k, v in metric_sums.items():
                sums[k] = sums.get(k, 0) + v.detach()
        return sums

    def _back_off(self, trajectories: list[Trajectory], part: list[int]) -> None:
        """After an out-of-memory error in minibatch `part`: drop the gradients of its failed attempt (the optimizer
        has not stepped on it) and halve the budget for the rest of the run, down to its longest trajectory."""
        free_after_oom((self.model, self.critic), self.device)
        longest = max((len(trajectories[i].input_ids) for i in part), default=1)
        budget = smaller_budget(self.max_length_per_device, longest)
        log.warning(f"out of memory at model.max_length_per_device={self.max_length_per_device}: retrying the "
                    f"minibatch with {budget} tokens per micro-batch, kept for the rest of the run")
        self.max_length_per_device = budget

    def _repack(self, trajectories: list[Trajectory], part: list[int], micro_batches: list[dict[str, Any]]
                ) -> list[dict[str, Any]]:
        """`part` packed again under the current budget, with the per-token values `score` and `assign_advantages`
        wrote into its micro-batches carried over through each token's trajectory and slot (0 off the targets, as
        computed). The first minibatch's ``old_logprobs``, if only partly recorded, come again from its forward."""
        fresh = self._micro_batches(trajectories, part)
        width = max((t.completion_length for t in trajectories), default=1)
        mask = torch.ones(len(trajectories), max(1, width), device=self.device)  # (B, T); only its shape is used
        for key in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns"):
            if all(key in mb for mb in micro_batches):
                per_trajectory = self.gather(micro_batches, [mb[key] for mb in micro_batches], mask)  # (B, T)
                for mb in fresh:
                    mb[key] = self.scatter(mb, per_trajectory)
        return fresh

    def loss_counts(self, trajectories: list[Trajectory], part: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Global counts of one minibatch, from whole trajectories (context-parallel shards hold parts of each):
        completion tokens, and the policy loss's normaliser under `aggregation`."""
        completions = float(len(part))
        tokens = float(sum(trajectories[i].completion_length for i in part))
        if self.hparams.aggregation == "token_sum":
            policy = completions * self.rollout_config.max_completion_tokens
        else:
            policy = tokens if self.hparams.aggregation == "token_mean" else completions
        # clamp: a minibatch whose completions were all masked out (truncated) has nothing to learn, not a NaN
        return tuple(data_parallel_sum(self.trainer, torch.tensor([tokens, policy])).clamp(min=1))

    def policy_loss(self, mb: dict[str, Any], normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        hp = self.hparams
        needs_grad = hp.entropy_coef != 0 or hp.constraints["entropy_min"] is not None
        logprobs, entropy = target_logprobs(self.model, mb, self.rollout_config.temperature,
                                            entropy="grad" if needs_grad else "value")
        if "old_logprobs" not in mb:  # the first minibatch: the policy has not moved since sampling
            mb["old_logprobs"] = logprobs.detach()
        mask = mb["target_mask"].float()
        log_ratio = (logprobs - mb["old_logprobs"]).detach()
        loss, metrics = self._surrogate(logprobs, log_ratio, mask, mb)
        if self.correction is not None:  # rollout/trainer mismatch: detached weights from pi_old / pi_engine
            weights, metrics["mismatch_masked"] = self._mismatch_weights(mask, mb)
            loss = loss * weights
        metrics["policy_loss"] = loss.detach()  # the surrogate per token, before KL and entropy terms
        measured = {"entropy": entropy}
        if self._reference is not None:
            measured["kl"] = KL_ESTIMATORS[self.kl_config.estimator](logprobs, mb["ref_logprobs"])
            if self.kl_config.type == "loss":
                loss = loss + self.controllers.kl_coef * measured["kl"]
        loss = loss - hp.entropy_coef * measured["entropy"] + self.controllers.penalty(measured)
        metrics.update({k: v.detach() for k, v in measured.items()})
        metrics["approx_kl"] = torch.exp(-log_ratio) - 1 + log_ratio
        metrics["engine_logprob_diff"] = (mb["old_logprobs"] - mb["target_engine_logprobs"]).abs()
        metrics["mismatch_kl"] = mismatch_kl(mb["old_logprobs"], mb["target_engine_logprobs"])
        if hp.skip_threshold is not None:  # skipped trajectories keep their share of the normaliser: weight 0
            loss, metrics["skipped"] = self._skip(loss, log_ratio, mask, mb)
        if hp.aggregation == "sequence_mean":  # each completion's token mean, summed over completions
            total = (sequence_sums(loss, mask, mb) / sequence_sums(mask, mask, mb).clamp(min=1)).sum() / normaliser
        else:
            total = token_mean(loss, mask, normaliser)
        return total, {k: (v * mask).sum() for k, v in metrics.items()}

    def _surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, mb: dict[str, Any]
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The (1, N) per-token surrogate of ``policy_loss`` and its metrics."""
        hp = self.hparams
        if hp.policy_loss == "gspo":  # each token gets its sequence's mean log ratio (over context-parallel shards)
            means = sequence_sums(log_ratio, mask, mb) / sequence_sums(mask, mask, mb).clamp(min=1)  # (S,)
            return gspo_policy_loss(logprobs, means[mb["seq_index"].clamp(min=0)], mb["advantages"], hp.clip_low,
                                    hp.clip_high)
        if hp.policy_loss == "cispo":
            return cispo_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], hp.clip_low, hp.clip_high)
        return clipped_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], hp.clip_low, hp.clip_high,
                                   hp.dual_clip)

    def _mismatch_weights(self, mask: torch.Tensor, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, N) correction weights and masked indicators of this micro-batch's tokens. At the sequence levels the
        indicator is 1 / (its trajectory's completion tokens) where masked, so its sum counts masked trajectories."""
        c = self.correction
        log_ratio = (mb["old_logprobs"] - mb["target_engine_logprobs"]).float()  # log pi_old / pi_engine
        if c.level == "token":
            return mismatch_weights(log_ratio, c.mode, c.low, c.high)
        counts = sequence_sums(mask, mask, mb)  # (S,) whole trajectories, over context-parallel shards
        sequence_ratio = sequence_log_ratios(sequence_sums(log_ratio, mask, mb), counts, c.level)
        weights, masked = mismatch_weights(sequence_ratio, c.mode, c.low, c.high)  # (S,)
        index = mb["seq_index"].clamp(min=0)  # (1, N); padding (-1) is off the mask
        return weights[index], (masked / counts.clamp(min=1))[index]

    def _skip(self, loss: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, mb: dict[str, Any]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`skip_mask` on this micro-batch's sequences: the (1, N) loss with skipped trajectories' tokens zeroed, and
        per token 1 / (its trajectory's completion tokens) where skipped, so its sum counts skipped trajectories."""
        counts = sequence_sums(mask, mask, mb)  # (S,) whole trajectories, over context-parallel shards
        skipped = skip_mask(sequence_sums(log_ratio, mask, mb), counts, self.hparams.skip_threshold).float()
        index = mb["seq_index"].clamp(min=0)  # (1, N); padding (-1) is off the mask
        per_token = (skipped / counts.clamp(min=1))[index]
        return loss * (1 - skipped[index]), per_token

    def _values(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        """(B, T) critic value of the state at each position (before its target token is generated)."""
        hidden = self.critic.base_model(**model_inputs(micro_batch)).last_hidden_state
        return self.critic.score(hidden).squeeze(-1).float()

    def value_loss(self, mb: dict[str, Any], normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        values = self._values(mb)
        mask = mb["target_mask"].float()
        loss = clipped_value_loss(values, mb["old_values"], mb["returns"], self.hparams.value_clip)
        sums = {"value_loss": (loss.detach() * mask).sum(), "values": (values.detach() * mask).sum(),
                "returns": (mb["returns"] * mask).sum()}
        return token_mean(loss, mask, normaliser), sums

    def log_rollout(self, rollout: Rollout, means: dict[str, torch.Tensor], advantage_sums: torch.Tensor,
                    logged: dict[str, Any], micro_batches: int) -> None:
        trajectories, names = rollout.trajectories, rollout.reward_names
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        lengths = torch.tensor([float(t.completion_length) for t in trajectories])
        per_rank = torch.stack([rewards.sum(), (rewards**2).sum(), lengths.sum(), torch.tensor(float(len(rewards))),
                                *(torch.tensor(sum(t.reward_components[c] for t in trajectories), dtype=torch.float32)
                                  for c in names)])
        reward_sum, reward_sq, length_sum, count, *component_sums = data_parallel_sum(self.trainer, per_rank)
        n = count.clamp(min=1)  # dynamic sampling may keep no trajectory at all
        mean = reward_sum / n
        adv_sum, adv_sq, tokens = advantage_sums
        adv_mean = adv_sum / tokens.clamp(min=1)
        metrics = {f"train/{k}": v for k, v in means.items() if k != "tokens"}
        metrics.update({f"train/reward/{c}": component_sums[i] / n for i, c in enumerate(names)})
        metrics.update({
            "train/reward": mean, "train/reward_std": (reward_sq / n - mean**2).clamp(min=0).sqrt(),
            "train/completion_length": length_sum / n, "train/advantage_mean": adv_mean,
            "train/advantage_std": (adv_sq / tokens.clamp(min=1) - adv_mean**2).clamp(min=0).sqrt(),
            **{k if k.startswith("train/") else f"train/{k}": v for k, v in logged.items()},
            "train/rollouts": float(self.rollouts), "train/refills": float(rollout.refills),
            "train/reward_failures": float(rollout.reward_failures), "train/trajectories": count,
            "train/micro_batches": float(micro_batches), **rollout.metrics})
        self.log_dict(metrics)

    # ---------------------------------------------------------------------------------------------- validation

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Held-out prompts (sampled by the rollout callback at `rollout.val_temperature`): accumulate reward sums
        per held-out set (``data.val_paths``: one dataloader each)."""
        rollout: Rollout = batch["rollout"]
        trajectories, self._val_names = rollout.trajectories, rollout.reward_names
        record = torch.tensor([sum(t.reward for t in trajectories), sum(t.completion_length for t in trajectories),
                               len(trajectories), *(sum(t.reward_components[c] for t in trajectories)
                                                    for c in self._val_names)], dtype=torch.float64)
        if self._val_sums is None:
            self._val_sums = {}
        self._val_sums[dataloader_idx] = self._val_sums.get(dataloader_idx, 0) + record

    def on_validation_epoch_end(self) -> None:
        """Log ``val/reward``, ``val/completion_length`` and ``val/reward/<component>``: means over every held-out
        trajectory (of all sets together: a set weighs by its trajectories); with named sets also
        ``val/<name>/...``, the same means over that set's trajectories."""
        sums, self._val_sums = self._val_sums, None
        if sums is None:
            return
        # "": the single data.val_path; dataloaders given without the prompts DataModule are named by their index
        set_names = getattr(self.trainer.datamodule, "val_names", None) or (
            [""] if max(sums) == 0 else [str(i) for i in range(max(sums) + 1)])
        width = len(next(iter(sums.values())))
        per_set = torch.zeros(len(set_names), width, dtype=torch.float64)  # (S, 3 + components), all ranks alike
        for i, record in sums.items():
            per_set[i] = record
        per_set = data_parallel_sum(self.trainer, per_set.to(self.device))
        metrics = {}
        for prefix, totals in [("val/", per_set.sum(0))] + [
                (f"val/{name}/", per_set[i]) for i, name in enumerate(set_names) if name]:
            reward, length, *components = totals[[0, 1, *range(3, len(totals))]] / totals[2].clamp(min=1)
            metrics.update({f"{prefix}reward": reward, f"{prefix}completion_length": length,
                            **{f"{prefix}reward/{c}": v for c, v in zip(self._val_names, components, strict=True)}})
        self.validation_metrics = {k: float(v) for k, v in metrics.items()}  # the terminal's, sanity check included
        if self.trainer.sanity_checking:  # Lightning drops sanity-check logs; keep the untrained policy's score
            for logger in self.trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=0)
        else:
            self.log_dict(metrics)

