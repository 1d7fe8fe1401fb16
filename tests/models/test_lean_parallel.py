"""Lean activations next to the rest of training: LoRA (the MLPs whose projections carry adapters fall back to the
original forward, the others and the norms stay lean), gradient checkpointing (the recompute runs the lean path),
FSDP2 on two gloo ranks (parameters are plain tensors inside a sharded layer's forward: lean path, same gradients)
and tensor parallelism (DTensor weights and the plan's hooks: the original forward). Everything equals the unpatched
model bit for bit."""

import pytest
import torch
from conftest import TINY_MODEL
from helpers import free_port, run_on_cpu_ranks
from test_lean import assert_bitwise, micro_batch, mlp_paths, model_step

from rl_lightning.models import lean
from rl_lightning.models.lean import apply_lean_activations, remove_lean_activations
from rl_lightning.models.loading import load_causal_lm
from rl_lightning.models.lora import LoRAConfig, apply_lora

LEAN, STOCK = "_SwiGLUDownBackward", "UnsafeViewBackward0"


def _lora_model(targets):
    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(str(TINY_MODEL), lean_activations=False), LoRAConfig(r=4, alpha=8.0, target_modules=targets))
    with torch.no_grad():  # adapters away from their zero start, so they change the outputs and get gradients
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize(("targets", "path"), [("all-linear", "AddBackward0"), (("q_proj", "v_proj"), LEAN)],
                         ids=["all-linear", "attention-only"])
@pytest.mark.parametrize("order", ["lean-first", "lora-first"])
def test_lora_equals_the_unpatched_lora_model(targets, path, order):
    """LoRA on the MLP: its forward falls back (lean-first) or it is not patched (lora-first); adapters on attention
    only: the MLPs are lean. The adapters' gradients, all there are, equal the unpatched model's."""
    batch = micro_batch()
    stock = model_step(_lora_model(targets), batch)
    if order == "lean-first":
        torch.manual_seed(0)
        base = load_causal_lm(str(TINY_MODEL), lean_activations=False)
        patched_count = apply_lean_activations(base)
        model = apply_lora(base, LoRAConfig(r=4, alpha=8.0, target_modules=targets))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.05)
        assert torch.equal(torch.cat([p.flatten() for p in model.parameters()]),
                           torch.cat([p.flatten() for p in _lora_model(targets).parameters()]))
    else:
        model = _lora_model(targets)
        patched_count = apply_lean_activations(model)
    assert patched_count == (5 if path != LEAN and order == "lora-first" else 7)  # 5 norms, 2 MLPs
    paths = mlp_paths(model)
    patched = model_step(model, batch)
    assert {p for _, p in paths} == {path}
    assert any("lora_" in name for name in stock[1]) and all("lora_" in name for name in stock[1])
    assert_bitwise(stock, patched)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_recomputes_the_lean_path(reentrant, monkeypatch):
    """Non-reentrant: lean in the forward and in the recompute (which stops once the last saved tensor is back, before
    the MLP's forward hook). Reentrant: the first forward runs under no_grad (the original forward), the recompute
    lean."""
    model = load_causal_lm(str(TINY_MODEL), lean_activations=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    batch = micro_batch()
    stock = model_step(model, batch)
    apply_lean_activations(model)
    paths, calls = mlp_paths(model), []
    monkeypatch.setattr(lean, "swiglu_down", lambda *a, f=lean.swiglu_down: calls.append(1) or f(*a))
    patched = model_step(model, batch)
    assert [p for _, p in paths] == ([None, None, LEAN, LEAN] if reentrant else [LEAN, LEAN])
    assert len(calls) == (2 if reentrant else 4)  # 2 layers: (forward and) recompute
    assert_bitwise(stock, patched)


def _fsdp_worker(rank, out_path):
    """Per rank: the stock and the lean tiny model, each layer and the root under fully_shard (fp32, and bf16
    parameters via MixedPrecisionPolicy), one packed micro-batch per rank; the full gradients after reduce-scatter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    batch = micro_batch(seed=rank)
    results = {}
    for precision, policy in (("fp32", MixedPrecisionPolicy()), ("bf16", MixedPrecisionPolicy(torch.bfloat16))):
        runs = {}
        for variant in ("stock", "lean"):
            torch.manual_seed(0)
            model = load_causal_lm(str(TINY_MODEL), lean_activations=False)
            if variant == "lean":
                assert apply_lean_activations(model) == 7  # before sharding, as loading would
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            paths = mlp_paths(model)
            logits, grads = model_step(model, batch)
            runs[variant] = (logits, {n: g.full_tensor() for n, g in grads.items()}, [p for _, p in paths])
        results[precision] = runs
    if rank == 0:
        torch.save(results, out_path)


def test_fsdp2_on_two_gloo_ranks_runs_lean_with_the_same_gradients(tmp_path):
    run_on_cpu_ranks(_fsdp_worker, 2, tmp_path / "fsdp.pt")
    results = torch.load(tmp_path / "fsdp.pt")
    for precision, runs in results.items():
        assert runs["stock"][2] == [STOCK] * 2 and runs["lean"][2] == [LEAN] * 2, precision
        assert runs["lean"][0].dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        assert_bitwise(runs["stock"][:2], runs["lean"][:2])


def test_tensor_parallel_mlp_falls_back_to_the_original():
    """A 1-rank tensor-parallel plan on the MLP (DTensor weights, input/output hooks): the original forward runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = load_causal_lm(str(TINY_MODEL), lean_activations=False)
    batch = micro_batch()
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                         "mlp.down_proj": RowwiseParallel()})
    stock = model_step(model, batch)
    assert apply_lean_activations(model) == 7
    paths = mlp_paths(model)
    patched = model_step(model, batch)
    assert paths == [(f"model.layers.{i}.mlp", "_ToTorchTensorBackward") for i in range(2)]  # down_proj ran
    # (RowwiseParallel's output hook made the local tensor): the original forward, not _SwiGLUDownBackward
    assert {type(g).__name__ for g in patched[1].values()} == {"DTensor", "Tensor"}
    assert_bitwise(stock, patched)
    assert remove_lean_activations(model) == 7
