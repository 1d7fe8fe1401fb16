"""LoRA vs full fine-tuning: trainable parameters, checkpoint size and peak host memory of a short SFT run.

Each configuration runs in its own process (so peak RSS is its own): 2 SFT steps on the demo data (batch 4, fp32, CPU),
full fine-tuning and `model.lm.lora` at its defaults (r 16, alpha 32, the 7 attention/MLP projections), on the tiny demo
model and, when built (``python -m rl_lightning.assets.build --real``), SmolLM2-135M-Instruct.

    OMP_NUM_THREADS=1 python benchmarks/lora_memory.py            # ~2 min on 2 CPU cores
    python benchmarks/lora_memory.py --tiny                       # the tiny model only
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "rl_lightning" / "assets" / "tiny-qwen2"
DATA = ROOT / "rl_lightning" / "assets" / "data" / "sft.jsonl"
REAL = "asset:SmolLM2-135M-Instruct"


def measure(model: str, lora: bool, root: str) -> dict:
    """One configuration, in this process: 2 SFT steps; trainable/total parameters, checkpoint MiB, peak RSS MiB."""
    import lightning as L

    from rl_lightning.data import SFTDataModule
    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.lora import LoRAConfig, parameter_counts
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.tasks import SFT

    L.seed_everything(0)
    data = SFTDataModule(str(DATA), tokenizer_name=model, batch_size=4, max_length=96, max_length_per_device=512)
    task = SFT(LMConfig(model, optim=OptimConfig(lr=1e-4), lora=LoRAConfig() if lora else None))
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    trainer.fit(task, datamodule=data)
    checkpoint = next(Path(root).rglob("*.ckpt"))
    trainable, total = parameter_counts(task.model)
    return {"trainable": trainable, "total": total, "checkpoint_mib": checkpoint.stat().st_size / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model only")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as root:
            print("RESULT " + json.dumps(measure(args.one[0], args.one[1] == "lora", root)))
        return
    from rl_lightning.assets.real import resolve_model

    models = [("tiny-qwen2", str(TINY))]
    if not args.tiny:
        try:
            models.append(("SmolLM2-135M", resolve_model(REAL)))
        except Exception as e:  # not built: say so, measure the tiny model
            print(f"skipping SmolLM2-135M: {e}")
    print("| model | mode | trainable parameters | checkpoint MiB | peak RSS MiB |\n|---|---|---|---|---|")
    for label, model in models:
        rows = {}
        for mode in ("full", "lora"):
            out = subprocess.run([sys.executable, __file__, "--one", model, mode], capture_output=True, text=True,
                                 check=True, cwd=ROOT).stdout
            rows[mode] = r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            print(f"| {label} | {mode} | {r['trainable']:,} of {r['total']:,} | {r['checkpoint_mib']:.1f} | "
                  f"{r['peak_rss_mib']:.0f} |")
        full, lora = rows["full"], rows["lora"]
        print(f"{label}: LoRA trains {lora['trainable'] / full['trainable']:.3f}x the parameters, checkpoint "
              f"{lora['checkpoint_mib'] / full['checkpoint_mib']:.2f}x, peak RSS {lora['peak_rss_mib'] / full['peak_rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
