"""``--ckpt_path`` resumes only the checkpoint's own run (`rl_lightning.cli.resume_check`): another task, model,
architecture or rollout mode is refused in one line naming each difference, before any weights load; other settings
may change; ``--load_weights_only true`` starts a new run from the checkpoint's weights alone (bit for bit), and
still refuses weights that do not fit; sharded (DCP, dp=2) checkpoints alike. Real CLI runs of the tiny model,
real checkpoints."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL

from rl_lightning.cli.main import main

SFT = ["fit", "--config", "recipes/sft.yaml", "--trainer.limit_val_batches", "0"]
WEIGHTS_AT_START = '''
import lightning as L
import torch

class WeightsAtStart(L.Callback):
    """Save the model's weights as training starts (after a weights-only load)."""

    def on_train_start(self, trainer, pl_module):
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, "weights_at_start.pt")
'''


class RunsCode:
    """Unpickling this runs ``touch ran``."""

    def __reduce__(self):
        return os.system, ("touch ran",)


def _train(*args: str, steps: int = 2) -> Path:
    """Run SFT for `steps` steps; the run's last checkpoint."""
    main([*SFT, "--trainer.max_steps", str(steps), *args])
    (checkpoint,) = Path("outputs").glob("*/latest/checkpoints/last.ckpt")
    return checkpoint.resolve().relative_to(Path.cwd().resolve())  # this run's, whatever `latest` points to later


def _refused(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    assert info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("rl_lightning: error: ")
    return error.removeprefix("rl_lightning: error: ")


def _hint() -> str:
    return ("(checkpoint -> this run); resume with the checkpoint's settings, or pass --load_weights_only true to "
            "start a new run from its weights")


def test_another_model_or_task_is_refused_and_other_settings_may_change(workdir, capsys):
    checkpoint = _train()
    sft = "rl_lightning/assets/tiny-qwen2-sft"
    assert _refused(capsys, *SFT, "--ckpt_path", str(checkpoint), "--model.lm.name", sft) == (
        f"--ckpt_path {checkpoint} is a checkpoint of another run: model.lm.name 'rl_lightning/assets/tiny-qwen2' "
        f"-> '{sft}' {_hint()}")
    lora = _refused(capsys, *SFT, "--ckpt_path", str(checkpoint), "--model.lm.lora", "{r: 4}")
    assert lora.startswith(f"--ckpt_path {checkpoint} is a checkpoint of another run: model.lm.lora None -> {{'r': 4,")
    assert _refused(capsys, "fit", "--config", "recipes/dpo.yaml", "--ckpt_path", str(checkpoint)) == (
        f"--ckpt_path {checkpoint} is a checkpoint of another run: model.class_path SFT -> DPO {_hint()}")
    # a copy that also holds a pickle running code (issue 36.2) is refused in one line; nothing runs
    crafted = checkpoint.with_name("crafted.ckpt")
    torch.save({**torch.load(checkpoint, weights_only=True), "note": RunsCode()}, crafted)
    assert _refused(capsys, *SFT, "--ckpt_path", str(crafted)) == (
        f"--ckpt_path {crafted} needs pickle beyond weights: it holds posix.system, which a weights-only load "
        "refuses (unpickling it could run code); pass --trust_checkpoint true only for a checkpoint you trust as code")
    assert not Path("ran").exists()
    # trusted (the explicit opt-in), by the same model's absolute path, a new learning rate: resumed, on to step 3
    main([*SFT, "--trainer.max_steps", "3", "--ckpt_path", str(crafted), "--model.lm.name", str(TINY_MODEL),
          "--model.lm.optim.lr", "1e-3", "--trust_checkpoint", "true"])
    assert Path("ran").exists()
    resumed = torch.load(checkpoint.parent / "epoch=0-step=3.ckpt", weights_only=False)  # the same run folder
    assert resumed["global_step"] == 3 and resumed["hyper_parameters"]["lm"]["optim"]["lr"] == 1e-3


def test_a_changed_architecture_is_refused_and_its_weights_do_not_load(workdir, capsys):
    shutil.copytree(TINY_MODEL, "model")
    checkpoint = _train("--model.lm.name", "model")
    config = json.loads(Path("model/config.json").read_text())
    old = f"{config['num_hidden_layers']} layers, hidden size {config['hidden_size']}, vocabulary {config['vocab_size']}"
    config["num_hidden_layers"] += 1
    config["layer_types"] = config.get("layer_types", ["full_attention"] * 2) + ["full_attention"]
    Path("model/config.json").write_text(json.dumps(config))
    new = f"{config['num_hidden_layers']} layers, hidden size {config['hidden_size']}, vocabulary {config['vocab_size']}"
    assert _refused(capsys, *SFT, "--model.lm.name", "model", "--ckpt_path", str(checkpoint)) == (
        f"--ckpt_path {checkpoint} is a checkpoint of another run: architecture of model.lm.name 'model': {old} -> "
        f"{new} {_hint()}")
    error = _refused(capsys, *SFT, "--model.lm.name", "model", "--ckpt_path", str(checkpoint),
                     "--load_weights_only", "true", "--trainer.max_steps", "1")
    assert error.startswith(f"--ckpt_path {checkpoint} with --load_weights_only: its weights do not fit this model "
                            "(missing model.model.layers.2.")  # the third layer's weights
    assert error.endswith("); use a checkpoint of the same model (model.lm.name, model.lm.lora)")


def test_weights_only_starts_a_new_run_from_the_checkpoints_weights(workdir, capsys):
    checkpoint = _train()
    Path("probe.py").write_text(WEIGHTS_AT_START)
    Path("probe.yaml").write_text("trainer:\n  callbacks:\n    - class_path: probe.WeightsAtStart\n")
    main([*SFT, "--config", "probe.yaml", "--trainer.logger.init_args.run_name", "sft", "--trainer.max_steps", "1",
          "--ckpt_path", str(checkpoint), "--load_weights_only", "true", "--model.lm.optim.lr", "1e-4",
          "--model.lm.optim.warmup_steps", "0"])
    saved = torch.load(checkpoint, weights_only=False)
    loaded = torch.load("weights_at_start.pt")
    assert saved["state_dict"].keys() == loaded.keys()
    assert all(torch.equal(saved["state_dict"][k], loaded[k]) for k in loaded)  # bit for bit
    runs = sorted(p for p in Path("outputs/sft").iterdir() if p.name != "latest")
    assert len(runs) == 2 and checkpoint.resolve().is_relative_to(runs[0].resolve())  # a new run folder
    new = torch.load(runs[1] / "checkpoints" / "last.ckpt", weights_only=False)
    assert new["global_step"] == 1 and new["hyper_parameters"]["lm"]["optim"]["lr"] == 1e-4  # from step 0, this config
    assert saved["global_step"] == 2  # the old run's checkpoint untouched
    assert _refused(capsys, *SFT, "--ckpt_path", "last", "--load_weights_only", "true") == (
        "--load_weights_only needs the checkpoint's path, got --ckpt_path last: name the file (or the sharded "
        "checkpoint's folder)")


def test_a_missing_checkpoint_is_one_line(workdir, capsys):
    assert _refused(capsys, *SFT, "--ckpt_path", "nowhere.ckpt") == (
        f"--ckpt_path nowhere.ckpt does not exist (resolved to {workdir / 'nowhere.ckpt'})")


@pytest.mark.slow
def test_a_changed_rollout_mode_is_refused(workdir, capsys):
    grpo = ["fit", "--config", "recipes/grpo.yaml", "--model.rollout.engine", "hf", "--trainer.limit_val_batches", "0",
            "--model.rollout.responses_per_prompt", "2", "--model.rollout.max_new_tokens", "4", "--data.batch_size", "2"]
    main([*grpo, "--model.max_rollouts", "1"])
    (checkpoint,) = Path("outputs").glob("*/latest/checkpoints/last.ckpt")
    assert _refused(capsys, *grpo, "--model.max_rollouts", "2", "--ckpt_path", str(checkpoint),
                    "--model.rollout.engine", "vllm", "--model.rollout.async_steps", "1") == (
        f"--ckpt_path {checkpoint} is a checkpoint of another run: model.rollout.engine.kind 'hf' -> 'vllm'; "
        f"model.rollout.async_steps 0 -> 1 {_hint()}")
    assert _refused(capsys, *grpo, "--model.max_rollouts", "2", "--ckpt_path", str(checkpoint),
                    "--model.advantage_estimator", "gae") == (
        f"--ckpt_path {checkpoint} is a checkpoint of another run: model.advantage_estimator drgrpo -> gae (adds the "
        f"critic) {_hint()}")


FULL_WEIGHTS_AT_START = '''
import lightning as L
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

