"""The PPO LightningModule: one rollout per training batch, turned into ``update_per_rollout`` optimizer steps.

`PPO.training_step` reads as the algorithm (see `rl_lightning.tasks.ppo`); the phases are in this package's
modules: `minibatches` (packing), `scoring` (log-probabilities, values, advantages), `update` (optimizer steps and
the out-of-memory back-off), `objective` (the losses), `metrics` (what is logged), `config` (the argument groups),
`networks` (loading and sharding the models), `losses` (a micro-batch's forwards and losses, which the update calls),
`validation` (the held-out rewards).
"""

from __future__ import annotations

import math
from dataclasses import asdict, is_dataclass
from typing import Any, Literal

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.algorithms.advantages import OFF_POLICY_ESTIMATORS
from rl_lightning.errors import ConfigError
from rl_lightning.memory.backoff import TokenBudget, initial_budget
from rl_lightning.memory.phases import phase
from rl_lightning.models.config import LMConfig, lm_config
from rl_lightning.models.loading import load_tokenizer
from rl_lightning.models.optim import SkippedStepsState, configure_adamw, typed
from rl_lightning.parallel.reductions import Groups, process_groups
from rl_lightning.rollout.callback import RolloutCallback, RolloutConfig
from rl_lightning.rollout.shaping_monitor import ShapingMonitorCallback
from rl_lightning.rollout.trajectory import Rollout, Trajectory
from rl_lightning.tasks.memory_check import check_memory
from rl_lightning.tasks.ppo import distill as distillation
from rl_lightning.tasks.ppo import metrics, minibatches, networks, scoring, update, validation
from rl_lightning.tasks.ppo.config import (
    ConstraintConfig,
    CorrectionConfig,
    DAPOConfig,
    KLConfig,
    argument_errors,
    dapo_errors,
    make_controllers,
    start_up_errors,
)
from rl_lightning.tasks.ppo.losses import MicroBatchLosses
from rl_lightning.tasks.ppo.objective import PolicyObjective


