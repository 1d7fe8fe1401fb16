"""Reward modelling: a causal-LM backbone with a scalar head trained with the Bradley–Terry loss on preference pairs.

The reward of a sequence is the head's output at its last token (for chat templates, the token after the end-of-turn
marker), which is where transformers' ``*ForSequenceClassification`` pools at inference, so the Hugging Face export
(``AutoModelForSequenceClassification``) scores sequences exactly as training did. Chosen and rejected sequences are
packed together; the loss is averaged over the global number of pairs in the step.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.algorithms import bradley_terry_loss
from rl_lightning.models.loading import load_reward_model
from rl_lightning.models.logprobs import model_inputs
from rl_lightning.models.lora import LoRAConfig, apply_lora, base_model, lora_config
from rl_lightning.models.optim import OptimConfig, SkippedStepsState, configure_adamw, run_length, typed
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.reductions import local_micro_batch, parallel_layout, sequence_sums
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
        model_name: Hugging Face causal-LM folder or hub name for the backbone (a fresh scalar head is added) or an
            existing sequence-classification reward model; also the tokenizer (linked to ``data.tokenizer_name``).
        optim: AdamW, its schedule over the run's optimizer steps, gradient clipping (``model.optim.*``).
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        lean_activations: memory-lean SwiGLU MLP and RMSNorm forwards (the same values and gradients, about a third
            fewer saved activations; `rl_lightning.models.lean`); false: the model's own forwards.
        attn_implementation: ``rl_varlen`` (exact per-sequence attention for packed micro-batches, any device) or a
            transformers implementation (``sdpa``, ``eager``, ``flash_attention_2``).
        lora: train low-rank adapters on the frozen backbone, and the scalar head in full (``model.lora.*``, see
            `rl_lightning.models.lora.LoRAConfig`); null: full fine-tuning.
        memory_check: refuse, at start-up, a run whose predicted peak memory per device exceeds the device's (one
            line naming the keys that would fit; the plan is printed either way, see
            `rl_lightning.tasks.memory_check`); false: print the plan and run anyway.
    """

    def __init__(
        self,
        model_name: str,
        optim: OptimConfig = OptimConfig(lr=5e-6),
        gradient_checkpointing: bool = False,
        lean_activations: bool = True,
        attn_implementation: str = "rl_varlen",
        lora: LoRAConfig | None = None,
        memory_check: bool = True,
    ) -> None:
        super().__init__()
        self.optim, self.lora = typed(OptimConfig, optim), lora_config(lora)
        self.save_hyperparameters(logger=False)
        self.hparams.optim = asdict(self.optim)  # checkpoints keep plain data
        self.hparams.lora = None if self.lora is None else asdict(self.lora)
        self.automatic_optimization = False
        self.model: Any = None
        self._val: list[dict[str, torch.Tensor]] = []

    @override
    def setup(self, stage: str) -> None:
        check_memory(self, stage, "reward")  # before any weights load

    @override
    def configure_model(self) -> None:
        if self.model is None:
            hp = self.hparams
            self.model = load_reward_model(hp.model_name, attn_implementation=hp.attn_implementation,
                                           gradient_checkpointing=hp.gradient_checkpointing,
                                           lean_activations=hp.lean_activations)
            if self.lora is not None:  # PEFT trains the sequence-classification head in full (modules_to_save)
                self.model = apply_lora(self.model, self.lora)
        self.model = parallelize_for(self, self.model)

    @override
    def configure_optimizers(self) -> Any:
        optimizer, schedule = configure_adamw(self.model, self.optim, run_length(self.trainer, self.optim))
        return [optimizer], [schedule]

    def _pair_loss(self, micro_batch: dict[str, Any], _: None, normaliser: Any) -> tuple[torch.Tensor, dict]:
        rewards = sequence_rewards(self.model, local_micro_batch(parallel_layout(self.trainer), micro_batch))  # (S,)
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
