"""The device rule (DESIGN.md section 4) on CPU: what NCCL and CUDA reject must fail here too.

Every tensor that meets a collective or a model input lives on ``trainer.strategy.root_device``. On a GPU a host tensor
handed to a collective fails ("No backend type associated with device type cpu"); on CPU CI gloo accepts it. Two
checks make the rule visible without a GPU:

1. a real process group whose only backend serves the ``cuda`` device type (``cuda:gloo``) rejects host tensors with
   NCCL's error, while a plain gloo group accepts them: that is why CPU CI was blind;
2. `device_rules.DeviceRules` tracks which tensors a GPU run would hold on the host and fails at the collectives (and
   where our code mixes them with device tensors); a real dp=2 GRPO run and the reductions run under it.

And under ``strategy.cpu_offload`` (parameters on the CPU, compute on the root device) the module's device, where the
tasks put micro-batches and labels, is the root device, and the HF engine samples there.
"""

import types

import lightning as L
import pytest
import torch
import torch.distributed as dist
from conftest import REPO
from device_rules import DEVICE, HOST, DeviceRuleError, DeviceRules, device_rules, state
from helpers import Metrics, fit, free_port, ppo_task, prompts, run_on_cpu_ranks

from rl_lightning.parallel import ParallelStrategy, reductions
from rl_lightning.parallel.reductions import Groups, data_parallel_max, data_parallel_sum, shard_sum

NCCL_ERROR = "No backend type associated with device type cpu"


def _old_all_reduce(trainer, value, op="sum"):
    """The reductions' collective as it was before the device rule: the caller's tensor, wherever it lives."""
    value = value.detach().float().clone()
    return trainer.strategy.reduce(value, reduce_op=op) if trainer.world_size > 1 else value


def _stub_trainer(root="cpu", world_size=2):
    """A trainer whose strategy reduces with a real all-reduce (no context parallelism) on `root` (the old collective's)."""
    def reduce(value, reduce_op):
        dist.all_reduce(value, op=dist.ReduceOp.SUM if reduce_op == "sum" else dist.ReduceOp.MAX)
        return value

    return types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device(root), reduce=reduce),
                                 world_size=world_size)


def _world_groups(root="cpu", world_size=2):
    """`Groups` of a DDP-like layout on `root`: every rank data-parallel over the default group."""
    return Groups(torch.device(root), dist.get_rank(), world_size, dist.group.WORLD)


