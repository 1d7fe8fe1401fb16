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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

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


def _pinned(reference: torch.Tensor) -> bool:
    return reference.device.type == "cuda"


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`: pinned and asynchronous from CUDA; the tensor itself when it is on the CPU already."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=_pinned(tensor))
    host.copy_(tensor, non_blocking=_pinned(tensor))
    return host


class ActivationOffload:
    """Saved-tensor hooks that keep a module's saved activations in host memory; ``stats`` counts what moved.

    Args:
        min_bytes: tensors smaller than this stay on the device.
    """

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.min_bytes = min_bytes
        self.stats = OffloadStats()

    def pack(self, tensor: torch.Tensor) -> Any:
        """Forward: a host copy of an activation, or the tensor itself (parameters, small tensors)."""
        size = tensor.numel() * tensor.element_size()
        base = tensor._base if tensor._base is not None else tensor  # a linear saves its weight as a transposed view
        if isinstance(base, torch.nn.Parameter) or size < self.min_bytes or tensor.is_sparse:
            self.stats.kept_on_device += 1
            return tensor
        self.stats.tensors += 1
        self.stats.bytes += size
        return (tensor.device, to_host(tensor))

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        """Backward: the activation back on its device."""
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Within this context, tensors saved for the backward pass go through `pack` and `unpack`."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def attach(self, module: torch.nn.Module) -> None:
        """Offload what `module`'s forward saves: the hooks are entered before and left after each forward."""
        contexts: list[Any] = []

        def enter(*_: Any) -> None:
            context = self.saving()
            context.__enter__()
            contexts.append(context)

        def leave(*_: Any) -> None:
            contexts.pop().__exit__(None, None, None)

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

    return DTensor(local, like._spec, requires_grad=False)


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

        # An LR scheduler built before this wrapped the step and checks for its mark (else it warns on every run).
        step._wrapped_by_lr_sched = getattr(self._step, "_wrapped_by_lr_sched", False)  # type: ignore[attr-defined]
        optimizer.step = step  # type: ignore[method-assign]
        optimizer.rl_lightning_state_offload = self  # type: ignore[attr-defined]

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
                else:
                    state[key] = _rewrap(value, to_host(local))
        return moved

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure` (forward and backward, state on the host), then the optimizer's step bucket by bucket."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [group["params"] for group in self.optimizer.param_groups]
        self.stats = OffloadStats()
        try:
            for bucket in self.buckets():
                params = [p for _, p in bucket]
                self._move_state(params, to_device=True)
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
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies are complete before anything reads or frees them
        return loss
