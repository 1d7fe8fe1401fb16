"""Run a function on N CPU processes joined by a gloo process group, the way Lightning expects external launches."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from a fork server that imported these once per pytest process: a rank then costs a fork and
# the import of its test module, not importing torch, Lightning and transformers again (~9 s of CPU a rank, ~19 s
# for a pair, on the 2-core CI machine; the suite starts dozens of groups).
FORKSERVER_PRELOAD = ["torch", "lightning", "transformers", "rl_lightning.data", "rl_lightning.parallel",
                      "rl_lightning.tasks"]
ENV_AT_START = dict(os.environ)  # the fork server starts with this, not with a test's monkeypatched environment
# ... and with this import path and working folder: the CLI tests run in a tmp_path with symlinks to the package
# (and the CLI puts its working folder first on sys.path; `python -m pytest` has '' there), so a fork server started
# inside one would import rl_lightning from that folder, which is deleted when the test passes: every later rank then
# fails to import the package's other modules.
SYS_PATH_AT_START, CWD_AT_START = list(sys.path), os.getcwd()


def _start_forkserver() -> None:
    """Start the fork server (once) with `FORKSERVER_PRELOAD` imported, in the environment the session began with."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    now, path, cwd = dict(os.environ), list(sys.path), os.getcwd()
    os.environ.clear()
    os.environ.update(ENV_AT_START)
    sys.path[:] = SYS_PATH_AT_START  # the fork server takes the import path and the working folder it starts with
    os.chdir(CWD_AT_START)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)
        sys.path[:] = path
        os.chdir(cwd)


def _worker(rank: int, fn: Callable, world_size: int, port: int, env: dict, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at the call, as a spawned process would have inherited it
    # Lightning treats these as an external launcher (torchrun-like) and does not re-execute sys.argv.
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "NODE_RANK": "0", "RANK": str(rank), "OMP_NUM_THREADS": "1",
    })
    fn(rank, *args)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Leave together: a rank tearing gloo down while a peer still talks to it aborts the peer
        # ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


