"""Pins `rl_lightning.compat.lightning`: each private Lightning name it uses still exists, with the shape it relies on,
and Lightning still calls the private methods its mixins override.

A failure names the private name, the versions tested and the module to update (`_pinned`).
"""

import inspect
from importlib.metadata import version
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import ModelParallelStrategy

from rl_lightning.compat import lightning as compat


def _pinned(condition: object, name: str, change: str = "is gone") -> None:
    assert condition, (f"{compat.TESTED} (installed {version('lightning')}): {name} {change}; "
                       "update rl_lightning/compat/lightning.py")


def _method(owner: type, name: str, parameters: list[str]) -> None:
    method = getattr(owner, name, None)
    _pinned(callable(method), f"{owner.__name__}.{name}")
    found = list(inspect.signature(method).parameters)
    found = found if isinstance(inspect.getattr_static(owner, name), staticmethod) else found[1:]
    _pinned(found == parameters, f"{owner.__name__}.{name}", f"takes {found}, not {parameters}")


def test_the_private_methods_the_mixins_override_keep_their_signatures():
    _method(ModelParallelStrategy, "_configure_launcher", [])
    _method(ModelParallelStrategy, "_setup_distributed", [])
    _method(ModelParallelStrategy, "_get_process_group_backend", [])
    _method(ModelCheckpoint, "_link_checkpoint", ["trainer", "filepath", "linkpath"])
    _method(ModelCheckpoint, "_remove_checkpoint", ["trainer", "filepath"])
    _method(LightningCLI, "_parse_ckpt_path", [])
    _method(Callback, "_generate_state_key", ["kwargs"])


class _Hooked(compat.StrategyHooks, ModelParallelStrategy):
    calls: list[str]

    def before_launch(self) -> None:
        self.calls.append("before_launch")

    def backend_when_unset(self) -> str | None:
        return "gloo-of-ours"


def test_lightning_calls_the_launcher_step_and_the_hooks_see_the_strategys_state():
    strategy = _Hooked(timeout=torch.distributed.constants.default_pg_timeout)
    strategy.calls = []
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    _pinned(strategy.calls == ["before_launch"], "ModelParallelStrategy._configure_launcher",
            "is no longer called while the Trainer is built")
    _pinned(hasattr(strategy, "_process_group_backend"), "ModelParallelStrategy._process_group_backend")
    assert compat.process_group_backend(strategy) == "gloo-of-ours"  # the user named none
    strategy._process_group_backend = "nccl"
    assert compat.process_group_backend(strategy) == "nccl"  # the user's choice wins
    _pinned(compat.process_group_timeout(strategy) == torch.distributed.constants.default_pg_timeout,
            "ModelParallelStrategy._timeout")
    _pinned(compat.saves_distributed_checkpoint(strategy) is True, "ModelParallelStrategy._save_distributed_checkpoint")


def test_the_checkpoint_io_and_device_mesh_attributes():
    strategy = ModelParallelStrategy()
    _pinned(hasattr(strategy, "_checkpoint_io"), "Strategy._checkpoint_io")
    assert compat.checkpoint_io_if_set(strategy) is None
    compat.set_checkpoint_io(strategy, "io")
    assert strategy.checkpoint_io == "io"
    assert compat.device_mesh(strategy) is None and compat.device_mesh(object()) is None
    module = L.LightningModule()
    strategy._lightning_module = module
    compat.set_device_mesh(strategy, "mesh")
    _pinned(module.device_mesh == "mesh", "LightningModule._device_mesh", "is no longer what device_mesh returns")
    assert compat.device_mesh(strategy) == "mesh"
    _pinned(compat.module_trainer(module) is None and "_trainer" in vars(module), "LightningModule._trainer")


def test_the_checkpoint_link_hooks_see_the_last_save(tmp_path):
    class Hooked(compat.CheckpointLinkHooks, ModelCheckpoint):
        def before_remove_checkpoint(self, trainer, filepath, last_saved):
            seen.append((filepath, last_saved))

    seen: list = []
    callback = Hooked(dirpath=tmp_path)
    _pinned(getattr(callback, "_last_checkpoint_saved", None) == "", "ModelCheckpoint._last_checkpoint_saved")
    callback._last_checkpoint_saved = "new.ckpt"
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    (tmp_path / "old.ckpt").write_text("x")
    callback._remove_checkpoint(trainer, str(tmp_path / "old.ckpt"))
    assert seen == [(str(tmp_path / "old.ckpt"), "new.ckpt")] and not (tmp_path / "old.ckpt").exists()


def test_the_private_functions_and_classes():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    assert compat.is_local_path(Path("/tmp/x")) and not compat.is_local_path("s3://bucket/x")
    assert compat.empty_wrapper(AsyncCheckpointIO()) and not compat.empty_wrapper(object())
    model = torch.nn.Linear(2, 2)
    compat.record_device(model, torch.device("cpu"))  # a plain module: nothing recorded, no error
    module = L.LightningModule()
    compat.record_device(module, torch.device("meta"))
    _pinned(module.device == torch.device("meta"), "device_dtype_mixin._update_properties", "no longer records")
    from lightning.fabric.strategies.model_parallel import _load_checkpoint

    _pinned({"path", "state", "strict", "weights_only"} <= set(inspect.signature(_load_checkpoint).parameters),
            "lightning.fabric.strategies.model_parallel._load_checkpoint", "changed its parameters")
    assert compat.callback_state_key(Callback(), threshold=1) == "Callback{'threshold': 1}"


@pytest.mark.parametrize("name", ["_parse_ckpt_path"])
def test_the_cli_mixin_replaces_lightnings_ckpt_path_parsing(name):
    class CLI(compat.KeepArgumentsOnCkptPath, LightningCLI):
        pass

    _pinned(getattr(LightningCLI, name) is not getattr(CLI, name), f"LightningCLI.{name}")
    assert CLI._parse_ckpt_path(object()) is None  # does nothing: the model's arguments stay


def test_lightning_hand_offs_we_rely_on():
    """Moved from tests/parallel/test_strategy.py: what ParallelStrategy relies on beside the names above."""
    assert callable(ModelParallelStrategy._setup_distributed)
    module = L.LightningModule()
    module._device_mesh = "mesh"
    assert module.device_mesh == "mesh"
    assert isinstance(ModelParallelStrategy.distributed_sampler_kwargs, property)
