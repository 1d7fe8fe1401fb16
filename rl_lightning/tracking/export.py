"""Hugging Face export of the trained model: full (unsharded) weights + tokenizer, loadable by transformers.

The export holds a model card, ``README.md`` (`rl_lightning.tracking.model_card`), so the folder can be shared as it is.

A LoRA model (`rl_lightning.models.lora`) is exported merged, plus its PEFT adapter folder in ``adapter/``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from rl_lightning.compat import mlflow as mlflow_compat
from rl_lightning.errors import ConfigError
from rl_lightning.memory.phases import phase

log = logging.getLogger(__name__)


def full_state_dict(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor (FSDP2/TP shard) gathered to a full CPU tensor.

    Collective under FSDP2/TP: every rank must call it. Tensors are gathered one at a time; a rank with `keep` false
    (every rank but the one that writes) drops each full tensor as soon as it is gathered and returns an empty dict,
    so only the writer ever holds the whole model (torch's ``StateDictOptions(full_state_dict=True,
    cpu_offload=True)`` semantics). Tied weights (one parameter under two names) are gathered once and share the
    returned tensor.
    """
    from rl_lightning.engines.weights import full_tensor

    state: dict[str, torch.Tensor] = {}
    gathered: dict[int, str] = {}  # id of the parameter -> the first name it was gathered under
    # keep_vars: the parameters themselves, so a tie is the same object on every rank (the collectives stay in step)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in gathered:  # a tied weight: gathered once
            if keep:
                state[name] = state[gathered[id(tensor)]]
            continue
        gathered[id(tensor)] = name
        with torch.no_grad():
            full = full_tensor(tensor)
        if keep:
            state[name] = (full.detach() if full is tensor else full).cpu()
        del full
    return state


def export_hf(model: Any, tokenizer_name: str, dirpath: str | Path, is_global_zero: bool = True) -> None:
    """Write ``save_pretrained`` of `model` (gathered) and of the tokenizer `tokenizer_name` to `dirpath`.

    A PEFT (LoRA) model is written merged (base + adapters, the same layout as a full model) and its adapters to
    ``dirpath/adapter`` (``peft.PeftModel.from_pretrained(base, dirpath/adapter)``).
    """
    with phase("export"):
        _export(model, tokenizer_name, dirpath, is_global_zero)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # no rank leaves (and tears down the process group) while rank 0 writes


def _export(model: Any, tokenizer_name: str, dirpath: str | Path, is_global_zero: bool) -> None:
    from rl_lightning.models.loading import load_tokenizer
    from rl_lightning.models.lora import is_peft
    from rl_lightning.parallel.checkpoint_io import publish_folder, temporary_path

    state = full_state_dict(model, keep=is_global_zero)  # only the writer holds the gathered model
    if is_global_zero:
        # written whole under a hidden name, then renamed into place: a kill mid-export leaves the previous export
        # (or none), never a folder of half-written weights that loads
        final = Path(dirpath)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = temporary_path(final)
        staging.mkdir()
        if is_peft(model):
            export_lora(model, state, staging)
        else:
            model.save_pretrained(staging, state_dict=state)
        load_tokenizer(tokenizer_name).save_pretrained(staging)
        _ordinary_permissions(staging)
        publish_folder(staging, final)
        log.info("exported Hugging Face model to %s", dirpath)


def export_lora(model: Any, state: dict[str, torch.Tensor], dirpath: Path) -> None:
    """Write a PEFT model's adapter folder (``dirpath/adapter``) and its merged weights (``dirpath``).

    They are written from its gathered state dict `state`. A CPU copy is rebuilt on the meta device and given `state`'s
    tensors, so the training model (sharded or not) is left as it is.
    """
    from peft import get_peft_model

    from rl_lightning.models.lora import base_model

    inner, name = base_model(model), model.active_adapter
    with torch.device("meta"):
        copy = get_peft_model(type(inner)(inner.config), model.peft_config[name], adapter_name=name)
    # clones: on a CPU run `state` shares the training weights, which merging would change in place
    copy.load_state_dict({name: tensor.clone() for name, tensor in state.items()}, assign=True)
    copy.get_base_model().tie_weights()  # assign=True leaves tied embeddings as two tensors
    copy.save_pretrained(dirpath / "adapter")
    _ordinary_permissions(dirpath / "adapter")
    copy.merge_and_unload().save_pretrained(dirpath)


