"""ParallelStrategy on CPU/gloo: SFT under dp, cp, tp and dp x cp gives the single-process per-step losses; DPO under
dp=2 too; distributed checkpoints resume exactly; misconfiguration and unsupported strategies fail at start-up with
one line."""

import ipaddress
import json
import os
import types

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL
from helpers import fit, run_on_cpu_ranks

from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig
from rl_lightning.models.optim import OptimConfig
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.parallel.local_group import loopback_interface
from rl_lightning.parallel.parallelize import parallelize_for
from rl_lightning.tasks import DPO, SFT, RewardModel

GLOBAL_ROWS = 8


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


class ListenerRecorder(L.Callback):
    """This process's listening TCP sockets and ``GLOO_SOCKET_IFNAME`` during the first step (the groups are up)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import psutil

        if batch_idx == 0:
            self.seen = {"gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "port": int(os.environ["MASTER_PORT"]),
                         "sockets": [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                                     if c.status == psutil.CONN_LISTEN]}


def _sft(dp=1, cp=1, tp=1, max_steps=3, callbacks=(), strategy_kwargs=None, **trainer_kwargs):
    L.seed_everything(0)
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=GLOBAL_ROWS // dp,
                         shuffle=True, max_length=96, max_length_per_device=256)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, lr_schedule="constant", max_grad_norm=1.0)
    strategy_kwargs = dict(strategy_kwargs or {})
    checkpointing = strategy_kwargs.pop("gradient_checkpointing", False)  # the model's switch: model.lm
    model = SFT(LMConfig(str(TINY_MODEL), optim=optim, gradient_checkpointing=checkpointing))
    world = dp * cp * tp
    if world > 1:
        trainer_kwargs["strategy"] = ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp,
                                                      tensor_parallel_size=tp, **strategy_kwargs)
    return fit(model, data, max_steps, callbacks, devices=world, **trainer_kwargs)


def _sft_worker(rank, sizes, out_path, strategy_kwargs=None):
    recorder, listeners = LossRecorder(), ListenerRecorder()
    trainer = _sft(*sizes, callbacks=[recorder, listeners], strategy_kwargs=strategy_kwargs)
    (out_path.parent / f"listening{rank}.json").write_text(json.dumps(listeners.seen))
    if rank == 0:
        strategy = trainer.strategy
        offload = getattr(strategy, "activation_offloader", None)
        states = [getattr(o, "rl_lightning_state_offload", None) for o in strategy.optimizers]
        from rl_lightning.models.lora import base_model

        torch.save({"losses": recorder.losses, "activations": offload.stats if offload else None,
                    "checkpointing": base_model(trainer.lightning_module.model).is_gradient_checkpointing,
                    "optimizer": [s.stats for s in states if s is not None]}, out_path)


SFT_SIZES = {"dp2": (2, 1, 1), "cp2": (1, 2, 1), "tp2": (1, 1, 2), "dp2-cp2": (2, 2, 1), "cp2-tp2": (1, 2, 2)}
STRATEGY_OPTIONS = {
    "hsdp-replicate2": {"replicate_size": 2}, "cpu-offload": {"cpu_offload": True},
    "checkpointing-zero2": {"gradient_checkpointing": True, "reshard_after_forward": False},  # model.lm's switch
    "activation-and-optimizer-offload": {"activation_offload": True, "optimizer_offload": True,
                                         "offload_bucket_mb": 1},
}
PAIRS = {"dpo-dp2": ("dpo", (2, 1, 1)), "dpo-cp2": ("dpo", (1, 2, 1)), "rm-cp2": ("rm", (1, 2, 1)),
         "rm-tp2": ("rm", (1, 1, 2))}
MISCONFIGURED = {
    "sizes-vs-world": ({"data_parallel_size": 2, "tensor_parallel_size": 2}, {},
                       "strategy sizes data_parallel_size=2 x context_parallel_size=1 x tensor_parallel_size=2 = 4, "
                       "but the job has 2 processes (trainer.devices x trainer.num_nodes); make the product equal "
                       "the world size"),
    "cp-needs-rl_varlen": ({"context_parallel_size": 2}, {"attn_implementation": "sdpa"},
                           "strategy.context_parallel_size=2 needs model.lm.attn_implementation: rl_varlen (ring "
                           "attention over packed sequences), got 'sdpa'"),
}


def _spawned_jobs(root):
    """Every fit of this module that needs its own ranks (except the resume test's): {world size: [(id, worker,
    args)]}; each job writes into ``root/<id>/``."""
    jobs = {2: [], 4: []}
    for name, sizes in SFT_SIZES.items():
        jobs[sizes[0] * sizes[1] * sizes[2]].append((name, _sft_worker, (sizes, root / name / "losses.pt")))
    for name, kwargs in STRATEGY_OPTIONS.items():
        jobs[2].append((name, _sft_worker, ((2, 1, 1), root / name / "losses.pt", kwargs)))
    for name, (task, sizes) in PAIRS.items():
        jobs[2].append((name, _pairs_worker, (task, sizes, root / name / "losses.pt")))
    jobs[2].append(("export-tp2", _export_worker, (root / "export-tp2" / "model",)))
    for name, (kwargs, model_kwargs, _) in MISCONFIGURED.items():  # last: they stop at start-up
        jobs[2].append((name, _misconfig_worker, (kwargs, model_kwargs, root / name / "error.txt")))
    return jobs


def _jobs_worker(rank, jobs):
    for name, worker, args in jobs:
        print(f"rank {rank}: {name}", flush=True)  # in the group's failure output: which fit it was on
        worker(rank, *args)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Run `_spawned_jobs` in one group of processes per world size instead of one group per test: each rank imports
    torch and Lightning once (~10 s a rank on 2 cores) and runs the fits in turn on the same default process group
    (each fit builds its own device mesh). Returns ``(root, errors)``; a group that fails records its error (its
    ranks printed the job they were on), and every test whose output is missing fails with it."""
    root = tmp_path_factory.mktemp("spawned")
    errors = {}
    for world, jobs in _spawned_jobs(root).items():
        for name, _, _ in jobs:
            (root / name).mkdir()
        try:
            run_on_cpu_ranks(_jobs_worker, world, jobs)
        except Exception as e:  # noqa: BLE001 - kept for the tests of this group, each fails naming it
            errors[world] = f"{type(e).__name__}: {e}"
    return root, errors


