"""The chunked output head (``model.lm.lm_head_chunk``) under ParallelStrategy on CPU/gloo: FSDP2 dp=2 (the tied head is
part of the root unit, gathered around the root's forward the chunked head runs inside), TP=2 and CP=2 (SFT), and
DPO under dp=2 (its FSDP2-sharded frozen reference too): a run with 16-position chunks logs the full-logits run's
losses and gradient norms, step by step. Every run of the module shares one spawned pair of processes. A vocabulary-sharded head (not in the
TP plan; a user's plan could shard it) is gathered per chunk: log-probs and gradients equal one process's."""

import lightning as L
import pytest
import torch
from conftest import DEMO_DATA, TINY_MODEL
from helpers import Metrics, fit, run_on_cpu_ranks

from rl_lightning.data import PreferenceDataModule, SFTDataModule
from rl_lightning.models.config import LMConfig
from rl_lightning.models.logprobs import ChunkedHead
from rl_lightning.models.optim import OptimConfig
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.tasks import DPO, SFT

CHUNK = 16  # far below the ~100 target positions per micro-batch: several chunks, one that does not fill
KEYS = ("train/loss", "train/grad_norm")


def _run(task, sizes, chunk):
    L.seed_everything(0)
    dp, cp, tp = sizes
    optim = OptimConfig(lr=1e-3, warmup_steps=0, lr_schedule="constant", max_grad_norm=1.0)
    if task == "sft":
        data = SFTDataModule(str(DEMO_DATA / "sft.jsonl"), tokenizer_name=str(TINY_MODEL), batch_size=8 // dp,
                             shuffle=True, max_length=96, max_length_per_device=256)
        model = SFT(LMConfig(str(TINY_MODEL), optim=optim, lm_head_chunk=chunk))
    else:
        data = PreferenceDataModule(str(DEMO_DATA / "preference.jsonl"), tokenizer_name=str(TINY_MODEL),
                                    batch_size=8 // dp, max_length=96, max_length_per_device=512)
        model = DPO(LMConfig(str(TINY_MODEL), optim=optim, lm_head_chunk=chunk), beta=0.5)
    metrics = Metrics(KEYS)
    strategy = ParallelStrategy(data_parallel_size=dp, context_parallel_size=cp, tensor_parallel_size=tp)
    fit(model, data, 3, [metrics], devices=dp * cp * tp, strategy=strategy)
    return metrics.history


def _worker(rank, task, sizes, out_path):
    heads, forward = [], ChunkedHead.forward

    def recording(self, hidden):  # which head the chunked path saw: (module, weight) types
        heads.append((type(self.head).__name__, type(self.head.weight).__name__))
        return forward(self, hidden)

    ChunkedHead.forward = recording
    try:
        runs = {chunk: _run(task, sizes, chunk) for chunk in (None, CHUNK)}
    finally:
        ChunkedHead.forward = forward
    if rank == 0:
        torch.save({**runs, "heads": heads}, out_path)


LAYOUTS = {"sft-dp2": ("sft", (2, 1, 1)), "sft-tp2": ("sft", (1, 1, 2)), "sft-cp2": ("sft", (1, 2, 1)),
           "dpo-dp2": ("dpo", (2, 1, 1))}


def _jobs_worker(rank, root):
    """Every two-rank run of this module in turn, in one spawned group (each rank imports torch and Lightning once,
    not six times); each writes ``root/<id>.pt``. The group's default process group serves them all."""
    jobs = [(name, _worker, (task, sizes, root / f"{name}.pt")) for name, (task, sizes) in LAYOUTS.items()]
    jobs += [("sharded-head", _sharded_head_worker, (root / "sharded-head.pt",)),
             ("own-unit", _own_unit_worker, (root / "own-unit.pt",))]
    for name, worker, args in jobs:
        print(f"rank {rank}: {name}", flush=True)  # in the group's failure output: which run it was on
        worker(rank, *args)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """``(root, error)``: the folder `_jobs_worker` wrote into, and the group's error if it failed (its ranks printed
    the run they were on); a test whose file is missing fails with it."""
    root = tmp_path_factory.mktemp("spawned")
    try:
        run_on_cpu_ranks(_jobs_worker, 2, root)
        error = None
    except Exception as e:  # noqa: BLE001 - kept for the tests, each fails naming it
        error = f"{type(e).__name__}: {e}"
    return root, error


def _output(spawned, name):
    root, error = spawned
    path = root / f"{name}.pt"
    if not path.exists():
        pytest.fail(f"{name}: no output; the group of spawned ranks failed: {error}")
    return torch.load(path)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_head_equals_full_logits_in_parallel(name, spawned):
    runs = _output(spawned, name)
    full, chunked = runs[None], runs[CHUNK]
    # only the chunked run went through ChunkedHead: a plain Linear whose weight the root's forward had gathered into
    # a full tensor (not a DTensor shard), so the fused chunked_token_logprobs ran
    assert len(runs["heads"]) > 0 and set(runs["heads"]) == {("Linear", "Parameter")}, runs["heads"]
    assert len(full) == len(chunked) == 3 and all(set(step) == set(KEYS) for step in full + chunked)
    for step, (a, b) in enumerate(zip(chunked, full, strict=True)):
        for key in KEYS:
            # fp32 over 3 Adam steps (lr 1e-3): the chunked head sums the same products in another order, so its
            # gradients differ by fp32 rounding (~1e-7 relative), which Adam's normalised steps carry into the
            # weights; the losses agree far below the parity tests' 1e-5
            assert abs(a[key] - b[key]) < 1e-5, (step, key, chunked, full)
    assert full[0]["train/loss"] > 0


def _sharded_head_worker(rank, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from rl_lightning.data.steps import pack
    from rl_lightning.data.tokenization import TokenizedExample
    from rl_lightning.models.loading import load_causal_lm
    from rl_lightning.models.logprobs import target_logprobs

    if not dist.is_initialized():  # the group's earlier runs made it
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    micro_batch = pack([TokenizedExample(ids[:25], [0] * 5 + [1] * 20), TokenizedExample(ids[25:], [1] * 35)], 257)

    def untied():
        model = load_causal_lm(str(TINY_MODEL))
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # the head alone shards
        return model

    def run(model, chunk_size):
        logprobs, entropy = target_logprobs(model, micro_batch, 0.7, "grad", chunk_size)
        (logprobs.sum() / 55 + entropy.sum() / 110).backward()
        head_grad = model.lm_head.weight.grad
        return (logprobs.detach(), entropy.detach(), model.model.layers[1].mlp.down_proj.weight.grad,
                head_grad.full_tensor() if hasattr(head_grad, "full_tensor") else head_grad)

    reference = run(untied(), None)
    model = untied()
    parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    sharded = run(model, 7)
    model = untied()
    parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=True))
    try:
        run(model, 7)
        local_error = None
    except RuntimeError as e:
        local_error = str(e)
    if rank == 0:
        torch.save({"reference": reference, "sharded": sharded, "local_error": local_error}, out_path)


