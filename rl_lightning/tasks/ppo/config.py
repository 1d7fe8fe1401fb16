"""PPO's argument groups (``model.kl.*``, ``model.constraints.*``, ``model.correction.*``) and its argument checks.

Arguments are checked at construction (`argument_errors`) and at start-up, once the trainer and the data are known
(`start_up_errors`); every error is reported together, naming its flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_lightning.algorithms.advantages import GROUP_ESTIMATORS, estimator_names
from rl_lightning.algorithms.controllers import Controllers
from rl_lightning.algorithms.correction import CORRECTION_LEVELS, CORRECTION_MODES
from rl_lightning.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS
from rl_lightning.algorithms.policy import AGGREGATIONS
from rl_lightning.errors import ConfigError
from rl_lightning.memory.backoff import budget_errors, oom_backoff_supported
from rl_lightning.rollout.callback import RolloutConfig
from rl_lightning.rollout.config import DAPOConfig

KL_TYPES = ("loss", "reward")
POLICY_LOSSES = ("ppo", "gspo", "cispo")

__all__ = ["AGGREGATIONS", "KL_TYPES", "POLICY_LOSSES", "ConstraintConfig", "CorrectionConfig", "KLConfig",
           "argument_errors", "make_controllers", "start_up_errors"]
@dataclass(frozen=True)
class KLConfig:
    """KL(policy || frozen reference): ``model.kl.*``.

    A reference model is loaded when `coef` > 0 or ``constraints.kl_max`` is set.

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
    """Rollout/trainer mismatch correction: ``model.correction.*`` (see `rl_lightning.algorithms.correction`).

    The per-token policy loss is multiplied by a detached weight from r = pi_old / pi_engine, the trainer's over the
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



def argument_errors(*, rollout: RolloutConfig, max_rollouts: int | None, advantage_estimator: str,
                    update_per_rollout: int, clip_low: float, clip_high: float, dual_clip: float | None,
                    aggregation: str, policy_loss: str, skip_threshold: float | None, vtrace_rho_bar: float,
                    vtrace_c_bar: float, nstep: int, max_length_per_device: object) -> list[str]:
    """Every error in PPO's arguments (the argument groups check their own), each naming its flag.

    Args:
        rollout: the rollout settings (``responses_per_prompt`` bounds the group estimators).
        max_rollouts: see `rl_lightning.tasks.ppo.PPO`; likewise every other argument.
        advantage_estimator: see `PPO`.
        update_per_rollout: see `PPO`.
        clip_low: see `PPO`.
        clip_high: see `PPO`.
        dual_clip: see `PPO`.
        aggregation: see `PPO`.
        policy_loss: see `PPO`.
        skip_threshold: see `PPO`.
        vtrace_rho_bar: see `PPO`.
        vtrace_c_bar: see `PPO`.
        nstep: see `PPO`.
        max_length_per_device: see `PPO`.

    Returns:
        The messages (empty: all good).
    """
    errors = []
    if advantage_estimator not in estimator_names():
        errors.append(f"model.advantage_estimator must be one of {', '.join(estimator_names())}, got "
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
    return errors


def start_up_errors(trainer: Any, stage: str, rollout: RolloutConfig, max_rollouts: int | None,
                    update_per_rollout: int, max_length_per_device: int | str, budget: int) -> list[str]:
    """Every error PPO's settings make with the trainer's and the data's (checked before any model is loaded).

    Args:
        trainer: the Trainer, its DataModule attached.
        stage: Lightning's stage (``fit``, ``validate``, ...).
        rollout: the rollout settings.
        max_rollouts: ``model.max_rollouts``.
        update_per_rollout: ``model.update_per_rollout``.
        max_length_per_device: ``model.max_length_per_device`` as configured (an integer or ``auto``).
        budget: the token budget in use.

    Returns:
        The messages (empty: all good).
    """
    errors = []
    if stage == "fit" and trainer.max_steps != -1:
        errors.append(f"PPO counts its run in rollouts: set model.max_rollouts instead of trainer.max_steps="
                      f"{trainer.max_steps} (which counts optimizer steps: update_per_rollout per rollout, plus "
                      "the critic's)")
    if stage == "fit" and max_rollouts is None and trainer.max_epochs == -1:
        errors.append("the run is unbounded (trainer.max_epochs=-1): set model.max_rollouts")
    train_prompts = getattr(trainer.datamodule, "prompts", {}).get("train") or []
    longest = max((len(p.prompt_ids) for p in train_prompts), default=0) + rollout.max_completion_tokens
    if max_length_per_device == "auto" and not oom_backoff_supported(trainer.world_size):
        errors.append(f"model.max_length_per_device=auto needs the out-of-memory back-off, which runs in a single "
                      f"process only (world size {trainer.world_size}): set an integer budget")
    if rollout.max_turns == 1 and longest > budget:
        errors.append(f"model.max_length_per_device={budget} cannot hold the longest trajectory, {longest} tokens "
                      f"(the longest training prompt + model.rollout.max_new_tokens): raise it to at least {longest}")
    per_rank = trainer.datamodule.hparams.batch_size * rollout.responses_per_prompt
    if per_rank % update_per_rollout:
        errors.append(f"model.update_per_rollout={update_per_rollout} must divide the {per_rank} trajectories "
                      "per rank (data.batch_size x model.rollout.responses_per_prompt)")
    return errors


def dapo_errors(dapo: DAPOConfig, rollout: RolloutConfig, world_size: int = 1) -> list[str]:
    """What ``model.dapo`` cannot be combined with in ``model.rollout`` (and, at start-up, the trainer's ranks).

    Args:
        dapo: ``model.dapo`` (its own keys checked already).
        rollout: ``model.rollout``.
        world_size: the trainer's processes (1 before the trainer exists).

    Returns:
        The messages (empty: all good).
    """
    errors = dapo.errors_with(rollout.max_new_tokens)
    tp, spec = getattr(rollout.engine_settings, "tp_size", 1), rollout.engine_spec
    if dapo.filter_range is not None and tp > 1:
        # the ranks of an engine generate together, but the refill decides per rank how often to generate
        errors.append(f"model.dapo.filter_range={dapo.filter_range} (dynamic sampling) with "
                      f"model.rollout.engine.tp_size={tp} is not supported yet; use tp_size: 1")
    if world_size > 1 and spec.own_process and rollout.async_steps and dapo.filter_range is not None:
        errors.append(f"model.dapo.filter_range={dapo.filter_range} with model.rollout.async_steps: 1 refills each "
                      f"rank on its own, but the {world_size} trainer ranks share one engine process (engine: "
                      f"{spec.kind}), which needs them to generate equally often: set async_steps: 0, "
                      "model.dapo.filter_range: null, or engine: vllm")
    return errors


def make_controllers(kl: KLConfig, constraints: ConstraintConfig, max_rollouts: int | None) -> Controllers:
    """The KL-coefficient controller and the Lagrange multipliers of `kl` and `constraints`.

    Args:
        kl: ``model.kl``.
        constraints: ``model.constraints``.
        max_rollouts: the run's length, the scheduled controller's default length.

    Returns:
        The controllers, at their initial values.
    """
    return Controllers(
        kl.controller, kl.coef, kl.target, kl.horizon, kl.rate, kl.pid, kl.final_coef,
        kl.total_rollouts or max_rollouts or 1, constraints.entropy_min, constraints.kl_max,
        constraints.multiplier_lr, constraints.multiplier_init)
