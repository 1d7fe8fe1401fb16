"""The quick GPU checks' real task path: the project's LightningModules (`SFT`, `PPO`) under `ParallelStrategy` and a
Lightning Trainer, on random-init models of a named shape and synthetic data of an exact token count.

- `model_folder`: a Hugging Face folder holding a random-init model of a shape (`train.SHAPES`; the tiny model's
  tokenizer), what the tasks load by name: nothing is downloaded.
- `SyntheticSFT`: the real `SFTDataModule` (its packing and step loader) over random conversations whose lengths
  repeat every step, so each step holds exactly the same number of tokens (loss on the last 3/4 of each).
- `SyntheticRollouts`: a callback that hands the `PPO` task a rollout of random completions (each trajectory exactly
  `sequence` tokens, random 0/1 rewards), so the RL trainer's step is measured without an engine's generation.
- `sft_task` / `ppo_task` / `fit_trainer`: the task and Trainer constructors the checks share (task keys in one
  place).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from train import ROOT, TINY_SFT, StepTimer, random_checkpoint, synchronize

EASY_PROMPTS = ROOT / "rl_lightning" / "assets" / "data" / "easy.jsonl"
ARITHMETIC_ENV = ROOT / "rl_lightning" / "recipes" / "envs" / "arithmetic_format.py"
SFT_LENGTHS = (4096, 2048, 3072, 1024, 512, 2560, 1536, 1536)  # 16,384 tokens per step, one packed micro-batch
DRY_SFT_LENGTHS = (256, 128, 192, 64, 32, 160, 96, 96)  # 1,024


def model_folder(shape: dict, folder: str | Path, device: torch.device) -> str:
    """A random-init bf16 model of `shape` saved as a Hugging Face folder under `folder` (returns its path)."""
    path = Path(folder) / "model"
    return random_checkpoint(shape, str(path), device)


class SyntheticSFT:
    """Builds an `SFTDataModule` whose training units are random token sequences of `lengths` per step.

    Args:
        tokenizer: the model folder (its tokenizer: pad id).
        lengths: the sequence lengths of one step (its `batch_size`); every step repeats them.
        steps: how many steps of units to make.
        vocab: token ids are drawn below this.
    """

    def __init__(self, tokenizer: str, lengths: Sequence[int], steps: int, vocab: int) -> None:
        self.tokenizer, self.lengths, self.steps, self.vocab = tokenizer, tuple(lengths), steps, vocab

    def build(self) -> Any:
        from rl_lightning.data import SFTDataModule
        from rl_lightning.data.tokenization import TokenizedExample

        tokens = sum(self.lengths)
        data = SFTDataModule(str(EASY_PROMPTS), tokenizer_name=self.tokenizer, max_length=max(self.lengths),
                             batch_size=len(self.lengths), max_length_per_device=tokens, shuffle=False)
        generator = torch.Generator().manual_seed(0)
        data.units["train"] = [TokenizedExample(torch.randint(0, self.vocab, (n,), generator=generator).tolist(),
                                                [0] * (n // 4) + [1] * (n - n // 4))
                               for _ in range(self.steps) for n in self.lengths]
        return data


class SyntheticRollouts(L.Callback):
    """Hands the PPO task a synthetic rollout each batch (before its rollout callback, which then samples nothing).

    Each of the batch's prompts gets `group_size` completions of random ids filling the trajectory to `sequence`
    tokens, engine log-probabilities of a uniform distribution over `vocab`, and seeded 0/1 rewards.
    """

    def __init__(self, group_size: int, sequence: int, vocab: int) -> None:
        self.group_size, self.sequence, self.vocab = group_size, sequence, vocab
        self.lengths: list[int] = []  # the last rollout's trajectory lengths
        self.completion_tokens = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: dict, batch_idx: int) -> None:
        import math

        from rl_lightning.rollout.trajectory import Rollout, Trajectory

        rng = random.Random(batch_idx)
        trajectories = []
        for prompt in batch["prompts"]:
            for _ in range(self.group_size):
                n = self.sequence - len(prompt.prompt_ids)
                completion = [rng.randrange(self.vocab) for _ in range(n)]
                trajectories.append(Trajectory(
                    prompt, prompt.prompt_ids + completion, [0] * len(prompt.prompt_ids) + [1] * n,
                    [0.0] * len(prompt.prompt_ids) + [-math.log(self.vocab)] * n,
                    prompt.messages + [{"role": "assistant", "content": ""}], True, reward=float(rng.random() < 0.5)))
        self.lengths = [len(t.input_ids) for t in trajectories]
        self.completion_tokens = sum(t.completion_length for t in trajectories)
        batch["rollout"] = Rollout(trajectories, self.group_size)


def lm_arguments(model: str, optim: Any, lm_head_chunk: int = 1024) -> dict[str, Any]:
    """The task's model group, ``model.lm`` (`rl_lightning.models.config.LMConfig`)."""
    from rl_lightning.models.config import LMConfig

    return {"lm": LMConfig(model, optim=optim, lm_head_chunk=lm_head_chunk)}


