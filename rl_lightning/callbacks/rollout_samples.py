"""Sampled completions as a table in MLflow, and a few on the terminal: what the policy writes, and how it scores.

Every `every_n_rollouts` training rollouts (and the first), global rank 0 appends `rows` of its trajectories to the
table ``rollout_samples.json`` of every MLflow logger's run, one row per trajectory:

| column | |
| --- | --- |
| ``rollout`` | the rollout's number, counted from 1 (the task's ``train/rollouts``) |
| ``step`` | the run's step, where MLflow's charts put the rollout's ``train/*`` values (rollouts done: equal to ``rollout``; `rl_lightning.tracking.logger.steps_done`) |
| ``prompt`` | the prompt's last user message |
| ``answer`` | what the reward compares against (``str``: a reasoning-gym row's ``answer`` value; empty when none) |
| ``completion`` | what was generated after the prompt: the assistant text; multi-turn, every turn after the prompt, tool messages prefixed ``[tool]``, one per line |
| ``reward`` | the trajectory's (combined, shaped) reward |
| ``reward/<name>`` | each reward component (``model.rollout.reward_weights``) |
| ``completion_length`` | generated tokens |
| ``finished`` | ended with a stop token (not cut at ``max_new_tokens``) |

The rows are the first `rows` trajectories of rank 0's share: whole prompt groups first, so a prompt's completions sit
next to each other (their reward differences are what group-baseline advantages see).

The run has one growing table to browse and filter by ``rollout`` (the run's Artifacts tab, the Evaluation view, or
``MlflowClient().load_table``), not one file per rollout. It is written the way ``MlflowClient.log_table`` writes
one (pandas' ``split`` layout, ``{"columns": [...], "data": [[...], ...]}``, and the run tag that marks it a table),
but not with it: ``log_table`` appends by reading the file back with pandas' type inference, which turns answers
and completions such as ``"18"`` into numbers in the earlier rows. This callback keeps the rows it has written and
rewrites the file with the new ones; a resumed run (``MLFlowLogger(run_id=...)``) first reads the run's table back
(as JSON, types kept) and appends to it.

`print_samples` of the same rows are printed to the terminal, one line each (prompt and completion cut at
`max_chars`).

Training rollouts only: validation samples (``data.val_path``) are not logged. Other tasks (SFT, DPO, RM) have no
rollout in their batches; there the callback does nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import lightning as L
from typing_extensions import override

from rl_lightning.errors import ConfigError

if TYPE_CHECKING:
    from rl_lightning.rollout.trajectory import Rollout

log = logging.getLogger(__name__)

ARTIFACT_FILE = "rollout_samples.json"
WHERE = "rl_lightning.callbacks.rollout_samples.RolloutSamples"
PROGRESS_BAR_VARIABLE = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # what MLflow's UI reads to show an artifact as a table


class RolloutSamples(L.Callback):
    """Log a table of sampled completions to MLflow and print a few, every `every_n_rollouts` rollouts.

    Args:
        every_n_rollouts: log rollouts 1, N, 2N, ... (counted as ``train/rollouts``).
        rows: trajectories per logged rollout (rank 0's first ones, whole prompt groups first).
        print_samples: trajectories printed to the terminal per logged rollout (0: none).
        max_chars: printed fields are cut at this many characters (the table keeps the full text).
    """

    def __init__(self, every_n_rollouts: int = 10, rows: int = 8, print_samples: int = 1, max_chars: int = 120) -> None:
        errors = []
        if every_n_rollouts < 1:
            errors.append(f"every_n_rollouts must be >= 1, got {every_n_rollouts}")
        if rows < 1:
            errors.append(f"rows must be >= 1, got {rows}")
        if print_samples < 0:
            errors.append(f"print_samples must be >= 0 (0: print none), got {print_samples}")
        if max_chars < 1:
            errors.append(f"max_chars must be >= 1, got {max_chars}")
        if errors:
            raise ConfigError(f"{WHERE}: " + "; ".join(errors))
        self.every_n_rollouts, self.rows = every_n_rollouts, rows
        self.print_samples, self.max_chars = print_samples, max_chars
        self._seen = 0  # rollouts seen, for modules without a `rollouts` counter
        self._tables: dict[str, dict[str, list]] = {}  # run id -> the table written so far ({"columns", "data"})

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not isinstance(batch, dict) or "rollout" not in batch:
            return
        self._seen += 1
        number = int(getattr(pl_module, "rollouts", self._seen))  # counted after the update: this one included
        if not trainer.is_global_zero or not (number == 1 or number % self.every_n_rollouts == 0):
            return
        rollout = batch["rollout"]
        table = sample_table(rollout, number, number, self.rows)  # rollouts done: the run's step
        for logger in _mlflow_loggers(trainer):
            try:
                self._append(logger.experiment, logger.run_id, table)
            except Exception as e:  # noqa: BLE001 - never let logging kill rank 0 (the other ranks would hang)
                log.warning("could not log %s to MLflow: %s", ARTIFACT_FILE, str(e).splitlines()[0])
        for i in range(min(self.print_samples, len(table["prompt"]))):
            print(self._sample_text(table, i), flush=True)

    def _append(self, client: Any, run_id: str, table: dict[str, list]) -> None:
        """Add `table`'s rows to the run's table and rewrite it (new columns: earlier rows get null)."""
        if run_id not in self._tables:
            self._tables[run_id] = _read_table(client, run_id)
            _tag_as_table(client, run_id)
        columns, data = self._tables[run_id]["columns"], self._tables[run_id]["data"]
        new = [name for name in table if name not in columns]
        columns += new
        for row in data:
            row += [None] * len(new)
        data += [[table[name][i] if name in table else None for name in columns] for i in range(len(table["rollout"]))]
        client.log_dict(run_id, self._tables[run_id], ARTIFACT_FILE)

    def _sample_text(self, table: dict[str, list], i: int) -> str:
        r"""Sample `i` as one line: prompt and completion each cut at `max_chars`, newlines shown as ``\n``.

        For example ``sample @ rollout 10: 'What is 1 + 0?' -> '1' (answer 1) · reward 1.5 (correct 1 · format 1) · 2
        tokens``.
        """
        def text(name: str) -> str:
            return repr(_cut(str(table[name][i]).replace("\n", "\\n"), self.max_chars))

        components = " · ".join(f"{name.removeprefix('reward/')} {table[name][i]:.4g}" for name in table
                                if name.startswith("reward/"))
        answer = f" (answer {table['answer'][i]})" if table["answer"][i] != "" else ""
        finished = "" if table["finished"][i] else ", cut at max_new_tokens"
        return (f"sample @ rollout {table['rollout'][i]}: {text('prompt')} -> {text('completion')}{answer} · reward "
                f"{table['reward'][i]:.4g}{f' ({components})' if components else ''} · "
                f"{table['completion_length'][i]} tokens{finished}")


def reference_answer(answer: Any) -> str:
    """What the reward compares a completion against, as the table and the sample line show it.

    A structured answer (a reasoning-gym row's ``{'task': 'chain_sum', 'answer': '-31', 'metadata': {...}}``) shows its
    ``answer`` value (``-31``); any other answer as it is; none as ``""``.
    """
    if isinstance(answer, dict) and "answer" in answer:
        answer = answer["answer"]
    return "" if answer is None else str(answer)


def sample_table(rollout: Rollout, number: int, step: int, rows: int) -> dict[str, list]:
    """The table's columns (see the module docstring) for the first `rows` trajectories of `rollout`."""
    trajectories = rollout.trajectories[:rows]
    table: dict[str, list] = {
        "rollout": [number] * len(trajectories),
        "step": [step] * len(trajectories),
        "prompt": [_last_user_message(t.prompt.messages) for t in trajectories],
        "answer": [reference_answer(t.prompt.answer) for t in trajectories],
        "completion": [_completion(t.messages[len(t.prompt.messages) :]) for t in trajectories],
        "reward": [_number(t.reward) for t in trajectories],
    }
    for name in rollout.reward_names:
        table[f"reward/{name}"] = [_number(t.reward_components.get(name)) for t in trajectories]
    table["completion_length"] = [int(t.completion_length) for t in trajectories]
    table["finished"] = [bool(t.finished) for t in trajectories]
    return table


def _number(value: Any) -> float | None:
    """A float for the JSON table; None (null) for a missing or non-finite value (JSON has no NaN)."""
    return None if value is None or not math.isfinite(value) else float(value)


def _last_user_message(messages: list[dict]) -> str:
    return next((str(m.get("content", "")) for m in reversed(messages) if m.get("role") == "user"), "")


def _completion(generated: list[dict]) -> str:
    """The assistant text as is.

    In multi-turn conversations, other roles' messages (tool results) are prefixed with their role, one message per
    line.
    """
    return "\n".join(str(m.get("content", "")) if m.get("role") == "assistant" else f"[{m.get('role')}] "
                     f"{m.get('content', '')}" for m in generated)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _read_table(client: Any, run_id: str) -> dict[str, list]:
    """The run's table so far (a resumed run has one), or an empty one."""
    if ARTIFACT_FILE not in [f.path for f in client.list_artifacts(run_id)]:
        return {"columns": [], "data": []}
    with tempfile.TemporaryDirectory() as folder, _no_artifact_progress_bar():
        with open(client.download_artifacts(run_id, ARTIFACT_FILE, folder)) as f:
            table = json.load(f)
    return {"columns": list(table["columns"]), "data": [list(row) for row in table["data"]]}


def _tag_as_table(client: Any, run_id: str) -> None:
    """Mark the artifact as a table, as ``MlflowClient.log_table`` does (the UI lists it among the run's tables)."""
    tags = json.loads(client.get_run(run_id).data.tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
    entry = {"path": ARTIFACT_FILE, "type": "table"}
    if entry not in tags:
        client.set_tag(run_id, LOGGED_ARTIFACTS_TAG, json.dumps([*tags, entry]))


@contextlib.contextmanager
def _no_artifact_progress_bar() -> Iterator[None]:
    """MLflow's tqdm bar for an artifact download would cut into the terminal's progress bar."""
    before = os.environ.get(PROGRESS_BAR_VARIABLE)
    os.environ[PROGRESS_BAR_VARIABLE] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[PROGRESS_BAR_VARIABLE]
        else:
            os.environ[PROGRESS_BAR_VARIABLE] = before


def _mlflow_loggers(trainer: L.Trainer) -> list[Any]:
    from lightning.pytorch.loggers import MLFlowLogger

    return [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger)]
