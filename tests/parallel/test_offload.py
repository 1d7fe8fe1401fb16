"""Activation and optimizer-state offload (issue 26, item 2): the same gradients and parameters as without them,
bucket by bucket; what moved; the options' one-line errors. The memory they save is measured on a GPU (``gpu``)."""

import copy
import gc

import pytest
import torch

from rl_lightning.errors import ConfigError
from rl_lightning.parallel import ParallelStrategy
from rl_lightning.parallel.offload import ActivationOffload, OptimizerStateOffload

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 8)).to(DEVICE)


def _grads(model, offload=None):
    torch.manual_seed(1)
    x = torch.randn(16, 32, device=DEVICE)
    model.zero_grad()
    if offload is None:
        out = model(x)
    else:
        with offload.saving():
            out = model(x)
    (out.square().mean()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_activation_offload_gives_the_same_gradients_and_keeps_parameters():
    plain, offloaded = _model(), _model()
    offload = ActivationOffload(min_bytes=0)
    for a, b in zip(_grads(plain), _grads(offloaded, offload), strict=True):
        assert torch.equal(a, b)
    # Saved for backward: each Linear its input, GELU its input, Tanh its output (5 moved); the 2nd and 3rd Linear
    # their weight, for the gradient of their input (kept: a parameter's view). The input needs no gradient, so the
    # 1st Linear saves no weight.
    assert offload.stats.tensors == 5 and offload.stats.kept_on_device == 2
    assert offload.stats.bytes == 4 * 16 * (32 + 64 + 64 + 64 + 64)


def test_small_tensors_stay_and_hooks_on_a_module_cover_only_its_forward():
    model = _model()
    offload = ActivationOffload(min_bytes=16 * 64 * 4)  # a [16, 32] fp32 input (2 KiB) is too small to move
    offload.attach(model[2])  # the middle Linear only
    plain = _grads(_model())
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model), strict=True))
    assert (offload.stats.tensors, offload.stats.kept_on_device) == (1, 1)  # its [16, 64] input; its weight stays
    assert offload.stats.bytes == 16 * 64 * 4


def _batches(n):
    torch.manual_seed(2)
    return [torch.randn(8, 32, device=DEVICE) for _ in range(n)]


def _steps(model, optimizer, scheduler, batches):
    losses = []
    for x in batches:

        def closure(x=x):
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            return loss

        losses.append(optimizer.step(closure).item())
        scheduler.step()
    return losses


def _adamw(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


@pytest.mark.parametrize("bucket_bytes", [1, 40_000, 1 << 30], ids=["per-parameter", "two-buckets", "one-bucket"])
def test_optimizer_state_offload_steps_like_the_optimizer(bucket_bytes):
    plain, offloaded = _model(), _model()
    opt_a, sched_a = _adamw(plain)
    opt_b, sched_b = _adamw(offloaded)
    offload = OptimizerStateOffload(opt_b, bucket_bytes)
    assert _steps(plain, opt_a, sched_a, _batches(3)) == _steps(offloaded, opt_b, sched_b, _batches(3))
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)
    state_bytes = [2 * p.numel() * 4 for p in offloaded.parameters()]  # exp_avg and exp_avg_sq, fp32
    expected = {1: len(state_bytes), 40_000: 2, 1 << 30: 1}[bucket_bytes]
    assert offload.stats.buckets == expected and offload.stats.bytes == sum(state_bytes)
    assert offload.stats.largest_bucket_bytes <= max(bucket_bytes, max(state_bytes))
    assert [g["params"] for g in opt_b.param_groups] == [list(offloaded.parameters())]  # groups restored
    a, b = opt_a.state_dict(), opt_b.state_dict()  # checkpoints see the optimizer's own state
    assert a["param_groups"] == b["param_groups"]
    for index, state in a["state"].items():
        assert all(torch.equal(v, b["state"][index][k].to(v.device)) for k, v in state.items())