class PPO(SkippedStepsState, L.LightningModule):
    """PPO-family policy optimisation.

    Args:
        lm: the policy, its adapters, memory switches and optimizer (``model.lm.*``, see
            `rl_lightning.models.config.LMConfig`): also the tokenizer and the reference; the optimizer's default here
            is AdamW at lr 1e-6, constant schedule, in actor optimizer steps. With ``lora`` the reference is the
            policy with its adapters disabled (no second model is loaded); a critic stays a full model, fully trained.
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
        critic_lr: peak learning rate of the critic (the critic estimators; it follows ``model.lm.optim``'s schedule).
        value_clip: clip of the value update around the rollout-time value (critic); null disables.
        freeze_steps: rollouts during which only the critic is trained (critic warm-up).
        max_length_per_device: token budget of one packed micro-batch, or ``auto`` (the largest multiple of 256
            tokens, at most 65536, whose predicted peak fits in 85% of the device's memory: the memory plan, see
            `rl_lightning.tasks.memory_check`; single process only). In a single process a micro-batch that runs out
            of memory halves the budget, is re-packed and redone (``train/oom_retries``,
            ``train/max_length_per_device``); see `rl_lightning.memory.backoff`.
        dapo: DAPO's sampling-side settings (``model.dapo.*``, see `rl_lightning.rollout.config.DAPOConfig`):
            dynamic sampling, soft overlong punishment, overlong filtering; all off by default.
        distill: on-policy distillation from a frozen teacher (``model.distill.*``, see
            `rl_lightning.tasks.ppo.distill.DistillConfig`): its per-token reverse KL as a reward or GKD's JSD as a loss.
    """

    groups: Groups = Groups()  # this rank's parallel layout: `setup` builds it from the strategy's device mesh

    def __init__(
        self,
        lm: LMConfig,
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
        dapo: DAPOConfig = DAPOConfig(),
        distill: distillation.DistillConfig | None = None,
    ) -> None:
        super().__init__()
        self.lm = lm_config(lm).for_task(lr=1e-6, lr_schedule="constant")
        rollout, kl = typed(RolloutConfig, rollout), typed(KLConfig, kl)
        constraints, optim, dapo = typed(ConstraintConfig, constraints), self.lm.optim, typed(DAPOConfig, dapo)
        correction, self.distill = typed(CorrectionConfig, correction), distillation.distill_config(distill)
        errors = argument_errors(
            rollout=rollout, max_rollouts=max_rollouts, advantage_estimator=advantage_estimator,
            update_per_rollout=update_per_rollout, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
            aggregation=aggregation, policy_loss=policy_loss, skip_threshold=skip_threshold,
            vtrace_rho_bar=vtrace_rho_bar, vtrace_c_bar=vtrace_c_bar, nstep=nstep,
            max_length_per_device=max_length_per_device) + dapo_errors(dapo, rollout)
        if errors:
            raise ConfigError("; ".join(errors))
        self.save_hyperparameters(logger=False)
        # checkpoints keep plain data: the argument groups as dicts (turned back into dataclasses above on loading)
        self.hparams.update({k: asdict(v) for k, v in self.hparams.items() if is_dataclass(v)})
        self.hparams.lm = self.lm.as_dict()  # the optimizer's task defaults filled in
        self.rollout_config, self.kl_config, self.optim, self.dapo_config = rollout, kl, optim, dapo
        self.correction: CorrectionConfig | None = correction
        self.objective = PolicyObjective(  # composed once from the terms this run enabled
            policy_loss, clip_low, clip_high, dual_clip, aggregation, entropy_coef, skip_threshold, correction,
            kl.estimator, kl_in_loss=kl.type == "loss", entropy_constrained=constraints.entropy_min is not None,
            reference=self.needs_reference, kl_constrained=constraints.kl_max is not None,
            teacher=self.distill is not None, policy_lags=rollout.inflight_segment_tokens is not None)
        self.automatic_optimization = False
        self.tokenizer = load_tokenizer(self.lm.name)
        if self.distill is not None:  # a missing teacher or another tokenizer: refused before anything loads
            distillation.check_teacher(self.distill, self.tokenizer, self.lm.name, aggregation)
        self.distill_reward = self.distill is not None and self.distill.type == "reward"  # in the advantages
        self.distill_mix = distillation.DatasetCompletions.create(self.distill, rollout, advantage_estimator, constraints)
        self.model: Any = None
        self.critic: Any = None
        self._reference: Any = None  # not a submodule: frozen, out of the optimizer and checkpoints
        self._teacher: Any = None  # likewise (model.distill)
        self.rollouts = 0  # completed rollouts
        self.budget = TokenBudget(initial_budget(max_length_per_device))  # in use: halved on OOM, checkpointed
        self.controllers = make_controllers(kl, constraints, max_rollouts)
        self.losses: Any = None  # the micro-batch losses (`MicroBatchLosses`): with the networks, `configure_model`
        self.rollout_callback = RolloutCallback(rollout, dapo)
        self.held_out = validation.HeldOutSums()  # this rank's reward sums of the held-out prompts
        self.validation_metrics: dict[str, float] = {}  # the last validation, for the terminal

    @property
    def model_name(self) -> str:
        """The policy's name or folder (``model.lm.name``)."""
        return self.lm.name

    @property
    def max_length_per_device(self) -> int:
        """The token budget of a packed micro-batch in use (the out-of-memory back-off lowers it)."""
        return self.budget.tokens

    @max_length_per_device.setter
    def max_length_per_device(self, tokens: int) -> None:
        self.budget.tokens = tokens

    @property
    def needs_reference(self) -> bool:
        """Whether a frozen reference is needed: a KL term or a KL ceiling."""
        return self.kl_config.coef > 0 or self.hparams.constraints["kl_max"] is not None

    @override
    def configure_callbacks(self) -> list[L.Callback]:
        monitor = ShapingMonitorCallback(self.rollout_config, self.dapo_config.overlong_cache_length is not None)
        return [*([self.distill_mix] if self.distill_mix else []), self.rollout_callback, monitor]

    @override
    def setup(self, stage: str) -> None:
        """Start-up checks that need the trainer and the data (before any model is loaded)."""
        hp = self.hparams
        errors = start_up_errors(self.trainer, stage, self.rollout_config, hp.max_rollouts, hp.update_per_rollout,
                                 hp.max_length_per_device, self.max_length_per_device)
        errors += dapo_errors(self.dapo_config, self.rollout_config, self.trainer.world_size)[
            len(dapo_errors(self.dapo_config, self.rollout_config)):]  # those of the ranks (the rest: at __init__)
        if errors:
            raise ConfigError("; ".join(errors))
        self.groups = process_groups(self.trainer)  # the parallel layout, for the step's reductions
        budget = check_memory(self, stage, "ppo")  # before any weights load; auto: the largest budget that fits
        if budget is not None:
            self.max_length_per_device = budget

    @override
    def configure_model(self) -> None:
        nets = networks.configure(self)  # the policy (LoRA), critic, reference, teacher: loaded once, sharded
        self.model, self.critic = nets.model, nets.critic
        # not submodules: frozen, out of the optimizer and the checkpoints
        object.__setattr__(self, "_reference", nets.reference)
        object.__setattr__(self, "_teacher", nets.teacher)
        jsd = self.distill is not None and self.distill.type == "loss"
        self.losses = MicroBatchLosses(self.model, self.objective, self.controllers, self.rollout_config.temperature,
                                       self.lm.lm_head_chunk, self.critic, self.hparams.value_clip,
                                       self.distill if jsd else None, nets.teacher, self.distill_mix)

    def run_rollouts(self) -> int:
        """Rollouts this run takes: `max_rollouts`, or fewer when the trainer's epochs of prompts end first."""
        by_epochs = self.trainer.estimated_stepping_batches  # one training batch = one rollout
        total = min(self.hparams.max_rollouts or math.inf, by_epochs)
        if math.isinf(total):
            raise ConfigError("the run is unbounded (trainer.max_epochs=-1): set model.max_rollouts")
        return int(total)

    @override
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

    @override
    def on_fit_start(self) -> None:
        networks.place_frozen((self._reference, self._teacher), self.device, self.trainer.strategy)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)  # the skipped-step counts
        checkpoint["rollouts"] = self.rollouts
        checkpoint["controllers"] = self.controllers.state_dict()
        checkpoint["max_length_per_device"] = self.max_length_per_device

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.rollouts = checkpoint.get("rollouts", 0)
        self.controllers.load_state_dict(checkpoint.get("controllers", {}))
        self.max_length_per_device = min(self.max_length_per_device,  # a budget that ran out of memory stays down
                                         checkpoint.get("max_length_per_device", self.max_length_per_device))

    # ---------------------------------------------------------------------------------------------------- the step

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """One rollout: pack, score, advantages, one optimizer step per minibatch, controllers, logs."""
        rollout: Rollout = batch["rollout"]
        minibatches = self.pack(rollout.trajectories)  # 1. [(trajectory indices, micro-batches)] per minibatch
        micro_batches = [mb for _, mbs in minibatches for mb in mbs]
        self.score(minibatches)  # 2. old/ref log-probs, values
        advantage_sums = self.assign_advantages(rollout, micro_batches)  # 3.
        sums, logged = self.update(rollout, minibatches)  # 4. one optimizer step per minibatch
        per_trajectory = ["skipped"]  # counts of trajectories, not per-token sums
        if self.correction is not None and self.correction.level != "token":
            per_trajectory.append("mismatch_masked")
        means, trajectories = metrics.global_means(self.groups, sums, len(rollout.trajectories), per_trajectory)
        logged.update(self.controllers.update(  # 5. KL coefficient, Lagrange multipliers
            {k: float(means[k]) for k in ("kl", "entropy") if k in means}, trajectories,
            move_multipliers=self.rollouts >= self.hparams.freeze_steps))
        self.rollouts += 1
        self.log_rollout(rollout, means, advantage_sums, logged, len(micro_batches))  # 6.
        if self.hparams.max_rollouts is not None and self.rollouts >= self.hparams.max_rollouts:
            self.trainer.should_stop = True

    def pack(self, trajectories: list[Trajectory]) -> list[minibatches.Minibatch]:
        """This rank's trajectories in ``update_per_rollout`` strided minibatches of packed micro-batches."""
        return minibatches.minibatches(trajectories, self.hparams.update_per_rollout, self.max_length_per_device,
                                       self.tokenizer.pad_token_id, self.groups, self.device)

    def score(self, packed: list[minibatches.Minibatch]) -> None:
        """Record the sampling policy's and the reference's log-probabilities and the critic's values."""
        kl_reward = self.kl_config.type == "reward" and self._reference is not None
        needed_now = kl_reward or self.hparams.advantage_estimator in OFF_POLICY_ESTIMATORS or self.distill_reward
        with phase("train/score"):
            scoring.score(packed, self.model, self._reference, self.critic, self.rollout_config.temperature,
                          needed_now, self.lm.lm_head_chunk, self._teacher)

    def assign_advantages(self, rollout: Rollout, micro_batches: list[minibatches.MicroBatch]) -> torch.Tensor:
        """Per-token advantages (and returns) written into the micro-batches; their global (sum, sum sq, count)."""
        hp = self.hparams
        kl_reward = self.kl_config.type == "reward" and self._reference is not None
        return scoring.assign_advantages(
            self.groups, rollout, micro_batches, self.device, estimator=hp.advantage_estimator,
            critic=self.critic is not None, kl_reward_coef=self.controllers.kl_coef if kl_reward else None,
            kl_estimator=self.kl_config.estimator, gamma=hp.gamma, lam=hp.lam, rho_bar=hp.vtrace_rho_bar,
            c_bar=hp.vtrace_c_bar, nstep=hp.nstep, distill_coef=self.distill.coef if self.distill_reward else None)

    def update(self, rollout: Rollout, packed: list[minibatches.Minibatch]
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One actor (and critic) optimizer step per minibatch; this rank's metric sums and the values to log."""
        optimizers, schedules = (x if isinstance(x, list) else [x] for x in (self.optimizers(), self.lr_schedulers()))
        learner = update.Learner(self.losses, optimizers, schedules, self.manual_backward, self.optim,
                                 self.skip_counter, self.budget, self.tokenizer.pad_token_id, self.groups, self.device)
        return update.update(learner, rollout, packed, self.rollouts >= self.hparams.freeze_steps,
                             self.hparams.aggregation, self.rollout_config.max_completion_tokens)

    def log_rollout(self, rollout: Rollout, means: dict[str, torch.Tensor], advantage_sums: torch.Tensor,
                    logged: dict[str, Any], micro_batches: int) -> None:
        """Log the rollout's global means, rewards and advantages, the controllers' values and the counters."""
        rollout_means = metrics.rollout_metrics(self.groups, rollout, means, advantage_sums)
        self.reward_means = {k: float(v) for k, v in rollout_means.items() if k.startswith("train/reward")}
        self.log_dict({
            **rollout_means,
            **{k if k.startswith("train/") else f"train/{k}": v for k, v in logged.items()},
            "train/rollouts": float(self.rollouts), "train/micro_batches": float(micro_batches), **rollout.metrics})

    # ---------------------------------------------------------------------------------------------- validation

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Held-out prompts (sampled by the rollout callback at `rollout.val_temperature`): accumulate reward sums.

        One record per held-out set (``data.val_paths``: one dataloader each).
        """
        self.held_out.add(batch["rollout"], dataloader_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        """Log ``val/reward``, ``val/completion_length`` and ``val/reward/<component>`` (and per named set).

        See `rl_lightning.tasks.ppo.validation.HeldOutSums.log_means`.
        """
        self.held_out.log_means(self)
