"""Direct Preference Optimisation and its variants (cDPO/robust label smoothing, IPO, hinge), SimPO, ORPO and KTO.

The policy's summed completion log-probabilities for the chosen and rejected answers are compared with a frozen
reference's (computed without gradients, all micro-batches of the step in one pass so an offloaded reference moves to
the accelerator once per step). ``reference_free`` drops the reference (log pi_ref = 0). The loss is averaged over the
global number of pairs in the step, so packing and data parallelism do not change the update.

SimPO and ORPO are reference-free and read average per-token log-probabilities. KTO trains on unpaired examples: the
step first runs the policy without gradients over every example's mismatched sequence (see
`rl_lightning.data.unpaired`) to estimate its reference point over the whole global step (TRL estimates it per
micro-batch), then the usual pass; it is averaged over the global number of examples.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.algorithms import kto_reference_point
from rl_lightning.errors import ConfigError
from rl_lightning.memory.phases import phase
from rl_lightning.models.config import LMConfig, lm_config
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import target_logprobs
from rl_lightning.models.lora import AdaptersDisabled, apply_lora
from rl_lightning.models.optim import SkippedStepsState, configure_adamw, run_length
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.reductions import (
    Groups,
    data_parallel_sum,
    local_micro_batch,
    process_groups,
    sequence_sums,
)
from rl_lightning.parallel.strategy import ParallelStrategy
from rl_lightning.tasks.memory_check import check_memory
from rl_lightning.tasks.pairwise import log_validation_means, pair_slices, pairwise_step, pairwise_validation
from rl_lightning.tasks.preference_objectives import (
    REFERENCE_FREE_LOSSES,
    UNPAIRED_LOSSES,
    loss_config_errors,
    preference_objective,
)


def completion_logprobs(model: Any, micro_batch: dict[str, Any], lm_head_chunk: int | None = None) -> torch.Tensor:
    """(S,) summed log-probabilities of each sequence's completion tokens (the head in chunks of `lm_head_chunk`)."""
    logprobs = target_logprobs(model, micro_batch, chunk_size=lm_head_chunk)[0]
    return sequence_sums(logprobs, micro_batch["target_mask"], micro_batch)


def completion_token_counts(micro_batch: dict[str, Any]) -> torch.Tensor:
    """(S,) number of completion (target) tokens of each sequence, as floats."""
    mask = micro_batch["target_mask"]
    return sequence_sums(mask.float(), mask, micro_batch)