def test_optimizer_state_offload_resumes_from_a_state_dict():
    """3 steps in one go == 2 steps, the state dicts saved and loaded into a fresh model and optimizer, 1 step."""
    batches = _batches(3)
    model = _model()
    optimizer, scheduler = _adamw(model)
    OptimizerStateOffload(optimizer, 1)
    _steps(model, optimizer, scheduler, batches[:2])
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), scheduler.state_dict()))
    _steps(model, optimizer, scheduler, batches[2:])
    resumed = _model(seed=5)
    opt_r, sched_r = _adamw(resumed)
    resumed.load_state_dict(saved[0])
    opt_r.load_state_dict(saved[1])
    sched_r.load_state_dict(saved[2])
    OptimizerStateOffload(opt_r, 1)
    _steps(resumed, opt_r, sched_r, batches[2:])
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"optimizer_offload": True, "cpu_offload": True},
     "strategy.optimizer_offload=true with strategy.cpu_offload=true: cpu_offload keeps the optimizer state on the "
     "CPU already; set one of them"),
    ({"optimizer_offload": True, "offload_bucket_mb": 0}, "strategy.offload_bucket_mb must be an integer >= 1, got 0"),
])
def test_offload_options_that_cannot_work_are_one_line(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ParallelStrategy(**kwargs)
    assert str(info.value) == message


def test_with_checkpointing_only_the_block_inputs_go_to_the_host_and_the_gradients_stay():
    """``model.lm.gradient_checkpointing`` with activation offload (refused before): the offload sits outside the
    checkpointed blocks, so it moves what checkpointing keeps, one (1, N, h) input per block (plus the final norm's
    saved tensors), not a block's inner tensors (recomputed); every gradient equals checkpointing without offload."""
    from conftest import TINY_MODEL

    from rl_lightning.models.loading import load_causal_lm
    from rl_lightning.parallel.parallelize import attach_activation_offload, decoder_layers

    ids = torch.randint(0, 200, (1, 37), generator=torch.Generator().manual_seed(0))
    grads, moved = [], []
    for offload in (False, True):
        model = load_causal_lm(str(TINY_MODEL), gradient_checkpointing=True).train()
        if offload:
            copies = _LoggingCopies()
            strategy = ParallelStrategy(activation_offload=True)
            strategy.activation_offloader = copies.offload = ActivationOffload(min_bytes=0, copies=copies)
            copies.to_host = lambda tensor, to_host=copies.to_host: moved.append(tuple(tensor.shape)) or to_host(tensor)
            attach_activation_offload(model, strategy)
        model(input_ids=ids).logits.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    layers, hidden = len(decoder_layers(model)), model.config.hidden_size
    blocks = [shape for shape in moved if shape == (1, 37, hidden)]
    # each block's input, and the final norm's input: no (1, N, intermediate) or attention tensor of a block
    assert len(blocks) == layers + 1 and all(shape[-1] in (37, hidden, 1) or len(shape) == 1 for shape in moved)
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])


def _held_after_steps(offload: bool, shard: bool) -> tuple[int, list[str], list[bool]]:
    """CUDA bytes a 4096 x 4096 linear's 2 AdamW steps leave allocated (FSDP2-sharded over one process with
    `shard`), the optimizer state offloaded or not; the devices of the state's local tensors and whether pinned."""
    gc.collect()  # the last call's model and optimizer (FSDP2's hooks make reference cycles)
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096, device="cuda")
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
    optimizer, scheduler = _adamw(model)
    if offload:
        OptimizerStateOffload(optimizer, 16 << 20)
    _steps(model, optimizer, scheduler, [torch.randn(8, 4096, device="cuda")] * 2)
    state = [getattr(v, "_local_tensor", v) for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    devices, pinned = [v.device.type for v in state], [v.device.type == "cpu" and v.is_pinned() for v in state]
    held = torch.cuda.memory_allocated() - before
    return held, devices, pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shard", [False, True], ids=["plain", "fsdp2"])
def test_offloaded_state_leaves_the_device_between_steps(shard, tmp_path):
    """The moments live in pinned host memory between steps: the device holds exactly their bytes less.

    Relative to the same steps without offload, after a first run that makes what CUDA keeps for good (the cuBLAS
    workspace lives in the allocator). FSDP2 keeps its state as DTensors, whose host shards must stay on the host.
    """
    if shard:
        torch.distributed.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        _held_after_steps(False, shard)
        held_plain, devices_plain, _ = _held_after_steps(False, shard)
        held_offload, _, pinned = _held_after_steps(True, shard)
    finally:
        if shard:
            torch.distributed.destroy_process_group()
    assert devices_plain == ["cuda"] * 4 and pinned == [True] * 4
    moments = 2 * (4096 * 4096 + 4096) * 4  # exp_avg and exp_avg_sq of the weight and the bias, fp32
    assert held_plain - held_offload == moments


class _LoggingCopies:
    """A CPU stand-in for `SideStreamCopies` that really copies (clones) and logs each move with its block."""

    def __init__(self):
        self.offload, self.blocks, self.order, self.log = None, {}, {}, []

    def _block(self, host):
        return self.blocks[id(host)]

    def to_host(self, tensor):
        host = tensor.detach().clone()
        self.blocks[id(host)] = self.order.setdefault(id(self.offload.group), len(self.order))  # forward order
        self.log.append(("out", self.blocks[id(host)]))
        return host

    def prefetch(self, host, device):
        self.log.append(("prefetch", self._block(host)))
        return host.clone(), self._block(host)

    def ready(self, tensor, event):
        self.log.append(("ready", event))
        return tensor

    def to_device(self, host, device):
        self.log.append(("now", self._block(host)))
        return host.clone()


def test_the_backward_prefetches_the_block_before_and_the_gradients_do_not_change():
    """Four blocks: the last block's activations are fetched when its backward starts, and each earlier block's
    were prefetched when the block after it started its backward, before any of them was read."""
    def blocks(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4)))

    plain, offloaded = blocks(0), blocks(0)
    copies = _LoggingCopies()
    offload = ActivationOffload(min_bytes=0, copies=copies)
    copies.offload = offload
    for block in offloaded:
        offload.attach(block)
    x = torch.randn(8, 16, requires_grad=True)
    for model in (plain, offloaded):
        model.zero_grad()
        model(x).square().sum().backward()
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    backward = [entry for entry in copies.log if entry[0] != "out"]
    assert [e for e in copies.log if e[0] == "out"] == [("out", b) for b in range(4) for _ in range(2)]
    assert backward[:2] == [("prefetch", 2), ("prefetch", 2)]  # block 3's backward starts: block 2 is fetched
    assert set(e for e in backward if e[0] == "now") == {("now", 3)}  # only the last block is fetched on demand
    for block in range(3):  # every earlier block was prefetched before any of its activations was read
        first_read = backward.index(("ready", block))
        assert backward.index(("prefetch", block)) < first_read
        assert backward.count(("ready", block)) == 2


