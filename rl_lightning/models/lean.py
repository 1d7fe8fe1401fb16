"""Lean activations: the SwiGLU MLP and RMSNorm of Llama/Qwen2/Mistral-style decoders, saving less for the backward.

A training forward of a stock decoder layer keeps, per token, the MLP's input x, the gate projection, silu(gate), the
up projection and silu(gate) * up (h + 4 i values), and each RMSNorm's input and normalised tensor (2 h + 1). Here:

- `swiglu_down` computes ``down_proj(silu(gate) * up)`` saving gate and up only: silu(gate) * up is recomputed in the
  backward (elementwise, cheap), so the MLP keeps h + 2 i values per token;
- `rms_norm` computes transformers' ``LlamaRMSNorm`` saving its input and the per-row rstd only (h + 1), the
  normalised tensor recomputed in the backward.

Both are `torch.autograd.Function`s whose forward runs the stock module's own ops (outputs are bitwise equal) and
whose backward runs the ops autograd runs for the stock graph, in the same order (``aten.silu_backward``, the ``mm``
calls of the linear's backward, ``sum_to_size`` for broadcast reductions): gradients are bitwise equal, whole
models included (`rms_norm` hands the input's two gradient terms to autograd separately, so the residual stream sums
its three terms in the stock order). Under autocast the forward's ops are autocast as in the stock forward. Tested on
CPU in fp32, bf16 autocast and bf16 weights; the norm has no double backward.

`apply_lean_activations` installs them per module instance (its class swapped for a subclass with the lean forward,
as FSDP2 swaps a sharded module's class); `remove_lean_activations` restores the original classes. A patched forward falls back to the original whenever the lean one
cannot stand in for it: no autograd, tensor subclasses (DTensor under tensor parallelism), PEFT LoRA layers or
subclasses in place of the plain ``nn.Linear`` projections, or hooks on the projections. FSDP2 gathers a decoder
layer's parameters before its forward, so inside it they are plain tensors and the lean path runs.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from rl_lightning.compat.torch import global_module_hooks, has_own_hooks

_PLAIN = (torch.Tensor, nn.Parameter)


class _SwiGLUDown(torch.autograd.Function):
    """``F.linear(F.silu(gate) * up, weight, bias)`` saving gate, up and the weight."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        device_type = gate.device.type
        ctx.autocast = None  # the forward's autocast dtype, for the recompute
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            ctx.autocast = torch.get_autocast_dtype(device_type)
        hidden = F.silu(gate) * up  # (..., i), autocast as in the stock forward
        out = F.linear(hidden, weight, bias)  # (..., h) in the linear's compute dtype
        ctx.hidden_dtype, ctx.compute_dtype = hidden.dtype, out.dtype
        ctx.bias_meta = None if bias is None else (bias.shape, bias.dtype)
        ctx.save_for_backward(gate, up, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight, need_bias = ctx.needs_input_grad
        autocast = nullcontext() if ctx.autocast is None else torch.autocast(gate.device.type, ctx.autocast)
        with autocast:
            act = F.silu(gate)  # the forward's silu(gate), recomputed
            hidden = act * up if need_weight else None
        # linear = mm on the (N, i) fold of its input (aten::matmul); autograd's mm backward for a transposed weight:
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # (N, h)
        grad_gate = grad_up = grad_weight = grad_bias = None
        if need_weight:
            hidden_2d = hidden.to(ctx.compute_dtype).reshape(-1, hidden.shape[-1])  # (N, i)
            grad_weight = grad_2d.t().mm(hidden_2d).to(weight.dtype)  # (h, i)
        if need_bias:
            shape, dtype = ctx.bias_meta
            grad_bias = grad_2d.sum_to_size(shape).to(dtype)  # (h,)
        if need_gate or need_up:
            grad_hidden = grad_2d.mm(weight.to(ctx.compute_dtype)).view(up.shape).to(ctx.hidden_dtype)  # (..., i)
            if need_up:
                grad_up = (grad_hidden * act).to(up.dtype)
            if need_gate:
                grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate).to(gate.dtype)
        return grad_gate, grad_up, grad_weight, grad_bias