def _output(spawned, name, file):
    root, errors = spawned
    path = root / name / file
    if not path.exists():
        pytest.fail(f"{name}: no {file}; its group of spawned ranks failed: {errors}")
    return path


@pytest.fixture(scope="module")
def single_process_losses():
    recorder = LossRecorder()
    _sft(callbacks=[recorder])
    assert len(recorder.losses) == 3
    return recorder.losses


@pytest.mark.parametrize("name", list(SFT_SIZES))
def test_sft_parallel_losses_equal_single_process(name, single_process_losses, spawned):
    out = _output(spawned, name, "losses.pt")
    losses = torch.load(out, weights_only=False)["losses"]
    assert len(losses) == 3
    for step, (parallel, single) in enumerate(zip(losses, single_process_losses, strict=True)):
        assert abs(parallel - single) < 1e-5, (step, losses, single_process_losses)
    # Issue 36.5: the group's store (rank 0, on MASTER_PORT) and gloo listen on 127.0.0.0/8 only (torch's env://
    # store listened on '::'); gloo's interface is the loopback one (this host's name may resolve to loopback too)
    sizes = SFT_SIZES[name]
    world = sizes[0] * sizes[1] * sizes[2]
    ranks = [json.loads((out.parent / f"listening{rank}.json").read_text()) for rank in range(world)]
    sockets = [(ip, port) for seen in ranks for ip, port in seen["sockets"]]
    assert [s for s in sockets if not ipaddress.ip_address(s[0]).is_loopback] == []
    assert ["127.0.0.1", ranks[0]["port"]] in ranks[0]["sockets"]
    assert {seen["gloo"] for seen in ranks} == {loopback_interface()}


