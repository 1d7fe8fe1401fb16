"""The chunked output head (``model.lm_head_chunk``) under ParallelStrategy on CPU/gloo: FSDP2 dp=2 (the tied head is
part of the root unit, gathered around the root's forward the chunked head runs inside), TP=2 and CP=2 (SFT), and
DPO under dp=2 (its FSDP2-sharded frozen reference too): a run with 16-position chunks logs the full-logits run's
losses and gradient norms, step by step. Both runs share the spawned processes."""

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL
from helpers import Metrics, fit, run_on_cpu_ranks

from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.models.loading import ChunkedHead
from rl_lightning.models.optim import OptimConfig
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.tasks import DPO, SFT

CHUNK = 16  # far below the ~100 target positions per micro-batch: several chunks, one that does not fill
KEYS = ("train/loss", "train/grad_norm")


def _run(task, sizes, chunk):
    L.seed_everything(0)
    dp, cp, tp = sizes
    optim = OptimConfig(lr=1e-3, warmup_steps=0, lr_schedule="constant", max_grad_norm=1.0)
    if task == "sft":
        data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=8 // dp,
                             shuffle=True, max_length=96, max_length_per_device=256)
        model = SFT(str(TINY_MODEL), optim=optim, lm_head_chunk=chunk)
    else:
        data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL),
                                    batch_size=8 // dp, max_length=96, max_length_per_device=512)
        model = DPO(str(TINY_MODEL), optim=optim, beta=0.5, lm_head_chunk=chunk)
    metrics = Metrics(KEYS)
    strategy = ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp, tensor_parallel_size=tp)
    fit(model, data, 3, [metrics], devices=dp * cp * tp, strategy=strategy)
    return metrics.history


def _worker(rank, task, sizes, out_path):
    heads, forward = [], ChunkedHead.forward

    def recording(self, hidden):  # which head the chunked path saw: (module, weight) types
        heads.append((type(self.head).__name__, type(self.head.weight).__name__))
        return forward(self, hidden)

    ChunkedHead.forward = recording
    runs = {chunk: _run(task, sizes, chunk) for chunk in (None, CHUNK)}
    if rank == 0:
        torch.save({**runs, "heads": heads}, out_path)


@pytest.mark.parametrize(("task", "sizes"), [("sft", (2, 1, 1)), ("sft", (1, 1, 2)), ("sft", (1, 2, 1)),
                                             ("dpo", (2, 1, 1))],
                         ids=["sft-dp2", "sft-tp2", "sft-cp2", "dpo-dp2"])
def test_chunked_head_equals_full_logits_in_parallel(task, sizes, tmp_path):
    run_on_cpu_ranks(_worker, sizes[0] * sizes[1] * sizes[2], task, sizes, tmp_path / "runs.pt")
    runs = torch.load(tmp_path / "runs.pt")
    full, chunked = runs[None], runs[CHUNK]
    # only the chunked run went through ChunkedHead: a plain Linear whose weight the root's forward had gathered into
    # a full tensor (not a DTensor shard), so the fused chunked_token_logprobs ran
    assert len(runs["heads"]) > 0 and set(runs["heads"]) == {("Linear", "Parameter")}, runs["heads"]
    assert len(full) == len(chunked) == 3 and all(set(step) == set(KEYS) for step in full + chunked)
    for step, (a, b) in enumerate(zip(chunked, full, strict=True)):
        for key in KEYS:
            # fp32 over 3 Adam steps (lr 1e-3): the chunked head sums the same products in another order, so its
            # gradients differ by fp32 rounding (~1e-7 relative), which Adam's normalised steps carry into the
            # weights; the losses agree far below the parity tests' 1e-5
            assert abs(a[key] - b[key]) < 1e-5, (step, key, chunked, full)
    assert full[0]["train/loss"] > 0
