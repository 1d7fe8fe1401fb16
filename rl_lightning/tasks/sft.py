"""Supervised fine-tuning on chat conversations, loss on assistant tokens only.

One training batch is one optimizer step on this rank (a list of packed micro-batches). The loss of every
micro-batch is normalised by the number of assistant tokens in the whole step across all data-parallel ranks, so the
update is the gradient of the mean token NLL of the global batch, whatever the packing, micro-batch split or number
of ranks. Optimisation is manual for that reason (gradient accumulation happens here, not in the Trainer): use
``model.optim.max_grad_norm`` instead of ``trainer.gradient_clip_val`` and ``data.max_length_per_device`` instead of
``trainer.accumulate_grad_batches``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.algorithms import sft_loss
from rl_lightning.memory.phases import phase
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.logprobs import check_lm_head_chunk, target_logprobs
from rl_lightning.models.lora import LoRAConfig, apply_lora, lora_config
from rl_lightning.models.optim import OptimConfig, SkippedStepsState, configure_adamw, optimizer_step, run_length, typed
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.parallel.reductions import (
    data_parallel_sum,
    grad_average_size,
    local_micro_batch,
    parallel_layout,
    shard_sum,
)
from rl_lightning.tasks.memory_check import check_memory


class SFT(SkippedStepsState, L.LightningModule):
    """Supervised fine-tuning of a causal LM.

    Args:
        model_name: Hugging Face model folder or hub name (also the tokenizer, linked to ``data.tokenizer_name``).
        optim: AdamW, its schedule over the run's optimizer steps, gradient clipping (``model.optim.*``).
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        lean_activations: memory-lean SwiGLU MLP and RMSNorm forwards (the same values and gradients, about a third
            fewer saved activations; `rl_lightning.models.lean`); false: the model's own forwards.
        attn_implementation: ``rl_varlen`` (exact per-sequence attention for packed micro-batches, any device) or a
            transformers implementation (``sdpa``, ``eager``, ``flash_attention_2``).
        lora: train low-rank adapters on the frozen model instead of every weight (``model.lora.*``, see
            `rl_lightning.models.lora.LoRAConfig`); null: full fine-tuning.
        lm_head_chunk: positions per chunk of the output head: the (tokens x vocabulary) logits are never built
            whole, only (lm_head_chunk x vocabulary) at a time, in the forward and the backward (same values); null:
            the full logits (more memory, sometimes faster on small batches).
        memory_check: refuse, at start-up, a run whose predicted peak memory per device exceeds the device's (one
            line naming the keys that would fit; the plan is printed either way, see
            `rl_lightning.tasks.memory_check`); false: print the plan and run anyway.
    """

    def __init__(
        self,
        model_name: str,
        optim: OptimConfig = OptimConfig(lr=1e-5),
        gradient_checkpointing: bool = False,
        lean_activations: bool = True,
        attn_implementation: str = "rl_varlen",
        lora: LoRAConfig | None = None,
        lm_head_chunk: int | None = 1024,
        memory_check: bool = True,
    ) -> None:
        super().__init__()
        check_lm_head_chunk(lm_head_chunk)
        self.optim, self.lora = typed(OptimConfig, optim), lora_config(lora)
        self.save_hyperparameters(logger=False)
        self.hparams.optim = asdict(self.optim)  # checkpoints keep plain data
        self.hparams.lora = None if self.lora is None else asdict(self.lora)
        self.automatic_optimization = False
        self.model: Any = None
        self._val_sums: list[torch.Tensor] = []

    @override
    def setup(self, stage: str) -> None:
        check_memory(self, stage, "sft")  # before any weights load

    @override
    def configure_model(self) -> None:
        if self.model is None:
            hp = self.hparams
            self.model = load_causal_lm(hp.model_name, attn_implementation=hp.attn_implementation,
                                        gradient_checkpointing=hp.gradient_checkpointing,
                                        lean_activations=hp.lean_activations)
            if self.lora is not None:
                self.model = apply_lora(self.model, self.lora)
        self.model = parallelize_for(self, self.model)

    @override
    def configure_optimizers(self) -> Any:
        optimizer, schedule = configure_adamw(self.model, self.optim, run_length(self.trainer, self.optim))
        return [optimizer], [schedule]

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        micro_batches, layout = batch["micro_batches"], parallel_layout(self.trainer)
        num_tokens = data_parallel_sum(self.trainer, sum(mb["target_mask"].sum() for mb in micro_batches))
        normaliser = num_tokens / grad_average_size(self.trainer)
        nll_sum = torch.zeros((), device=self.device)
        for micro_batch in micro_batches:
            local = local_micro_batch(layout, micro_batch)
            with phase("train/forward"):
                logprobs = target_logprobs(self.model, local, chunk_size=self.hparams.lm_head_chunk)[0]
                loss, metrics = sft_loss(logprobs, local["target_mask"], normaliser)
            with phase("train/backward"):
                self.manual_backward(loss)
            nll_sum += metrics["nll_sum"]
        lr = self.lr_schedulers().get_last_lr()[0]
        grad_norm = optimizer_step(self, self.optim)
        self.log("train/loss", shard_sum(self.trainer, nll_sum) / num_tokens, prog_bar=True)
        self.log_dict({"train/grad_norm": grad_norm, "train/lr": lr, "train/tokens": num_tokens,
                       "train/micro_batches": float(len(micro_batches))})

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        layout = parallel_layout(self.trainer)
        for micro_batch in batch["micro_batches"]:
            local = local_micro_batch(layout, micro_batch)
            logprobs = target_logprobs(self.model, local, chunk_size=self.hparams.lm_head_chunk)[0]
            _, metrics = sft_loss(logprobs, local["target_mask"], 1.0)
            self._val_sums.append(torch.stack([metrics["nll_sum"], metrics["num_tokens"]]))

    @override
    def on_validation_epoch_end(self) -> None:
        if self._val_sums:
            nll_sum, num_tokens = shard_sum(self.trainer, torch.stack(self._val_sums).sum(0))
            self.log("val/loss", nll_sum / num_tokens, prog_bar=True)
        self._val_sums.clear()