@pytest.mark.parametrize("name", list(STRATEGY_OPTIONS))
def test_sft_strategy_options_keep_single_process_losses(name, single_process_losses, spawned):
    result = torch.load(_output(spawned, name, "losses.pt"), weights_only=False)
    losses = result["losses"]
    # model.lm.gradient_checkpointing, the one switch, reaches the sharded model (strategy.activation_checkpointing
    # is gone)
    assert result["checkpointing"] is bool(STRATEGY_OPTIONS[name].get("gradient_checkpointing"))
    if STRATEGY_OPTIONS[name].get("activation_offload"):
        assert result["activations"].tensors > 0 and result["activations"].kept_on_device > 0  # params stay
        (optimizer,) = result["optimizer"]
        assert optimizer.buckets > 1 and optimizer.largest_bucket_bytes > 0  # streamed in several 1 MiB buckets
    for step, (parallel, single) in enumerate(zip(losses, single_process_losses, strict=True)):
        assert abs(parallel - single) < 1e-5, (step, losses, single_process_losses)


def _pairs(task, dp=1, cp=1, tp=1, callbacks=(), **trainer_kwargs):
    L.seed_everything(0)
    data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL),
                                batch_size=GLOBAL_ROWS // dp, max_length=96, max_length_per_device=512)
    if task == "dpo":
        model = DPO(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")), beta=0.5)
    else:
        model = RewardModel(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")))
    if dp * cp * tp > 1:
        trainer_kwargs["strategy"] = ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp,
                                                      tensor_parallel_size=tp)
    return fit(model, data, 3, callbacks, devices=dp * cp * tp, **trainer_kwargs)


def _pairs_worker(rank, task, sizes, out_path):
    recorder = LossRecorder()
    _pairs(task, *sizes, callbacks=[recorder])
    if rank == 0:
        torch.save(recorder.losses, out_path)


@pytest.mark.parametrize("name", list(PAIRS))
def test_preference_tasks_parallel_losses_equal_single_process(name, spawned):
    """Per-sequence sums (DPO log-probabilities, RM last-token rewards) are completed across context-parallel ranks;
    their gradient must still count each token once."""
    task, _ = PAIRS[name]
    single = LossRecorder()
    _pairs(task, callbacks=[single])
    parallel = torch.load(_output(spawned, name, "losses.pt"))
    assert len(parallel) == len(single.losses) == 3
    for a, b in zip(parallel, single.losses, strict=True):
        assert abs(a - b) < 1e-5, (parallel, single.losses)


class BatchRecorder(LossRecorder):
    """Losses plus a fingerprint of each step's first micro-batch (to check the data resumes where it stopped)."""

    def __init__(self):
        super().__init__()
        self.fingerprints = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.fingerprints.append(int(batch["micro_batches"][0]["input_ids"].sum()))


def _resume_worker(rank, root, ckpt_path, out_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    recorder = BatchRecorder()
    callbacks = [recorder]
    if ckpt_path is None:
        callbacks.append(ModelCheckpoint(dirpath=f"{root}/ckpt", every_n_train_steps=2, save_top_k=-1))
    L.seed_everything(0)
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=96,
                         max_length_per_device=256)
    model = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, warmup_steps=1, lr_schedule="cosine")))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, default_root_dir=str(root),
                        strategy=ParallelStrategy(data_parallel_size=2))
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    if rank == 0:
        torch.save({"losses": recorder.losses, "fingerprints": recorder.fingerprints}, out_path)


