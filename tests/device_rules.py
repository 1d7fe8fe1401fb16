"""`DeviceRules`: CPU runs that fail where a GPU run would, because a host tensor met a collective or a device tensor.

NCCL rejects CPU tensors ("No backend type associated with device type cpu") and CUDA kernels reject operands on two
devices ("Expected all tensors to be on the same device"); gloo on CPU accepts both, so CPU CI cannot see a tensor
left on the host. `DeviceRules` is a `torch.overrides.TorchFunctionMode` that tracks where each tensor *would* live
on a GPU run:

- **host**: made by a factory function (``torch.tensor``, ``zeros``, ``arange``, ...) without ``device=``, by
  ``torch.from_numpy`` or by ``.cpu()``, when our code (`WATCHED` folders) calls it;
- **device**: made with ``device=`` given, or moved with ``.to(root)`` / ``.to(device=root)`` / ``.to(tensor on
  device)`` / ``.cuda()`` (module moves go through ``.to`` too);
- anything else inherits: an op's outputs are host when all its tensor inputs are host, device when any is device;
  tensors third-party code makes are untracked (never host), so its own choices stay out of scope.

It raises `DeviceRuleError` when a host tensor reaches a collective (``torch.distributed.all_reduce``, ``all_gather``,
``all_gather_into_tensor``, ``broadcast``, ``reduce``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``all_to_all_single``, and Lightning's ``strategy.reduce``) from any frame, and when one of our frames mixes a device
tensor with a host tensor of at least one dimension (CUDA's same-device rule: 0-dim host tensors are allowed as
scalars, except in ``cat``/``stack``; indexing and ``copy_`` move between devices and are not checked). `guard` checks
the arguments of a function of ours the same way (e.g. that counts reach the reductions on the device already).

The root device is a device type: on CPU the root is ``cpu``, so ``.to("cpu")`` counts as a move there; the rule it
checks is "explicitly placed", which is what DESIGN.md section 4 asks of our code.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[1]
WATCHED = tuple(str(REPO / name) + "/" for name in ("rl_lightning", "tests"))
_SKIPPED = (str(Path(torch.__file__).parent) + "/", __file__, functools.__file__)
_STATE = "_device_rule_state"  # attribute on tracked tensors: HOST or DEVICE
HOST, DEVICE = "host", "device"

FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor, torch.zeros, torch.ones, torch.full,
             torch.empty, torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn,
             torch.randint, torch.randperm, torch.empty_strided}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all_single")
_MOVES_BETWEEN_DEVICES = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_}
_NO_SCALAR_EXCEPTION = {torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack}


class DeviceRuleError(RuntimeError):
    """A host tensor reached a collective (or met a device tensor) where a GPU run would have failed."""


def state(tensor: torch.Tensor) -> str | None:
    """HOST, DEVICE or None (untracked) for `tensor`."""
    return getattr(tensor, _STATE, None)


def _mark(tensor: Any, value: str | None) -> None:
    if isinstance(tensor, torch.Tensor) and value is not None:
        try:
            setattr(tensor, _STATE, value)
        except (AttributeError, RuntimeError):  # a tensor that keeps no Python attributes: stays untracked
            pass


def _caller() -> str:
    """The file of the innermost frame outside torch and this module (who called the torch function)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


def _ours() -> bool:
    return _caller().startswith(WATCHED)


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _check_arguments(where: str, args: tuple, kwargs: dict) -> None:
    host = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and state(t) == HOST]
    if host:
        raise DeviceRuleError(
            f"{where} got a host tensor {_describe(host[0])} (made without device= or moved off the root device): "
            f"NCCL would fail with 'No backend type associated with device type cpu'")


