"""The Hugging Face export under FSDP2: only the writing rank holds the gathered model, tied weights are gathered once,
and what it writes equals the sharded model's full weights."""

import weakref

import lightning as L
import torch
from conftest import DEMO_DATA, TINY_MODEL
from helpers import fit, run_on_cpu_ranks

from rl_lightning.data import SFTDataModule
from rl_lightning.models.config import LMConfig
from rl_lightning.models.optim import OptimConfig
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.tasks import SFT


def _gather_worker(rank, out_dir):
    from torch.distributed.tensor import DTensor

    import rl_lightning.engines.weights as weights
    from rl_lightning.tracking.export import full_state_dict

    L.seed_everything(0)
    model = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3, lr_schedule="constant")))
    data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=4, max_length=96,
                         max_length_per_device=256)
    fit(model, data, 1, devices=2, strategy=ParallelStrategy(data_parallel_size=2))
    assert all(isinstance(p, DTensor) for p in model.model.parameters())  # really sharded

    gathered, alive_at_call = [], []
    original = weights.full_tensor

    def recording(tensor):
        alive_at_call.append(sum(ref() is not None for ref in gathered))  # full tensors still held at this gather
        out = original(tensor)
        gathered.append(weakref.ref(out))
        return out

    weights.full_tensor = recording
    try:
        state = full_state_dict(model.model, keep=rank == 0)
    finally:
        weights.full_tensor = original
    unique = {id(t) for t in model.model.state_dict(keep_vars=True).values()}
    reference = {name: t.full_tensor().cpu() for name, t in model.model.state_dict().items()}  # the naive gather
    torch.save({"state": state, "alive_at_call": alive_at_call, "calls": len(gathered), "unique": len(unique),
                "reference": reference if rank == 0 else None}, out_dir / f"rank{rank}.pt")


def test_only_the_writer_holds_the_gathered_model(tmp_path):
    run_on_cpu_ranks(_gather_worker, 2, tmp_path)
    writer, other = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # every rank takes part in one gather per distinct tensor (the tied embedding/head once), in the same order
    assert writer["calls"] == other["calls"] == writer["unique"] < len(writer["reference"])
    assert other["state"] == {}
    assert max(other["alive_at_call"]) == 0  # a non-writing rank holds no full tensor when it gathers the next one
    assert writer["alive_at_call"][-1] == writer["calls"] - 1  # the writer keeps them all (the check can fail)
    state, reference = writer["state"], writer["reference"]
    assert state.keys() == reference.keys()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]  # tied: one tensor in the export
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name


def test_an_export_that_fails_midway_leaves_the_previous_export_whole(tmp_path):
    """The export is written under a hidden name and renamed into place: a failure after the weights are written (here
    the tokenizer cannot load) leaves the previous export as it was, not new weights beside an old tokenizer."""
    import pytest
    from transformers import AutoModelForCausalLM

    from rl_lightning.tracking.export import export_hf

    model = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL))
    target = tmp_path / "export"
    export_hf(model, str(TINY_MODEL), target)
    before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
    assert "model.safetensors" in before and "tokenizer_config.json" in before
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # different weights: a partial export would show
    with pytest.raises(Exception):  # noqa: B017 - whatever the tokenizer loader raises for a missing folder
        export_hf(model, str(tmp_path / "no-such-tokenizer"), target)
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["export"]
