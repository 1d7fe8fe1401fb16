"""Lightning's private names, behind named functions and three mixins (tested on lightning 2.5-2.6).

Lightning offers no public hook for some steps this package changes; the mixins override the private method and
call a public one of ours instead, so the private name appears only here:

- `StrategyHooks` (before ``ModelParallelStrategy``): ``_configure_launcher`` calls `before_launch`,
  ``_setup_distributed`` calls `before_process_group`, ``_get_process_group_backend`` asks `backend_when_unset`;
- `CheckpointLinkHooks` (before ``ModelCheckpoint``): ``_link_checkpoint`` is `link_checkpoint`,
  ``_remove_checkpoint`` calls `before_remove_checkpoint` with the last checkpoint saved;
- `KeepArgumentsOnCkptPath` (before ``LightningCLI``): ``_parse_ckpt_path`` does nothing (Lightning would replace
  the model's arguments with the checkpoint's hyperparameters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TESTED = "lightning 2.5-2.6"


class StrategyHooks:
    """Public hooks on ``ModelParallelStrategy``'s private launch and process-group steps (put it first in the bases)."""

    def before_launch(self) -> None:
        """Called in the launching process, before Lightning makes its launcher (and starts the other processes)."""

    def before_process_group(self) -> None:
        """Called in every process right before Lightning initialises the default process group."""

    def backend_when_unset(self) -> str | None:
        """The process-group backend to use when the user named none; None: Lightning's default for the device."""
        return None

    def _configure_launcher(self) -> None:
        self.before_launch()
        super()._configure_launcher()  # type: ignore[misc]

    def _setup_distributed(self) -> None:
        self.before_process_group()
        super()._setup_distributed()  # type: ignore[misc]

    def _get_process_group_backend(self) -> str:
        chosen = self._process_group_backend  # type: ignore[attr-defined]
        backend = None if chosen is not None else self.backend_when_unset()
        return backend or super()._get_process_group_backend()  # type: ignore[misc]


class CheckpointLinkHooks:
    """Public hooks on ``ModelCheckpoint``'s private ``last`` link and top-k removal (put it first in the bases)."""

    def link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:
        """Point `linkpath` (``last.ckpt``) at `filepath`; Lightning's way unless overridden."""
        super()._link_checkpoint(trainer, filepath, linkpath)  # type: ignore[misc]

    def before_remove_checkpoint(self, trainer: Any, filepath: str, last_saved: str) -> None:
        """Called before Lightning removes a checkpoint it no longer keeps; `last_saved` is the newest save's path."""

    def _link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:
        self.link_checkpoint(trainer, filepath, linkpath)

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        self.before_remove_checkpoint(trainer, filepath, self._last_checkpoint_saved)  # type: ignore[attr-defined]
        super()._remove_checkpoint(trainer, filepath)  # type: ignore[misc]


class KeepArgumentsOnCkptPath:
    """``--ckpt_path FILE`` keeps the run's model arguments (put it first in ``LightningCLI``'s bases).

    Lightning would replace them with the checkpoint's hyperparameters, silently (a changed model or learning rate
    ignored; and only for a file, not ``last``).
    """

    def _parse_ckpt_path(self) -> None:
        pass


def setup_distributed(strategy: Any) -> None:
    """Lightning's process-group set-up of `strategy` (``_setup_distributed``)."""
    strategy._setup_distributed()


def process_group_backend(strategy: Any) -> str:
    """The backend `strategy` initialises its process group with (``_get_process_group_backend``)."""
    return str(strategy._get_process_group_backend())


def process_group_timeout(strategy: Any) -> Any:
    """`strategy`'s collective timeout (``_timeout``)."""
    return strategy._timeout


def device_mesh(strategy: Any) -> Any:
    """A ``ModelParallelStrategy``'s device mesh (``_device_mesh``); None for other strategies or before set-up."""
    return getattr(strategy, "_device_mesh", None)


def set_device_mesh(strategy: Any, mesh: Any) -> None:
    """Make `mesh` the strategy's mesh and, when attached, its module's ``device_mesh`` (``_device_mesh`` of both)."""
    strategy._device_mesh = mesh
    module = getattr(strategy, "lightning_module", None)
    if module is not None:
        module._device_mesh = mesh


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether `strategy` saves sharded (DCP) checkpoints (``_save_distributed_checkpoint``)."""
    return bool(strategy._save_distributed_checkpoint)


def checkpoint_io_if_set(strategy: Any) -> Any:
    """The CheckpointIO given to `strategy`, None if none (``_checkpoint_io``; the property would make the default)."""
    return strategy._checkpoint_io


def set_checkpoint_io(strategy: Any, io: Any) -> None:
    """Give `strategy` the CheckpointIO `io` without going through the property (``_checkpoint_io``)."""
    strategy._checkpoint_io = io


def empty_wrapper(io: Any) -> bool:
    """Whether `io` is one of Lightning's wrapping CheckpointIO plugins with nothing wrapped yet."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    return isinstance(io, _WrappingCheckpointIO) and io.checkpoint_io is None


def is_local_path(path: str | Path) -> bool:
    """Whether `path` is on the local file system, not a remote URL (``cloud_io._is_local_file_protocol``)."""
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

    return bool(_is_local_file_protocol(path))


def module_trainer(module: Any) -> Any:
    """The Trainer `module` is attached to, None when it is not (``_trainer``; the property raises instead)."""
    return getattr(module, "_trainer", None)


def record_device(module: Any, device: Any) -> None:
    """Record `device` as the device of `module` and its submodules, moving no tensor (``_update_properties``)."""
    from lightning.fabric.utilities.device_dtype_mixin import _update_properties

    _update_properties(module, device=device)


def load_sharded_checkpoint(path: Path, module: Any, weights_only: bool) -> None:
    """Load a sharded (DCP) checkpoint folder's ``state_dict`` into `module`, strictly (fabric's ``_load_checkpoint``)."""
    from lightning.fabric.strategies.model_parallel import _load_checkpoint

    _load_checkpoint(path, {"state_dict": module}, strict=True, weights_only=weights_only)


def callback_state_key(callback: Any, **identity: Any) -> str:
    """A callback's state key made from its class and `identity` as Lightning makes them (``_generate_state_key``)."""
    return str(callback._generate_state_key(**identity))
