"""Hugging Face export of the trained model: full (unsharded) weights + tokenizer, loadable by transformers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch

log = logging.getLogger(__name__)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor (FSDP2/TP shard) gathered to a full CPU tensor.

    Collective under FSDP2/TP: every rank must call it.
    """
    from rl_lightning.rollout.weights import full_tensor

    return {name: full_tensor(tensor).detach().cpu() for name, tensor in model.state_dict().items()}


def export_hf(model: Any, tokenizer_name: str, dirpath: str | Path, is_global_zero: bool = True) -> None:
    """Write ``save_pretrained`` of `model` (gathered) and of the tokenizer `tokenizer_name` to `dirpath`."""
    from rl_lightning.models import load_tokenizer

    state = full_state_dict(model)
    if is_global_zero:
        model.save_pretrained(dirpath, state_dict=state)
        load_tokenizer(tokenizer_name).save_pretrained(dirpath)
        _ordinary_permissions(Path(dirpath))
        log.info("exported Hugging Face model to %s", dirpath)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank leaves (and tears down the process group) while rank 0 writes


def _ordinary_permissions(dirpath: Path) -> None:
    """safetensors writes its weight files through a private temporary file (mode 0600): give every exported file
    the mode a new file gets under the user's umask, so the export can be served by another user or container."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for path in dirpath.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


class HFExport(L.Callback):
    """Export the task's model in Hugging Face format when training ends.

    The module must have ``model`` (a transformers ``PreTrainedModel``) and ``hparams.model_name`` (its tokenizer).

    Args:
        dirpath: output folder (``save_pretrained`` layout; load it with ``AutoModelForCausalLM.from_pretrained``);
            default: ``exports/<run name>`` through the CLI, ``exports/model`` otherwise.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        export_hf(pl_module.model, pl_module.hparams.model_name, self.dirpath or "exports/model", trainer.is_global_zero)
