"""The DataModule skeleton every task's data shares.

Load → validate → tokenise into packing units (once, at ``setup``, so bad rows fail before training) → serve one
optimizer step per batch through `StepDataset`.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import lightning as L
from lightning.fabric.utilities.data import AttributeDict
from torch.utils.data import DataLoader
from typing_extensions import override

from rl_lightning.data.loading import Rows, load_rows
from rl_lightning.data.steps import (
    StepDataset,
    check_batching_args,
    check_enough_rows,
)
from rl_lightning.errors import ConfigError
from rl_lightning.parallel.reductions import process_groups

log = logging.getLogger(__name__)


def load_tokenizer_for_data(name: str | None) -> Any:
    """Load the tokenizer `name`; raises `ConfigError` when it is unset (the CLI links it from the model name)."""
    if name is None:
        raise ConfigError("data.tokenizer_name is not set (the CLI links it from model.lm.name)")
    from rl_lightning.models.loading import load_tokenizer

    return load_tokenizer(name)


def saved_hparams(datamodule: L.LightningDataModule) -> AttributeDict:
    """The ``__init__`` arguments a DataModule stored with ``save_hyperparameters()``, read by attribute.

    Lightning annotates ``hparams`` as any ``MutableMapping``; ``save_hyperparameters()`` always stores an
    `AttributeDict`.
    """
    return cast(AttributeDict, datamodule.hparams)


def run_seed(datamodule: Any) -> int:
    """The run's one seed (``seed_everything``), as the CLI handed it to `datamodule`'s ``seed`` (0 without one)."""
    return int(getattr(datamodule, "seed", 0))


class StepDataModule(L.LightningDataModule):
    """Base of the task DataModules.

    Subclasses implement `build_units(rows, name)`, returning the packing units and their row locations, and document
    their own arguments (the common ones are described in the subclasses).

    Attributes:
        seed: the run's one seed (the data order here; the rollout's sampling seeds read it too). The CLI sets it
            from ``seed_everything``; from Python, set it before ``fit`` (default 0).
    """

    seed: int = 0

    def __init__(
        self,
        path: str,
        tokenizer_name: str | None,
        val_path: str | None,
        split: str,
        max_length: int,
        batch_size: int,
        packing: bool,
        max_length_per_device: int,
        micro_batch_size: int,
        shuffle: bool,
    ) -> None:
        super().__init__()
        check_batching_args(max_length, batch_size, packing, max_length_per_device, micro_batch_size)
        self.tokenizer = load_tokenizer_for_data(tokenizer_name)
        self.units: dict[str, list[Any]] = {}
        self.stats: dict[str, int] = {}
        if val_path is None:
            # Lightning skips validation when the hook is absent (`is_overridden` is False for None).
            self.val_dataloader = None  # type: ignore[method-assign,assignment]

    def build_units(self, rows: Rows, name: str) -> tuple[list[Any], list[str]]:
        """Tokenise the rows of split `name` (``train``/``val``); returns the packing units and their row locations."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_units(rows, name)")

    @override
    def setup(self, stage: str) -> None:
        hp = saved_hparams(self)
        cp_size = getattr(getattr(self.trainer, "strategy", None), "cp_size", 1)
        if cp_size > 1 and not hp.packing:
            raise ConfigError(f"strategy.context_parallel_size={cp_size} splits packed sequences; set data.packing: true")
        for name, path in (("train", hp.path), ("val", hp.val_path)):
            if path and name not in self.units:
                units, _ = self.build_units(load_rows(path, hp.split), name)
                self.units[name] = units
        check_enough_rows(len(self.units["train"]), hp.batch_size, process_groups(self.trainer).dp_size, hp.path)

    def count(self, name: str, rows: int, truncated: int, dropped: int, source: str, what: str) -> None:
        """Record (and warn about) rows, truncations and drops.

        They become ``data/<name>_*`` metrics, which the CLI's ``rl_lightning.tracking.mlflow_run.MLflowTracking``
        logs at train start.
        """
        self.stats.update({f"data/{name}_rows": rows, f"data/{name}_truncated": truncated,
                           f"data/{name}_dropped": dropped})
        if truncated or dropped:
            log.warning("%s: %d of %d %s were truncated to data.max_length=%d; %d dropped (see data/%s_dropped)",
                        source, truncated, rows, what, saved_hparams(self).max_length, dropped, name)

    def _loader(self, units: list[Any], shuffle: bool, resumable: bool) -> DataLoader:
        hp = saved_hparams(self)
        groups = process_groups(self.trainer)
        dp_rank, dp_size = groups.dp_rank, groups.dp_size
        trainer = self.trainer
        dataset = StepDataset(
            units, hp.batch_size, dp_rank, dp_size, hp.packing, hp.max_length_per_device, hp.micro_batch_size,
            self.tokenizer.pad_token_id, shuffle, lambda: trainer.current_epoch if trainer else 0,
            # Lightning does not fast-forward iterable datasets when resuming mid-epoch: start where training stopped.
            (lambda: trainer.fit_loop.epoch_loop.batch_progress.current.completed) if resumable and trainer else
            (lambda: 0),
            drop_remainder=resumable, seed=self.seed,
        )
        return DataLoader(dataset, batch_size=None)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.units["train"], saved_hparams(self).shuffle, resumable=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.units["val"], False, resumable=False)
