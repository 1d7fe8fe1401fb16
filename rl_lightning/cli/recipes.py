"""The recipes that ship inside the package, named without a path, and the package files they refer to.

``--config grpo`` (or ``real/grpo``, ``grpo.yaml``, or the repository path ``recipes/grpo.yaml``) names
``rl_lightning/recipes/grpo.yaml`` of the installed package, from any folder; a file the user has at that path wins
(`find_config`). A recipe refers to the package's own files (the bundled models and data, the example environments)
by their path from the package's parent folder, ``rl_lightning/assets/tiny-qwen2``,
``rl_lightning/recipes/envs/arithmetic.py``: such a value resolves from the working directory when it exists there (a
clone's root, or the user's own copy) and otherwise to the installed package's file (`resolve_references`,
`rl_lightning.assets.package_files`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_lightning.assets.package_files import PACKAGE, PREFIX, package_file, resolve_reference
from rl_lightning.errors import ConfigError

RECIPES = PACKAGE / "recipes"


def recipe_names() -> list[str]:
    """The bundled recipes as ``--config`` names them: ``dpo``, ..., ``real/grpo`` (sorted)."""
    return sorted(path.relative_to(RECIPES).with_suffix("").as_posix() for path in RECIPES.rglob("*.yaml"))


def bundled_recipe(name: str) -> Path | None:
    """The bundled recipe file `name` names (``grpo``, ``real/grpo.yaml``, ``recipes/grpo.yaml``), else None."""
    stem = name.removeprefix("./").removeprefix("recipes/").removeprefix(f"{PREFIX}recipes/")
    stem = stem.removesuffix(".yaml").removesuffix(".yml")
    path = RECIPES / f"{stem}.yaml"
    return path if stem and ".." not in Path(stem).parts and path.is_file() else None


def find_config(value: str) -> str:
    """The file a ``--config`` value names: the user's file when it exists, else the bundled recipe of that name.

    Raises:
        ConfigError: neither exists and the value is a bare name (no folder, no extension), naming the bundled
            recipes; a missing file's path is left to the parser, which says so in one line.
    """
    if os.path.isfile(value) or value.lstrip().startswith(("{", "[")) or "\n" in value:  # a file, or inline YAML
        return value
    bundled = bundled_recipe(value)
    if bundled is not None:
        return str(bundled)
    if (found := package_file(value)) is not None:
        return str(found)
    if "/" in value or value.endswith((".yaml", ".yml", ".json")):  # a file's path: the parser's own one-line error
        return value
    raise ConfigError(f"config: no such file and no bundled recipe of that name (value '{value}'); bundled recipes: "
                      f"{', '.join(recipe_names())}, or give the path of your own YAML file")


def resolve_config_args(argv: Sequence[str]) -> list[str]:
    """`argv` with each ``--config X`` / ``--config=X`` value replaced by the file it names (`find_config`)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = find_config(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + find_config(arg.split("=", 1)[1])
    return out


def resolve_references(config: Any) -> Any:
    """Resolve, in place, every string in a parsed config (namespaces, dicts, lists) with `resolve_reference`."""
    from jsonargparse import Namespace

    items = vars(config) if isinstance(config, Namespace) else config
    if isinstance(items, dict):
        for key, value in items.items():
            items[key] = resolve_reference(value) if isinstance(value, str) else resolve_references(value)
    elif isinstance(items, list):
        for index, value in enumerate(items):
            items[index] = resolve_reference(value) if isinstance(value, str) else resolve_references(value)
    return config