@pytest.fixture
def process_group():
    """A one-process gloo group (conftest's autouse fixture destroys it)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


# --------------------------------------------------------------------------------- 1. a cuda-only process group


def _cuda_only_worker(rank, out_path):
    dist.init_process_group("cuda:gloo")  # the default group serves the cuda device type only, as NCCL does
    gloo = dist.new_group(backend="gloo")  # what CPU CI runs on
    errors = {}
    for name, call in [("all_reduce", lambda: dist.all_reduce(torch.tensor(1.0))),
                       ("broadcast", lambda: dist.broadcast(torch.tensor(1.0), 0)),
                       ("all_gather", lambda: dist.all_gather([torch.zeros(1), torch.zeros(1)], torch.ones(1))),
                       ("old _all_reduce", lambda: _old_all_reduce(_stub_trainer(), torch.tensor(3.0)))]:
        with pytest.raises(RuntimeError) as info:
            call()
        errors[name] = str(info.value)
    accepted = torch.tensor(float(rank + 1))
    dist.all_reduce(accepted, group=gloo)
    # the fixed reductions move the count to the root device before any collective: on a CPU-only torch the move
    # itself fails (no CUDA), so no host tensor ever reaches the cuda-only group; with CUDA the sum comes back there
    cuda_groups = _world_groups("cuda")
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        total = data_parallel_sum(cuda_groups, torch.tensor(3.0))
        moved = f"{total.device.type} {float(total)}"
    else:
        with pytest.raises((AssertionError, RuntimeError)) as info:
            data_parallel_sum(cuda_groups, torch.tensor(3.0))
        moved = str(info.value)
    dist.destroy_process_group()  # before helpers' closing barrier, which this group would refuse too
    if rank == 0:
        torch.save({"errors": errors, "gloo": float(accepted), "moved": moved}, out_path)


def test_cuda_only_group_rejects_host_tensors_like_nccl(tmp_path):
    run_on_cpu_ranks(_cuda_only_worker, 2, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    assert out["errors"] == dict.fromkeys(["all_reduce", "broadcast", "all_gather", "old _all_reduce"], NCCL_ERROR)
    assert out["gloo"] == 3.0  # 1 + 2: gloo takes the same host tensors, so CPU CI cannot see the slip
    if torch.cuda.is_available():
        assert out["moved"] == "cuda 6.0"
    else:
        assert "CUDA" in out["moved"] and NCCL_ERROR not in out["moved"]


# ----------------------------------------------------------------------------------------- 2. the checker itself


def test_checker_flags_host_tensors_at_collectives(process_group):
    root = torch.device("cpu")
    with DeviceRules(root):
        for make in (lambda: torch.tensor(1.0), lambda: torch.tensor([1.0, 2.0]).sum() * 2,
                     lambda: torch.zeros(2, device=root).cpu(), lambda: torch.stack([torch.tensor(1.0)] * 2)):
            with pytest.raises(DeviceRuleError, match="torch.distributed.all_reduce got a host tensor"):
                dist.all_reduce(make())
        with pytest.raises(DeviceRuleError, match="torch.distributed.broadcast got a host tensor"):
            dist.broadcast(torch.ones(2), 0)
        with pytest.raises(DeviceRuleError, match="all_gather got a host tensor"):
            dist.all_gather([torch.zeros(1)], torch.ones(1, device=root))
        with pytest.raises(DeviceRuleError, match="ModelParallelStrategy.reduce got a host tensor"):
            L.pytorch.strategies.ModelParallelStrategy().reduce(torch.tensor(1.0), reduce_op="sum")
        placed = [torch.tensor(1.0, device=root), torch.tensor(2.0).to(root), torch.tensor(3.0).to(device=root),
                  torch.tensor(4.0).to(torch.zeros((), device=root)), torch.tensor(5.0) + torch.ones(3, device=root)]
        for value in placed:
            dist.all_reduce(value)  # a one-process group: the sum is the value
        assert [state(v) for v in placed] == [DEVICE] * 5
        assert [v.tolist() for v in placed] == [1.0, 2.0, 3.0, 4.0, [6.0, 6.0, 6.0]]


def test_checker_tracks_moves_and_mixing_as_cuda_would(process_group):
    root = torch.device("cpu")
    with DeviceRules(root):
        host = torch.tensor([1.0, 2.0])
        moved = host.to(root)
        assert (state(host), state(moved), state(host.float()), state(moved.float())) == (HOST, DEVICE, HOST, DEVICE)
        assert state(torch.as_tensor(moved)) == DEVICE and state(host.to(torch.float64)) == HOST
        with pytest.raises(DeviceRuleError, match="mixes a device tensor with a host tensor"):
            moved + host  # non-0-dim host operand: CUDA refuses
        with pytest.raises(DeviceRuleError, match="stack at .* mixes a device tensor with a host tensor"):
            torch.stack([torch.tensor(1.0), torch.tensor(1.0, device=root)])  # no scalar exception in stack
        scaled = moved * torch.tensor(2.0)  # a 0-dim host tensor is a scalar operand: allowed, stays on the device
        assert state(scaled) == DEVICE and scaled.tolist() == [2.0, 4.0]
        assert moved[torch.tensor([1])].tolist() == [2.0]  # indexing with host indices is allowed on CUDA
        in_place = torch.zeros(2, device=root)
        in_place += moved
        assert state(in_place) == DEVICE


def test_checker_leaves_third_party_tensors_alone(process_group):
    """Only our code's factories make host tensors: a library's own tensors are untracked and pass."""
    namespace = {"torch": torch}
    exec(compile("def make():\n    return torch.zeros(2)\n", "/site-packages/library.py", "exec"), namespace)
    with DeviceRules("cpu"):
        value = namespace["make"]()
        dist.all_reduce(value)
        assert state(value) is None and value.tolist() == [0.0, 0.0]


def test_guard_checks_our_functions_arguments():
    calls = []
    owner = types.SimpleNamespace(count=lambda trainer, value: calls.append(float(value)))
    with device_rules("cpu", guards=((owner, "count"),)):
        owner.count(None, torch.tensor(2.0, device="cpu"))
        with pytest.raises(DeviceRuleError, match="count got a host tensor"):
            owner.count(None, torch.tensor(3.0))
    owner.count(None, torch.tensor(4.0))  # unpatched on exit
    assert calls == [2.0, 4.0]


# ----------------------------------------------------------------------------------------------- the reductions


def test_reductions_move_host_values_to_the_root_device(process_group):
    """The old collective fails the checker on a host count; the reductions put any count on the root device first
    (tensor or plain number) and return it there, as float32."""
    trainer, groups = _stub_trainer(), _world_groups()
    with DeviceRules("cpu"):
        with pytest.raises(DeviceRuleError, match="got a host tensor"):
            _old_all_reduce(trainer, torch.tensor(3.0))
        results = [data_parallel_sum(groups, torch.tensor([3, 4])), data_parallel_max(groups, 5),
                   shard_sum(groups, torch.tensor(6.0, dtype=torch.float64))]
        assert [state(r) for r in results] == [DEVICE] * 3
    assert [r.tolist() for r in results] == [[3.0, 4.0], 5.0, 6.0]
    assert {r.dtype for r in results} == {torch.float32}
    assert reductions.process_groups(None).device == torch.device("cpu")
    assert reductions.process_groups(_stub_trainer(world_size=1)) == Groups(torch.device("cpu"))


# ------------------------------------------------------------------------------------- a dp=2 GRPO run, checked

TWO_COMPONENTS = str(REPO / "rl_lightning" / "recipes" / "envs" / "arithmetic_format.py")
LOGGED = ("train/trajectories", "train/reward", "train/reward/format", "train/pareto_size", "train/kl",
          "train/micro_batches")


def _grpo_worker(rank, out_path):
    """One GRPO rollout on 2 data-parallel ranks: counts, metrics, KL reference, Pareto sums and a held-out set, all
    under `DeviceRules`, which also checks that the counts reach the reductions on the device already."""
    from conftest import DEMO_DATA

    L.seed_everything(0)
    model = ppo_task(TWO_COMPONENTS, advantage_estimator="grpo", max_rollouts=1, kl={"coef": 0.05},
                     rollout={"reward_weights": {"correct": 1.0, "format": 1.0}, "reward_workers": 0,
                              "pareto_archive_size": 2})
    metrics = Metrics(LOGGED)
    data = prompts(2, val_path=str(DEMO_DATA / "arithmetic_test.jsonl"))
    with device_rules("cpu", guards=((reductions, "_all_reduce"),)):
        fit(model, data, -1, [metrics], devices=2, strategy=ParallelStrategy(data_parallel_size=2),
            limit_val_batches=1, num_sanity_val_steps=1)
    if rank == 0:
        torch.save({"history": metrics.history, "val": model.validation_metrics}, out_path)


def test_data_parallel_grpo_keeps_every_collective_on_the_device(tmp_path):
    """Fails on the code before the device rule: PPO's micro-batch count reached the data-parallel max as a host
    tensor (``torch.tensor(float(count))``), as did the loss counts and the logged trajectory counts."""
    run_on_cpu_ranks(_grpo_worker, 2, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    (step,) = out["history"]
    assert set(step) == set(LOGGED)
    assert step["train/trajectories"] == 16.0  # 2 prompts x 4 completions x 2 ranks, summed on the device
    assert step["train/pareto_size"] == 1.0 and step["train/micro_batches"] >= 1.0
    assert 0.0 <= step["train/reward/format"] <= 1.0 and step["train/kl"] >= 0.0
    assert set(out["val"]) >= {"val/reward", "val/completion_length", "val/reward/correct", "val/reward/format"}


# ----------------------------------------------------------------------------------- 3. strategy.cpu_offload

COMPARED = ("train/reward", "train/entropy", "train/kl", "train/grad_norm", "train/approx_kl", "train/kl_coef")
ROOT = torch.device("cpu", 0)  # a root device that differs from the parameters' (torch.device("cpu") != "cpu:0")


class Devices(L.Callback):
    """Where the task computes, what the strategy says, where the engine samples and where the parameters are."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append({"module": pl_module.device, "root": trainer.strategy.root_device,
                          "engine": pl_module.rollout_callback.engine.device,
                          "parameters": {p.device for p in pl_module.model.parameters()}})