class DPO(SkippedStepsState, L.LightningModule):
    """DPO-family preference optimisation of a causal LM (against a frozen reference, or none), SimPO, ORPO and KTO.

    Args:
        lm: the policy, its adapters, memory switches and optimizer (``model.lm.*``, see
            `rl_lightning.models.config.LMConfig`; the optimizer's default here is AdamW at lr 5e-7, cosine schedule).
            With ``model.lm.lora`` the reference is the policy with its adapters disabled (no second model;
            `ref_model_name` and `reference_offload` must be left unset).
        ref_model_name: frozen reference; defaults to ``model.lm.name`` (the usual SFT starting point).
        beta: implicit-reward inverse temperature (IPO's tau; SimPO's reward scale, 2 to 10 in its paper; ORPO's
            lambda, the weight of the odds-ratio term).
        loss_type: ``sigmoid`` (DPO), ``robust`` (rDPO), ``ipo``, ``hinge``; ``simpo`` and ``orpo`` (reference-free,
            need ``reference_free: true``); ``kto`` (unpaired examples, or pairs split into two; needs the reference).
        label_smoothing: probability that a preference label is flipped, for ``sigmoid`` (cDPO), ``robust`` and
            ``simpo``; in [0, 0.5).
        reference_free: compare against a uniform reference (log pi_ref = 0) and load no reference model.
        simpo_gamma: SimPO's target reward margin (``loss_type: simpo`` only); null: 0.5.
        desirable_weight: KTO's weight on desirable examples (``loss_type: kto``; > 0).
        undesirable_weight: KTO's weight on undesirable examples (``loss_type: kto``; > 0).
        reference_offload: keep the reference on the CPU between steps (saves accelerator memory).
    """

    groups: Groups = Groups()  # this rank's parallel layout: `setup` builds it from the strategy's device mesh

    def __init__(
        self,
        lm: LMConfig,
        ref_model_name: str | None = None,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        simpo_gamma: float | None = None,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        reference_offload: bool = False,
    ) -> None:
        super().__init__()
        self.lm = lm_config(lm).for_task(lr=5e-7, lr_schedule="cosine")
        self.optim, self.lora = self.lm.optim, self.lm.lora
        errors = loss_config_errors(loss_type, reference_free, label_smoothing, simpo_gamma, desirable_weight,
                                    undesirable_weight)
        if beta <= 0:
            errors.append(f"model.beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            errors.append(f"model.label_smoothing must be in [0, 0.5), got {label_smoothing}")
        if self.lora is not None and (reference_offload or ref_model_name not in (None, self.lm.name)):
            errors.append(f"model.lm.lora: the reference is the policy with its adapters disabled, so "
                          f"model.ref_model_name ({ref_model_name}) and model.reference_offload ({reference_offload}) "
                          "must be left unset")
        if errors:
            raise ConfigError("; ".join(errors))
        self.save_hyperparameters(logger=False)
        self.hparams.lm = self.lm.as_dict()  # checkpoints keep plain data
        self.automatic_optimization = False
        self.model: Any = None
        # Not a registered submodule: frozen weights stay out of the optimizer and checkpoints, and their device is
        # managed here (offloading) rather than by Lightning.
        self._reference: Any = None
        self._val: list[dict[str, torch.Tensor]] = []

    @override
    def setup(self, stage: str) -> None:
        check_memory(self, stage, "dpo")  # before any weights load
        self.groups = process_groups(self.trainer)  # the parallel layout, for the steps' reductions

    @override
    def configure_model(self) -> None:
        hp, lm = self.hparams, self.lm
        if self.model is None:
            self.model = load_causal_lm(lm.name, attn_implementation=lm.attn_implementation,
                                        gradient_checkpointing=lm.gradient_checkpointing,
                                        lean_activations=lm.lean_activations)
            if self.lora is not None:
                self.model = apply_lora(self.model, self.lora)
        self.model = parallelize_for(self, self.model)
        if self.lora is not None and not hp.reference_free:
            object.__setattr__(self, "_reference", AdaptersDisabled(self.model))
        if self._reference is None and not hp.reference_free:
            if hp.reference_offload and isinstance(self.trainer.strategy, ParallelStrategy):
                raise ConfigError("model.reference_offload moves a whole model between devices; under ParallelStrategy "
                                  "use strategy.cpu_offload instead")
            reference = load_causal_lm(hp.ref_model_name or lm.name, attn_implementation=lm.attn_implementation)
            # object.__setattr__: nn.Module would register it as a submodule (checkpointed, moved, mode-switched).
            object.__setattr__(self, "_reference", parallelize_for(self, reference.eval().requires_grad_(False),
                                                                   trainable=False))

    @override
    def configure_optimizers(self) -> Any:
        optimizer, schedule = configure_adamw(self.model, self.optim, run_length(self.trainer.estimated_stepping_batches, self.optim))
        return [optimizer], [schedule]

    @override
    def on_fit_start(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, ParallelStrategy) and strategy.cpu_offload:
            return  # FSDP2 keeps the offloaded reference's shards on the CPU and streams them in
        if self._reference is not None and not self.hparams.reference_offload:
            self._reference.to(self.device)

    @torch.no_grad()
    def reference_logprobs(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """(S,) reference completion log-probabilities for each micro-batch (zeros when reference-free)."""
        if self._reference is None:
            return [torch.zeros(int(mb["num_sequences"]), device=self.device) for mb in micro_batches]
        if self.hparams.reference_offload:
            self._reference.to(self.device)
        layout = self.groups
        logprobs = [completion_logprobs(self._reference, local_micro_batch(layout, mb), self.lm.lm_head_chunk)
                    for mb in micro_batches]
        if self.hparams.reference_offload:
            self._reference.to("cpu")
        return logprobs

    @property
    def unpaired_examples(self) -> bool:
        """Whether the loss trains on unpaired examples (KTO): `PreferenceDataModule` then builds one unit each."""
        return self.hparams.loss_type in UNPAIRED_LOSSES

    @torch.no_grad()
    def mismatched_reference_point(self, micro_batches: list[dict[str, Any]],
                                   reference: list[torch.Tensor]) -> torch.Tensor:
        """() KTO's z0 over the global step: the policy's mismatched log-ratios, a no-gradient pass of its own."""
        layout, logratio_sum = self.groups, torch.zeros((), device=self.device)
        for micro_batch, ref_logprobs in zip(micro_batches, reference, strict=True):
            local = local_micro_batch(layout, micro_batch)
            logprobs = completion_logprobs(self.model, local, self.lm.lm_head_chunk)  # (S,)
            _, mismatched = pair_slices(logprobs - ref_logprobs, int(micro_batch["num_units"]))  # (U,)
            logratio_sum += mismatched.sum()
        num_examples = data_parallel_sum(self.groups, sum(mb["num_units"] for mb in micro_batches))
        return kto_reference_point(data_parallel_sum(self.groups, logratio_sum), num_examples.clamp(min=1))

    def _extras(self, micro_batches: list[dict[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per micro-batch: reference log-probabilities and (KTO) the step's reference point."""
        reference = self.reference_logprobs(micro_batches)
        point = self.mismatched_reference_point(micro_batches, reference) if self.unpaired_examples else None
        return [(ref_logprobs, point) for ref_logprobs in reference]

    def _pair_loss(self, micro_batch: dict, extra: tuple, normaliser: Any) -> tuple[torch.Tensor, dict]:
        hp = self.hparams
        local = local_micro_batch(self.groups, micro_batch)
        logprobs = completion_logprobs(self.model, local, self.lm.lm_head_chunk)  # (S,)
        num_tokens = completion_token_counts(local) if hp.loss_type in REFERENCE_FREE_LOSSES else None
        loss, metrics = preference_objective(hp, logprobs, extra[0], num_tokens, micro_batch, normaliser, extra[1])
        if int(micro_batch["num_units"]) == 0:  # a filler micro-batch: keep the graph, every rank runs a backward
            loss = loss + 0.0 * logprobs.sum()
        return loss, metrics

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        micro_batches = batch["micro_batches"]
        with phase("train/score"):
            extras = self._extras(micro_batches)
        pairwise_step(self, micro_batches, self._pair_loss, extras)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        micro_batches = batch["micro_batches"]
        pairwise_validation(self._val, micro_batches, self._pair_loss, self._extras(micro_batches))

    @override
    def on_validation_epoch_end(self) -> None:
        log_validation_means(self, self._val)