def run_on_cpu_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, *args)`` in `world_size` new processes (forked from the fork server); raises if any fails.

    A rank killed by a signal (no Python exception: gloo aborting with "terminate called without an active
    exception" while connecting or tearing down on a loaded 2-core machine) is retried once on a fresh port; a Python
    exception in any rank (a failed assertion included) is never retried.
    """
    _start_forkserver()
    for attempt in range(2):
        try:
            mp.start_processes(_worker, args=(fn, world_size, free_port(), dict(os.environ), args),
                               nprocs=world_size, start_method="forkserver")
            return
        except mp.ProcessExitedException as e:
            if attempt == 1 or e.signal_name is None:
                raise


import lightning as L  # noqa: E402


class GradientRecorder(L.Callback):
    """Keeps every step's (already data-parallel-averaged) gradients and micro-batch counts."""

    def __init__(self):
        self.grads, self.micro_batches = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if "micro_batches" in batch:  # SFT, RM, DPO steps (a PPO batch is prompts)
            self.micro_batches.append(len(batch["micro_batches"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        named = list(pl_module.model.named_parameters())
        if all(p.grad is None for _, p in named):  # an empty step: its all-zero gradient was dropped (`optimizer_step`)
            self.grads.append({n: torch.zeros_like(p.detach()) for n, p in named})
        else:
            self.grads.append({n: p.grad.detach().clone() for n, p in named})


def fit(model, data, max_steps=1, callbacks=(), precision="32-true", **trainer_kwargs):
    """`Trainer.fit` on CPU with no logger, checkpointing or progress bar."""
    trainer = L.Trainer(
        accelerator="cpu", devices=trainer_kwargs.pop("devices", 1), max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        precision=precision, **trainer_kwargs,
    )
    trainer.fit(model, datamodule=data)
    return trainer


def assert_same_grads(a: GradientRecorder, b: GradientRecorder, atol: float = 1e-5) -> None:
    from conftest import assert_close

    assert len(a.grads) == len(b.grads) >= 1
    for step_a, step_b in zip(a.grads, b.grads, strict=True):
        for name, grad in step_a.items():
            assert_close(step_b[name], grad, atol=atol)


class Metrics(L.Callback):
    """Every training step's logged metrics (`keys`: only these)."""

    def __init__(self, keys=None):
        self.keys, self.history = keys, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items()
                             if self.keys is None or k in self.keys})


def ppo_task(env, rollout=None, optim=None, kl=None, constraints=None, task_class=None, lm=None, dapo=None, **kwargs):
    """A PPO task on the tiny model with the HF engine: `rollout`, `optim` (``model.lm.optim``), `lm` (the rest of
    ``model.lm``: ``name``, ``lora``, ...), `kl`, `constraints`, `dapo` are dicts of the argument groups (defaults
    here: 4 completions of 8 tokens, lr 1e-3 constant, no clipping of the gradient)."""
    from conftest import TINY_MODEL

    from rl_lightning.models.config import LMConfig
    from rl_lightning.models.optim import OptimConfig
    from rl_lightning.rollout.callback import RolloutConfig
    from rl_lightning.rollout.config import DAPOConfig
    from rl_lightning.tasks import PPO
    from rl_lightning.tasks.ppo import ConstraintConfig, KLConfig

    lm = {"name": str(TINY_MODEL), **(lm or {})}
    lm["name"] = str(lm["name"])
    optim = OptimConfig(**{"lr": 1e-3, "max_grad_norm": 0.0, "lr_schedule": "constant", **(optim or {})})
    return (task_class or PPO)(
        LMConfig(**lm, optim=optim),
        RolloutConfig(str(env), **{"responses_per_prompt": 4, "max_new_tokens": 8, **(rollout or {})}),
        kl=KLConfig(**(kl or {})), constraints=ConstraintConfig(**(constraints or {})), dapo=DAPOConfig(**(dapo or {})),
        **kwargs)


def prompts(batch_size=2, shuffle=False, **kwargs):
    from conftest import DEMO_DATA, TINY_MODEL

    from rl_lightning.data import PromptDataModule

    return PromptDataModule(str(DEMO_DATA / "arithmetic.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=batch_size,
                            shuffle=shuffle, **kwargs)


def run_ppo(env=None, rollouts=1, batch_size=2, callbacks=(), **task_kwargs):
    """Seeded `ppo_task` fitted for `rollouts` rollouts on demo prompts; `env` defaults to the arithmetic example."""
    import lightning as L
    from conftest import REPO

    L.seed_everything(0)
    model = ppo_task(env or str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic.py"), max_rollouts=rollouts, **task_kwargs)
    trainer = fit(model, prompts(batch_size), -1, callbacks)
    return model, trainer


def parse_cli(args):
    """The real CLI with `args`, parsed and instantiated without running (no config saved)."""
    from lightning.pytorch import LightningDataModule, LightningModule

    from rl_lightning.cli.main import RLLightningCLI

    return RLLightningCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
        save_config_callback=None, parser_kwargs={"parser_mode": "omegaconf+"}, args=args, run=False,
    )


def start_vllm_serve(rm_folder: str, port: int, log_path) -> subprocess.Popen:
    """``vllm serve`` of the RM export on localhost `port` (CPU: explicit KV-cache size), once it answers /health."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", rm_folder, "--host",
               "127.0.0.1", "--port", str(port), "--runner", "pooling", "--dtype", "float32", "--max-model-len", "512",
               "--max-num-seqs", "8"]
    with open(log_path, "a") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            stop_vllm_serve(server)
            pytest.fail(f"vllm serve did not come up (exit {server.returncode}):\n"
                        + "\n".join(open(log_path).read().splitlines()[-30:]))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(1)


def stop_vllm_serve(server: subprocess.Popen) -> None:
    """Stop the server with its whole process group (the API server and its engine-core child)."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
