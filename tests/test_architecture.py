"""The house rules that keep the package walkable, checked on the source (AST, no imports run):

- no import circle between modules (function-level imports count: a lazy import is still a dependency);
- imports flow one way between packages, top to bottom: cli, callbacks, tracking, tasks, rollout, envs, rewards,
  engines, data, parallel, models, memory, attention, assets, algorithms; `rl_lightning.errors` and `.redaction` are
  for everyone; nothing imports `cli`, and `algorithms` imports nothing of ours;
- every package's ``__init__`` says what it may import (``May import: a, b.``) and imports nothing else, so the
  package graph has no circle either;
- at most 5 modules at the package root, every package's ``__init__`` opens with a docstring;
- no file over 400 lines and no function over 80 in `rl_lightning/` (its callbacks and example environments too).
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "rl_lightning"
RECIPES = PACKAGE / "recipes"

# Top to bottom; a package may import its own modules and what its ``__init__`` declares, all of it below it.
LAYERS = [["__main__"], ["cli"], ["callbacks"], ["tracking"], ["tasks"], ["rollout"], ["envs"], ["rewards"], ["engines"],
          ["data"], ["parallel"], ["models"], ["memory"], ["attention"], ["assets"], ["algorithms"],
          ["errors", "redaction"]]
FOR_EVERYONE = {"errors", "redaction"}
# Commands that live beside what they build: they sit at the top of the order, and nothing of ours imports them.
COMMANDS = {"rl_lightning.assets.build": "cli"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(RECIPES):  # data the CLI loads by path (the example environments), not modules
            continue
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of ours that `name` imports anywhere in its body, resolved to the longest existing module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("rl_lightning") and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(module: str) -> str:
    if module in COMMANDS:
        return COMMANDS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _layer(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_circle_and_only_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_circle_between_modules():
    assert _cycles(GRAPH) == []


def test_every_package_is_in_the_layer_order():
    packages = {_package(module) for module in MODULES} - {"<root>"}
    known = {package for layer in LAYERS for package in layer}
    assert packages <= known, f"packages missing from LAYERS: {sorted(packages - known)}"


def test_imports_flow_down_the_layers():
    upward = [
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if _package(module) != "<root>" and _package(target) != "<root>"
        and _layer(_package(target)) < _layer(_package(module))
    ]
    assert upward == []


def _declared(package: str) -> set[str] | None:
    """What the package's ``__init__`` docstring says it may import (None: every package)."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    line = next((line for line in docstring.splitlines() if line.startswith("May import: ")), None)
    assert line is not None, f"rl_lightning/{package}/__init__.py: its docstring needs a 'May import: ...' line"
    listed = line.removeprefix("May import: ").split("(")[0].strip().rstrip(".")
    if listed == "every package of ours":
        return None
    return set() if listed == "nothing of ours" else {name.strip() for name in listed.split(",")}


def _package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        source = _package(module)
        graph.setdefault(source, set()).update(_package(t) for t in targets if _package(t) not in {source, "<root>"})
    return graph


def test_each_package_imports_only_what_its_init_declares_and_the_declared_lie_below_it():
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    undeclared, upward = [], []
    for package, targets in _package_graph().items():
        if package not in packages:
            continue
        declared = _declared(package)
        if declared is not None:
            undeclared += [f"{package} -> {t}" for t in sorted(targets - declared - FOR_EVERYONE)]
            upward += [f"{package} declares {d}" for d in sorted(declared) if d not in packages
                       or _layer(d) <= _layer(package)]
    assert undeclared == [], "imports a package its __init__ does not declare (add it to 'May import:' or move code)"
    assert upward == [], "a declared package is unknown or not below the declaring one"


def test_no_import_circle_between_packages():
    assert _cycles(_package_graph()) == []


def test_the_declaration_check_catches_an_undeclared_import(monkeypatch):
    graph = {name: set(targets) for name, targets in GRAPH.items()}
    graph["rl_lightning.attention.kernels"] = {"rl_lightning.models.lora"}  # attention may import nothing of ours
    monkeypatch.setitem(globals(), "GRAPH", graph)
    with pytest.raises(AssertionError, match="does not declare"):
        test_each_package_imports_only_what_its_init_declares_and_the_declared_lie_below_it()
    graph["rl_lightning.models.lora"] = {"rl_lightning.attention.kernels"}
    assert _cycles(_package_graph()) != []


def test_algorithms_import_nothing_of_ours_and_nothing_imports_commands():
    algorithms = {f"{m} -> {t}" for m, ts in GRAPH.items() if _package(m) == "algorithms" for t in ts
                  if _package(t) != "algorithms"}
    assert algorithms == set()
    into_commands = {f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts if t in COMMANDS}
    assert into_commands == set()


def test_at_most_five_root_modules_and_every_package_says_what_it_holds():
    roots = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(roots) <= 5, roots
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text()))
        assert docstring and len(docstring) > 40, f"{init.relative_to(REPO)} needs a docstring saying what lives there"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))  # rl_lightning/callbacks/ and the example environments in recipes/envs/


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_file_over_400_lines_and_no_function_over_80(path):
    text = path.read_text()
    assert text.count("\n") <= 400, f"{path.relative_to(REPO)}: {text.count(chr(10))} lines (the rule is 400)"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80]
    assert long == [], f"{path.relative_to(REPO)}: functions over 80 lines: {long}"


def test_test_file_names_are_unique():
    """Test folders have no ``__init__.py`` (pytest's rootdir-relative import mode): two ``test_x.py`` in different
    folders break the collection of the whole suite, so each basename appears once."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
