"""What a run is called: in MLflow (the runs table, chart legends, the compare page), on the terminal, and on disk.

A run's name is its configs followed by the settings the command line changed:

    python -m rl_lightning fit --config recipes/grpo.yaml --model.lm.optim.lr 2e-5          -> grpo lr=2e-05
    python -m rl_lightning fit --config recipes/real/grpo.yaml --config rl_lightning/cli/demo.yaml -> real-grpo+demo

- each config file by its path below ``recipes/`` without the extension, ``/`` -> ``-`` (other files: their stem),
  joined with ``+`` (an overlay adds to the recipe's name instead of replacing it);
- each command-line setting as ``key=value`` with the key's last part (the whole key where two settings share it),
  numbers as Python prints them (``2e-05``), a URL by its host (``rm:8000``: never its credentials), a path (a value
  with ``/``) by its file name without extension, a secret-named key's value as ``***``
  (`rl_lightning.redaction`); the trainer's settings (devices, run length, validation and logging intervals; `UNNAMED`) are left out but for
  precision, gradient accumulation and clipping.

MLflow's runs table and chart legends show about the first 20 characters of a name; runs that differ in many settings
are easier to tell apart with an overlay file for the shared ones (``--config my_base.yaml``, named ``+my_base``) or a
``run_name`` of their own.

``trainer.logger.init_args.run_name`` set anywhere replaces the whole name. The run's folder
(``outputs/<name>/<time>``, `rl_lightning.cli.outputs`) takes the configs' part only, so ``--ckpt_path last``
resumes the newest run of the same configs whatever the overrides.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import PurePath
from urllib.parse import urlsplit

from rl_lightning.redaction import REDACTED, redact_text, secret_key

# command-line settings that say where, how long and how often a run is recorded, not what it trains: the trainer's
# (all but the three below) and the resume point. MLflow's legends show a name's first ~20 characters.
UNNAMED = ("config", "ckpt_path", "print_config", "trainer")
NAMED_TRAINER = ("trainer.precision", "trainer.accumulate_grad_batches", "trainer.gradient_clip_val")
MAX_VALUE_CHARS = 40


def recipe_name(config_path: str) -> str:
    """A config file's part of the name: below ``recipes/`` without the extension, ``/`` -> ``-``; else its stem.

    ``recipes/real/grpo.yaml`` -> ``real-grpo``, ``rl_lightning/cli/demo.yaml`` -> ``demo``.
    """
    parts = os.path.normpath(os.path.splitext(config_path)[0]).split(os.sep)
    if "recipes" in parts[:-1]:
        parts = parts[len(parts) - 1 - parts[::-1].index("recipes") + 1 :]
        return "-".join(parts)
    return parts[-1]


def configs_name(config_files: Sequence[str]) -> str:
    """The configs' part of a run's name (and its folder): each file's `recipe_name`, joined with ``+``."""
    return "+".join(recipe_name(str(path)) for path in config_files)


def command_line_settings(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``(key, value)`` of each ``--key value`` / ``--key=value`` in `argv`, the subcommand and `UNNAMED` left out."""
    settings = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or arg == "--":
            continue
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                continue  # a flag without a value (--print_config)
            value = argv[i + 1]
        if key in NAMED_TRAINER or not any(key == skip or key.startswith(f"{skip}.") for skip in UNNAMED):
            settings.append((key.replace(".init_args.", "."), value))
    return settings


def show_value(value: str, key: str = "") -> str:
    """A setting's value as the name shows it: numbers as Python prints them, a path by its stem, cut if long.

    A URL is shown by its host (never its credentials), the value of a secret-named `key` as ``***``.
    """
    if secret_key(key):
        return REDACTED
    value = redact_text(value)
    if "://" in value:
        value = urlsplit(value).netloc.rpartition("@")[2] or value
    try:
        number = float(value)
    except ValueError:
        number = None
    if number is not None and not value.lstrip("+-").isdigit():
        value = f"{number:g}"
    elif "/" in value:
        value = PurePath(value.rstrip("/")).stem or value
    return value if len(value) <= MAX_VALUE_CHARS else value[: MAX_VALUE_CHARS - 1] + "…"


def run_name(config_files: Sequence[str], argv: Sequence[str] = ()) -> str:
    """A run's default name: `configs_name` followed by the command line's settings (see the module docstring)."""
    settings = command_line_settings(argv)
    last_parts = [key.rsplit(".", 1)[-1] for key, _ in settings]
    words = [configs_name(config_files)] if config_files else []
    for (key, value), last in zip(settings, last_parts, strict=True):
        words.append(f"{last if last_parts.count(last) == 1 else key}={show_value(value, key)}")
    return " ".join(words)