def swiglu_down(x_gate: torch.Tensor, x_up: torch.Tensor, down_weight: torch.Tensor,
                down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(F.silu(x_gate) * x_up, down_weight, down_bias)``, saving x_gate and x_up for the backward.

    Args:
        x_gate: the gate projection, (..., i).
        x_up: the up projection, (..., i).
        down_weight: the down projection's weight, (h, i).
        down_bias: its bias, (h,), or None.

    Returns:
        The MLP's output, (..., h): bitwise the stock ops' output (autocast included).
    """
    return _SwiGLUDown.apply(x_gate, x_up, down_weight, down_bias)


class _RMSNorm(torch.autograd.Function):
    """transformers' ``LlamaRMSNorm`` saving its input and the (..., 1) fp32 rstd.

    The input comes in twice: for an fp32 input autograd's own graph sends it two gradient terms (through ``hs * rstd``
    and through ``hs.pow(2)``), which the input's gradient buffer adds, after the residual stream's term, in that
    order; returning them as two gradients keeps that order, hence the stock bits.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_again: torch.Tensor, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
        hs = x.to(torch.float32)  # (..., h)
        variance = hs.pow(2).mean(-1, keepdim=True)  # (..., 1)
        rstd = torch.rsqrt(variance + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (hs * rstd).to(x.dtype)

    @staticmethod
    @once_differentiable  # the saved rstd has no graph: no double backward (autograd's RMSNorm would allow one)
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        hs = x.to(torch.float32)  # (..., h)
        grad_x = grad_x_again = grad_weight = None
        if ctx.needs_input_grad[2]:
            normed = (hs * rstd).to(x.dtype)  # (..., h), recomputed
            grad_weight = (grad_out * normed).sum_to_size(weight.shape).to(weight.dtype)  # (h,)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_normed = (grad_out * weight).to(x.dtype).to(torch.float32)  # (..., h)
            grad_rstd = (grad_normed * hs).sum_to_size(rstd.shape)  # (..., 1)
            grad_variance = -0.5 * grad_rstd * rstd.pow(3)  # rsqrt's backward: -0.5 * grad * result^3
            grad_squares = grad_variance.expand(hs.shape) / hs.shape[-1]  # mean's backward
            through_mul = grad_normed * rstd  # (..., h)
            through_pow = grad_squares * (2.0 * hs.pow(1.0))  # pow's backward: grad * (2 * hs^1)
            if x.dtype == torch.float32:
                grad_x, grad_x_again = through_mul, through_pow
            else:  # autograd sums the two terms at the fp32 copy, then casts to the input's dtype
                grad_x = (through_mul + through_pow).to(x.dtype)
        return grad_x, grad_x_again, grad_weight, None


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The forward of transformers' ``LlamaRMSNorm``, saving its input and the per-row rstd for the backward.

    Args:
        hidden_states: the input, (..., h), any floating dtype (normalised in fp32 as the stock module does).
        weight: the scale, (h,).
        eps: added to the mean square.

    Returns:
        ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, (..., h): bitwise the stock module's output.
    """
    return _RMSNorm.apply(hidden_states, hidden_states, weight, eps)


def _plain(tensor: torch.Tensor | None) -> bool:
    """None or a plain tensor/parameter: no DTensor or other subclass."""
    return tensor is None or type(tensor) in _PLAIN


def _has_hooks(module: nn.Module) -> bool:
    """Whether `module` has forward or backward hooks of its own."""
    return has_own_hooks(module)


def _global_hooks() -> bool:
    """Whether module hooks are registered for every module (``register_module_forward_hook`` and the like)."""
    return global_module_hooks()


def _is_silu(act: Any) -> bool:
    """Whether `act` is an out-of-place SiLU module (``nn.SiLU`` or transformers' ``ACT2FN["silu"]``)."""
    from transformers.activations import SiLUActivation

    return isinstance(act, (nn.SiLU, SiLUActivation)) and not getattr(act, "inplace", False)


def _same_code(function: Any, reference: Any) -> bool:
    """Whether `function` has `reference`'s bytecode (transformers copies Llama's modules into other models)."""
    code, ref = getattr(function, "__code__", None), reference.__code__
    return code is not None and (code.co_code, code.co_names, code.co_consts) == (ref.co_code, ref.co_names,
                                                                                  ref.co_consts)


def _projections(module: nn.Module) -> tuple[Any, Any, Any]:
    return module.gate_proj, module.up_proj, module.down_proj


def _is_swiglu_mlp(module: nn.Module) -> bool:
    """Llama's MLP: plain linear gate/up/down projections, a SiLU, and ``LlamaMLP.forward`` as its forward."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    return _is_silu(getattr(module, "act_fn", None)) and _same_code(type(module).forward, LlamaMLP.forward)


def _is_rms_norm(module: nn.Module) -> bool:
    """An ``*RMSNorm`` with ``weight`` and ``variance_epsilon`` whose forward is ``LlamaRMSNorm.forward``."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and _same_code(type(module).forward, LlamaRMSNorm.forward))


def _mlp_applies(module: nn.Module, x: torch.Tensor) -> bool:
    """The lean MLP stands in for the original now: autograd on, plain tensors, plain linears without hooks."""
    if not torch.is_grad_enabled() or type(x) is not torch.Tensor or x.dim() < 2 or _global_hooks():
        return False
    for proj in _projections(module):
        if type(proj) is not nn.Linear or _has_hooks(proj) or not (_plain(proj.weight) and _plain(proj.bias)):
            return False
    return _is_silu(module.act_fn)


def _lean_mlp(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` through `swiglu_down`: x (..., h) -> (..., h)."""
    gate_proj, up_proj, down_proj = _projections(module)
    return swiglu_down(gate_proj(x), up_proj(x), down_proj.weight, down_proj.bias)


def _norm_applies(module: nn.Module, x: torch.Tensor) -> bool:
    """The lean RMSNorm stands in for the original now: autograd on, plain tensors."""
    return torch.is_grad_enabled() and type(x) is torch.Tensor and _plain(module.weight)


def _lean_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's RMSNorm through `rms_norm`: x (..., h) -> (..., h)."""
    return rms_norm(x, module.weight, module.variance_epsilon)


class LeanModule:
    """Mixin of a patched module's class: the lean forward where it applies, else the class's own forward.

    `apply_lean_activations` gives a module the class ``Lean<its class>`` (the same name, one class per original
    class and kind, made once per process), so every block's norms and MLPs share one forward: torch.compile
    compiles a block once for all layers (an object per instance as ``forward`` made it guard on that object's id
    and recompile per layer, falling back to eager after eight; seen on an H200, 2026-11-28). Under torch.compile
    the stock forward runs: inductor's partitioner already recomputes the pointwise ops rather than saving them,
    and the lean norm's input-twice autograd Function would break the graph.
    """

    lean: Any  # lean(module, x): the lean forward
    applies: Any  # applies(module, x): whether the lean forward may run now
    base: Any  # the class the module had before the patch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The lean forward when ``applies(module, x)`` for a single positional argument x, else the original."""
        if not torch.compiler.is_compiling() and len(args) == 1 and not kwargs and type(self).applies(self, args[0]):
            return type(self).lean(self, args[0])
        return type(self).base.forward(self, *args, **kwargs)


@functools.cache
def _lean_class(base: Any, lean: Any, applies: Any) -> type:
    """The class of a patched `base` module (`LeanModule` first, so its forward is the one called)."""
    return type(base.__name__, (LeanModule, base), {"lean": staticmethod(lean), "applies": staticmethod(applies),
                                                    "base": base, "__qualname__": base.__qualname__,
                                                    "__module__": base.__module__})


def apply_lean_activations(model: nn.Module) -> int:
    """Give every Llama-style SwiGLU MLP and RMSNorm of `model` the lean forward; returns how many were patched.

    Patches each module instance: its class becomes a subclass with the lean forward (`LeanModule`; the original
    class is untouched, other instances and models keep it). Modules already patched, and modules whose ``forward``
    was replaced on the instance, are left alone (a second call returns 0). Matches MLPs with plain ``nn.Linear``
    ``gate_proj``/``up_proj``/``down_proj`` and a SiLU ``act_fn`` (an MLP whose projections are already LoRA layers is
    not patched), and ``*RMSNorm`` modules with ``weight`` and ``variance_epsilon``, in both cases only where the
    class's forward is transformers' Llama one (Qwen2, Qwen3, Mistral... copy it; Gemma's and OLMo-2's norms differ).
    Call it before LoRA and FSDP2 wrapping or after: the forwards check at each call whether they can apply.

    Args:
        model: a transformers model, or a PEFT wrapper around one.

    Returns:
        The number of modules patched by this call.
    """
    patched = 0
    for module in model.modules():
        if isinstance(module, LeanModule) or "forward" in vars(module):  # patched, or its forward replaced by hand
            continue
        if _is_swiglu_mlp(module):
            lean, applies = _lean_mlp, _mlp_applies
        elif _is_rms_norm(module):
            lean, applies = _lean_norm, _norm_applies
        else:
            continue
        module.__class__ = _lean_class(type(module), lean, applies)
        patched += 1
    return patched


def remove_lean_activations(model: nn.Module) -> int:
    """Restore the forwards `apply_lean_activations` replaced in `model`; returns how many were restored.

    Args:
        model: a model `apply_lean_activations` patched (unpatched modules are left alone).

    Returns:
        The number of modules restored.
    """
    restored = 0
    for module in model.modules():
        if isinstance(module, LeanModule):
            module.__class__ = type(module).base
            restored += 1
    return restored