class FullWeightsAtStart(L.Callback):
    """Save the model's full (gathered) weights as training starts, on rank 0."""

    def on_train_start(self, trainer, pl_module):
        weights = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            torch.save(weights, "weights_at_start.pt")
'''
DP2 = ["--trainer.devices", "2", "--trainer.strategy", "rl_lightning.parallel.ParallelStrategy",
       "--trainer.strategy.data_parallel_size", "2", "--trainer.max_steps", "2"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl_lightning", *SFT, *DP2, *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_a_sharded_checkpoint_is_checked_and_its_weights_load_alone(workdir):
    """ParallelStrategy dp=2 writes DCP folders: hyperparameters from meta.pt, shapes from DCP's metadata."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    shutil.copytree(TINY_MODEL, "model")
    assert _cli("--model.lm.name", "model").returncode == 0
    checkpoint = Path("outputs/sft/latest/checkpoints/epoch=0-step=2.ckpt").resolve().relative_to(Path.cwd().resolve())
    assert checkpoint.is_dir()
    from rl_lightning.parallel.checkpoint_trust import damage

    listed = sorted(line.split()[1] for line in (checkpoint / "SHA256SUMS").read_text().splitlines())
    assert listed == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"] and damage(checkpoint) is None
    shard = checkpoint / "__1_0.distcp"  # every rank's shards are listed: a changed byte in rank 1's is seen
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert damage(checkpoint) == "does not match its digest (SHA256SUMS: __1_0.distcp): a byte changed after it was " \
                                 "written"
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    config = json.loads(Path("model/config.json").read_text())
    Path("model/config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    refused = _cli("--model.lm.name", "model", "--ckpt_path", str(checkpoint))
    assert refused.returncode == 2
    assert f"architecture of model.lm.name 'model': 2 layers, hidden size {config['hidden_size']}, vocabulary " \
           f"{config['vocab_size']} -> 2 layers, hidden size {config['hidden_size']}, vocabulary " \
           f"{config['vocab_size'] + 64} " in refused.stderr
    Path("model/config.json").write_text(json.dumps(config))
    Path("probe.py").write_text(FULL_WEIGHTS_AT_START)
    Path("probe.yaml").write_text("trainer:\n  callbacks:\n    - class_path: probe.FullWeightsAtStart\n")
    started = _cli("--config", "probe.yaml", "--model.lm.name", "model", "--ckpt_path", str(checkpoint),
                   "--load_weights_only", "true", "--model.lm.optim.lr", "1e-4")
    assert started.returncode == 0, started.stderr[-3000:]
    dcp_to_torch_save(checkpoint, "saved.pt")
    saved, loaded = torch.load("saved.pt")["state_dict"], torch.load("weights_at_start.pt")
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in loaded)  # bit for bit