def test_a_resume_puts_the_optimizer_state_back_on_the_host_at_once():
    """Optimizer.load_state_dict puts the moments on the parameters' device; the offload's post-hook moves every
    byte of them out again right away (on the CPU the host is the device: the bytes are counted, nothing moves)."""
    model = _model()
    optimizer, scheduler = _adamw(model)
    _steps(model, optimizer, scheduler, _batches(1))
    saved = copy.deepcopy(optimizer.state_dict())
    resumed = _model()
    opt_r, _ = _adamw(resumed)
    offload = OptimizerStateOffload(opt_r, 1)
    opt_r.load_state_dict(saved)
    moments = 2 * 4 * sum(p.numel() for p in resumed.parameters())
    assert offload.stats.resumed_bytes == moments
    state = [v for s in opt_r.state.values() for k, v in s.items() if k != "step"]
    assert all(v.device.type == "cpu" for v in state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_resumed_state_is_in_pinned_host_memory_before_the_first_step():
    model = torch.nn.Linear(256, 256, device="cuda")
    optimizer, scheduler = _adamw(model)
    _steps(model, optimizer, scheduler, [torch.randn(8, 256, device="cuda")])
    saved = copy.deepcopy(optimizer.state_dict())
    opt_r, _ = _adamw(torch.nn.Linear(256, 256, device="cuda"))
    OptimizerStateOffload(opt_r, 1 << 20)
    opt_r.load_state_dict(saved)
    state = [v for s in opt_r.state.values() for k, v in s.items() if k != "step"]
    assert [(v.device.type, v.is_pinned()) for v in state] == [("cpu", True)] * 4


def test_host_copies_are_freed_by_the_backward_without_the_garbage_collector():
    """Each activation's host copy is freed when the backward is done with it, by reference counting: on CUDA the
    pinned host allocator reuses a freed block in the next step, while a block kept alive until a garbage
    collection means a new ``cudaHostAlloc`` (~7 ms each) for every activation of every step (the H200 quick run
    of 2026-11-28: 61 a step, 14.6 s steps). A reference cycle between a block's group and its entries did that."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)))
    copies = _LoggingCopies()
    offload = ActivationOffload(min_bytes=0, copies=copies)
    copies.offload = offload
    hosts = []
    to_host = copies.to_host
    copies.to_host = lambda tensor: hosts.append(weakref.ref(host := to_host(tensor))) or host
    for block in model:
        offload.attach(block)
    gc.disable()
    try:
        model(torch.randn(8, 16, requires_grad=True)).square().sum().backward()
        alive = sum(ref() is not None for ref in hosts)
    finally:
        gc.enable()
    assert len(hosts) == 6 and alive == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_step_writes_the_moments_back_into_the_same_pinned_host_memory():
    """After the first step the moments go back into the pinned host tensors they came from: no new pinned
    allocation (``cudaHostAlloc``, ~4 ms each on an H200, 6 a step before) and the numbers of plain AdamW."""
    torch.manual_seed(0)
    plain, offloaded = torch.nn.Linear(512, 512, device="cuda"), torch.nn.Linear(512, 512, device="cuda")
    offloaded.load_state_dict(plain.state_dict())
    (opt_p, sched_p), (opt_o, sched_o) = _adamw(plain), _adamw(offloaded)
    OptimizerStateOffload(opt_o, 1 << 20)  # the weight's moments (2 MiB) in a bucket of their own
    batches = [torch.randn(8, 512, device="cuda") for _ in range(3)]
    hosts = []  # the state's host tensors after each step (kept alive, so that their ids cannot be reused)
    for batch in batches:
        _steps(plain, opt_p, sched_p, [batch])
        _steps(offloaded, opt_o, sched_o, [batch])
        hosts.append([v for s in opt_o.state.values() for k, v in s.items() if k != "step"])
    assert all(v.is_pinned() for v in hosts[0]) and len(hosts[0]) == 4
    assert [id(v) for v in hosts[0]] == [id(v) for v in hosts[1]] == [id(v) for v in hosts[2]]
    for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(a, b)
