"""The CLI's MLflow logger: one step axis for MLflow, the terminal and the plots, and counters only when they move.

``rl_lightning.tracking.logger.MLFlowLogger`` is Lightning's ``MLFlowLogger`` (same arguments, same class name, so
``isinstance`` checks and recipes that name a logger by its class keep working) with two changes once it follows a
trainer (`MLflowTracking` makes every logger of this class follow its trainer at setup), and the run's headline
charts first:

- **Step.** Every value is logged at the run's own step, `steps_done`: rollouts done for PPO-family tasks (the
  terminal's ``rollout 10/40``, the ``rollout`` and ``step`` columns of ``rollout_samples.json``), optimizer steps
  done for the others. A step's ``train/*`` values sit at that step, a validation after it at the same step, the
  validation of the starting policy (and the data counters) at 0. Lightning's own logger puts a step's values one
  step earlier (the number of batches stepped *before* it) and adds an ``epoch`` metric to every call.
- **Counters.** The names in `COUNTERS` are logged only when their value changes: counters that start at 0 (OOM
  retries, refills, reward failures and timeouts, skipped steps, dropped rows, and Lightning's ``epoch``) not at all
  while they stay 0, and values that rarely change (``train/trajectories``, ``train/max_length_per_device``) once
  and then on change. A constant line is not a chart worth drawing, and a counter's MLflow history is its changes.
- **Headline first.** The MLflow run page groups charts into sections named by the metric's name up to its last
  ``/`` and orders the sections by name, capitals first: ``data``, ``memory``, ... came before the reward. The
  `HEADLINE` metrics are also logged under ``Summary/``, the page's first section: the training reward, the held-out
  accuracy (the ``correct`` component on the validation prompts) and the held-out reward.

Without a trainer (used on its own) it logs exactly as Lightning's.

- **Rank 0 only.** Lightning's logger opens an MLflow client, and so the tracking store, in every process: with a
  ``sqlite:`` store on a shared file system, every rank of a multi-node job creates and migrates the same database at
  start-up (and on a node-local disk leaves an empty ``mlflow.db`` behind). Only global rank 0 logs, so the other
  ranks make no client at all (`NoClient`: any use raises, naming the rank).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

# name -> the value taken as already logged at the start (0.0: a counter; None: log the first value)
COUNTERS: dict[str, float | None] = {
    "epoch": 0.0,  # Lightning adds it to every call: a chart only for runs of several epochs
    "train/oom_retries": 0.0,
    "train/refills": 0.0,
    "train/reward_failures": 0.0,
    "train/skipped_steps": 0.0,
    "train/empty_steps": 0.0,  # optimizer steps on an all-zero gradient (rl_lightning.models.optim.optimizer_step)
    "rollout/reward_timeouts": 0.0,
    "rollout/engine_restarts": 0.0,  # engine: vllm_process
    "rollout/reward_model_failures": 0.0,  # failed requests to a served reward model
    "train/trajectories": None,
    "train/max_length_per_device": None,
}
COUNTER_SUFFIXES = {"_dropped": 0.0}  # data/train_dropped, data/val_dropped, ...: rows dropped by the data checks
# metric -> its copy in the run page's first chart section (`Summary` sorts before every lower-case section name)
HEADLINE = {"train/reward": "Summary/reward", "val/reward/correct": "Summary/held-out accuracy",
            "val/reward": "Summary/held-out reward"}


def steps_done(trainer: Any) -> int:
    """The run's step: rollouts done (PPO-family tasks, ``pl_module.rollouts``), else optimizer steps done."""
    return int(getattr(trainer.lightning_module, "rollouts", trainer.global_step))


def counter_start(name: str) -> tuple[bool, float | None]:
    """Whether `name` is logged only on change, and the value taken as logged at the start."""
    if name in COUNTERS:
        return True, COUNTERS[name]
    for suffix, start in COUNTER_SUFFIXES.items():
        if name.endswith(suffix):
            return True, start
    return False, None


class NoClient:
    """The MLflow client of a rank other than global rank 0, which never logs: made without touching the store."""

    def __init__(self, tracking_uri: str | None = None, *args: Any, **kwargs: Any) -> None:
        self.tracking_uri = tracking_uri

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"MLflow is used from global rank {rank_zero_only.rank} (client.{name}); only rank 0 "
                           "logs: guard the call with lightning's rank_zero_only or trainer.is_global_zero")


class MLFlowLogger(LightningMLFlowLogger):
    """Lightning's ``MLFlowLogger`` logging at the run's step, counters only when they move (see the module)."""

    _followed: Any = None  # the Trainer whose steps it logs at
    _last: dict[str, float | None]  # counter -> the value last logged (set by `follow`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Lightning's arguments (LightningCLI reads them through this call); the client is made where Lightning's
        # __init__ imports it, so a non-zero rank swaps in `NoClient` for that call only
        import mlflow.tracking

        real = mlflow.tracking.MlflowClient
        if getattr(rank_zero_only, "rank", 0) != 0:
            mlflow.tracking.MlflowClient = NoClient  # type: ignore[misc,assignment]
        try:
            super().__init__(*args, **kwargs)
        finally:
            mlflow.tracking.MlflowClient = real  # type: ignore[misc]

    def follow(self, trainer: Any) -> None:
        """Log at `trainer`'s `steps_done` from now on."""
        self._followed, self._last = trainer, {}

    def changed(self, metrics: dict[str, float]) -> dict[str, float]:
        """`metrics` without the counters whose value is the one last logged (records the others)."""
        kept = {}
        for name, value in metrics.items():
            is_counter, start = counter_start(name)
            if is_counter:
                if self._last.get(name, start) == float(value):
                    continue
                self._last[name] = float(value)
            kept[name] = value
        return kept

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._followed is not None:
            step = steps_done(self._followed)
            metrics = self.changed(metrics)
            if not metrics:
                return
            metrics = {**metrics, **{HEADLINE[name]: value for name, value in metrics.items() if name in HEADLINE}}
        super().log_metrics(metrics, step)