def test_a_vocabulary_sharded_head_is_gathered_per_chunk(spawned):
    """ColwiseParallel on the head, its output a DTensor sharded on the vocabulary (Shard(-1)): the chunked path calls
    the module per chunk and gathers each (chunk, V) logits before the log-softmax; with the local shard as output
    (use_local_output=True) it refuses rather than normalise over half the vocabulary."""
    from conftest import assert_close

    out = _output(spawned, "sharded-head")
    for got, want in zip(out["sharded"], out["reference"], strict=True):
        assert_close(got, want)
    assert out["reference"][3].abs().sum() > 0
    assert out["local_error"] == ("the output head returned 160 logits per position for a vocabulary of 320 (a local "
                                  "shard of a tensor-parallel head?); return a DTensor (use_local_output=False) or "
                                  "set model.lm.lm_head_chunk: null")


def _own_unit_worker(rank, out_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rl_lightning.data.steps import pack
    from rl_lightning.data.tokenization import TokenizedExample
    from rl_lightning.models.loading import load_causal_lm
    from rl_lightning.models.logprobs import target_logprobs

    if not dist.is_initialized():  # the group's earlier runs made it
        dist.init_process_group("gloo")
    model = load_causal_lm(str(TINY_MODEL))
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: a unit of its own
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(rank)).tolist()
    micro_batch = pack([TokenizedExample(ids[:25], [0] * 5 + [1] * 20), TokenizedExample(ids[25:], [1] * 35)], 257)
    runs, seen = {}, []
    forward = ChunkedHead.forward

    def recording(self, hidden):
        seen.append(type(self.head.weight).__name__)  # a DTensor shard: the module path runs
        return forward(self, hidden)

    ChunkedHead.forward = recording
    try:
        for chunk_size in (None, 7):
            model.zero_grad(set_to_none=True)
            logprobs, entropy = target_logprobs(model, micro_batch, 0.7, "grad", chunk_size)
            (logprobs.sum() / 55 + entropy.sum() / 110).backward()
            runs[chunk_size] = (logprobs.detach(), entropy.detach(),
                                *(p.grad.full_tensor() for p in model.parameters()))  # gradients reduced over ranks
    finally:
        ChunkedHead.forward = forward
    if rank == 0:
        torch.save({"runs": runs, "seen": seen}, out_path)


def test_a_head_in_its_own_fsdp_unit_is_called_per_chunk(spawned):
    """An untied head sharded as its own FSDP2 unit (not what `parallelize` does; a user's wrapping could): inside
    the root's forward its weight is still a shard, so the chunked path calls the module per chunk (FSDP's hooks
    gather it each time, also when the backward recomputes a chunk) and equals the full path, gradients included."""
    from conftest import assert_close

    out = _output(spawned, "own-unit")
    assert out["seen"] == ["DTensor"]
    full, chunked = out["runs"][None], out["runs"][7]
    assert len(full) == len(chunked) > 20
    for got, want in zip(chunked, full, strict=True):
        assert_close(got, want)
