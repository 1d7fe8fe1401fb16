"""SFT task in-process: the logged loss is the reference cross-entropy, and micro-batching does not change the update."""

import lightning as L
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close

from rl_lightning.data import SFTDataModule
from rl_lightning.tasks import SFT


class GradientRecorder(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()})


def _fit(micro_batch_size, max_steps=1, data_kwargs=None, callbacks=(), model_kwargs=None, precision="32-true"):
    L.seed_everything(0)
    data = SFTDataModule(
        str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=8,
        micro_batch_size=micro_batch_size, shuffle=False, max_length=64, **(data_kwargs or {}),
    )
    model = SFT(str(TINY_MODEL), lr=1e-3, warmup_steps=0, lr_schedule="constant", max_grad_norm=0.0,
                **(model_kwargs or {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks), precision=precision,
    )
    trainer.fit(model, datamodule=data)
    return model, data, trainer


def test_logged_loss_is_cross_entropy_over_assistant_tokens():
    from transformers import AutoModelForCausalLM

    _, data, trainer = _fit(micro_batch_size=4)
    batch = data._collate(data.train_examples[:8])["micro_batches"]
    reference_model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)  # weights before the step
    nll, tokens = 0.0, 0
    for mb in batch:
        logits = reference_model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        labels = mb["input_ids"][:, 1:].masked_fill(mb["loss_mask"][:, 1:] == 0, -100)
        nll += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum")
        tokens += int((labels != -100).sum())
    assert_close(trainer.callback_metrics["train/loss"], nll / tokens, atol=1e-5)


def test_micro_batch_split_gives_the_same_gradient():
    """Gradients are compared, not parameters: Adam divides by sqrt(v), which turns 1e-9 gradient noise on
    near-zero gradients into lr-sized parameter differences."""
    whole, split = GradientRecorder(), GradientRecorder()
    _, _, trainer_whole = _fit(micro_batch_size=8, max_steps=1, callbacks=[whole])
    _, _, trainer_split = _fit(micro_batch_size=2, max_steps=1, callbacks=[split])
    assert len(whole.grads) == len(split.grads) == 1
    for step_whole, step_split in zip(whole.grads, split.grads, strict=True):
        for name, grad in step_whole.items():
            assert_close(step_split[name], grad, atol=1e-6)
    assert_close(trainer_split.callback_metrics["train/loss"], trainer_whole.callback_metrics["train/loss"])


def test_truncation_is_counted(tmp_path):
    short = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), max_length=40)
    short.setup("fit")
    lengths = [len(e.input_ids) for e in short.train_examples]
    assert max(lengths) == 40
    full = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), max_length=1024)
    full.setup("fit")
    assert full.stats == {"data/train_rows": 2000, "data/train_truncated": 0, "data/train_dropped": 0}
    expected_truncated = sum(len(e.input_ids) > 40 for e in full.train_examples)
    expected_dropped = sum(sum(e.loss_mask[:40]) == 0 for e in full.train_examples)
    assert expected_truncated > 0 and expected_dropped > 0  # the demo data has long system prompts
    assert short.stats["data/train_truncated"] == expected_truncated
    assert short.stats["data/train_dropped"] == expected_dropped
    assert len(short.train_examples) == 2000 - expected_dropped


def test_gradient_checkpointing_gives_the_same_gradient():
    plain, checkpointed = GradientRecorder(), GradientRecorder()
    _fit(micro_batch_size=4, callbacks=[plain])
    model, _, _ = _fit(micro_batch_size=4, callbacks=[checkpointed], model_kwargs={"gradient_checkpointing": True})
    assert model.model.is_gradient_checkpointing
    for name, grad in plain.grads[0].items():
        assert_close(checkpointed.grads[0][name], grad, atol=1e-6)


def test_bf16_true_precision_trains_bf16_weights():
    recorder = GradientRecorder()
    model, _, trainer = _fit(micro_batch_size=4, max_steps=2, callbacks=[recorder], precision="bf16-true")
    assert {p.dtype for p in model.model.parameters()} == {torch.bfloat16}
    loss = trainer.callback_metrics["train/loss"]
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # ~ln(320) = 5.77 for the random model


def test_too_few_rows_for_one_step_is_an_error(tmp_path):
    import json

    import pytest

    from rl_lightning.errors import DataError

    path = tmp_path / "two.jsonl"
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text((json.dumps(row) + "\n") * 2)
    data = SFTDataModule(str(path), tokenizer_name=str(TINY_MODEL), batch_size=4, micro_batch_size=4)
    with pytest.raises(DataError, match="2 usable conversations, fewer than one step needs"):
        data.setup("fit")
