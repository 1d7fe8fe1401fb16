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

Departures from the papers: the KL term is a loss term (GRPO's choice) with the k1/k2/k3 estimator of your choice;
advantages are not whitened; reward-type KL, adaptive KL control and DAPO's dynamic sampling are not in this task yet.
"""

from __future__ import annotations

import itertools
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

ESTIMATORS = ("drgrpo", "grpo", "rloo", "gae")
AGGREGATIONS = ("token", "sequence")


class PPO(L.LightningModule):
    """PPO-family policy optimisation (critic-free group baselines).

    Args:
        model_name: policy to train (HF folder or hub name); also the tokenizer and the KL reference.
        advantage_estimator: ``drgrpo`` (group mean baseline), ``grpo`` (mean and std), ``rloo`` (leave-one-out),
            ``gae`` (critic + generalised advantage estimation).
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
        kl_coef: weight of KL(policy || reference) in the loss; 0 loads no reference.
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
        kl_estimator: str = "k3",
        kl_controller: str = "fixed",
        kl_target: float = 0.01,
        kl_horizon: float = 10000.0,
        kl_rate: float = 0.1,
        kl_pid: tuple[float, float, float] = (0.1, 0.01, 0.0),
        kl_final_coef: float = 0.0,
        kl_total_rollouts: int = 100,
        entropy_coef: float = 0.0,
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
        if self._reference is None and hp.kl_coef > 0:
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
        if self.hparams.advantage_estimator == "gae":
            if getattr(self.trainer.strategy, "cp_size", 1) > 1:
                raise ConfigError("model.advantage_estimator=gae needs whole sequences per rank; it does not support "
                                  "strategy.context_parallel_size > 1 yet")
        elif group < 2:
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

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.rollouts = checkpoint.get("rollouts", 0)
        vars(self.kl).update(checkpoint.get("kl_controller", {}))

    def advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        if self.hparams.advantage_estimator == "rloo":
            return rloo_advantages(rewards, group_size)
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
                if self.critic is not None:
                    local["old_values"] = self._values(local)
                    local["target_advantages"], local["returns"] = packed_gae(
                        local["target_reward"], local["old_values"], local["target_mask"], local["seq_index"],
                        int(local["num_sequences"]), self.hparams.gamma, self.hparams.lam)
            micro_batches.append(local)
        return micro_batches

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
        if self._reference is not None:
            kl = KL_ESTIMATORS[hp.kl_estimator](logprobs, mb["ref_logprobs"])
            loss = loss + self.kl.coef * kl
            metrics["kl"] = kl.detach()
        entropy = entropy_from_logits(logits.detach() if hp.entropy_coef == 0 else logits)
        loss = loss - hp.entropy_coef * entropy
        log_ratio = (logprobs - mb["old_logprobs"]).detach()
        metrics.update({"entropy": entropy.detach(), "approx_kl": torch.exp(-log_ratio) - 1 + log_ratio})
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
        # Contiguous, near-equal parts (dynamic sampling can leave fewer trajectories than the batch had; a rank may
        # even have none: it still runs filler micro-batches so every rank takes the same optimizer steps).
        bounds = [round(i * len(trajectories) / self.hparams.update_per_rollout)
                  for i in range(self.hparams.update_per_rollout + 1)]
        parts = list(itertools.pairwise(bounds))
        minibatches = [self._minibatch(trajectories[a:b], advantages[a:b]) for a, b in parts]
        token_count, sums, extra = torch.zeros((), device=self.device), {}, {}
        for micro_batches, (a, b) in zip(minibatches, parts, strict=True):
            # Counted from whole trajectories: context-parallel shards hold only parts of each sequence.
            if self.hparams.aggregation == "token":
                count = data_parallel_sum(self.trainer, torch.tensor(float(sum(
                    t.completion_length for t in trajectories[a:b]))))
            else:
                count = data_parallel_sum(self.trainer, torch.tensor(float(b - a)))
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
        if self._reference is not None:  # move the KL coefficient with the measured per-token KL of this rollout
            totals = data_parallel_sum(self.trainer, torch.stack([sums["kl"], token_count]))
            # the adaptive controller counts trajectories (Ziegler et al.'s n_steps); the others count rollouts
            steps = len(trajectories) if self.hparams.kl_controller == "adaptive" else 1
            extra["train/kl_coef"] = self.kl.update(float(totals[0] / totals[1].clamp(min=1)), steps)
        self._log_rollout(trajectories, rewards, advantages, sums, token_count, extra, batch)

    def _log_rollout(self, trajectories: list, rewards: torch.Tensor, advantages: torch.Tensor, sums: dict,
                     token_count: torch.Tensor, extra: dict, batch: dict) -> None:
        names = sorted(sums)
        totals = data_parallel_sum(self.trainer, torch.stack([*(sums[n] for n in names), token_count]))
        lengths = torch.tensor([float(t.completion_length) for t in trajectories])
        per_rank = torch.stack([rewards.sum(), (rewards**2).sum(), lengths.sum(), torch.tensor(float(len(rewards))),
                                advantages.abs().sum(), torch.tensor(float(batch["reward_failures"]))])
        reward_sum, reward_sq, length_sum, count, adv_abs, failures = data_parallel_sum(self.trainer, per_rank)
        n = count.clamp(min=1)  # dynamic sampling may keep no trajectory at all
        mean = reward_sum / n
        metrics = {f"train/{name}": totals[i] / totals[-1].clamp(min=1) for i, name in enumerate(names)}
        metrics.update({"train/reward": mean, "train/reward_std": (reward_sq / n - mean**2).clamp(min=0).sqrt(),
                        "train/completion_length": length_sum / n, "train/advantage_abs": adv_abs / n,
                        **extra, "train/rollouts": float(self.rollouts), "train/refills": float(batch.get("refills", 0)),
                        "train/reward_failures": failures,
                        "train/trajectories": count})
        self.log_dict(metrics, prog_bar=False)
        self.log("reward", mean, prog_bar=True, logger=False)
