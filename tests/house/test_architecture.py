"""The house rules that keep the package walkable, checked on the source (AST, no imports run):

- no import circle between modules (function-level imports count: a lazy import is still a dependency);
- imports flow one way between packages, top to bottom: cli, callbacks, tracking, tasks, rollout, envs, rewards,
  engines, data, parallel, models, memory, attention, assets, algorithms and compat; `rl_lightning.errors` and
  `.redaction` are for everyone; nothing imports `cli`, and `algorithms` and `compat` import nothing of ours;
- a private name of jsonargparse/argparse, Lightning, MLflow, transformers or vLLM appears only in `rl_lightning.compat`
  (`private_uses`: private module imports; ``x._name`` where ``x`` is one of those libraries, or ``_name`` is a private
  name of theirs we know of (`FOREIGN`, on ``self`` too, and as an overriding method), or ``x`` is not ``self``/``cls``
  and no code of ours defines ``_name``);
- every package's ``__init__`` says what it may import (``May import: a, b.``) and imports nothing else, so the
  package graph has no circle either;
- at most 5 modules at the package root, every package's ``__init__`` opens with a docstring;
- no file over 400 lines and no function over 80 in `rl_lightning/` (its callbacks and example environments too);
- no module-level mutable state outside compat (`module_state`: ``global``, a module's dict/list/set mutated), but
  what `PROCESS_WIDE` lists with why.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rl_lightning"
RECIPES = PACKAGE / "recipes"

# Top to bottom; a package may import its own modules and what its ``__init__`` declares, all of it below it.
LAYERS = [["__main__"], ["cli"], ["callbacks"], ["tracking"], ["tasks"], ["rollout"], ["envs"], ["rewards"], ["engines"],
          ["data"], ["parallel"], ["models"], ["memory"], ["attention"], ["assets"], ["algorithms", "compat"],
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


COMPAT = PACKAGE / "compat"
LIBRARIES = {"jsonargparse", "argparse", "lightning", "lightning_fabric", "pytorch_lightning", "mlflow", "transformers",
             "vllm"}
# Private names of those libraries we know of: flagged wherever they appear outside compat, on `self` too (a subclass
# reading its base's private attribute, or overriding its private method).
FOREIGN = {
    "_actions", "_option_string_actions", "_name_parser_map", "_typehint", "_check_value_key", "_subcommand_parsers",
    "_parse_ckpt_path", "_configure_launcher", "_setup_distributed", "_get_process_group_backend", "_device_mesh",
    "_process_group_backend", "_timeout", "_checkpoint_io", "_save_distributed_checkpoint", "_link_checkpoint",
    "_remove_checkpoint", "_last_checkpoint_saved", "_generate_state_key", "_trainer", "_run_id", "_run_name",
    "_experiment_id", "_experiment_name", "_tracking_uri", "_initialized", "_mlflow_client", "_attn_implementation",
}
# The standard library's private names on objects of unknown type: listed so a new one is a decision.
OTHER_LIBRARIES = {"_exit", "_base_executable", "_fields"}  # os._exit, sys._base_executable, a namedtuple's fields


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _our_names(paths: list[Path]) -> set[str]:
    """Private names our code defines: functions, classes, module/class variables, `self.`/`cls.` attributes."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}):
                names.add(node.attr)
    return {name for name in names if _is_private(name)} - FOREIGN


