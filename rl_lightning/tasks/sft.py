"""Supervised fine-tuning on chat conversations, loss on assistant tokens only.

One training batch is one optimizer step on this rank (a list of packed micro-batches). The loss of every
micro-batch is normalised by the number of assistant tokens in the whole step across all data-parallel ranks, so the
update is the gradient of the mean token NLL of the global batch, whatever the packing, micro-batch split or number
of ranks. Optimisation is manual for that reason (gradient accumulation happens here, not in the Trainer): use
``model.lm.optim.max_grad_norm`` instead of ``trainer.gradient_clip_val`` and ``data.max_length_per_device`` instead of
``trainer.accumulate_grad_batches``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.algorithms import sft_loss
from rl_lightning.memory.phases import phase
from rl_lightning.models.config import LMConfig, lm_config
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import target_logprobs
from rl_lightning.models.lora import apply_lora
from rl_lightning.models.optim import SkippedStepsState, configure_adamw, optimizer_step, run_length
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.reductions import (
    Groups,
    data_parallel_sum,
    local_micro_batch,
    process_groups,
    shard_sum,
)
from rl_lightning.tasks.memory_check import check_memory


class SFT(SkippedStepsState, L.LightningModule):
    """Supervised fine-tuning of a causal LM.

    Args:
        lm: the model, its adapters, memory switches and optimizer (``model.lm.*``, see
            `rl_lightning.models.config.LMConfig`); the optimizer's default here is AdamW at lr 1e-5, cosine schedule.
    """

    groups: Groups = Groups()  # this rank's parallel layout: `setup` builds it from the strategy's device mesh

    def __init__(self, lm: LMConfig) -> None:
        super().__init__()
        self.lm = lm_config(lm).for_task(lr=1e-5, lr_schedule="cosine")
        self.optim, self.lora = self.lm.optim, self.lm.lora
        self.save_hyperparameters(logger=False)
        self.hparams.lm = self.lm.as_dict()  # checkpoints keep plain data
        self.automatic_optimization = False
        self.model: Any = None
        self._val_sums: list[torch.Tensor] = []

    @override
    def setup(self, stage: str) -> None:
        check_memory(self, stage, "sft")  # before any weights load
        self.groups = process_groups(self.trainer)  # the parallel layout, for the steps' reductions

    @override
    def configure_model(self) -> None:
        if self.model is None:
            lm = self.lm
            self.model = load_causal_lm(lm.name, attn_implementation=lm.attn_implementation,
                                        gradient_checkpointing=lm.gradient_checkpointing,
                                        lean_activations=lm.lean_activations)
            if self.lora is not None:
                self.model = apply_lora(self.model, self.lora)
        self.model = parallelize_for(self, self.model)

    @override
    def configure_optimizers(self) -> Any:
        optimizer, schedule = configure_adamw(self.model, self.optim, run_length(self.trainer.estimated_stepping_batches, self.optim))
        return [optimizer], [schedule]

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        micro_batches, layout = batch["micro_batches"], self.groups
        num_tokens = data_parallel_sum(self.groups, sum(mb["target_mask"].sum() for mb in micro_batches))
        normaliser = num_tokens / self.groups.grad_average_size
        nll_sum = torch.zeros((), device=self.device)
        for micro_batch in micro_batches:
            local = local_micro_batch(layout, micro_batch)
            with phase("train/forward"):
                logprobs = target_logprobs(self.model, local, chunk_size=self.lm.lm_head_chunk)[0]
                loss, metrics = sft_loss(logprobs, local["target_mask"], normaliser)
            with phase("train/backward"):
                self.manual_backward(loss)
            nll_sum += metrics["nll_sum"]
        schedule = self.lr_schedulers()
        lr = schedule.get_last_lr()[0]
        grad_norm, logged = optimizer_step(self.optimizers(), schedule, self.parameters(), self.optim,
                                           self.skip_counter)
        self.log_dict(logged)
        self.log("train/loss", shard_sum(self.groups, nll_sum) / num_tokens, prog_bar=True)
        self.log_dict({"train/grad_norm": grad_norm, "train/lr": lr, "train/tokens": num_tokens,
                       "train/micro_batches": float(len(micro_batches))})

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        layout = self.groups
        for micro_batch in batch["micro_batches"]:
            local = local_micro_batch(layout, micro_batch)
            logprobs = target_logprobs(self.model, local, chunk_size=self.lm.lm_head_chunk)[0]
            _, metrics = sft_loss(logprobs, local["target_mask"], 1.0)
            self._val_sums.append(torch.stack([metrics["nll_sum"], metrics["num_tokens"]]))

    @override
    def on_validation_epoch_end(self) -> None:
        if self._val_sums:
            nll_sum, num_tokens = shard_sum(self.groups, torch.stack(self._val_sums).sum(0))
            self.log("val/loss", nll_sum / num_tokens, prog_bar=True)
        self._val_sums.clear()
