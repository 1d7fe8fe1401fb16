"""Which reasoning-gym tasks' scorers may evaluate text as code: the rule behind `EVALUATING_TASKS`.

The rule (static, over the installed reasoning-gym source): start at the task's ``score_answer`` and follow what it
names, transitively: methods and attributes of its own dataset (``self.x``, looked up on the dataset reasoning-gym
builds to score, so what ``__init__`` stores, lazy imports included, is followed too), functions and classes of
reasoning-gym (a class: every method it defines). The task *may evaluate text* when that code names

- a builtin that runs or imports text (``eval``, ``exec``, ``compile``, ``__import__``, ``breakpoint``);
- anything from sympy (its functions ``sympify`` string arguments: ``eval``) or from a module that runs
  code while reading data or importing by name (pickle, marshal, shelve, dill, yaml, importlib, runpy, code, codeop);
- ``score_answer``/``get_score_answer_fn`` on an object it cannot resolve (it delegates to another task's scorer);
- or a function whose source cannot be read (it cannot be checked).

This errs on the side of listing a task (a listed task is only slower, scored in the sandbox). Whether the text is the
model's answer or a row's reference/metadata does not matter: data files are data too.
``python -m rl_lightning.rewards.reasoning_gym_scan`` prints what this finds.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types
from typing import Any

_BUILTINS = {"eval", "exec", "compile", "__import__", "breakpoint"}
_MODULES = ("sympy", "pickle", "_pickle", "marshal", "shelve", "dill", "yaml", "importlib", "runpy", "code", "codeop")
_DELEGATES = {"score_answer", "get_score_answer_fn"}


def evaluating_tasks() -> dict[str, list[str]]:
    """Task name -> what its scorer reaches that may evaluate text (tasks reaching nothing are left out)."""
    from reasoning_gym.factory import DATASETS

    found = {}
    for task in sorted(DATASETS):
        dataset_class, config_class = DATASETS[task]
        unresolved: list[str] = []
        reasons = scan_scorer(dataset_class, unresolved)
        if unresolved:  # attributes set in __init__: look at the dataset reasoning-gym builds to score
            try:
                reasons = scan_scorer(dataset_class(config=config_class()))
            except Exception:  # noqa: BLE001, S110 - it needs a config (composite): the class alone it is
                pass
        if reasons:
            found[task] = reasons
    return found


def scan_scorer(dataset: Any, unresolved: list[str] | None = None) -> list[str]:
    """What `dataset`'s (a dataset or its class) ``score_answer`` reaches that may evaluate text (sorted).

    Each finding reads ``function: name``; `unresolved` collects the ``self.x`` of `dataset` that were not found on it.
    """
    findings: set[str] = set()
    dataset_class: Any = dataset if inspect.isclass(dataset) else type(dataset)
    todo: list[tuple[Any, Any]] = [(dataset_class.score_answer, dataset)]
    seen: set[Any] = set()
    while todo:
        function, owner = todo.pop()
        function = inspect.unwrap(function)
        if function in seen:
            continue
        seen.add(function)
        tree = _tree(function)
        if tree is None:
            findings.add(f"{function.__qualname__}: source unreadable")
            continue
        module = inspect.getmodule(function)
        for node in ast.walk(tree):
            name, target = _resolve(node, module, owner)
            if name is None:
                continue
            if target is None and owner is dataset and _on_self(node) and unresolved is not None:
                unresolved.append(name)
            reason = _verdict(name, target, node)
            if reason:
                findings.add(f"{function.__qualname__}: {reason}")
            todo += _followed(target, owner)
    return sorted(findings)


def _tree(function: Any) -> ast.AST | None:
    code = getattr(function, "__code__", None)
    if code is not None and code.co_filename.startswith("<") and function.__name__.startswith("__"):
        return ast.parse("")  # a dataclass's generated __init__/__eq__/__repr__: no text evaluated
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def _resolve(node: ast.AST, module: Any, owner: Any) -> tuple[str | None, Any]:
    """The name `node` reads and the object it denotes (None where unknown)."""
    scope = vars(module) if module is not None else {}
    if isinstance(node, ast.Name):
        if node.id in ("self", "cls"):
            return None, None
        return node.id, scope.get(node.id, getattr(builtins, node.id, None))
    if not isinstance(node, ast.Attribute):
        return None, None
    base = node.value
    if isinstance(base, ast.Name) and base.id in ("self", "cls") and owner is not None:
        target = inspect.getattr_static(owner, node.attr, None)
        return node.attr, target.__func__ if isinstance(target, (staticmethod, classmethod)) else target
    if isinstance(base, ast.Name) and isinstance(scope.get(base.id), types.ModuleType):
        return node.attr, getattr(scope[base.id], node.attr, None)
    return node.attr, None


def _on_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _origin(target: Any) -> str:
    if isinstance(target, types.ModuleType):
        return target.__name__
    return getattr(target, "__module__", None) or ""


def _verdict(name: str, target: Any, node: ast.AST) -> str | None:
    if name in _BUILTINS and target is getattr(builtins, name, None):
        return f"builtin {name}"
    origin = _origin(target)
    if target is not None and origin.split(".")[0] in _MODULES:
        return f"{origin}.{name}"
    if name in _DELEGATES and target is None and isinstance(node, ast.Attribute):
        return f"delegates to another scorer ({name})"
    return None


def _followed(target: Any, owner: Any) -> list[tuple[Any, Any]]:
    """The reasoning-gym functions `target` stands for, with the object (or class) their ``self`` is."""
    if not _origin(target).startswith("reasoning_gym"):
        return []
    if inspect.isclass(target):
        methods = [m.__func__ if isinstance(m, (staticmethod, classmethod)) else m for m in vars(target).values()]
        return [(m, target) for m in methods if inspect.isfunction(m)]
    if inspect.isfunction(target):
        mro = (owner if inspect.isclass(owner) else type(owner)).__mro__ if owner is not None else ()
        own = target.__qualname__.split(".")[0] in {c.__name__ for c in mro}
        return [(target, owner if own else None)]
    return []


if __name__ == "__main__":
    for task, reasons in evaluating_tasks().items():
        print(f"{task}: {'; '.join(reasons)}")