def sft_task(model: str, lm_head_chunk: int = 1024) -> Any:
    """The SFT task on `model` (lr 1e-5, constant schedule, clipping at 1.0)."""
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.tasks import SFT

    optim = OptimConfig(lr=1e-5, lr_schedule="constant", warmup_steps=0, max_grad_norm=1.0)
    return SFT(**lm_arguments(model, optim, lm_head_chunk))


def ppo_task(model: str, rollouts: int, group_size: int, new_tokens: int, budget: int, engine: str = "hf",
             async_steps: int = 0, teacher: str | None = None) -> Any:
    """Dr. GRPO (no KL, one update per rollout) on `model`; with `teacher`, GKD (``distill.type: loss``)."""
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.rollout.callback import RolloutConfig
    from rl_lightning.tasks import PPO

    rollout = RolloutConfig(str(ARITHMETIC_ENV), responses_per_prompt=group_size, max_new_tokens=new_tokens,
                            engine=engine, reward_workers=0, async_steps=async_steps,
                            reward_weights={"correct": 1.0, "format": 0.5})
    distill = None
    if teacher is not None:
        from rl_lightning.tasks.ppo.distill import DistillConfig

        distill = DistillConfig(teacher=teacher, type="loss", coef=1.0)
    return PPO(**lm_arguments(model, OptimConfig(lr=1e-6, lr_schedule="constant")), rollout=rollout,
               max_rollouts=rollouts, update_per_rollout=1, clip_high=0.28, max_length_per_device=budget,
               distill=distill)


def prompt_data(model: str, prompts: int) -> Any:
    from rl_lightning.data import PromptDataModule

    return PromptDataModule(str(EASY_PROMPTS), tokenizer_name=model, max_prompt_length=256, batch_size=prompts,
                            shuffle=False)


def fit_trainer(device: torch.device, strategy: Any = None, callbacks: Sequence[L.Callback] = (), **kwargs: Any
                ) -> L.Trainer:
    """A one-device Trainer (fp32 masters; `strategy` sets the compute precision), no logger, progress bar or
    checkpoints unless `kwargs` say otherwise."""
    options = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, "num_sanity_val_steps": 0, **kwargs}
    return L.Trainer(accelerator="cpu" if device.type == "cpu" else "gpu", devices=1, precision="32-true",
                     strategy=strategy if strategy is not None else "auto", callbacks=list(callbacks), **options)


def parallel_strategy(device: torch.device, **options: Any) -> Any:
    """`ParallelStrategy` on one device: bf16 compute over fp32 masters on CUDA, fp32 on CPU."""
    from rl_lightning.parallel.strategy import ParallelStrategy

    return ParallelStrategy(mixed_precision="bf16" if device.type == "cuda" else None, **options)


def step_seconds(timer: StepTimer, warmup: int) -> tuple[float, list[float]]:
    """The median step time after `warmup` steps, and every step's time."""
    seconds = [s["seconds"] for s in timer.steps]
    return statistics.median(seconds[warmup:]), seconds


def peak_allocated(device: torch.device) -> int | None:
    """The CUDA allocator's peak since the last reset (bytes); None on CPU."""
    if device.type != "cuda":
        return None
    synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


__all__ = ["TINY_SFT", "SyntheticRollouts", "SyntheticSFT", "fit_trainer", "model_folder", "parallel_strategy",
           "peak_allocated", "ppo_task", "prompt_data", "sft_task", "step_seconds"]
