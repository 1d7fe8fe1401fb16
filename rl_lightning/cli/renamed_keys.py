"""Config keys that were renamed or moved to another group, and where a user's config still writes one.

A recipe, an overlay, a ``--config`` file or a command-line option written before a key moved (``model.model_name``,
now ``model.lm.name``) stops the CLI before jsonargparse parses anything, with one line naming the old key, the new
one and where it was written::

    model.model_name was renamed: write model.lm.name in old.yaml (see docs/configuration.md)

`RENAMED` is the one table of old key -> new key, both as the user writes them (dotted, without ``init_args``). A key
under an old one moves with it (``model.lora.r`` -> ``model.lm.lora.r``). Add a line when a key moves; the test
parametrized over this table checks each line gives its error from a real parse.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

DOCS = "docs/configuration.md"

# old key -> new key, as the user writes them (``init_args`` levels left out)
RENAMED: dict[str, str] = {
    # issue 38: one model group for every task (rl_lightning.models.config.LMConfig)
    "model.model_name": "model.lm.name",
    "model.optim": "model.lm.optim",
    "model.lora": "model.lm.lora",
    "model.gradient_checkpointing": "model.lm.gradient_checkpointing",
    "model.lean_activations": "model.lm.lean_activations",
    "model.attn_implementation": "model.lm.attn_implementation",
    "model.lm_head_chunk": "model.lm.lm_head_chunk",
    "model.memory_check": "model.lm.memory_check",
    # issue 38: one checkpointing switch
    "trainer.strategy.activation_checkpointing": "model.lm.gradient_checkpointing",
    # issue 38: DAPO's keys left the rollout group (rl_lightning.rollout.config.DAPOConfig)
    "model.rollout.filter_range": "model.dapo.filter_range",
    "model.rollout.max_refill_rounds": "model.dapo.max_refill_rounds",
    "model.rollout.overlong_cache_length": "model.dapo.overlong_cache_length",
    "model.rollout.mask_truncated": "model.dapo.mask_truncated",
    # the engine is a group whose kind carries its keys (``model.rollout.engine: {kind: vllm, tp_size: 2}``)
    "model.rollout.engine_tp_size": "model.rollout.engine.tp_size",
    "model.rollout.engine_devices": "model.rollout.engine.devices",
    "model.rollout.engine_timeout_s": "model.rollout.engine.timeout_s",
    "model.rollout.engine_restarts": "model.rollout.engine.restarts",
    "model.rollout.max_model_len": "model.rollout.engine.max_model_len",
    "model.rollout.kv_cache_memory_bytes": "model.rollout.engine.kv_cache_memory_bytes",
    "model.rollout.gpu_memory_utilization": "model.rollout.engine.gpu_memory_utilization",
    "model.rollout.weight_bucket_mb": "model.rollout.engine.weight_bucket_mb",
    "model.rollout.weight_sync": "model.rollout.engine.weight_sync",
    "model.rollout.seed": "seed_everything",  # one seed drives the data order and every sampling seed
}


def new_key(key: str, table: dict[str, str] | None = None) -> str | None:
    """The key `key` is now (``model.lora.r`` -> ``model.lm.lora.r``), or None when it was not renamed.

    The longest old key that is `key` or a group above it wins; a key already under its new name is not renamed
    (an old key may be a group above its own new one).
    """
    table = RENAMED if table is None else table
    old = max((name for name in table if key == name or key.startswith(name + ".")), key=len, default=None)
    if old is None:
        return None
    new = table[old]
    if key == new or key.startswith(new + "."):
        return None
    return new + key[len(old):]


def find_renamed(value: Any, key: str = "", table: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """``(old key, new key)`` for each renamed key set in a config value (its own key, then the keys inside it).

    Args:
        value: A value as the user wrote it: a YAML mapping is looked through, ``init_args`` levels left out.
        key: Where `value` sits (``model``; empty for a whole config file).
        table: The renames (default `RENAMED`).
    """
    if key and (new := new_key(key, table)):
        yield key, new
        return
    if isinstance(value, dict):
        for name, item in value.items():
            if name in ("class_path", "__path__"):
                continue
            inner = key if name == "init_args" else f"{key}.{name}" if key else str(name)
            yield from find_renamed(item, inner, table)


def renamed_error(argv: Sequence[str], table: dict[str, str] | None = None) -> str | None:
    """The one line for the first renamed key the command line or its ``--config`` files set, else None."""
    from rl_lightning.cli.config_check import COMMAND_LINE, read_settings, user_key

    for setting in read_settings(argv):
        if setting.key in ("config", "c", "help") or setting.key.endswith((".help", "print_config")):
            continue
        for old, new in find_renamed(setting.value, user_key(setting.key), table):
            where = "on the command line" if setting.where == COMMAND_LINE else f"in {setting.where}"
            written = f"--{new}" if setting.where == COMMAND_LINE else new
            return f"{old} was renamed: write {written} {where} (see {DOCS})"
    return None


def rename_hparams(hparams: dict[str, Any], table: dict[str, str] | None = None) -> dict[str, Any]:
    """A checkpoint's task hyperparameters (keys as under ``model.``) with each renamed key under its new name.

    A checkpoint saved before a rename stores ``model_name``; this run's hyperparameters say ``lm.name``. Keys moved
    out of ``model.`` (to ``seed_everything``) are dropped.
    """
    out: dict[str, Any] = {}
    for old, value in _leaves_renamed(hparams, "model", table):
        parts = old.removeprefix("model.").split(".")
        place = out
        for group in parts[:-1]:
            if isinstance(place.get(group), str):  # a group written by its kind alone (``engine: vllm``)
                place[group] = {"kind": place[group]}
            place = place.setdefault(group, {})
        place[parts[-1]] = value
    return out


def _leaves_renamed(value: dict[str, Any], key: str, table: dict[str, str] | None) -> Iterator[tuple[str, Any]]:
    """``(key under its new name, value)`` for the renamed keys and the leaves of `value`, groups looked through."""
    for name, item in value.items():
        inner = f"{key}.{name}"
        if new := new_key(inner, table):
            if new.startswith("model."):
                yield new, item
        elif isinstance(item, dict) and item:
            yield from _leaves_renamed(item, inner, table)
        else:
            yield inner, item