def _offload_worker(rank, env, out_path):
    """dp=2 PPO with and without cpu_offload, the root device named ``cpu:0``: on a CPU the parameters' device and the
    root device then differ as they do on a GPU (``cpu`` vs ``cuda:0``), so a device read off the parameters shows."""
    out = {}
    for offload in (True, False):
        L.seed_everything(0)
        model = ppo_task(env, max_rollouts=1, kl={"coef": 0.05})
        strategy = ParallelStrategy(data_parallel_size=2, cpu_offload=offload)
        strategy.parallel_devices = [ROOT, ROOT]  # Lightning keeps the devices a strategy brings
        devices, metrics = Devices(), Metrics(COMPARED)
        with device_rules(ROOT):
            fit(model, prompts(2), -1, [devices, metrics], devices=2, strategy=strategy)
        out[offload] = {"devices": devices.seen, "metrics": metrics.history}
    if rank == 0:
        torch.save(out, out_path)


def test_cpu_offload_computes_on_the_root_device_and_matches(parity_env, tmp_path):
    """Under cpu_offload the parameters stay on the CPU, but the module's device (micro-batches, labels, counts) and
    the HF engine's (prompts, sampled tokens, generators) are the strategy's root device, under `DeviceRules`, and the
    step equals the non-offloaded one. Before the fix the engine read ``cpu`` off the offloaded parameters (on a GPU:
    CPU generators against CUDA probabilities)."""
    run_on_cpu_ranks(_offload_worker, 2, parity_env, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    for offload in (True, False):
        (seen,) = out[offload]["devices"]
        assert (seen["module"], seen["root"], seen["engine"]) == (ROOT, ROOT, ROOT), offload
    assert out[True]["devices"][0]["parameters"] == {torch.device("cpu")}  # offloaded: the CPU, not the root
    (offloaded,), (resident,) = out[True]["metrics"], out[False]["metrics"]
    assert set(offloaded) == set(COMPARED) and offloaded["train/grad_norm"] > 0
    for key in COMPARED:
        assert abs(offloaded[key] - resident[key]) < 1e-5, (key, offloaded, resident)


def test_model_to_device_under_cpu_offload_records_the_root_device():
    """Offloaded parameters stay where FSDP2 keeps them; the module's device still says the root device (Lightning's
    setup hook sets it early as a stand-in, which the move makes real; ParallelStrategy records it without the move,
    through Lightning's ``device_dtype_mixin._update_properties``)."""
    for offload in (True, False):
        module = L.LightningModule()
        module.layer = torch.nn.Linear(2, 2)
        strategy = ParallelStrategy(cpu_offload=offload)
        strategy.parallel_devices = [ROOT]
        strategy.connect(module)
        assert module.device == torch.device("cpu")  # Lightning's default before setup
        strategy.model_to_device()
        assert (module.device, module.layer.weight.device) == (ROOT, torch.device("cpu")), offload


class ParametersElsewhere(torch.nn.Module):
    """The policy as an offloaded FSDP2 module looks to whoever asks its parameters: they live on another device
    (here ``meta``) than the one it computes on."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def parameters(self, recurse=True):
        yield torch.nn.Parameter(torch.empty(0, device="meta"))

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_hf_engine_samples_on_the_device_it_is_given(tokenizer):
    """The engine takes its device from the caller (the strategy's root device), not from the parameters: given the
    compute device it samples exactly what the plain engine samples; reading the parameters' device (the old
    behaviour) builds the prompts and generators on the wrong device and fails."""
    from conftest import TINY_MODEL

    from rl_lightning.engines.hf import HFEngine
    from rl_lightning.engines.protocol import SamplingParams
    from rl_lightning.models.loading import load_causal_lm

    model = load_causal_lm(str(TINY_MODEL))
    prompts = [tokenizer("1 + 2 =")["input_ids"], tokenizer("3 + 4 = ")["input_ids"]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seeds=[5, 6])
    expected = HFEngine(model, tokenizer.pad_token_id).generate(prompts, params)
    elsewhere = ParametersElsewhere(model)
    with device_rules("cpu"):
        given = HFEngine(elsewhere, tokenizer.pad_token_id, torch.device("cpu")).generate(prompts, params)
    assert given == expected and [len(g) for g in given] == [2, 2]
    with pytest.raises(RuntimeError, match="device"):  # here: a generator on meta; on a GPU: a CPU one for CUDA
        HFEngine(elsewhere, tokenizer.pad_token_id).generate(prompts, params)
