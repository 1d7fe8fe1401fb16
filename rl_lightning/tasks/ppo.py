"""Policy optimisation from sampled trajectories (the PPO family), critic-free estimators.

Each training batch is one rollout: the `RolloutCallback` has already sampled ``responses_per_prompt`` completions per
prompt and scored them. This task then

1. turns outcome rewards into advantages with a group baseline (``drgrpo``: reward minus group mean, the default;
   ``grpo``: also divided by the group std; ``rloo``: leave-one-out mean) spread over completion tokens, or with
   ``gae``: a critic (scalar head on the policy's backbone, its own optimizer) and generalised advantage estimation
   over the completion tokens, the outcome reward on the last one;
2. splits the trajectories into ``update_per_rollout`` minibatches, packs each into balanced micro-batches, and
   records the sampling policy's log-probabilities (``old_logprobs``, before any update of this rollout) and, when
   the KL loss is on, the frozen reference's;
3. takes one optimizer step per minibatch on the clipped surrogate (asymmetric ``clip_low``/``clip_high``, optional
   dual clip, truncated importance weights against the engine's log-probabilities), plus ``kl_coef`` x KL(policy ||
   reference) and minus ``entropy_coef`` x entropy, aggregated per token (Dr. GRPO/DAPO) or per sequence, normalised by
   global counts.

``reinforce_pp`` (REINFORCE++) uses the reward itself, whitened over every completion token of the rollout on all
data-parallel ranks. The KL to the frozen reference is either a loss term (``kl_type: loss``, GRPO's choice) or a
per-token reward penalty (``kl_type: reward``, InstructGPT/REINFORCE++: -coef x KL_t at rollout time, entering the
advantages as its reward-to-go, or the GAE rewards), with the k1/k2/k3 estimator of your choice and a coefficient
controller. Lagrangian constraints (``entropy_min``, ``kl_max``) learn a multiplier that keeps the measured per-token
entropy above / KL below a target. DAPO's dynamic sampling lives in the rollout callback.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from rl_lightning.algorithms import KL_ESTIMATORS, group_advantages, rloo_advantages, token_logprobs
from rl_lightning.algorithms.advantages import broadcast_to_tokens, packed_gae
from rl_lightning.algorithms.kl import KL_CONTROLLERS, make_kl_controller
from rl_lightning.algorithms.policy import (
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    lagrangian_terms,
    token_mean,
    truncated_importance_weights,
)
from rl_lightning.data.packing import karmarkar_karp
from rl_lightning.data.steps import pack
from rl_lightning.data.tokenization import TokenizedExample
from rl_lightning.errors import ConfigError
from rl_lightning.models import load_causal_lm, load_reward_model, load_tokenizer
from rl_lightning.optim import check_optim_args
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.tasks.step import (
    configure_adamw,
    data_parallel_sum,
    grad_average_size,
    local_micro_batch,
    model_inputs,
    optimizer_step,
    parallel_layout,
    sequence_sums,
)

ESTIMATORS = ("drgrpo", "grpo", "rloo", "reinforce_pp", "gae")
GROUP_ESTIMATORS = ("drgrpo", "grpo", "rloo")
AGGREGATIONS = ("token", "sequence")
KL_TYPES = ("loss", "reward")


class PPO(L.LightningModule):
    """PPO-family policy optimisation (critic-free group baselines).

    Args:
        model_name: policy to train (HF folder or hub name); also the tokenizer and the KL reference.
        advantage_estimator: ``drgrpo`` (group mean baseline), ``grpo`` (mean and std), ``rloo`` (leave-one-out),
            ``reinforce_pp`` (REINFORCE++: global batch whitening), ``gae`` (critic + generalised advantage
            estimation).
        gamma: GAE discount over completion tokens.
        lam: GAE lambda.
        critic_lr: peak learning rate of the critic (``gae``).
        value_clip: clip of the value update around the rollout-time value (``gae``); null disables.
        freeze_steps: rollouts during which only the critic is trained (``gae`` warm-up).
        update_per_rollout: optimizer steps (minibatches) per rollout; must divide the trajectories per rank.
        clip_low: lower ratio clip (1 - clip_low).
        clip_high: upper ratio clip (1 + clip_high); DAPO's clip-higher uses 0.28.
        dual_clip: bound on the loss for negative advantages (c > 1), or null.
        aggregation: ``token`` (every completion token weighs the same) or ``sequence`` (each completion's mean).
        kl_coef: weight of KL(policy || reference); 0 (and no `kl_max`) loads no reference.
        kl_type: ``loss`` (a loss term) or ``reward`` (a per-token reward penalty fixed at rollout time).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (Schulman's estimators).
        kl_controller: how ``kl_coef`` moves after each rollout, from the measured per-token KL: ``fixed``,
            ``adaptive`` (Ziegler et al.: towards `kl_target` over `kl_horizon` trajectories), ``linear`` (coef +=
            `kl_rate` x (KL - target)), ``pid`` (gains `kl_pid`), ``scheduled`` (cosine from `kl_coef` to
            `kl_final_coef` over `kl_total_rollouts`).
        kl_target: target per-token KL of the adaptive, linear and PID controllers.
        kl_horizon: adaptive controller horizon, in trajectories.
        kl_rate: linear controller rate.
        kl_pid: PID controller gains (kp, ki, kd).
        kl_final_coef: scheduled controller end value.
        kl_total_rollouts: scheduled controller length, in rollouts.
        entropy_coef: entropy bonus weight.
        entropy_min: Lagrangian constraint: keep the per-token entropy above this (a learned multiplier); null: off.
        kl_max: Lagrangian constraint: keep the per-token KL to the reference below this; null: off.
        multiplier_lr: step size of the constraints' log-multipliers (dual ascent, once per rollout).
        multiplier_init: initial value of the constraints' multipliers.
        tis_cap: cap of the truncated importance weights pi_old / pi_engine (null disables the correction).
        temperature: sampling temperature of the rollouts (log-probabilities are recomputed at it).
        max_length_per_device: token budget of one packed micro-batch.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup in optimizer steps.
        lr_schedule: ``cosine``, ``linear`` or ``constant`` after warmup.
        min_lr_ratio: final learning rate as a fraction of `lr`.
        max_grad_norm: clip the global gradient norm; <= 0 disables.
        gradient_checkpointing: recompute activations in the backward pass.
        attn_implementation: ``rl_varlen`` or a transformers implementation.
    """

    def __init__(
        self,
        model_name: str,
        advantage_estimator: str = "drgrpo",
        gamma: float = 1.0,
        lam: float = 1.0,
        critic_lr: float = 1e-5,
        value_clip: float | None = 0.2,
        freeze_steps: int = 0,
        update_per_rollout: int = 1,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dual_clip: float | None = None,
        aggregation: str = "token",
        kl_coef: float = 0.0,
        kl_type: str = "loss",
        kl_estimator: str = "k3",
        kl_controller: str = "fixed",
        kl_target: float = 0.01,
        kl_horizon: float = 10000.0,
        kl_rate: float = 0.1,
        kl_pid: tuple[float, float, float] = (0.1, 0.01, 0.0),
        kl_final_coef: float = 0.0,
        kl_total_rollouts: int = 100,
        entropy_coef: float = 0.0,
        entropy_min: float | None = None,
        kl_max: float | None = None,
        multiplier_lr: float = 0.05,
        multiplier_init: float = 0.1,
        tis_cap: float | None = None,
        temperature: float = 1.0,
        max_length_per_device: int = 8192,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        min_lr_ratio: float = 0.1,
        max_grad_norm: float = 1.0,
        gradient_checkpointing: bool = False,
        attn_implementation: str = "rl_varlen",
    ) -> None:
        super().__init__()
        errors = []
        if advantage_estimator not in ESTIMATORS:
            errors.append(f"model.advantage_estimator must be one of {', '.join(ESTIMATORS)}, got "
                          f"'{advantage_estimator}'")
        if aggregation not in AGGREGATIONS:
            errors.append(f"model.aggregation must be one of {', '.join(AGGREGATIONS)}, got '{aggregation}'")
        if kl_controller not in KL_CONTROLLERS:
            errors.append(f"model.kl_controller must be one of {', '.join(KL_CONTROLLERS)}, got '{kl_controller}'")
        if kl_estimator not in KL_ESTIMATORS:
            errors.append(f"model.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got '{kl_estimator}'")
        if update_per_rollout < 1 or temperature <= 0 or max_length_per_device < 1:
            errors.append("model.update_per_rollout, model.temperature and model.max_length_per_device must be > 0")
        if kl_type not in KL_TYPES:
            errors.append(f"model.kl_type must be one of {', '.join(KL_TYPES)}, got '{kl_type}'")
        if kl_max is not None and kl_max <= 0:
            errors.append(f"model.kl_max must be > 0 or null, got {kl_max}")
        if multiplier_lr <= 0 or multiplier_init <= 0:
            errors.append(f"model.multiplier_lr and model.multiplier_init must be > 0, got {multiplier_lr}, "
                          f"{multiplier_init}")
        if dual_clip is not None and dual_clip <= 1:
            errors.append(f"model.dual_clip must be > 1 or null, got {dual_clip}")
        if errors:
            raise ConfigError("; ".join(errors))
        check_optim_args(lr, warmup_steps, lr_schedule, min_lr_ratio)
        self.save_hyperparameters(logger=False)
        self.automatic_optimization = False
        self.tokenizer = load_tokenizer(model_name)
        self.model: Any = None
        self.critic: Any = None
        self._reference: Any = None
        self.rollouts = 0
        self.kl = make_kl_controller(kl_controller, kl_coef, kl_target, kl_horizon, kl_rate, tuple(kl_pid),
                                     kl_final_coef, kl_total_rollouts)
        # Lagrangian constraints: name -> (target, sign); sign +1 keeps the value below, -1 above the target
        self.constraints = {name: (target, sign) for name, target, sign in (("entropy", entropy_min, -1.0),
                                                                            ("kl", kl_max, 1.0)) if target is not None}
        self.log_multipliers = {name: torch.tensor(float(multiplier_init)).log().requires_grad_()
                                for name in self.constraints}

    def configure_model(self) -> None:
        hp = self.hparams
        if self.model is None:
            self.model = load_causal_lm(hp.model_name, attn_implementation=hp.attn_implementation,
                                        gradient_checkpointing=hp.gradient_checkpointing)
        self.model = parallelize_for(self, self.model)
        if hp.advantage_estimator == "gae":
            if self.critic is None:
                self.critic = load_reward_model(hp.model_name, attn_implementation=hp.attn_implementation,
                                                gradient_checkpointing=hp.gradient_checkpointing)
            self.critic = parallelize_for(self, self.critic)
        if self._reference is None and (hp.kl_coef > 0 or hp.kl_max is not None):
            reference = load_causal_lm(hp.model_name, attn_implementation=hp.attn_implementation)
            object.__setattr__(self, "_reference", parallelize_for(self, reference.eval().requires_grad_(False),
                                                                   trainable=False))

    def configure_optimizers(self) -> Any:
        actor_optimizers, actor_schedulers = configure_adamw(self, self.model)
        if self.critic is None:
            return actor_optimizers, actor_schedulers
        critic_optimizers, critic_schedulers = configure_adamw(self, self.critic, lr=self.hparams.critic_lr)
        return actor_optimizers + critic_optimizers, actor_schedulers + critic_schedulers

    def on_fit_start(self) -> None:
        from rl_lightning.rollout.callback import RolloutCallback

        callbacks = [c for c in self.trainer.callbacks if isinstance(c, RolloutCallback)]
        if len(callbacks) != 1:
            raise ConfigError("PPO needs exactly one rl_lightning.rollout.callback.RolloutCallback in trainer.callbacks")
        group = callbacks[0].responses_per_prompt
        per_rank = self.trainer.datamodule.hparams.batch_size * group
        hp = self.hparams
        whole_sequences = [f"model.advantage_estimator={hp.advantage_estimator}"] if hp.advantage_estimator in (
            "gae", "reinforce_pp") else []
        if hp.kl_type == "reward" and self._reference is not None:
            whole_sequences.append("model.kl_type=reward")
        if whole_sequences and getattr(self.trainer.strategy, "cp_size", 1) > 1:
            raise ConfigError(f"{' and '.join(whole_sequences)} needs whole sequences per rank (token reward-to-go); "
                              "it does not support strategy.context_parallel_size > 1 yet")
        if hp.advantage_estimator in GROUP_ESTIMATORS and group < 2:
            raise ConfigError(f"model.advantage_estimator={self.hparams.advantage_estimator} compares completions of a "
                              f"prompt: set the rollout callback's responses_per_prompt >= 2 (got {group})")
        if per_rank % self.hparams.update_per_rollout:
            raise ConfigError(f"model.update_per_rollout={self.hparams.update_per_rollout} must divide the "
                              f"{per_rank} trajectories per rank (data.batch_size x responses_per_prompt)")
        if self._reference is not None:
            self._reference.to(self.device)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rollouts"] = self.rollouts
        checkpoint["kl_controller"] = dict(vars(self.kl))
        checkpoint["log_multipliers"] = {k: float(v) for k, v in self.log_multipliers.items()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.rollouts = checkpoint.get("rollouts", 0)
        vars(self.kl).update(checkpoint.get("kl_controller", {}))
        for name, value in checkpoint.get("log_multipliers", {}).items():
            if name in self.log_multipliers:
                self.log_multipliers[name] = torch.tensor(value).requires_grad_()

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """(B,) per-trajectory advantages before any token-level terms (reinforce_pp: the reward, whitened later)."""
        if self.hparams.advantage_estimator == "rloo":
            return rloo_advantages(rewards, group_size)
        if self.hparams.advantage_estimator in ("reinforce_pp", "gae"):
            return rewards
        return group_advantages(rewards, group_size, scale_by_std=self.hparams.advantage_estimator == "grpo")

    def _minibatch(self, trajectories: list, advantages: torch.Tensor) -> list[dict[str, Any]]:
        """Pack trajectories into micro-batches (the same count on every data-parallel rank), with old and reference
        log-probabilities (and, for GAE, values, advantages and returns) recorded for this rank's tokens."""
        units = []
        for t, a in zip(trajectories, advantages, strict=True):
            reward = [0.0] * len(t.input_ids)
            last = max((i for i, m in enumerate(t.completion_mask) if m), default=None)
            if last is not None:  # on the last generated token (a masked-out truncated completion has none)
                reward[last] = t.reward
            per_token = broadcast_to_tokens(a[None], torch.tensor([t.completion_mask]))[0].tolist()
            units.append(t.example(advantages=per_token, reward=reward))
        if not units:  # this rank drew no trajectories for this minibatch: one masked filler token keeps it in step
            units = [TokenizedExample([self.tokenizer.pad_token_id], [0],
                                      values={k: [0.0] for k in ("engine_logprobs", "advantages", "reward")})]
        lengths = [len(u.input_ids) for u in units]
        count = -(-sum(lengths) // self.hparams.max_length_per_device)
        while True:  # the smallest count that fits locally, then the largest over ranks
            parts = karmarkar_karp(lengths, max(1, count))
            if all(sum(lengths[i] for i in p) <= self.hparams.max_length_per_device for p in parts):
                break
            count += 1
        count = int(self._dp_max(torch.tensor(float(max(1, count)))))
        layout = parallel_layout(self.trainer)
        micro_batches = []
        for part in karmarkar_karp(lengths, count):
            local = local_micro_batch(layout, self._to_device(pack([units[i] for i in part],
                                                                   self.tokenizer.pad_token_id)))
            with torch.no_grad():
                local["old_logprobs"] = self._logprobs(self.model, local)[0]
                if self._reference is not None:
                    local["ref_logprobs"] = self._logprobs(self._reference, local)[0]
                    if self.hparams.kl_type == "reward":
                        self._add_kl_penalty(local)
                if self.critic is not None:
                    local["old_values"] = self._values(local)
                    local["target_advantages"], local["returns"] = packed_gae(
                        local["target_reward"], local["old_values"], local["target_mask"], local["seq_index"],
                        int(local["num_sequences"]), self.hparams.gamma, self.hparams.lam)
            micro_batches.append(local)
        return micro_batches

    def _add_kl_penalty(self, mb: dict[str, Any]) -> None:
        """``kl_type: reward``: a per-token reward -coef x KL_t(sampling policy || reference). GAE sees it in its token
        rewards; the other estimators add its reward-to-go (sum over the rest of the completion) to the advantages."""
        hp = self.hparams
        mask = mb["target_mask"].float()
        penalty = -self.kl.coef * KL_ESTIMATORS[hp.kl_estimator](mb["old_logprobs"], mb["ref_logprobs"]) * mask
        if hp.advantage_estimator == "gae":
            mb["target_reward"] = mb["target_reward"] + penalty
        else:  # reward-to-go = GAE with zero values, gamma = lambda = 1
            to_go, _ = packed_gae(penalty, torch.zeros_like(penalty), mask, mb["seq_index"], int(mb["num_sequences"]),
                                  1.0, 1.0)
            mb["target_advantages"] = mb["target_advantages"] + to_go

    def _whiten_globally(self, minibatches: list[list[dict[str, Any]]]) -> None:
        """REINFORCE++: whiten the token advantages over every completion token of the rollout on all data-parallel
        ranks (population std, as `masked_whiten`)."""
        mbs = [mb for micro_batches in minibatches for mb in micro_batches]
        stats = torch.zeros(3, device=self.device)
        for mb in mbs:
            mask, adv = mb["target_mask"].float(), mb["target_advantages"]
            stats += torch.stack([(adv * mask).sum(), (adv**2 * mask).sum(), mask.sum()])
        total, square, count = data_parallel_sum(self.trainer, stats)
        mean = total / count.clamp(min=1)
        std = (square / count.clamp(min=1) - mean**2).clamp(min=0).sqrt()
        for mb in mbs:
            mb["target_advantages"] = (mb["target_advantages"] - mean) / (std + 1e-8) * mb["target_mask"]

    def _values(self, micro_batch: dict[str, Any]) -> torch.Tensor:
        """(B, T) critic value of the state at each position (before its target token is generated)."""
        hidden = self.critic.base_model(**model_inputs(micro_batch)).last_hidden_state
        return self.critic.score(hidden).squeeze(-1).float()

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _dp_max(self, value: torch.Tensor) -> torch.Tensor:
        dp_mesh = getattr(self.trainer.strategy, "dp_mesh", None)
        if dp_mesh is not None and dp_mesh.size() > 1:
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=dp_mesh.get_group())
            return value
        return self.trainer.strategy.reduce(value, reduce_op="max") if self.trainer.world_size > 1 else value

    def _logprobs(self, model: Any, micro_batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) target log-probabilities at the sampling temperature, and the logits."""
        logits = model(**model_inputs(micro_batch)).logits
        return token_logprobs(logits, micro_batch["target_ids"], self.hparams.temperature), logits

    def _loss(self, mb: dict[str, Any], normaliser: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hp = self.hparams
        logprobs, logits = self._logprobs(self.model, mb)
        mask = mb["target_mask"].float()
        loss, metrics = clipped_policy_loss(logprobs, mb["old_logprobs"], mb["target_advantages"], hp.clip_low,
                                            hp.clip_high, hp.dual_clip)
        if hp.tis_cap is not None:
            loss = loss * truncated_importance_weights(mb["old_logprobs"], mb["target_engine_logprobs"], hp.tis_cap)
        measured = {}
        if self._reference is not None:
            measured["kl"] = KL_ESTIMATORS[hp.kl_estimator](logprobs, mb["ref_logprobs"])
            if hp.kl_type == "loss":
                loss = loss + self.kl.coef * measured["kl"]
        needs_grad = hp.entropy_coef != 0 or "entropy" in self.constraints
        measured["entropy"] = entropy_from_logits(logits if needs_grad else logits.detach())
        loss = loss - hp.entropy_coef * measured["entropy"]
        for name, (target, sign) in self.constraints.items():  # lambda x (value - target) per token, lambda fixed
            term, _ = lagrangian_terms(self.log_multipliers[name], measured[name], target, sign)
            loss = loss + term
        metrics.update({k: v.detach() for k, v in measured.items()})
        log_ratio = (logprobs - mb["old_logprobs"]).detach()
        metrics["approx_kl"] = torch.exp(-log_ratio) - 1 + log_ratio
        if hp.aggregation == "token":
            total = token_mean(loss, mask, normaliser)
        else:  # each completion's token mean, summed over completions
            total = (sequence_sums(loss, mask, mb) / sequence_sums(mask, mask, mb).clamp(min=1)).sum() / normaliser
        sums = {k: (v * mask).sum() for k, v in metrics.items()}
        return total, sums

    def _value_loss(self, mb: dict[str, Any], normaliser: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = self._values(mb)
        mask = mb["target_mask"].float()
        loss = clipped_value_loss(values, mb["old_values"], mb["returns"], self.hparams.value_clip)
        sums = {"value_loss": (loss.detach() * mask).sum(), "values": (values.detach() * mask).sum(),
                "returns": (mb["returns"] * mask).sum()}
        return token_mean(loss, mask, normaliser), sums

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        trajectories, group = batch["trajectories"], batch["group_size"]
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages = self.advantages(rewards, group)
        # Strided parts: minibatch k takes this rank's trajectories k, k + U, k + 2U, ... Since U divides every rank's
        # share, the global minibatch k is the same set of trajectories whatever the data-parallel size (dp=2 == dp=1).
        # Dynamic sampling can leave fewer trajectories (a rank may even have none: it still runs filler
        # micro-batches so every rank takes the same optimizer steps).
        parts = [list(range(k, len(trajectories), self.hparams.update_per_rollout))
                 for k in range(self.hparams.update_per_rollout)]
        minibatches = [self._minibatch([trajectories[i] for i in part], advantages[part]) for part in parts]
        if self.hparams.advantage_estimator == "reinforce_pp":
            self._whiten_globally(minibatches)
        adv_sums = self._advantage_sums(minibatches)
        token_count, sums, extra = torch.zeros((), device=self.device), {}, {}
        for micro_batches, part in zip(minibatches, parts, strict=True):
            # Counted from whole trajectories: context-parallel shards hold only parts of each sequence.
            if self.hparams.aggregation == "token":
                count = data_parallel_sum(self.trainer, torch.tensor(float(sum(
                    trajectories[i].completion_length for i in part))))
            else:
                count = data_parallel_sum(self.trainer, torch.tensor(float(len(part))))
            # clamp: a minibatch whose completions were all masked out (truncated) has nothing to learn, not a NaN
            normaliser = count.clamp(min=1) / grad_average_size(self.trainer)
            train_actor = self.rollouts >= self.hparams.freeze_steps
            for mb in micro_batches:
                metric_sums = {}
                if train_actor:
                    loss, metric_sums = self._loss(mb, normaliser)
                    self.manual_backward(loss)
                if self.critic is not None:
                    value_loss, value_sums = self._value_loss(mb, normaliser)
                    self.manual_backward(value_loss)
                    metric_sums.update(value_sums)
                sums = {k: sums.get(k, 0) + v.detach() for k, v in metric_sums.items()}
                token_count += mb["target_mask"].sum()
            index = None if self.critic is None else 0
            grad_norm = optimizer_step(self, self.hparams.max_grad_norm, index, self.model) if train_actor else \
                torch.zeros(())
            if self.critic is not None:
                extra["train/critic_grad_norm"] = optimizer_step(self, self.hparams.max_grad_norm, 1, self.critic)
        self.rollouts += 1
        extra["train/grad_norm"] = grad_norm
        if "kl" in sums:  # move the KL coefficient with the measured per-token KL of this rollout
            totals = data_parallel_sum(self.trainer, torch.stack([sums["kl"], token_count]))
            # the adaptive controller counts trajectories (Ziegler et al.'s n_steps); the others count rollouts
            steps = len(trajectories) if self.hparams.kl_controller == "adaptive" else 1
            extra["train/kl_coef"] = self.kl.update(float(totals[0] / totals[1].clamp(min=1)), steps)
        if self.constraints and train_actor:
            extra.update(self._update_multipliers(sums, token_count))
        self._log_rollout(trajectories, rewards, adv_sums, sums, token_count, extra, batch)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Held-out prompts, one greedy completion each (sampled by the rollout callback): accumulate reward sums."""
        trajectories, self._val_names = batch["trajectories"], batch.get("reward_names", [])
        record = torch.tensor([sum(t.reward for t in trajectories), sum(t.completion_length for t in trajectories),
                               len(trajectories), *(sum(t.reward_components[c] for t in trajectories)
                                                    for c in self._val_names)], dtype=torch.float64)
        self._val_sums = record if getattr(self, "_val_sums", None) is None else self._val_sums + record

    def on_validation_epoch_end(self) -> None:
        sums, self._val_sums = getattr(self, "_val_sums", None), None
        if sums is None:
            return
        totals = data_parallel_sum(self.trainer, sums.to(self.device))
        reward, length, *components = totals[[0, 1, *range(3, len(totals))]] / totals[2].clamp(min=1)
        metrics = {"val/reward": reward, "val/completion_length": length,
                   **{f"val/reward/{c}": v for c, v in zip(self._val_names, components, strict=True)}}
        if self.trainer.sanity_checking:  # Lightning drops sanity-check logs; keep the untrained policy's score
            for logger in self.trainer.loggers:
                logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=0)
        else:
            self.log_dict(metrics)

    def _update_multipliers(self, sums: dict, token_count: torch.Tensor) -> dict[str, torch.Tensor]:
        """One dual-ascent step per constraint on the rollout's global per-token mean of the measured value."""
        names = sorted(self.constraints)
        totals = data_parallel_sum(self.trainer, torch.stack([*(sums[n] for n in names), token_count]))
        logged = {}
        for i, name in enumerate(names):
            target, sign = self.constraints[name]
            log_multiplier = self.log_multipliers[name]
            _, multiplier_loss = lagrangian_terms(log_multiplier, (totals[i] / totals[-1].clamp(min=1)).cpu(), target,
                                                  sign)
            (grad,) = torch.autograd.grad(multiplier_loss, log_multiplier)
            with torch.no_grad():
                log_multiplier -= self.hparams.multiplier_lr * grad
            logged[f"train/{name}_multiplier"] = log_multiplier.detach().exp()
        return logged

    def _advantage_sums(self, minibatches: list[list[dict[str, Any]]]) -> torch.Tensor:
        """This rank's (sum, sum of squares) of the token advantages the loss will use."""
        sums = torch.zeros(2, device=self.device)
        for mb in (mb for micro_batches in minibatches for mb in micro_batches):
            adv = mb["target_advantages"] * mb["target_mask"]
            sums += torch.stack([adv.sum(), (adv**2).sum()])
        return sums

    def _log_rollout(self, trajectories: list, rewards: torch.Tensor, adv_sums: torch.Tensor, sums: dict,
                     token_count: torch.Tensor, extra: dict, batch: dict) -> None:
        names = sorted(sums)
        totals = data_parallel_sum(self.trainer, torch.stack([*(sums[n] for n in names), token_count]))
        tokens = totals[-1].clamp(min=1)
        lengths = torch.tensor([float(t.completion_length) for t in trajectories])
        components = batch.get("reward_names", [])
        per_rank = torch.stack([rewards.sum(), (rewards**2).sum(), lengths.sum(), torch.tensor(float(len(rewards))),
                                torch.tensor(float(batch["reward_failures"])), *adv_sums.cpu(),
                                *(torch.tensor(sum(t.reward_components[c] for t in trajectories), dtype=torch.float32)
                                  for c in components)])
        reward_sum, reward_sq, length_sum, count, failures, adv_sum, adv_sq, *component_sums = data_parallel_sum(
            self.trainer, per_rank)
        n = count.clamp(min=1)  # dynamic sampling may keep no trajectory at all
        mean = reward_sum / n
        adv_mean = adv_sum / tokens
        metrics = {f"train/{name}": totals[i] / tokens for i, name in enumerate(names)}
        metrics.update({f"train/reward/{c}": component_sums[i] / n for i, c in enumerate(components)})
        metrics.update({"train/reward": mean, "train/reward_std": (reward_sq / n - mean**2).clamp(min=0).sqrt(),
                        "train/completion_length": length_sum / n, "train/advantage_mean": adv_mean,
                        "train/advantage_std": (adv_sq / tokens - adv_mean**2).clamp(min=0).sqrt(),
                        **extra, "train/rollouts": float(self.rollouts), "train/refills": float(batch.get("refills", 0)),
                        "train/reward_failures": failures,
                        "train/trajectories": count})
        self.log_dict(metrics, prog_bar=False)
        self.log("reward", mean, prog_bar=True, logger=False)
