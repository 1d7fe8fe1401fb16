"""Host offload of what a training step keeps on the device: saved activations and optimizer state.

- **Activations** (`ActivationOffload`): tensors a decoder block saves for its backward pass are copied to host memory
  (pinned on CUDA, asynchronously) as the forward pass saves them, and copied back when the backward pass needs them.
  Parameters, and tensors smaller than ``min_bytes``, stay where they are: FSDP2 re-gathers parameters for the
  backward anyway, and a copy of a small tensor costs more than it saves.
- **Optimizer state** (`OptimizerStateOffload`): the optimizer's per-parameter state (AdamW's two moments) lives in
  host memory between steps. The step streams it through the device in buckets of ``bucket_bytes``: one bucket's
  state is copied in, that bucket's parameters are stepped by the optimizer's own ``step`` (same kernels, same
  numbers), and the state is copied back. Parameters and gradients stay on the device throughout. AdamW's update of
  one parameter reads only that parameter's state, so stepping bucket by bucket is the same step.

Both are `ParallelStrategy` options (``activation_offload``, ``optimizer_offload``). On a CPU device the host is the
device: nothing moves and the numbers are unchanged, which is what the CPU tests check; the memory saved is measured
on a GPU (tests marked ``gpu``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.compat.torch import dtensor_spec, keep_lr_scheduler_mark, view_base

BUCKET_BYTES = 256 << 20
MIN_OFFLOAD_BYTES = 1 << 16


@dataclass
class OffloadStats:
    """What the last step moved: tensors and bytes offloaded, and the largest bucket of optimizer state."""

    tensors: int = 0
    bytes: int = 0
    kept_on_device: int = 0
    buckets: int = 0
    largest_bucket_bytes: int = 0
    resumed_bytes: int = 0


def _pinned(reference: torch.Tensor) -> bool:
    return reference.device.type == "cuda"


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`: pinned and asynchronous from CUDA; the tensor itself when it is on the CPU already."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=_pinned(tensor))
    host.copy_(tensor, non_blocking=_pinned(tensor))
    return host


class SideStreamCopies:
    """Copies between a CUDA device and pinned host memory on two side streams per device, ordered by events.

    Copies out (device to host) and in (host to device) run on streams of their own, so the GPU's two copy engines
    work at once (51 GiB/s one way, 91 GiB/s both ways on an H200, where one stream for both got 51). The copy out of
    an activation waits for the compute stream's work so far and runs beside the next kernels; the device tensor is
    kept from reuse until it is done (``record_stream``). A prefetch copies host to device after the copies out
    queued so far (its host tensor may be one of them), and returns an event the compute stream waits for.
    """

    def __init__(self) -> None:
        self.streams: dict[tuple[torch.device, str], Any] = {}

    def _side(self, device: torch.device, direction: str) -> Any:
        if (device, direction) not in self.streams:
            self.streams[device, direction] = torch.cuda.Stream(device)
        return self.streams[device, direction]

    def to_host(self, tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Start `tensor`'s copy to pinned host memory, complete once the stream out gets there.

        `into`, when given, is the pinned host tensor (of `tensor`'s size and dtype) to copy into.
        """
        side = self._side(tensor.device, "out")
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        if into is None:
            into = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        with torch.cuda.stream(side):
            into.copy_(tensor, non_blocking=True)
        tensor.record_stream(side)
        return into

    def prefetch(self, host: torch.Tensor, device: torch.device, after_out: bool = True) -> tuple[torch.Tensor, Any]:
        """Start `host`'s copy to `device` on the stream in: the tensor and the event that marks it done.

        With `after_out`, the copy waits for the copies out queued so far (needed when `host` may be one of them).
        """
        side = self._side(device, "in")
        if after_out:
            side.wait_stream(self._side(device, "out"))
        with torch.cuda.stream(side):
            tensor = torch.empty(host.size(), dtype=host.dtype, device=device)
            tensor.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return tensor, event

    def ready(self, tensor: torch.Tensor, event: Any) -> torch.Tensor:
        """`tensor` for the compute stream: wait for its copy, and keep it from reuse until the compute is done."""
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(event)
        tensor.record_stream(current)
        return tensor

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`host` on `device` now (not prefetched): on the compute stream, after both side streams' copies."""
        current = torch.cuda.current_stream(device)
        current.wait_stream(self._side(device, "out"))
        current.wait_stream(self._side(device, "in"))
        return host.to(device, non_blocking=True)


class _Group:
    """What one forward of an attached module (a decoder block) saved, and the block that ran before it.

    Entries are weak references: autograd owns each `_Saved` (and through it, its group), so a host copy is freed
    by reference counting as soon as the backward is done with it and the pinned block is reused in the next step
    (with strong references both ways the copies lived until a garbage collection: a new ``cudaHostAlloc`` for
    every activation of every step, 61 a step and 14.6 s steps on an H200).
    """

    __slots__ = ("__weakref__", "entries", "previous", "prefetched")

    def __init__(self, previous: _Group | None) -> None:
        self.entries: list[weakref.ref[_Saved]] = []
        self.previous = None if previous is None else weakref.ref(previous)
        self.prefetched = False


