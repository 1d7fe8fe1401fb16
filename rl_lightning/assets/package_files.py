"""The installed package's own files named by their path from its parent folder: ``rl_lightning/assets/tiny-qwen2``.

Recipes refer to the files that ship with the package (the bundled models and data, the example environments) this
way. Such a value means the file in the working directory when one is there (a clone's root, or the user's own copy:
theirs wins), else the installed package's file, so a recipe runs from any folder (`resolve_reference`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the installed rl_lightning/ folder
PREFIX = "rl_lightning/"
_VALUE = re.compile(r"^([a-z]+:)?(rl_lightning/.*)$")  # an optional adapter scheme (verifiers:, openenv:), the path


def package_file(value: str) -> Path | None:
    """The installed package's file for a ``rl_lightning/...`` path absent from the working directory, else None."""
    if not value.startswith(PREFIX) or os.path.exists(value):
        return None
    path = PACKAGE.parent / value
    return path if path.exists() else None


def resolve_reference(value: str) -> str:
    """`value` with a package path (``rl_lightning/...``, after an optional ``verifiers:``-style scheme) resolved.

    Unchanged unless the path is absent from the working directory and present in the installed package.
    """
    match = _VALUE.match(value)
    if match is None:
        return value
    scheme, path = match.group(1) or "", match.group(2)
    found = package_file(path)
    return value if found is None else f"{scheme}{found}"


def shown_path(path: str) -> str:
    """A path as logs and model cards show it: the package's own files from its parent (``rl_lightning/...``).

    Keeps the installing machine's folders (a home directory, a virtualenv) out of what a run records.
    """
    resolved = Path(path).resolve()
    return PREFIX + resolved.relative_to(PACKAGE).as_posix() if resolved.is_relative_to(PACKAGE) else path
