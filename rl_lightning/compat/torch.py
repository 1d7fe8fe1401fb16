"""torch's private names, behind named functions (tested on torch 2.9-2.13).

torch exposes a gloo group's device and timeout only through ``ProcessGroupGloo._Options`` (private, stable since
torch 1.x); a tensor's in-place modification counter only as ``tensor._version``; a module's hooks, a compiled
module's original, a device mesh's flattening, the fused ``_foreach`` ops and ATen's varlen flash-attention kernels
only under private names too.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

TESTED = "torch 2.9-2.13"


def gloo_options(hostname: str, timeout: timedelta) -> Any:
    """Options for a ``ProcessGroupGloo`` whose sockets bind `hostname` only (``ProcessGroupGloo._Options``)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = timeout
    return options


def nccl_options(timeout: timedelta) -> Any:
    """Options for a ``ProcessGroupNCCL`` with `timeout` (``ProcessGroupNCCL.Options._timeout``)."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return options


def tensor_version(tensor: Any) -> int:
    """`tensor`'s in-place modification counter (``tensor._version``; it moves on every in-place write)."""
    return int(tensor._version)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """The 1-D mesh of all of `mesh`'s dims, named `name` (``DeviceMesh._flatten``)."""
    return mesh._flatten(name)


def has_own_hooks(module: Any) -> bool:
    """Whether `module` has forward or backward hooks of its own (``_forward_hooks`` and the three others)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def global_module_hooks() -> bool:
    """Whether module hooks are registered for every module (``register_module_forward_hook`` and the like)."""
    from torch.nn.modules import module as module_impl

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return any(getattr(module_impl, name, None) for name in names)


def compiled_original(module: Any) -> Any:
    """The module ``torch.compile`` wrapped (``_orig_mod``), or `module` itself when it is not a compiled wrapper."""
    return getattr(module, "_orig_mod", module)


def foreach_mul_(tensors: list[Any], factor: Any) -> None:
    """Multiply every tensor of `tensors` by `factor` in place, in one fused launch (``torch._foreach_mul_``)."""
    import torch

    torch._foreach_mul_(tensors, factor)


def flash_attention_forward(*args: Any, **kwargs: Any) -> Any:
    """ATen's variable-length flash-attention forward (``torch.ops.aten._flash_attention_forward``)."""
    import torch

    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def flash_attention_backward(*args: Any, **kwargs: Any) -> Any:
    """ATen's variable-length flash-attention backward (``torch.ops.aten._flash_attention_backward``)."""
    import torch

    return torch.ops.aten._flash_attention_backward(*args, **kwargs)


def view_base(tensor: Any) -> Any:
    """The tensor `tensor` is a view of (``tensor._base``), or `tensor` itself when it is not a view."""
    return tensor._base if tensor._base is not None else tensor


def dtensor_spec(dtensor: Any) -> Any:
    """A DTensor's sharding spec (mesh, placements, global shape; ``DTensor._spec``), to build one like it."""
    return dtensor._spec


def keep_lr_scheduler_mark(new_step: Any, old_step: Any) -> None:
    """Carry an LR scheduler's mark from an optimizer's `old_step` to the `new_step` replacing it.

    A scheduler built before the replacement checks for it (``_wrapped_by_lr_sched``), else it warns on every run.
    """
    new_step._wrapped_by_lr_sched = getattr(old_step, "_wrapped_by_lr_sched", False)