class _Saved:
    """One offloaded activation: its device, its host copy, a prefetched device copy (and its event) if any."""

    __slots__ = ("__weakref__", "device", "event", "group", "host", "tensor")

    def __init__(self, device: torch.device, host: torch.Tensor, group: _Group | None) -> None:
        self.device, self.host, self.group = device, host, group
        self.tensor: torch.Tensor | None = None
        self.event: Any = None


class ActivationOffload:
    """Saved-tensor hooks that keep a module's saved activations in host memory; ``stats`` counts what moved.

    On CUDA the copies run on a side stream (`SideStreamCopies`): out beside the forward's next kernels, and in
    the backward, when a block's first activation is needed, the block before it is prefetched, so its copies run
    beside this block's backward. On the CPU the host is the device: the tensors stay, the numbers are unchanged.

    Args:
        min_bytes: tensors smaller than this stay on the device.
        copies: how tensors move (default: `SideStreamCopies`; tests pass a CPU stand-in).
    """

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES, copies: Any = None) -> None:
        self.min_bytes = min_bytes
        self.copies = copies
        self.stats = OffloadStats()
        self.group: _Group | None = None  # the attached module whose forward runs now
        self.last: _Group | None = None  # the last group a forward started (the next one's `previous`)

    def _mover(self, tensor: torch.Tensor) -> Any:
        if self.copies is None and tensor.device.type == "cuda":
            self.copies = SideStreamCopies()
        return self.copies

    def pack(self, tensor: torch.Tensor) -> Any:
        """Forward: a host copy of an activation, or the tensor itself (parameters, small tensors)."""
        size = tensor.numel() * tensor.element_size()
        base = view_base(tensor)  # a linear saves its weight as a transposed view
        if isinstance(base, torch.nn.Parameter) or size < self.min_bytes or tensor.is_sparse:
            self.stats.kept_on_device += 1
            return tensor
        self.stats.tensors += 1
        self.stats.bytes += size
        mover = self._mover(tensor)
        if mover is None:  # the CPU: the host is the device
            return _Saved(tensor.device, tensor, None)
        saved = _Saved(tensor.device, mover.to_host(tensor), self.group)
        if self.group is not None:
            self.group.entries.append(weakref.ref(saved))
        return saved

    def unpack(self, packed: Any) -> torch.Tensor:
        """Backward: the activation back on its device (prefetched, or copied now); prefetch the block before."""
        if isinstance(packed, torch.Tensor):
            return packed
        if self.copies is None:
            return packed.host
        group = packed.group
        if group is not None and not group.prefetched:  # this block's backward starts: fetch the one before it
            group.prefetched = True
            before = group.previous() if group.previous is not None else None
            if before is not None and not before.prefetched:
                for ref in before.entries:
                    entry = ref()
                    if entry is not None:  # None: autograd freed it (a tensor saved by a graph already run)
                        entry.tensor, entry.event = self.copies.prefetch(entry.host, entry.device)
        if packed.tensor is not None:
            tensor, packed.tensor = self.copies.ready(packed.tensor, packed.event), None
            return tensor
        return self.copies.to_device(packed.host, packed.device)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Within this context, tensors saved for the backward pass go through `pack` and `unpack`."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def attach(self, module: torch.nn.Module) -> None:
        """Offload what `module`'s forward saves: the hooks are entered before and left after each forward."""
        contexts: list[Any] = []

        def enter(*_: Any) -> None:
            if torch.is_grad_enabled():  # one group per forward that saves anything (not scoring forwards)
                self.group = self.last = _Group(self.last)
            context = self.saving()
            context.__enter__()
            contexts.append(context)

        def leave(*_: Any) -> None:
            contexts.pop().__exit__(None, None, None)
            self.group = None

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _rewrap(like: Any, local: torch.Tensor) -> Any:
    """`local` as `like` is: a DTensor with `like`'s mesh, placements and global shape, or the plain tensor.

    Built from `like`'s spec, as FSDP2's own CPU offload builds its host shards: ``DTensor.from_local`` would move a
    host `local` straight back to a CUDA mesh's device, so the state would never leave the GPU (seen on an H200).
    """
    if not hasattr(like, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor(local, dtensor_spec(like), requires_grad=False)


class OptimizerStateOffload:
    """Keep `optimizer`'s state on the host between steps and stream it through the device bucket by bucket.

    Installed on the optimizer instance (its ``step`` is replaced; the ``state_dict`` is the optimizer's own, so
    checkpoints and resumption are unchanged).

    Args:
        optimizer: a torch optimizer whose update of a parameter reads only that parameter's state (AdamW, Adam, SGD).
        bucket_bytes: the most optimizer state on the device at once (one parameter's state always fits).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, bucket_bytes: int = BUCKET_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.optimizer, self.bucket_bytes = optimizer, bucket_bytes
        self.stats = OffloadStats()
        self._step = optimizer.step

        def step(closure: Callable[[], Any] | None = None) -> Any:
            return self.step(closure)

        keep_lr_scheduler_mark(step, self._step)  # an LR scheduler built before this wrapped the step
        optimizer.step = step  # type: ignore[method-assign]
        optimizer.rl_lightning_state_offload = self  # type: ignore[attr-defined]
        self.copies: SideStreamCopies | None = None
        # each state tensor's pinned host copy, written again in place after every step: no new pinned allocation
        # (``cudaHostAlloc``, milliseconds each) in a steady-state step, and host memory that does not grow
        self.homes: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        # Optimizer.load_state_dict puts the moments on the parameters' device: back to the host at once (a resume)
        optimizer.register_load_state_dict_post_hook(self._resumed)

    def _resumed(self, optimizer: torch.optim.Optimizer) -> None:
        self.homes.clear()  # the loaded state replaces the old host copies
        self.to_host_now()

    def to_host_now(self) -> int:
        """Move every parameter's optimizer state to the host now (after a resume); the bytes moved."""
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p in self.optimizer.state]
        moved = self._move_state(params, to_device=False)
        self.stats.resumed_bytes = moved
        self._synchronize()
        return moved

    def _synchronize(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies are complete before anything reads or frees them

    def _state_bytes(self, param: torch.Tensor) -> int:
        state = self.optimizer.state.get(param, {})
        own = sum(_local(v).numel() * _local(v).element_size() for k, v in state.items()
                  if isinstance(v, torch.Tensor) and k != "step")
        return own or 2 * _local(param).numel() * _local(param).element_size()  # first step: AdamW's two moments

    def buckets(self) -> list[list[tuple[int, torch.Tensor]]]:
        """(group index, parameter) pairs with a gradient, in order, cut where the state would exceed a bucket."""
        buckets: list[list[tuple[int, torch.Tensor]]] = [[]]
        size = 0
        for index, group in enumerate(self.optimizer.param_groups):
            for param in group["params"]:
                if param.grad is None:
                    continue
                need = self._state_bytes(param)
                if buckets[-1] and size + need > self.bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append((index, param))
                size += need
        return [b for b in buckets if b]

    def _move_state(self, params: list[torch.Tensor], to_device: bool) -> int:
        moved = 0
        for param in params:
            state = self.optimizer.state.get(param, {})
            device = _local(param).device
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor) or key == "step":
                    continue
                local = _local(value)
                moved += local.numel() * local.element_size()
                if to_device:
                    state[key] = _rewrap(value, local.to(device, non_blocking=local.is_pinned()))
                elif local.device.type == "cuda":  # on the side stream, after the step's kernels
                    self.copies = self.copies or SideStreamCopies()
                    home = self.homes.get(param, {}).get(key)
                    if home is not None and (home.shape, home.dtype) != (local.shape, local.dtype):
                        home = None
                    state[key] = _rewrap(value, self.copies.to_host(local, into=home))
                else:
                    state[key] = _rewrap(value, to_host(local))
        return moved

    def _prefetch(self, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        """CUDA: start copying `params`' state to their device on the side stream; what to wait for before use."""
        pending = []
        for param in params:
            state, device = self.optimizer.state.get(param, {}), _local(param).device
            if device.type != "cuda":
                continue
            self.copies = self.copies or SideStreamCopies()
            for key, value in list(state.items()):
                local = _local(value) if isinstance(value, torch.Tensor) else None
                if local is None or key == "step" or local.device == device:
                    continue
                self.homes.setdefault(param, {})[key] = local
                # the host copies were completed by the last step's synchronize: no wait for the stream out
                tensor, event = self.copies.prefetch(local, device, after_out=False)
                state[key] = _rewrap(value, tensor)
                pending.append((tensor, event))
        return pending

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure` (forward and backward, state on the host), then the optimizer's step bucket by bucket.

        On CUDA bucket k+1's state is copied in on a side stream while bucket k steps, and bucket k's goes back out
        on it while bucket k+1 steps (two buckets on the device at most).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [group["params"] for group in self.optimizer.param_groups]
        self.stats = OffloadStats()
        buckets = self.buckets()
        pending = self._prefetch([p for _, p in buckets[0]]) if buckets else []
        try:
            for k, bucket in enumerate(buckets):
                params = [p for _, p in bucket]
                for tensor, event in pending:  # bucket k's state is on the device before its step reads it
                    assert self.copies is not None  # set by `_prefetch` whenever it returns copies
                    self.copies.ready(tensor, event)
                self._move_state(params, to_device=True)  # what was not prefetched (the CPU: nothing moves)
                pending = self._prefetch([p for _, p in buckets[k + 1]]) if k + 1 < len(buckets) else []
                for index, group in enumerate(self.optimizer.param_groups):
                    group["params"] = [p for i, p in bucket if i == index]
                self._step()
                moved = self._move_state(params, to_device=False)
                self.stats.buckets += 1
                self.stats.bytes += moved
                self.stats.largest_bucket_bytes = max(self.stats.largest_bucket_bytes, moved)
        finally:
            for group, params in zip(self.optimizer.param_groups, groups, strict=True):
                group["params"] = params
        self._synchronize()
        return loss