class DeviceRules(TorchFunctionMode):
    """Track host/device tensors and raise `DeviceRuleError` where a GPU run would fail (see the module docstring).

    Args:
        root: the root device (its type is what ``.to`` must name to move a tensor onto the device).
    """

    def __init__(self, root: torch.device | str = "cpu") -> None:
        super().__init__()
        self.root = torch.device(root)
        self._patches: list[tuple[Any, str, Any]] = []

    # ---------------------------------------------------------------------------------------- entering, leaving

    def __enter__(self) -> DeviceRules:
        import lightning.pytorch.strategies as strategies

        for name in COLLECTIVES:
            if hasattr(torch.distributed, name):
                self.guard(torch.distributed, name, f"torch.distributed.{name}")
        for cls in (strategies.ModelParallelStrategy, strategies.DDPStrategy):
            self.guard(cls, "reduce", f"{cls.__name__}.reduce", only_if_distributed=True)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()

    def guard(self, owner: Any, name: str, where: str | None = None, only_if_distributed: bool = False) -> None:
        """Check every tensor argument of ``owner.name`` (until the mode exits): a host one raises `DeviceRuleError`.

        Args:
            owner: a module or class.
            name: the function's attribute name on `owner`.
            where: how the error names the function (default ``owner.name``).
            only_if_distributed: check only while a process group is initialised (what Lightning's reduce needs).
        """
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        where = where or f"{getattr(owner, '__name__', owner)}.{name}"

        @functools.wraps(original)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if not only_if_distributed or torch.distributed.is_initialized():
                _check_arguments(where, args, kwargs)
            return original(*args, **kwargs)

        self._patches.append((owner, name, original))
        setattr(owner, name, checked)

    # ------------------------------------------------------------------------------------------------ tracking

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES or func is torch.from_numpy:
            return self._factory(func, args, kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        states = [state(t) for t in tensors]
        if DEVICE in states and HOST in states and func not in _MOVES_BETWEEN_DEVICES:
            self._check_mixing(func, tensors)
        out = func(*args, **kwargs)
        if tensors and (HOST in states or DEVICE in states):
            derived = HOST if all(s == HOST for s in states) else DEVICE if DEVICE in states else None
            inputs = {id(t) for t in tensors}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t) not in inputs:  # in-place results keep their own state
                    _mark(t, derived)
        return out

    def _factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        data = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if device is not None:
            _mark(out, DEVICE if torch.device(device).type == self.root.type else HOST)
        elif data is not None:  # torch.tensor / as_tensor of a tensor keep its device (as_tensor may return it)
            if out is not data:
                _mark(out, state(data))
        elif _ours():
            _mark(out, HOST)
        return out

    def _check_mixing(self, func: Any, tensors: list[torch.Tensor]) -> None:
        strict = func in _NO_SCALAR_EXCEPTION
        host = [t for t in tensors if state(t) == HOST and (t.dim() > 0 or strict)]
        if host and _ours():
            name = getattr(func, "__name__", repr(func))
            raise DeviceRuleError(
                f"{name} at {_caller()} mixes a device tensor with a host tensor {_describe(host[0])}: CUDA would fail "
                f"with 'Expected all tensors to be on the same device'")

    def _move(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``.to`` / ``.cuda`` / ``.cpu``: the result's state is where it is moved (or the source's, for a dtype)."""
        source = args[0]
        out = func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            target: str | None = DEVICE
        elif func is torch.Tensor.cpu:
            target = HOST if _ours() else state(source)
        else:
            target = self._destination(source, args[1:], kwargs)
        if out is source and target != state(source):
            if state(source) is None and target == DEVICE:  # e.g. a parameter moved with its module: track it
                _mark(source, DEVICE)
                return out
            out = out.view_as(out)  # a real move makes a new tensor; the source keeps where it was
        _mark(out, target)
        return out


    def _destination(self, source: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        """Where ``source.to(*args, **kwargs)`` puts a tensor: HOST, DEVICE, or the source's state (dtype only)."""
        device = kwargs.get("device")
        for a in (*args, kwargs.get("other")):
            if isinstance(a, torch.Tensor):  # .to(other): other's device
                return state(a)
            if isinstance(a, (torch.device, str)):
                device = a
        if device is None:
            return state(source)
        return DEVICE if torch.device(device).type == self.root.type else HOST


@contextmanager
def device_rules(root: torch.device | str = "cpu", guards: tuple[tuple[Any, str], ...] = ()) -> Iterator[DeviceRules]:
    """`DeviceRules` on `root`, with `guards` ((owner, name) pairs) checked like collectives."""
    rules = DeviceRules(root)
    with rules:
        for owner, name in guards:
            rules.guard(owner, name)
        yield rules


# ------------------------------------------------------------------------------- per-thread device selection

ENGINE_CALLS = ("generate", "update_weights", "update_adapter", "wake", "sleep")