def _library_bindings(tree: ast.AST) -> set[str]:
    """Names a module binds by importing from the libraries (``import lightning as L``, ``from mlflow import x``)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            bound |= {a.asname or a.name for a in node.names}
    return bound


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def private_uses(source: str, ours: set[str]) -> list[str]:
    """``line: name`` for each use of a library's private name in `source` (the heuristic of the module docstring)."""
    tree = ast.parse(source)
    bound, found = _library_bindings(tree), []
    methods = {id(item) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for item in c.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            module = getattr(node, "module", None) or ""
            dotted = [module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if (module or dotted[0]).split(".")[0] in LIBRARIES and getattr(node, "level", 0) == 0:
                found += [f"{node.lineno}: import {d}" for d in dotted if any(map(_is_private, d.split(".")))]
                found += [f"{node.lineno}: import {n}" for n in names if _is_private(n)]
            continue
        if isinstance(node, ast.Attribute):
            receiver, name = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in {"getattr", "hasattr", "setattr", "delattr"} and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            receiver, name = node.args[0], node.args[1].value
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in FOREIGN and id(node) in methods:
            found.append(f"{node.lineno}: def {node.name} (overrides a library's private method)")
            continue
        else:
            continue
        if not _is_private(name):
            continue
        root = _root(receiver)
        library = isinstance(root, ast.Name) and root.id in bound
        mine = isinstance(receiver, ast.Name) and receiver.id in {"self", "cls"}
        if library or name in FOREIGN or (not mine and name not in ours and name not in OTHER_LIBRARIES):
            found.append(f"{node.lineno}: {name}")
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def _outside_compat() -> list[Path]:
    return [path for path in _sources() if not path.is_relative_to(COMPAT)]


def test_third_party_private_names_only_in_compat():
    ours = _our_names(_outside_compat())
    found = {str(path.relative_to(REPO)): uses for path in _outside_compat()
             if (uses := private_uses(path.read_text(), ours))}
    assert found == {}, "a library's private name outside rl_lightning/compat/: add a named function there and call it"


def test_the_private_name_check_catches_a_planted_use():
    planted = ("import argparse\nfrom jsonargparse._optionals import x\nimport lightning as L\n"
               "def f(parser, logger, trainer):\n    parser._actions\n    L.pytorch._x\n"
               "    getattr(logger, '_run_id')\n    trainer._not_ours\n    trainer._ours\n    return argparse._SUPPRESS\n"
               "class S:\n    def _setup_distributed(self):\n        self._device_mesh = 1\n        self._mine = 2\n")
    assert private_uses(planted, ours={"_ours", "_mine"}) == [
        "2: import jsonargparse._optionals", "5: _actions", "6: _x", "7: _run_id", "8: _not_ours", "10: _SUPPRESS",
        "12: def _setup_distributed (overrides a library's private method)", "13: _device_mesh"]


MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
            "discard", "sort", "reverse"}
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}
# State that is process-wide by nature, each with why (a new entry is a decision a reviewer sees).
PROCESS_WIDE = {
    "rl_lightning/memory/phases.py: _PEAKS_BEFORE_RESETS": "the kernel's and CUDA's peak counters are process-wide",
    "rl_lightning/redaction.py: _remembered": "secret values redacted from every text this process writes",
    "rl_lightning/redaction.py: _from_env": "values read with ${oc.env:...}, shown as that reference everywhere",
    "rl_lightning/rewards/isolation.py: _found": "the bwrap path the once-per-process (lru_cache) probe found",
    "rl_lightning/rewards/scorer_sandbox.py: _shared": "one sandboxed scorer per process, stopped at exit",
    "rl_lightning/rollout/engine_thread.py: _streams": "one engine stream per device, shared by the rank's threads",
    "rl_lightning/engines/registry.py: _SPECS": "the engine kinds model.rollout.engine takes: register() adds one "
                                                "for the process, as defining a class does (issue 38: one line)",
    "rl_lightning/envs/adapters.py: ADAPTERS": "the env_path prefixes this process can build (register_adapter)",
    "rl_lightning/algorithms/advantages.py: OUTCOME_ESTIMATORS": "the advantage estimators registered by name "
                                                                "(register_estimator), as the engine kinds are",
}


def module_state(source: str) -> list[str]:
    """``line: name`` for each `global` statement and each mutation of a module-level dict/list/set in `source`."""
    tree = ast.parse(source)
    found = [f"{node.lineno}: global {', '.join(node.names)}" for node in ast.walk(tree) if isinstance(node, ast.Global)]
    mutable = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in MUTABLE_CALLS):
            mutable |= {target.id for target in targets if isinstance(target, ast.Name)}
    for node in ast.walk(tree):
        changed: list[ast.expr] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            changed = [node.func.value]
        elif isinstance(node, ast.Assign | ast.Delete | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            changed = [target.value for target in targets if isinstance(target, ast.Subscript)]
        found += [f"{node.lineno}: {each.id}" for each in changed if isinstance(each, ast.Name) and each.id in mutable]
    return found


def test_no_module_level_mutable_state_outside_compat():
    found = []
    for path in _outside_compat():
        for line in module_state(path.read_text()):
            name = line.split(": ", 1)[1]
            if f"{path.relative_to(REPO)}: {name}" not in PROCESS_WIDE:
                found.append(f"{path.relative_to(REPO)}:{line}")
    assert found == [], "module-level state: give it an owner (an object whoever uses it holds), or list it with why"


def test_the_module_state_check_catches_a_planted_one():
    planted = ("CACHE = {}\nSEEN: list[int] = []\nFIXED = {'a': 1}\nlast = None\n"
               "def f(x):\n    global last\n    last = x\n    CACHE[x] = 1\n    SEEN.append(x)\n    return FIXED['a']\n")
    assert module_state(planted) == ["6: global last", "8: CACHE", "9: SEEN"]
