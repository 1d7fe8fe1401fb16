"""The run's one seed: ``seed_everything`` drives the data order and every sampling seed of the rollouts.

LightningCLI resolves ``seed_everything`` before the classes are built (an int as given; ``true``: one drawn at
random, logged and saved in ``config.yaml``). `run_seed` reads that value; `hand_seed` gives it to the DataModule as a
plain int (its ``seed`` attribute), where the data order and the rollout callback read it. Nothing else reads the
seed from the environment.

``seed_everything: false`` is read as ``true``: the rollouts need a seed (no two requests may share a random
stream, and a run must be repeatable from its log), so one is drawn at random once, with Lightning's
``seed_everything`` (the processes Lightning launches inherit it), and logged.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def run_seed(config: Any) -> int:
    """The run's seed from the parsed config's ``seed_everything`` (``false``: drawn at random once and logged)."""
    value = config.get("seed_everything")
    if isinstance(value, bool) or value is None:
        import lightning as L

        value = L.seed_everything(workers=True)
        log.warning("seed_everything is false: the data order and the sampling seeds use seed %d "
                    "(seed_everything: %d repeats them)", value, value)
    return int(value)


def hand_seed(datamodule: Any, seed: int) -> None:
    """Give `datamodule` the run's seed (rl_lightning's DataModules have a ``seed`` attribute; others are left)."""
    if datamodule is not None and hasattr(datamodule, "seed"):
        datamodule.seed = seed
