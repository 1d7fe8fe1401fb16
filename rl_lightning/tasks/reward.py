"""Reward modelling: a causal-LM backbone with a scalar head trained with the Bradley–Terry loss on preference pairs.

The reward of a sequence is the head's output at its last token (for chat templates, the token after the end-of-turn
marker), which is where transformers' ``*ForSequenceClassification`` pools at inference, so the Hugging Face export
(``AutoModelForSequenceClassification``) scores sequences exactly as training did. Chosen and rejected sequences are
packed together; the loss is averaged over the global number of pairs in the step.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.algorithms import bradley_terry_loss
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LM_HEAD_CHUNK, LMConfig, lm_config
from rl_lightning.models.loading import load_reward_model
from rl_lightning.models.logprobs import model_inputs
from rl_lightning.models.lora import apply_lora, base_model
from rl_lightning.models.optim import SkippedStepsState, configure_adamw, run_length
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.reductions import Groups, local_micro_batch, process_groups, sequence_sums
from rl_lightning.tasks.memory_check import check_memory
from rl_lightning.tasks.pairwise import log_validation_means, pair_slices, pairwise_step, pairwise_validation


def sequence_rewards(model: Any, micro_batch: dict[str, Any]) -> torch.Tensor:
    """(S,) scalar reward of each sequence of the micro-batch, read at its last token."""
    model = base_model(model)  # inside a PEFT wrapper: the adapters are in its layers, the head a trained copy
    hidden = model.base_model(**model_inputs(micro_batch)).last_hidden_state  # (B, T, H)
    scores = model.score(hidden).squeeze(-1).float()  # (B, T)
    return sequence_sums(scores, micro_batch["last_mask"], micro_batch)


class RewardModel(SkippedStepsState, L.LightningModule):
    """Bradley–Terry reward model.

    Args:
        lm: the backbone, its adapters, memory switches and optimizer (``model.lm.*``, see
            `rl_lightning.models.config.LMConfig`): ``name`` is a causal LM (a fresh scalar head is added) or an
            existing sequence-classification reward model; with ``lora`` the scalar head trains in full; the
            optimizer's default here is AdamW at lr 5e-6, cosine schedule. The scalar head has no output head to
            chunk: ``lm_head_chunk`` other than its default or null is refused.
    """

    groups: Groups = Groups()  # this rank's parallel layout: `setup` builds it from the strategy's device mesh

    def __init__(
        self,
        lm: LMConfig,
    ) -> None:
        super().__init__()
        self.lm = lm_config(lm).for_task(lr=5e-6, lr_schedule="cosine")
        if self.lm.lm_head_chunk not in (None, LM_HEAD_CHUNK):
            raise ConfigError(f"model.lm.lm_head_chunk={self.lm.lm_head_chunk}: the RewardModel has a scalar head, no "
                              "output head to chunk; leave model.lm.lm_head_chunk unset")
        self.optim, self.lora = self.lm.optim, self.lm.lora
        self.save_hyperparameters(logger=False)
        self.hparams.lm = self.lm.as_dict()  # checkpoints keep plain data
        self.automatic_optimization = False
        self.model: Any = None
        self._val: list[dict[str, torch.Tensor]] = []

    @override
    def setup(self, stage: str) -> None:
        check_memory(self, stage, "reward")  # before any weights load
        self.groups = process_groups(self.trainer)  # the parallel layout, for the steps' reductions

    @override
    def configure_model(self) -> None:
        if self.model is None:
            lm = self.lm
            self.model = load_reward_model(lm.name, attn_implementation=lm.attn_implementation,
                                           gradient_checkpointing=lm.gradient_checkpointing,
                                           lean_activations=lm.lean_activations)
            if self.lora is not None:  # PEFT trains the sequence-classification head in full (modules_to_save)
                self.model = apply_lora(self.model, self.lora)
        self.model = parallelize_for(self, self.model)

    @override
    def configure_optimizers(self) -> Any:
        optimizer, schedule = configure_adamw(self.model, self.optim, run_length(self.trainer.estimated_stepping_batches, self.optim))
        return [optimizer], [schedule]

    def _pair_loss(self, micro_batch: dict[str, Any], _: None, normaliser: Any) -> tuple[torch.Tensor, dict]:
        rewards = sequence_rewards(self.model, local_micro_batch(self.groups, micro_batch))  # (S,)
        num_pairs = int(micro_batch["num_units"])
        chosen, rejected = pair_slices(rewards, num_pairs)
        loss, metrics = bradley_terry_loss(chosen, rejected, normaliser, micro_batch["margin"])
        if num_pairs == 0:  # a filler micro-batch: keep the graph so every rank runs the same backward
            loss = loss + 0.0 * rewards.sum()
        return loss, metrics

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        micro_batches = batch["micro_batches"]
        pairwise_step(self, micro_batches, self._pair_loss, [None] * len(micro_batches))

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        micro_batches = batch["micro_batches"]
        pairwise_validation(self._val, micro_batches, self._pair_loss, [None] * len(micro_batches))

    @override
    def on_validation_epoch_end(self) -> None:
        log_validation_means(self, self._val)
