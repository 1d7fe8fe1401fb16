"""What docs/determinism.md promises on CPU, checked: a run resumed from one of its own mid-run checkpoints (what a
kill -9 leaves behind: the atomic-checkpoint tests show the last complete one survives any kill) ends with the
uninterrupted run's weights bit for bit, in sync mode, for SFT and for GRPO (HF engine, seeded rollouts, reward
workers), and in the rollout modes with state of their own: DAPO refill, multi-turn tools, the Pareto archive, LoRA
(HF engine, and vLLM with adapter sync).
Real CLI runs of the tiny model. (One-step-off-policy resume: tests/rollout/test_async_rollout.py.)"""

from pathlib import Path

import pytest
import torch

from rl_lightning.cli.main import main

EVERY_STEP = "trainer:\n  callbacks:\n    - class_path: rl_lightning.parallel.checkpoint_io.AtomicModelCheckpoint\n" \
             "      init_args: {every_n_train_steps: 1, save_top_k: -1, save_last: link}\n"
RUNS = {
    "sft": (["--config", "recipes/sft.yaml", "--trainer.limit_val_batches", "0"], "--trainer.max_steps", 4),
    "grpo": (["--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--trainer.limit_val_batches", "0",
              "--model.rollout.responses_per_prompt", "4", "--model.rollout.max_new_tokens", "8",
              "--model.rollout.reward_workers", "1", "--data.batch_size", "2"], "--model.max_rollouts", 3),
    # the rollout modes whose state lives outside the weights and optimizer (issue 28.1), HF engine:
    # DAPO refill (its refill counter and extra-prompt draws), multi-turn tools, the Pareto archive, LoRA adapters
    "dapo": (["--config", "recipes/dapo.yaml", "--model.rollout.engine", "hf", "--trainer.limit_val_batches", "0",
              "--model.rollout.max_new_tokens", "8", "--data.batch_size", "2"], "--model.max_rollouts", 3),
    "multiturn": (["--config", "examples/calculator/grpo_calculator.yaml", "--trainer.limit_val_batches", "0",
                   "--data.batch_size", "2"], "--model.max_rollouts", 3),
    "pareto": (["--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--trainer.limit_val_batches", "0",
                "--model.rollout.responses_per_prompt", "4", "--model.rollout.max_new_tokens", "8",
                "--model.rollout.pareto_archive_size", "2", "--data.batch_size", "2"], "--model.max_rollouts", 3),
    "lora": (["--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--trainer.limit_val_batches", "0",
              "--model.rollout.responses_per_prompt", "4", "--model.rollout.max_new_tokens", "8",
              "--model.lm.lora.r", "4", "--data.batch_size", "2"], "--model.max_rollouts", 3),
    # LoRA with the colocated vLLM engine and adapter sync (the engine holds base + adapter): in spawned processes
    "lora-vllm-adapter-sync": (["--config", "recipes/grpo.yaml", "--trainer.limit_val_batches", "0",
                                "--model.rollout.responses_per_prompt", "4", "--model.rollout.max_new_tokens", "8",
                                "--model.rollout.engine.kv_cache_memory_bytes", str(64 << 20), "--model.lm.lora.r", "4",
                                "--model.rollout.engine.weight_sync", "adapter", "--data.batch_size", "2"],
                               "--model.max_rollouts", 3),
}
SPAWNED = {"lora-vllm-adapter-sync"}  # one vLLM engine per process: each fit in a fresh one


def _fit(task: str, args: list[str]) -> None:
    if task in SPAWNED:
        from helpers import run_on_cpu_ranks

        run_on_cpu_ranks(_main_worker, 1, args)
    else:
        main(args)


def _main_worker(rank: int, args: list[str]) -> None:
    main(args)


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(RUNS))
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(workdir, task):
    args, length_key, length = RUNS[task]
    Path("every_step.yaml").write_text(EVERY_STEP)
    command = ["fit", *args, "--config", "every_step.yaml", "--trainer.logger.init_args.run_name", task]
    _fit(task, [*command, length_key, str(length)])
    (run,) = [p for p in Path("outputs", task).iterdir() if p.name != "latest"]
    checkpoints = sorted(run.glob("checkpoints/epoch=*.ckpt"), key=lambda p: p.stat().st_mtime)
    straight = torch.load(checkpoints[-1], weights_only=False)
    middle = next(c for c in checkpoints if torch.load(c, weights_only=False)["global_step"] < straight["global_step"])
    _fit(task, [*command, length_key, str(length), "--ckpt_path", str(middle)])
    newest = max(run.glob("checkpoints/epoch=*.ckpt"), key=lambda p: p.stat().st_mtime)
    resumed = torch.load(newest, weights_only=False)
    assert resumed["global_step"] == straight["global_step"] and newest != checkpoints[-1]
    assert resumed["state_dict"].keys() == straight["state_dict"].keys()
    assert all(torch.equal(resumed["state_dict"][k], straight["state_dict"][k]) for k in straight["state_dict"])
    assert resumed["optimizer_states"][0]["state"].keys() == straight["optimizer_states"][0]["state"].keys()