def test_distributed_checkpoint_resumes_exactly(tmp_path):
    """Uninterrupted 4 steps vs. a fresh process group resuming the step-2 DCP checkpoint: steps 3 and 4 (loss,
    data, optimizer and schedule state) match exactly."""
    run_on_cpu_ranks(_resume_worker, 2, tmp_path, None, tmp_path / "full.pt")
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert checkpoint.is_dir() and any(checkpoint.glob("*.distcp"))  # sharded (DCP) format
    run_on_cpu_ranks(_resume_worker, 2, tmp_path, str(checkpoint), tmp_path / "resumed.pt")
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert len(full["losses"]) == 4 and len(resumed["losses"]) == 2
    assert resumed["fingerprints"] == full["fingerprints"][2:]
    for a, b in zip(resumed["losses"], full["losses"][2:], strict=True):
        assert abs(a - b) < 1e-6, (resumed, full)


def _export_worker(rank, out_dir):
    from rl_lightning.tracking.export import export_hf

    L.seed_everything(0)
    model = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")))
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=96,
                         max_length_per_device=256)
    trainer = fit(model, data, 2, devices=2, strategy=ParallelStrategy(tensor_parallel_size=2))
    assert any(hasattr(p, "device_mesh") for p in model.model.parameters())  # really sharded
    export_hf(model.model, str(TINY_MODEL), out_dir, trainer.is_global_zero)


def test_hf_export_gathers_full_weights_from_shards(spawned):
    from transformers import AutoModelForCausalLM

    exported_dir = _output(spawned, "export-tp2", "model/config.json").parent
    single = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")))
    L.seed_everything(0)
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=96,
                         max_length_per_device=256)
    fit(single, data, 2)
    exported = AutoModelForCausalLM.from_pretrained(exported_dir).state_dict()
    reference = single.model.state_dict()
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-5, rtol=0)  # 2 Adam steps; see the parity tests


def _misconfig_worker(rank, kwargs, model_kwargs, out_path):
    try:
        _sft_with(kwargs, model_kwargs)
    except ConfigError as e:
        if rank == 0:
            out_path.write_text(str(e))


def _sft_with(strategy_kwargs, model_kwargs):
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4)
    model = SFT(LMConfig(str(TINY_MODEL), **model_kwargs))
    fit(model, data, 1, devices=2, strategy=ParallelStrategy(**strategy_kwargs))


@pytest.mark.parametrize("name", list(MISCONFIGURED))
def test_misconfiguration_fails_at_start_up(name, spawned):
    assert _output(spawned, name, "error.txt").read_text() == MISCONFIGURED[name][2]


def test_unsupported_strategies_are_rejected():
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        module = types.SimpleNamespace(_trainer=types.SimpleNamespace(strategy=strategy))
        with pytest.raises(ConfigError, match=f"trainer.strategy {type(strategy).__name__} is not supported; use "
                                              "rl_lightning.parallel.ParallelStrategy"):
            parallelize_for(module, object())


def test_heads_not_divisible_by_tp_and_bad_sizes():
    from transformers import AutoConfig

    from rl_lightning.parallel.parallelize import check_tensor_parallel

    class Model:
        config = AutoConfig.from_pretrained(TINY_MODEL)

    with pytest.raises(ConfigError, match="the model has 4 attention heads and 2 key-value heads, not both divisible "
                                          "by strategy.tensor_parallel_size=4; pick a tensor_parallel_size that "
                                          "divides 2"):
        check_tensor_parallel(Model(), 4)
    with pytest.raises(ConfigError, match=r"strategy.data_parallel_size must be an integer >= 1, got 0; "
                                          r"strategy.mixed_precision must be 'bf16' or null, got 'fp8'"):
        ParallelStrategy(data_parallel_size=0, mixed_precision="fp8")
    with pytest.raises(ConfigError, match="strategy.replicate_size=3 must divide strategy.data_parallel_size=4"):
        ParallelStrategy(data_parallel_size=4, replicate_size=3)
