"""SFT task in-process: the logged loss is the reference cross-entropy, and neither packing, the micro-batch split,
gradient checkpointing nor the number of data-parallel ranks changes the gradient."""

import json

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL, assert_close
from helpers import GradientRecorder, assert_same_grads, fit, run_on_cpu_ranks

from rl_lightning.data import SFTDataModule
from rl_lightning.errors import ConfigError, DataError
from rl_lightning.models.config import LMConfig
from rl_lightning.models.optim import OptimConfig
from rl_lightning.tasks import SFT


def fit_sft(max_steps=1, data_kwargs=None, model_kwargs=None, precision="32-true", callbacks=(), **trainer_kwargs):
    L.seed_everything(0)
    data_kwargs = {"batch_size": 8, "shuffle": False, "max_length": 64, **(data_kwargs or {})}
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), **data_kwargs)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, lr_schedule="constant", max_grad_norm=0.0)
    model = SFT(LMConfig(str(TINY_MODEL), optim=optim, **(model_kwargs or {})))
    return model, data, fit(model, data, max_steps, callbacks, precision, **trainer_kwargs)


def test_optim_group_is_typed_on_the_task_and_plain_data_in_its_hyperparameters():
    """``model.lm.optim`` reaches the task as an `OptimConfig` (unset fields: the task's defaults); checkpoints keep
    the whole ``model.lm`` group as a plain dict (no class to import when loading), and it loads back."""
    optim = OptimConfig(lr=1e-3, warmup_steps=3, max_grad_norm=0.5)
    task = SFT(LMConfig(str(TINY_MODEL), optim=optim))
    assert task.optim == OptimConfig(lr=1e-3, warmup_steps=3, max_grad_norm=0.5, lr_schedule="cosine")
    assert task.hparams.lm["optim"] == {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8,
                                        "warmup_steps": 3, "lr_schedule": "cosine", "min_lr_ratio": 0.1,
                                        "max_grad_norm": 0.5, "max_skipped_steps": 10}
    assert task.hparams.lm["name"] == str(TINY_MODEL) and task.hparams.lm["lora"] is None
    assert SFT(**dict(task.hparams)).lm == task.lm  # load_from_checkpoint passes the plain dict back
    # the defaults: cosine, as before the optim group; each task its own learning rate
    assert SFT(LMConfig(str(TINY_MODEL))).optim == OptimConfig(lr=1e-5, lr_schedule="cosine")


def test_logged_loss_is_cross_entropy_over_assistant_tokens():
    from transformers import AutoModelForCausalLM

    _, data, trainer = fit_sft(data_kwargs={"packing": False, "micro_batch_size": 8})
    reference_model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)  # the weights before the step
    examples = data.train_examples[:8]
    nll, tokens = 0.0, 0
    for example in examples:  # one by one, no padding, no packing
        ids = torch.tensor([example.input_ids])
        logits = reference_model(input_ids=ids).logits
        labels = ids[:, 1:].masked_fill(torch.tensor([example.loss_mask[1:]]) == 0, -100)
        nll += torch.nn.functional.cross_entropy(logits[0, :-1], labels[0], reduction="sum")
        tokens += int((labels != -100).sum())
    assert_close(trainer.callback_metrics["train/loss"], nll / tokens, atol=1e-5)


# Gradients are compared, not parameters: Adam divides by sqrt(v), turning 1e-9 gradient noise on near-zero
# gradients into lr-sized parameter differences.
@pytest.mark.parametrize(
    ("data_kwargs", "expected_micro_batches"),
    [
        ({"packing": True, "max_length_per_device": 4096}, 1),
        ({"packing": True, "max_length_per_device": 256}, 2),
        ({"packing": True, "max_length_per_device": 128}, 3),
        ({"packing": False, "micro_batch_size": 2}, 4),
    ],
    ids=["packed-1", "packed-2", "packed-3", "padded-4"],
)
def test_packing_and_micro_batch_split_give_the_one_by_one_gradient(data_kwargs, expected_micro_batches):
    one_by_one, other = GradientRecorder(), GradientRecorder()
    fit_sft(data_kwargs={"packing": False, "micro_batch_size": 1}, callbacks=[one_by_one])
    fit_sft(data_kwargs=data_kwargs, callbacks=[other])
    assert one_by_one.micro_batches == [8]
    assert other.micro_batches == [expected_micro_batches]
    assert_same_grads(one_by_one, other)


