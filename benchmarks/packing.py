"""Packing vs padding on the demo model and data, measured in one run.

Reports, for the same rows per optimizer step:
- the non-pad fraction of the tokens each micro-batch carries (packing 1.0 by construction; padding pays for the
  longest row of every micro-batch),
- the data-parallel load balance (max / min real tokens per rank and step) for `--dp` simulated ranks,
- training throughput (real tokens per second) of SFT and DPO, packed vs padded, on this machine.

    python benchmarks/packing.py            # ~2 minutes on 2 CPU cores
    python benchmarks/packing.py --steps 5  # quicker, noisier
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L

from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.data.steps import layout_stats
from rl_lightning.models.config import LMConfig
from rl_lightning.models.optim import OptimConfig
from rl_lightning.tasks import DPO, SFT

ASSETS = Path(__file__).resolve().parents[1] / "rl_lightning" / "assets"
MODEL = str(ASSETS / "tiny-qwen2")


class Throughput(L.Callback):
    """Real (loss-relevant, non-pad) tokens per second over the steps after the first (warm-up)."""

    def __init__(self):
        self.tokens, self.start, self.seconds = 0, None, 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            self.start = time.perf_counter()
        if batch_idx >= 1:
            self.tokens += sum(int((mb["seq_index"] >= 0).sum()) for mb in batch["micro_batches"])

    def on_train_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start


def train_throughput(task: str, packing: bool, steps: int, rows: int, budget: int, micro_batch_size: int) -> float:
    L.seed_everything(0)
    if task == "sft":
        data = SFTDataModule(str(ASSETS / "data" / "sft.jsonl"), tokenizer_name=MODEL, batch_size=rows,
                             packing=packing, max_length_per_device=budget, micro_batch_size=micro_batch_size)
        model = SFT(LMConfig(MODEL, optim=OptimConfig(lr=1e-4)))
    else:
        data = PreferenceDataModule(str(ASSETS / "data" / "preference.jsonl"), tokenizer_name=MODEL, batch_size=rows,
                                    packing=packing, max_length_per_device=budget, micro_batch_size=micro_batch_size)
        model = DPO(LMConfig(MODEL, optim=OptimConfig(lr=1e-4)))
    meter = Throughput()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[meter])
    trainer.fit(model, datamodule=data)
    return meter.tokens / meter.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="timed optimizer steps per configuration")
    parser.add_argument("--dp", type=int, default=4, help="simulated data-parallel ranks for the balance figures")
    args = parser.parse_args()

    sft = SFTDataModule(str(ASSETS / "data" / "sft.jsonl"), tokenizer_name=MODEL)
    sft.setup("fit")
    pairs = PreferenceDataModule(str(ASSETS / "data" / "preference.jsonl"), tokenizer_name=MODEL)
    pairs.setup("fit")
    # Same rows per step for both layouts; the padded micro-batch size gives about as many passes as packing.
    configs = {"sft": (sft.units["train"], 64, 1024, 8), "dpo": (pairs.units["train"], 64, 2048, 8)}

    print(f"{'data':<5} {'layout':<8} {'non-pad fraction':>17} {'rank max/min (dp=' + str(args.dp) + ')':>21}")
    for task, (units, rows, budget, mbs) in configs.items():
        for packing in (True, False):
            rows_per_rank = rows // args.dp
            fraction, balance = layout_stats(units, args.dp, rows_per_rank, packing, budget, mbs)
            print(f"{task:<5} {'packed' if packing else 'padded':<8} {fraction:>17.3f} {balance:>21.3f}")

    print(f"\n{'task':<5} {'packed tok/s':>13} {'padded tok/s':>13} {'speed-up':>9}")
    for task, (_, rows, budget, mbs) in configs.items():
        packed = train_throughput(task, True, args.steps, rows, budget, mbs)
        padded = train_throughput(task, False, args.steps, rows, budget, mbs)
        print(f"{task:<5} {packed:>13.0f} {padded:>13.0f} {packed / padded:>8.2f}x")


if __name__ == "__main__":
    main()
