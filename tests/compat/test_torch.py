"""Pins `rl_lightning.compat.torch`: the private gloo options still take a device and a timeout.

A failure names the private name, the versions tested and the module to update (`_pinned`).
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from rl_lightning.compat import torch as compat


def _pinned(condition: object, name: str, change: str = "is gone") -> None:
    assert condition, (f"{compat.TESTED} (installed {torch.__version__}): {name} {change}; "
                       "update rl_lightning/compat/torch.py")


def test_loopback_gloo_options():
    _pinned(hasattr(dist.ProcessGroupGloo, "_Options"), "ProcessGroupGloo._Options")
    options = compat.gloo_options("127.0.0.1", timedelta(seconds=7))
    _pinned(len(options._devices) == 1, "ProcessGroupGloo._Options._devices")
    _pinned(options._timeout == timedelta(seconds=7), "ProcessGroupGloo._Options._timeout")


def test_a_tensors_version_counts_in_place_writes():
    tensor = torch.zeros(3)
    _pinned(isinstance(getattr(tensor, "_version", None), int), "Tensor._version")
    before = compat.tensor_version(tensor)
    tensor[0] = 1.0
    assert compat.tensor_version(tensor) == before + 1


def test_a_modules_hooks_and_the_global_ones():
    module = torch.nn.Linear(2, 2)
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        _pinned(hasattr(module, name), f"Module.{name}")
    assert not compat.has_own_hooks(module)
    handle = module.register_forward_pre_hook(lambda *args: None)
    assert compat.has_own_hooks(module)
    handle.remove()
    from torch.nn.modules import module as module_impl

    _pinned(hasattr(module_impl, "_global_forward_hooks"), "torch.nn.modules.module._global_forward_hooks")
    assert not compat.global_module_hooks()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert compat.global_module_hooks()
    finally:
        handle.remove()


def test_a_compiled_modules_original_and_the_fused_multiply():
    module = torch.nn.Linear(2, 2)
    compiled = torch.compile(module)  # wraps only; nothing compiles until it is called
    _pinned(getattr(compiled, "_orig_mod", None) is module, "OptimizedModule._orig_mod")
    assert compat.compiled_original(compiled) is module and compat.compiled_original(module) is module
    tensors = [torch.ones(2), torch.full((3,), 2.0)]
    _pinned(callable(getattr(torch, "_foreach_mul_", None)), "torch._foreach_mul_")
    compat.foreach_mul_(tensors, 0.5)
    assert [t.tolist() for t in tensors] == [[0.5, 0.5], [1.0, 1.0, 1.0]]


def test_a_meshs_flattening_and_the_flash_kernels_schemas():
    from torch.distributed.device_mesh import DeviceMesh

    _pinned(callable(getattr(DeviceMesh, "_flatten", None)), "DeviceMesh._flatten")
    for name, arguments in (("_flash_attention_forward", ["query", "cum_seq_q", "max_q", "dropout_p", "is_causal"]),
                            ("_flash_attention_backward", ["grad_out", "logsumexp", "rng_state", "unused"])):
        op = getattr(torch.ops.aten, name, None)
        _pinned(op is not None, f"torch.ops.aten.{name}")
        found = [argument.name for argument in op.default._schema.arguments]
        _pinned(set(arguments) <= set(found), f"torch.ops.aten.{name}", f"takes {found}")


def test_a_views_base_a_dtensors_spec_and_the_lr_scheduler_mark():
    weight = torch.zeros(2, 3)
    _pinned(compat.view_base(weight.T) is weight, "Tensor._base")
    assert compat.view_base(weight) is weight
    from torch.distributed.tensor import DTensor

    _pinned("_spec" in DTensor.__slots__ or "_spec" in getattr(DTensor, "__annotations__", {}), "DTensor._spec")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, 1)
    _pinned(getattr(optimizer.step, "_wrapped_by_lr_sched", False), "Optimizer.step._wrapped_by_lr_sched")

    def step(closure=None):
        return None

    compat.keep_lr_scheduler_mark(step, optimizer.step)
    assert step._wrapped_by_lr_sched is True