def _dp_worker(rank, out_path):
    recorder = GradientRecorder()
    _, _, trainer = fit_sft(max_steps=2, data_kwargs={"batch_size": 4, "max_length_per_device": 256},
                            callbacks=[recorder], devices=2, strategy="ddp")
    if rank == 0:
        torch.save({"grads": recorder.grads, "loss": trainer.callback_metrics["train/loss"]}, out_path)


def test_two_data_parallel_ranks_give_the_single_rank_gradient(tmp_path):
    """Global batch 8 = 2 ranks x 4 rows; DDP averages the ranks' gradients, which the loss scaling undoes."""
    run_on_cpu_ranks(_dp_worker, 2, tmp_path / "dp2.pt")
    dp2 = torch.load(tmp_path / "dp2.pt")
    single = GradientRecorder()
    _, _, trainer = fit_sft(max_steps=2, data_kwargs={"batch_size": 8, "max_length_per_device": 256},
                            callbacks=[single])
    distributed = GradientRecorder()
    distributed.grads = dp2["grads"]
    assert_same_grads(single, distributed)
    assert_close(dp2["loss"], trainer.callback_metrics["train/loss"], atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradient():
    plain, checkpointed = GradientRecorder(), GradientRecorder()
    fit_sft(callbacks=[plain])
    model, _, _ = fit_sft(callbacks=[checkpointed], model_kwargs={"gradient_checkpointing": True})
    assert model.model.is_gradient_checkpointing
    assert_same_grads(plain, checkpointed, atol=1e-6)


def test_bf16_true_precision_trains_bf16_weights():
    model, _, trainer = fit_sft(max_steps=2, precision="bf16-true")
    assert {p.dtype for p in model.model.parameters()} == {torch.bfloat16}
    loss = trainer.callback_metrics["train/loss"]
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # ~ln(320) = 5.77 for the random model


def test_truncation_is_counted():
    short = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), max_length=40)
    short.setup("fit")
    assert max(len(e.input_ids) for e in short.train_examples) == 40
    full = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), max_length=1024)
    full.setup("fit")
    assert full.stats == {"data/train_rows": 2000, "data/train_truncated": 0, "data/train_dropped": 0}
    expected_truncated = sum(len(e.input_ids) > 40 for e in full.train_examples)
    expected_dropped = sum(sum(e.loss_mask[:40]) == 0 for e in full.train_examples)
    assert expected_truncated > 0 and expected_dropped > 0  # the demo data has long system prompts
    assert short.stats["data/train_truncated"] == expected_truncated
    assert short.stats["data/train_dropped"] == expected_dropped
    assert len(short.train_examples) == 2000 - expected_dropped


def test_too_few_rows_for_one_step_is_an_error(tmp_path):
    path = tmp_path / "two.jsonl"
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text((json.dumps(row) + "\n") * 2)
    data = SFTDataModule(str(path), tokenizer_name=str(TINY_MODEL), batch_size=4)
    with pytest.raises(DataError, match="2 usable rows, fewer than one step needs"):
        data.setup("fit")


def test_budget_below_longest_conversation_is_an_error():
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), max_length_per_device=50)
    with pytest.raises(ConfigError, match=r"sft.jsonl line \d+: the conversation has \d+ tokens, more than "
                                          r"data.max_length_per_device=50; raise data.max_length_per_device to at "
                                          r"least \d+"):
        data.setup("fit")