class ThreadDeviceRules:
    """Fail where a GPU run would compute on the wrong device: a thread that drives the engine without selecting one.

    A CUDA host thread starts on device 0: one that calls the engine (or computes with tensors in our code or inside
    an engine call) before ``torch.cuda.set_device`` runs its kernels on GPU 0, whatever rank it serves; vLLM 0.32's
    V2 runner also caches the stream of the first thread that steps it. On CPU nothing shows. This records, per
    thread, the device it selected (`rl_lightning.rollout.engine_thread.selected_device`) before each call of a
    watched engine's methods and each tensor call inside one (or from our code) on threads started while it is
    active, and `check` raises `DeviceRuleError` for a thread that never selected one (or selected another).

    Args:
        device: the device every engine thread must select.
        main_thread_engine_calls: whether the training thread may call the engine (the synchronous mode: its device
            is Lightning's); False where every engine call must run on the engine thread (one-step-off, in-flight).
    """

    def __init__(self, device: torch.device | str = "cpu", main_thread_engine_calls: bool = False) -> None:
        self.device = torch.device(device)
        self.main_thread_engine_calls = main_thread_engine_calls
        self.engine_calls: list[tuple[str, str, torch.device | None]] = []  # (thread, method, selected device)
        self.tensor_calls: dict[str, int] = {}  # thread -> tensor calls seen with the right device selected
        self.violations: list[str] = []
        self._local = threading.local()
        self._patches: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> ThreadDeviceRules:
        original_run = threading.Thread.run
        rules = self

        def run(thread: threading.Thread) -> None:  # every thread started meanwhile records its tensor calls
            with _ThreadTensorCalls(rules):
                original_run(thread)

        self._patches.append((threading.Thread, "run", original_run))
        threading.Thread.run = run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._patches):
            if name in vars(owner) and owner is not threading.Thread:
                delattr(owner, name)  # an engine instance: its class's method again
            else:
                setattr(owner, name, original)
        self._patches.clear()

    def watch(self, engine: Any, methods: tuple[str, ...] = ENGINE_CALLS) -> None:
        """Record every call of `engine`'s `methods` (those it has) with the calling thread's selected device."""
        for name in methods:
            if not hasattr(engine, name):
                continue
            original = getattr(engine, name)

            @functools.wraps(original)
            def recorded(*args: Any, name_: str = name, original_: Any = original, **kwargs: Any) -> Any:
                self._engine_call(name_)
                depth = getattr(self._local, "depth", 0)
                self._local.depth = depth + 1
                try:
                    return original_(*args, **kwargs)
                finally:
                    self._local.depth = depth

            self._patches.append((engine, name, original))
            setattr(engine, name, recorded)

    def _engine_call(self, method: str) -> None:
        thread = threading.current_thread()
        selected = _selected()
        self.engine_calls.append((thread.name, method, selected))
        if thread is threading.main_thread():
            if not self.main_thread_engine_calls:
                self.violations.append(f"the training thread called engine.{method}: in this mode every engine call "
                                       "runs on the engine thread (its device and stream)")
        elif selected != self.device:
            self.violations.append(f"thread {thread.name} called engine.{method} with device {selected} selected, "
                                   f"not {self.device}: on CUDA its kernels would run on device 0")

    def _tensor_call(self) -> None:
        thread = threading.current_thread()
        if getattr(self._local, "depth", 0) == 0 and not _ours():
            return  # third-party threads and code outside an engine call choose their own devices
        selected = _selected()
        if selected != self.device:
            message = (f"thread {thread.name} made a tensor call with device {selected} selected, not {self.device}: "
                       "on CUDA it would run on device 0")
            if message not in self.violations:
                self.violations.append(message)
        else:
            self.tensor_calls[thread.name] = self.tensor_calls.get(thread.name, 0) + 1

    def check(self) -> None:
        """Raise `DeviceRuleError` with the first violation recorded (if any)."""
        if self.violations:
            raise DeviceRuleError(f"{self.violations[0]} ({len(self.violations)} violation(s))")


def _selected() -> torch.device | None:
    from rl_lightning.rollout.engine_thread import selected_device

    return selected_device()


class _ThreadTensorCalls(TorchFunctionMode):
    """One thread's recorder of tensor calls for `ThreadDeviceRules` (torch function modes are per thread)."""

    def __init__(self, rules: ThreadDeviceRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.rules._tensor_call()
        return func(*args, **(kwargs or {}))
