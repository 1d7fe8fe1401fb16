"""The run's Pareto archive of rollouts (``model.rollout.pareto_archive_size``), kept by the rollout callback.

One point per training rollout: the mean of each reward component over the rollout's trajectories, summed over the
data-parallel ranks (so every rank holds the same archive), i.e. the sampling policy's performance at that step. The
archive keeps the non-dominated rollouts (at most `max_size`, evicting the least exclusive hypervolume contributor,
`rl_lightning.algorithms.pareto.update_archive`): the run's Pareto-optimal policies, i.e. which checkpoints to look
at. Each entry stores the rollout's number (counted from 1, as ``train/rollouts``) and ``trainer.global_step`` when it
was sampled (the sampling policy is the one after that many optimizer steps).

Logged every rollout: ``train/hypervolume`` (against ``pareto_reference``) and ``train/pareto_size``; whenever the
archive changes, global rank 0 rewrites ``pareto_archive.json`` in every MLflow logger's run, in the table layout the
MLflow UI shows as a table (``{"columns": [...], "data": [[...], ...]}``, tagged as ``MlflowClient.log_table`` does).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from rl_lightning.algorithms.pareto import exclusive_contributions, hypervolume, update_archive

log = logging.getLogger(__name__)

ARTIFACT_FILE = "pareto_archive.json"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # what MLflow's UI reads to show an artifact as a table


class ParetoArchive:
    """Bounded non-dominated archive of per-rollout reward-component means (all maximised).

    Args:
        names: the reward components, in the order of every point's coordinates.
        max_size: most entries kept.
        reference: hypervolume reference point per component (default 0.0 each).
    """

    def __init__(self, names: list[str], max_size: int, reference: dict[str, float] | None = None) -> None:
        self.names, self.max_size = list(names), max_size
        self.reference = torch.tensor([(reference or {}).get(n, 0.0) for n in self.names], dtype=torch.float64)
        self.entries: list[dict[str, Any]] = []  # {"rollout", "step", "means"}, oldest first
        self._tagged: set[str] = set()  # MLflow runs whose artifact is tagged as a table

    def points(self) -> torch.Tensor:
        """(N, K) the entries' component means."""
        return torch.tensor([e["means"] for e in self.entries], dtype=torch.float64).reshape(-1, len(self.names))

    def add(self, means: list[float], rollout: int, step: int) -> bool:
        """Offer one rollout's component means; True when the archive changed (the rollout entered it)."""
        candidates = [*self.entries, {"rollout": rollout, "step": step, "means": [float(m) for m in means]}]
        points = torch.tensor([e["means"] for e in candidates], dtype=torch.float64)  # (N + 1, K)
        kept = update_archive(points, self.reference, self.max_size).tolist()
        self.entries = [candidates[i] for i in kept]
        return len(candidates) - 1 in kept

    def metrics(self) -> dict[str, float]:
        """``train/hypervolume`` and ``train/pareto_size``."""
        return {"train/hypervolume": hypervolume(self.points(), self.reference),
                "train/pareto_size": float(len(self.entries))}

    def table(self) -> dict[str, list]:
        """The archive as ``{"columns", "data"}``: rollout, step, ``reward/<name>`` means, exclusive hypervolume."""
        contributions = exclusive_contributions(self.points(), self.reference).tolist()
        columns = ["rollout", "step", *(f"reward/{n}" for n in self.names), "hypervolume_contribution"]
        data = [[e["rollout"], e["step"], *e["means"], c] for e, c in zip(self.entries, contributions, strict=True)]
        return {"columns": columns, "data": data}

    def log_to(self, loggers: list[Any]) -> None:
        """Rewrite the artifact in every MLflow logger's run (call on global rank 0 only)."""
        table = self.table()
        for logger in loggers:
            try:
                client, run_id = logger.experiment, logger.run_id
                if run_id not in self._tagged:
                    tags = json.loads(client.get_run(run_id).data.tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
                    entry = {"path": ARTIFACT_FILE, "type": "table"}
                    if entry not in tags:
                        client.set_tag(run_id, LOGGED_ARTIFACTS_TAG, json.dumps([*tags, entry]))
                    self._tagged.add(run_id)
                client.log_dict(run_id, table, ARTIFACT_FILE)
            except Exception as e:  # noqa: BLE001 - never let logging kill rank 0 (the other ranks would hang)
                log.warning("could not log %s to MLflow: %s", ARTIFACT_FILE, str(e).splitlines()[0])

    def state_dict(self) -> dict[str, Any]:
        """The component names and the archive's entries, for the checkpoint (`load_state_dict` continues it)."""
        return {"names": self.names, "entries": [dict(e) for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpointed archive (entries of other components are dropped: the reward changed)."""
        if state.get("names") != self.names:
            log.warning("the checkpoint's Pareto archive has components %s, not %s: starting a new one",
                        state.get("names"), self.names)
            return
        self.entries = [dict(e) for e in state.get("entries", [])]
