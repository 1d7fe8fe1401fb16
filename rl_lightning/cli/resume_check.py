"""``--ckpt_path``: resume only the run a checkpoint belongs to, or take its weights alone (``--load_weights_only``).

A resume restores everything (weights, optimizer and schedule, loops, callbacks, the rollout counters) and trains on
as if never stopped, which is only meaningful under the checkpoint's own run. So before anything is loaded (no
weights, no engine) the CLI compares the checkpoint's stored hyperparameters (and the policy's tensor shapes) with
this run's and refuses, in one line naming every difference, a checkpoint of

- another task (``model.class_path``),
- another model (``model.lm.name``, ``model.ref_model_name``, ``model.reference_free``, ``model.lm.lora``, a critic
  that appears or goes) or an architecture that no longer matches the model folder's ``config.json`` (layers, hidden
  size, vocabulary),
- another rollout mode (``model.rollout.engine.kind``, ``model.rollout.async_steps``).

Everything else (learning rate, ``max_rollouts``, time limits, ...) may change on resume. ``--load_weights_only true``
takes the checkpoint's model weights only and starts a new run under this config: step 0, a fresh optimizer and
schedule, a new run folder and MLflow run; the weights must still fit the model (same names and shapes).

A checkpoint is data (`rl_lightning.parallel.checkpoint_trust`): before it is compared, a damaged one (truncated, or
a byte changed since its save, per its digest) is refused in one line naming the previous complete checkpoint, and
one that needs more than a weights-only load (pickle of arbitrary objects: it could run code) is refused in one line
unless ``--trust_checkpoint true``. Every read here and Lightning's own load are weights-only without that flag.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from rl_lightning.algorithms.advantages import CRITIC_ESTIMATORS  # PPO's estimators that train a critic
from rl_lightning.cli.renamed_keys import rename_hparams
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.checkpoint_trust import load_file, read_dcp_metadata, refuse_damaged, refuse_untrusted

# hyperparameters (dotted, as in the CLI under `model.`) whose change makes a checkpoint another run's
IDENTITY = ("lm.name", "ref_model_name", "reference_free", "lm.lora", "rollout.engine.kind", "rollout.async_steps")
SWITCH = "--load_weights_only true"
TRUST = "--trust_checkpoint true"
LAYER = re.compile(r"\.layers\.(\d+)\.")


def check_resume(fit_config: Any, model: L.LightningModule, trainer: L.Trainer) -> None:
    """Refuse ``--ckpt_path`` from another run, or turn it into a weights-only start (``--load_weights_only``).

    Args:
        fit_config: the ``fit`` subcommand's instantiated config (``ckpt_path``, ``load_weights_only``); a
            weights-only start sets its ``ckpt_path`` to None and adds a `WeightsFromCheckpoint` to the trainer.
        model: the instantiated task.
        trainer: the instantiated trainer.

    Raises:
        ConfigError: one line naming the checkpoint and what differs (and the two ways on), or a checkpoint that
            does not exist.
    """
    path = fit_config.get("ckpt_path")
    weights_only, trust = bool(fit_config.get("load_weights_only")), bool(fit_config.get("trust_checkpoint"))
    if fit_config.get("weights_only") is False and not trust:
        raise ConfigError(f"--weights_only false unpickles the checkpoint in full (it could run code): pass {TRUST} "
                          "to load a checkpoint you trust as code")
    fit_config["weights_only"] = not trust  # Lightning's own load (`trainer.fit(weights_only=...)`)
    if path is None or str(path) in ("last", "best", "hpc", "registry") or "://" in str(path):
        if weights_only and path is not None:
            raise ConfigError(f"--load_weights_only needs the checkpoint's path, got --ckpt_path {path}: name the "
                              "file (or the sharded checkpoint's folder)")
        return  # no checkpoint, or one Lightning looks up (or fetches) itself
    if not os.path.lexists(path):
        raise ConfigError(f"--ckpt_path {path} does not exist (resolved to {Path(path).resolve()})")
    refuse_damaged(path)
    if not trust:
        refuse_untrusted(path)
    if weights_only:
        fit_config["ckpt_path"] = None  # a new run: step 0, fresh optimizer, schedule and loops
        trainer.callbacks.append(WeightsFromCheckpoint(str(path), trust))
        return
    stored, shapes = read_checkpoint(str(path), trust)
    stored = rename_hparams(stored)  # a checkpoint saved before a key moved: its keys under their new names
    differences = compare(stored, dict(model.hparams), type(model).__name__)
    differences += architecture_differences(shapes, getattr(getattr(model, "lm", None), "name", None))
    if differences:
        raise ConfigError(f"--ckpt_path {path} is a checkpoint of another run: {'; '.join(differences)} "
                          f"(checkpoint -> this run); resume with the checkpoint's settings, or pass {SWITCH} to "
                          "start a new run from its weights")


def read_checkpoint(path: str, trust: bool = False) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """A checkpoint's task hyperparameters and tensor shapes (``state_dict`` names), read without its tensors.

    A ``.ckpt`` file (memory-mapped: only the pickle is read) or a sharded (DCP) folder (``meta.pt`` and DCP's
    ``.metadata``), weights-only unless `trust`.
    """
    if os.path.isdir(path):
        from torch.distributed.checkpoint import FileSystemReader

        meta = load_file(os.path.join(path, "meta.pt"), trust, mmap=False)
        reader = FileSystemReader(path).read_metadata if trust else lambda: read_dcp_metadata(Path(path))
        metadata = reader().state_dict_metadata
        shapes = {k.removeprefix("state_dict."): tuple(getattr(v, "size", ())) for k, v in metadata.items()}
        return dict(meta.get("hyper_parameters") or {}), shapes
    checkpoint = load_file(path, trust)
    shapes = {k: tuple(v.shape) for k, v in (checkpoint.get("state_dict") or {}).items() if hasattr(v, "shape")}
    return dict(checkpoint.get("hyper_parameters") or {}), shapes


def compare(stored: dict[str, Any], current: dict[str, Any], task: str) -> list[str]:
    """What differs between a checkpoint's hyperparameters and this run's, as ``key old -> new`` phrases."""
    old_task = str(stored.get("_class_path", "")).rsplit(".", 1)[-1]
    if old_task and old_task != task:
        return [f"model.class_path {old_task} -> {task}"]
    differences = []
    for key in IDENTITY:
        old, new = _get(stored, key), _get(current, key)
        if _same_place(old, new) != (old, old) and not (old is _MISSING or new is _MISSING):
            differences.append(f"model.{key} {_show(old)} -> {_show(new)}")
    if "advantage_estimator" in stored and "advantage_estimator" in current:
        critics = [stored["advantage_estimator"] in CRITIC_ESTIMATORS, current["advantage_estimator"] in
                   CRITIC_ESTIMATORS]
        if critics[0] != critics[1]:
            differences.append(f"model.advantage_estimator {stored['advantage_estimator']} -> "
                               f"{current['advantage_estimator']} ({'drops' if critics[0] else 'adds'} the critic)")
    return differences


def architecture_differences(shapes: dict[str, tuple[int, ...]], model_name: str | None) -> list[str]:
    """The policy's layers, hidden size and vocabulary in the checkpoint vs ``model_name``'s ``config.json``.

    Empty when they agree or cannot be told (no config, no embedding among the checkpoint's tensors).
    """
    policy = {k: v for k, v in shapes.items() if k.startswith("model.")}  # not the critic's
    embedding = next((v for k, v in policy.items() if k.endswith("embed_tokens.weight") and len(v) == 2), None)
    if model_name is None or embedding is None:
        return []
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_name)
    except Exception:  # noqa: BLE001 - no config to compare with: the model's own loading reports it
        return []
    layers = 1 + max((int(m.group(1)) for k in policy for m in [LAYER.search(k)] if m), default=-1)
    old = (layers, embedding[1], embedding[0])
    new = (getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None),
           getattr(config, "vocab_size", None))
    if old == new or None in new:
        return []
    return [f"architecture of model.lm.name {model_name!r}: {_architecture(old)} -> {_architecture(new)}"]


class WeightsFromCheckpoint(L.Callback):
    """``--load_weights_only``: load a checkpoint's model weights at fit start, nothing else of it.

    After the strategy has set the model up (sharded, on its device) and before the first batch: a ``.ckpt`` file's
    full ``state_dict`` or a sharded folder's model shards, strictly (every name and shape must match).
    """

    def __init__(self, path: str, trust: bool = False) -> None:
        self.path, self.trust = path, trust

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Load the weights into `pl_module` (weights-only unless ``--trust_checkpoint``)."""
        try:
            if os.path.isdir(self.path):  # a sharded (DCP) checkpoint: ParallelStrategy's model, shard by shard
                from rl_lightning.compat.lightning import load_sharded_checkpoint

                load_sharded_checkpoint(Path(self.path), pl_module, weights_only=not self.trust)
            else:  # a full state dict: into a plain or a sharded model alike
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                state_dict = load_file(self.path, self.trust)["state_dict"]
                misfits = _misfits(state_dict, pl_module.state_dict())
                if misfits:
                    raise KeyError(misfits)
                set_model_state_dict(pl_module, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
        except (RuntimeError, KeyError, ValueError) as e:
            first = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip().splitlines()
            raise ConfigError(f"--ckpt_path {self.path} with --load_weights_only: its weights do not fit this model "
                              f"({' '.join(line.strip() for line in first[:3])[:400]}); use a checkpoint of the same "
                              "model (model.lm.name, model.lm.lora)") from None


_MISSING = object()


def _misfits(loaded: dict[str, Any], expected: dict[str, Any]) -> str:
    """What keeps `loaded` from fitting a module whose state dict is `expected` ("" when it fits)."""
    missing, unexpected = sorted(set(expected) - set(loaded)), sorted(set(loaded) - set(expected))
    shapes = sorted(k for k in set(expected) & set(loaded) if tuple(expected[k].shape) != tuple(loaded[k].shape))
    parts = [f"{what} {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''} ({len(keys)})"
             for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)) if keys]
    return "; ".join(parts)


def _get(hparams: dict[str, Any], dotted: str) -> Any:
    value: Any = hparams
    for part in dotted.split("."):
        if isinstance(value, str) and part == "kind":  # a group given by its kind alone (``engine: vllm``)
            return value
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


def _same_place(old: Any, new: Any) -> tuple[Any, Any]:
    """`old` twice when `new` is the same value or names the same local folder (relative vs absolute path)."""
    if old == new or (isinstance(old, str) and isinstance(new, str) and os.path.exists(old) and os.path.exists(new)
                      and os.path.realpath(old) == os.path.realpath(new)):
        return old, old
    return old, new


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _architecture(values: tuple[Any, ...]) -> str:
    layers, hidden, vocabulary = values
    return f"{layers} layers, hidden size {hidden}, vocabulary {vocabulary}"