def _ordinary_permissions(dirpath: Path) -> None:
    """Give every exported file the mode a new file gets under the user's umask.

    Safetensors writes its weight files through a private temporary file (mode 0600); with the umask's mode the export
    can be served by another user or container.
    """
    import os

    umask = os.umask(0)
    os.umask(umask)
    for path in dirpath.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


class HFExport(L.Callback):
    """Export the task's model in Hugging Face format when training ends, and log it to MLflow (global rank 0).

    The module must have ``model`` (a transformers ``PreTrainedModel``) and ``lm.name`` (its tokenizer).
    Every ``MLFlowLogger`` run gets the export as an MLflow logged model tagged with the run's lineage (recipe, data
    and environment hashes, git commit: `rl_lightning.tracking.lineage`).

    Args:
        dirpath: output folder (``save_pretrained`` layout; load it with ``AutoModelForCausalLM.from_pretrained``);
            default: ``export/`` in the run's output folder through the CLI (`rl_lightning.cli.outputs.RunOutputs`),
            ``exports/model`` otherwise.
        log_model: log the export as an MLflow model of the run (the run's "Logged models").
        log_weights: store the weights in MLflow too (a copy of the export: loadable with
            ``mlflow.transformers.load_model``); false: only config and tokenizer files, pointing at ``dirpath``.
        registered_model_name: also register the logged model in the MLflow model registry under this name (a new
            version per run, with the lineage as tags); null: not registered.
        model_card: write the model card ``README.md`` (and the resolved config) into the export
            (`rl_lightning.tracking.model_card`).
    """

    def __init__(self, dirpath: str | None = None, log_model: bool = True, log_weights: bool = True,
                 registered_model_name: str | None = None, model_card: bool = True) -> None:
        if registered_model_name is not None and not registered_model_name.strip():
            raise ConfigError("HFExport.registered_model_name is empty: name the registered model (e.g. my-model) "
                              "or leave it null")
        if registered_model_name is not None and not log_model:
            raise ConfigError(f"HFExport.registered_model_name={registered_model_name!r} needs log_model: true (only a "
                              "logged model can be registered); set log_model: true or registered_model_name: null")
        self.dirpath, self.log_model, self.log_weights = dirpath, log_model, log_weights
        self.registered_model_name, self.model_card = registered_model_name, model_card

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning.pytorch.loggers import MLFlowLogger

        from rl_lightning.tracking import lineage

        dirpath = self.dirpath or "exports/model"
        export_hf(pl_module.model, pl_module.lm.name, dirpath, trainer.is_global_zero)
        if not trainer.is_global_zero:
            return
        loggers = [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger)]
        try:
            tags = lineage.collect(trainer, pl_module) if self.model_card or (loggers and self.log_model) else {}
        except Exception as e:  # noqa: BLE001 - e.g. the data file moved during the run: the export stands without
            log.warning("could not read the run's lineage for the export: %s", e)
            tags = {}
        if self.model_card:
            self._write_card(trainer, pl_module, dirpath, tags)
        if self.log_model:
            try:
                self._log_to_mlflow(loggers, dirpath, tags)
            except Exception as e:  # noqa: BLE001 - the trained model is on disk: a tracking failure must not fail the run
                log.error("could not log the export %s to MLflow (%s: %s); it is on disk, log or register it by hand",
                          dirpath, type(e).__name__, str(e).splitlines()[0] if str(e) else "")

    @staticmethod
    def _write_card(trainer: L.Trainer, pl_module: L.LightningModule, dirpath: str, tags: dict[str, str]) -> None:
        from rl_lightning.tracking.model_card import write_card

        try:
            write_card(dirpath, trainer, pl_module, tags)
        except Exception as e:  # noqa: BLE001 - the model is exported: a failed card must not fail the run
            log.error("could not write the model card of %s (%s: %s)", dirpath, type(e).__name__, e)

    def _log_to_mlflow(self, loggers: list[Any], dirpath: str, tags: dict[str, str]) -> None:
        from rl_lightning.tracking import lineage

        for logger in loggers:
            client, run_id = logger.experiment, logger.run_id
            name = lineage.model_name(client.get_run(run_id).info.run_name)
            model = lineage.log_model(client, mlflow_compat.tracking_uri(logger), run_id, dirpath, tags, self.log_weights, name)
            log.info("logged the export as MLflow model %s", model.model_uri)
            if self.registered_model_name is not None:
                version = lineage.register(client, self.registered_model_name, model, run_id, tags)
                client.set_tag(run_id, "registered_model",
                               f"{self.registered_model_name}/{version.version}")
                log.info("registered %s version %s", self.registered_model_name, version.version)
