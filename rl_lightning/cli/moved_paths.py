"""Dotted paths that moved when the root modules became packages, and where a user's config still names one.

A recipe or an overlay written before the move names ``rl_lightning.export.HFExport`` (or the repository's old
top-level ``callbacks.rollout_samples.RolloutSamples``, now ``rl_lightning.callbacks.rollout_samples``); the CLI then
stops with one line naming the key and the new path (`rl_lightning.cli.config_errors`) instead of jsonargparse's
import error.
`MOVED` is the one table of old module -> new module(s); a path moved only when it no longer resolves as written
(``rl_lightning.models`` is a package now, so ``rl_lightning.models.loading.load_causal_lm`` did not move, while
``rl_lightning.models.load_causal_lm`` did).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

# old module -> the module(s) its names went to, the first that has a name wins (the attention module's block
# kernels went to their own module)
MOVED: dict[str, tuple[str, ...]] = {
    "rl_lightning.cli": ("rl_lightning.cli.main",),
    "rl_lightning.cli_errors": ("rl_lightning.cli.config_errors",),
    "rl_lightning.progress": ("rl_lightning.cli.progress",),
    "rl_lightning.outputs": ("rl_lightning.cli.outputs",),
    "rl_lightning.tune": ("rl_lightning.cli.tune",),
    "rl_lightning.search_space": ("rl_lightning.cli.search_space",),
    "rl_lightning.models": ("rl_lightning.models.loading",),
    "rl_lightning.lora": ("rl_lightning.models.lora",),
    "rl_lightning.optim": ("rl_lightning.models.optim",),
    "rl_lightning.memory": ("rl_lightning.memory.backoff",),
    "rl_lightning.attention": ("rl_lightning.attention.packed", "rl_lightning.attention.kernels"),
    "rl_lightning.tracking": ("rl_lightning.tracking.mlflow_run",),
    "rl_lightning.lineage": ("rl_lightning.tracking.lineage",),
    "rl_lightning.export": ("rl_lightning.tracking.export",),
    # the second house (issue 38): engines, environments, attention and memory got packages of their own
    "rl_lightning.rollout.engine": ("rl_lightning.engines.protocol",),
    "rl_lightning.rollout.hf": ("rl_lightning.engines.hf",),
    "rl_lightning.rollout.vllm": ("rl_lightning.engines.vllm",),
    "rl_lightning.rollout.engine_process": ("rl_lightning.engines.process",),
    "rl_lightning.rollout.engine_restart": ("rl_lightning.engines.restart",),
    "rl_lightning.rollout.shared_engine": ("rl_lightning.engines.shared",),
    "rl_lightning.rollout.weights": ("rl_lightning.engines.weights",),
    "rl_lightning.rollout.lora_sync": ("rl_lightning.engines.lora_sync",),
    "rl_lightning.rollout.local_channels": ("rl_lightning.engines.local_channels",),
    "rl_lightning.rollout.lockstep": ("rl_lightning.engines.lockstep",),
    "rl_lightning.rollout.env": ("rl_lightning.envs.environment",),
    "rl_lightning.rollout.env_adapters": ("rl_lightning.envs.adapters",),
    "rl_lightning.rollout.openenv_adapter": ("rl_lightning.envs.openenv",),
    "rl_lightning.rollout.verifiers_adapter": ("rl_lightning.envs.verifiers",),
    "rl_lightning.rollout.scoring": ("rl_lightning.envs.workers",),
    "rl_lightning.models.attention": ("rl_lightning.attention.packed",),
    "rl_lightning.models.kernels": ("rl_lightning.attention.kernels",),
    "rl_lightning.parallel.ring_attention": ("rl_lightning.attention.ring",),
    "rl_lightning.parallel.zigzag": ("rl_lightning.attention.zigzag",),
    "rl_lightning.models.memory": ("rl_lightning.memory.backoff",),
    "rl_lightning.models.memory_fit": ("rl_lightning.memory.fit",),
    "rl_lightning.models.memory_phases": ("rl_lightning.memory.phases",),
    "rl_lightning.models.memory_plan": ("rl_lightning.memory.plan",),
    "rl_lightning.models.model_shape": ("rl_lightning.memory.model_shape",),
    # the ready-made callbacks were a folder beside the package, importable only from a clone's root; they ship in it
    "callbacks": ("rl_lightning.callbacks",),
}
ROOTS = tuple(sorted({module.split(".")[0] + "." for module in MOVED}))  # what a moved path starts with


def resolves(path: str) -> bool:
    """Whether the dotted `path` names something: its longest importable module, then attributes."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for name in parts[end:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def new_path(path: str) -> str | None:
    """Where `path` moved (``rl_lightning.export.HFExport`` -> ``rl_lightning.tracking.export.HFExport``), else None.

    None when `path` is under no moved module, or still resolves as written.
    """
    old = max((module for module in MOVED if path.startswith(module + ".")), key=len, default=None)
    if old is None or resolves(path):
        return None
    rest = path[len(old) + 1 :]
    candidates = [f"{module}.{rest}" for module in MOVED[old]]
    return next((candidate for candidate in candidates if resolves(candidate)), candidates[0])


def find_moved(value: Any, key: str = "") -> Iterator[tuple[str, str, str]]:
    """``(key, old path, new path)`` for each moved path among the strings in a config value, in order.

    Args:
        value: A value as the user wrote it: a string, or a YAML mapping or list (looked through).
        key: Where `value` sits, as the user names it: ``trainer.callbacks[0].class_path`` (``init_args`` levels
            left out, list items indexed).
    """
    if isinstance(value, dict):
        for name, item in value.items():
            inner = key if name == "init_args" else f"{key}.{name}" if key else str(name)
            yield from find_moved(item, inner)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from find_moved(item, f"{key}[{index}]")
    elif isinstance(value, str) and value.startswith(ROOTS) and (moved := new_path(value)):
        yield key, value, moved
