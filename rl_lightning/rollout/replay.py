"""Replayable rollouts: the rollout dump's format (version 2) and its replay, ``model.rollout.replay``.

A dump (written by ``rl_lightning.callbacks.rollout_dump.RolloutDump``) is a folder holding ``manifest.json`` (what must agree
for a replay: the model, a fingerprint of its tokenizer, the rollout's shape; plus the sampling settings, for the
record) and per rank ``rollouts-rank<r>-<n>.jsonl``, one JSON line per trajectory (`trajectory_record`): the exact
token ids, completion mask and engine log-probabilities, the reward and its components, the prompt's dataset index,
its place in the rollout and the rollout's counters. Floats are written with Python's shortest round-trip ``repr``,
so they read back bit for bit.

A replay (`ReplayDump`) rebuilds each rollout's `Rollout` from its lines instead of sampling and scoring: no engine
is built and no reward function runs, and since the PPO update only reads what the dump holds, a replayed run on
the same seed and device makes the same updates, bit for bit, as the run that dumped them. A folder that was written
by another format, another model or tokenizer, another rollout shape, or that lacks a rollout the run needs is
refused at start-up with one line (`ReplayDump.check`).

A dump is data read back as data: an unreadable manifest, a file in the folder whose name is not a dump file's
(``rollouts-rank<r>-<n>.jsonl``), or a line that is not a trajectory record is refused in one line naming the file
and line. The one exception is the last line of a file when it lacks its newline: that is the line a killed run was
writing, so it is skipped with a warning (the rollout it belonged to then counts as incomplete, which `check` refuses
only if the run needs that rollout). A damaged line anywhere else is not a kill's doing and stops the replay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rl_lightning.data.datamodule import run_seed
from rl_lightning.data.prompts import Prompt
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.config import RolloutConfig
from rl_lightning.rollout.trajectory import Rollout, Trajectory

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 1: conversations and rewards only (before replay)
MANIFEST = "manifest.json"
# manifest keys a replay must agree with, and the setting each comes from
MUST_MATCH = {"model_name": "model.lm.name", "tokenizer": "the tokenizer of model.lm.name",
              "responses_per_prompt": "model.rollout.responses_per_prompt", "batch_size": "data.batch_size",
              "world_size": "the number of processes (trainer.devices x trainer.num_nodes)"}
# the keys a training line must hold for `_read_rollouts` and `_trajectory`
LINE_KEYS = ("rollout", "trajectory", "trajectories", "group_size", "reward_names", "reward_failures", "refills",
             "prompt_index", "prompt_tokens", "prompt_messages", "input_ids", "completion_mask", "engine_logprobs",
             "messages", "answer", "prompt_row", "finished", "turns", "reward", "reward_components",
             "completion_length")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A SHA-256 of what turns text into the dumped token ids: the vocabulary, the chat template, EOS and pad."""
    content = {"vocab": sorted(tokenizer.get_vocab().items()), "chat_template": tokenizer.chat_template,
               "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def manifest(model_name: str, tokenizer: Any, config: RolloutConfig, batch_size: int | None, world_size: int,
             filter_range: tuple[float, float] | None = None, seed: int = 0) -> dict[str, Any]:
    """The dump's ``manifest.json``: the keys of `MUST_MATCH`, then the sampling settings (not checked)."""
    return {"format": FORMAT_VERSION, "model_name": model_name, "tokenizer": tokenizer_fingerprint(tokenizer),
            "responses_per_prompt": config.responses_per_prompt, "batch_size": batch_size, "world_size": world_size,
            "engine": config.engine_spec.kind, "temperature": config.temperature, "top_p": config.top_p,
            "top_k": config.top_k, "max_new_tokens": config.max_new_tokens, "max_turns": config.max_turns,
            "seed": seed, "filter_range": filter_range}


def run_manifest(trainer: Any, task: Any, config: RolloutConfig, filter_range: tuple[float, float] | None = None
                 ) -> dict[str, Any]:
    """The `manifest` of the run `trainer` fits `task` (the PPO task: ``model_name``, ``tokenizer``) in.

    `filter_range` is ``model.dapo.filter_range`` (dynamic sampling: the rollouts hold refilled prompts); the seed is
    the run's (``seed_everything``, the DataModule's).
    """
    datamodule = getattr(trainer, "datamodule", None)
    batch_size = getattr(datamodule, "hparams", {}).get("batch_size")
    return manifest(task.model_name, task.tokenizer, config, batch_size, trainer.world_size, filter_range,
                    run_seed(datamodule))


def trajectory_record(trajectory: Trajectory, position: int, rollout: Rollout) -> dict[str, Any]:
    """The replay fields of one JSONL line: `trajectory`, its `position` in `rollout` (this rank's), the counters."""
    t = trajectory
    return {"format": FORMAT_VERSION, "trajectory": position, "trajectories": len(rollout.trajectories),
            "group_size": rollout.group_size, "reward_names": rollout.reward_names,
            "reward_failures": rollout.reward_failures, "refills": rollout.refills, "prompt_index": t.prompt.index,
            "prompt_tokens": len(t.prompt.prompt_ids), "prompt_messages": len(t.prompt.messages),
            "input_ids": t.input_ids, "completion_mask": t.completion_mask, "engine_logprobs": t.engine_logprobs}


def _trajectory(line: dict[str, Any]) -> Trajectory:
    prompt = Prompt(line["input_ids"][: line["prompt_tokens"]], line["messages"][: line["prompt_messages"]],
                    line["answer"], line["prompt_row"], line["prompt_index"])
    return Trajectory(prompt, line["input_ids"], line["completion_mask"], line["engine_logprobs"], line["messages"],
                      line["finished"], line["turns"], line["reward"], line["reward_components"],
                      generated_tokens=line["completion_length"])  # checked by `_length_error`


def _length_error(line: dict[str, Any]) -> str | None:
    """Why `line`'s ``completion_length`` cannot be what its completion generated (None: it can).

    That is the number of tokens its ``completion_mask`` counts or, for a cut completion that overlong filtering left
    out of the loss (a mask of zeros), up to the tokens after the prompt.
    """
    length, mask, ids, prompt_tokens = (line[k] for k in ("completion_length", "completion_mask", "input_ids",
                                                           "prompt_tokens"))
    if not isinstance(ids, list) or type(prompt_tokens) is not int or not 0 <= prompt_tokens <= len(ids):
        return f"has prompt_tokens {repr(prompt_tokens)[:20]} that is not a count of its input_ids"
    if not isinstance(mask, list) or len(mask) != len(ids) or any(type(m) is not int or m not in (0, 1) for m in mask):
        return "has a completion_mask that is not one 0 or 1 per input id"
    kept, room = sum(mask), len(ids) - prompt_tokens
    dropped = kept == 0 and line["finished"] is False  # cut, and left out of the loss
    if type(length) is not int or not (length == kept or dropped and 0 < length <= room):
        return (f"has completion_length {repr(length)[:20]}, but its completion_mask counts {kept} tokens (only a "
                f"cut completion left out of the loss may have more, up to the {room} after its prompt)")
    return None


class ReplayDump:
    """The dumped training rollouts of one rank, read from `dirpath` (``model.rollout.replay``).

    Args:
        dirpath: the dump's folder.
        rank: the process's global rank (it replays its own files).

    Raises:
        ConfigError: one line: no folder, no manifest, or a manifest of another format.
    """

    def __init__(self, dirpath: str, rank: int) -> None:
        self.key = f"model.rollout.replay={dirpath}"
        self.dirpath, self.rank = Path(dirpath), rank
        path = self.dirpath / MANIFEST
        if not path.is_file():
            raise ConfigError(f"{self.key}: no {MANIFEST} there; point it at the rollouts/ folder a run with "
                              "rl_lightning.callbacks.rollout_dump.RolloutDump wrote")
        try:
            self.manifest = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{self.key}: {path} is not JSON ({e}); dump the run again, or restore the file") from None
        if not isinstance(self.manifest, dict):
            raise ConfigError(f"{self.key}: {path} is not a dump manifest (a JSON object); dump the run again")
        if self.manifest.get("format") != FORMAT_VERSION:
            raise ConfigError(f"{self.key}: dump format {self.manifest.get('format')}, this version replays format "
                              f"{FORMAT_VERSION}; dump the run again with this version")
        self.lines = _read_rollouts(self.dirpath, rank)

    @classmethod
    def start(cls, trainer: Any, task: Any, config: RolloutConfig, filter_range: tuple[float, float] | None = None
              ) -> ReplayDump:
        """This rank's dump for the run `trainer` fits `task` in, checked at start-up (before any model loads).

        Raises:
            ConfigError: one line: validation would need an engine, or `check` refuses the dump.
        """
        dirpath = str(config.replay)
        datamodule = getattr(trainer, "datamodule", None)
        if getattr(datamodule, "val_dataloader", None) is not None and trainer.limit_val_batches != 0:
            raise ConfigError(f"model.rollout.replay={dirpath} builds no engine, so held-out prompts cannot be "
                              "scored: set trainer.limit_val_batches: 0 or drop data.val_path/val_paths")
        dump = cls(dirpath, trainer.global_rank)
        dump.check(run_manifest(trainer, task, config, filter_range), [], filter_range is not None)
        return dump

    def check(self, current: dict[str, Any], rollouts: Iterable[int], filtered: bool) -> None:
        """Refuse, with one line, a dump that cannot replay this run.

        Args:
            current: this run's `manifest`.
            rollouts: the rollout indices (0-based, as sampled) the run will train on.
            filtered: dynamic sampling was on (a rollout's trajectories may then be fewer than a full batch).

        Raises:
            ConfigError: the manifests disagree on a `MUST_MATCH` key, or a rollout is missing or incomplete.
        """
        errors = [f"{what} is {current[k]!r} but the dump has {self.manifest.get(k)!r}"
                  for k, what in MUST_MATCH.items() if self.manifest.get(k) != current[k]]
        if not errors:
            errors = self._rollout_errors(list(rollouts), current, filtered)
        if errors:
            raise ConfigError(f"{self.key} cannot be replayed: " + "; ".join(errors) + "; replay with the dumped "
                              "run's settings, or dump this run (rl_lightning.callbacks.rollout_dump.RolloutDump, keep_files: 0)")

    def _rollout_errors(self, rollouts: list[int], current: dict[str, Any], filtered: bool) -> list[str]:
        missing = [k + 1 for k in rollouts if k + 1 not in self.lines]  # the dump numbers rollouts from 1
        errors = []
        if missing:
            have = sorted(self.lines)
            errors.append(f"rank {self.rank} lacks rollout(s) {_ranges(missing)} (the run needs "
                          f"{_ranges([k + 1 for k in rollouts])}, the dump has {_ranges(have) or 'none'})")
        full = current["batch_size"] * current["responses_per_prompt"]
        for number in (k + 1 for k in rollouts if k + 1 in self.lines):
            lines = self.lines[number]
            count = lines[0]["trajectories"]
            if len(lines) != count or [line["trajectory"] for line in lines] != list(range(count)):
                errors.append(f"rollout {number} of rank {self.rank} holds {len(lines)} of its {count} trajectories")
            elif (count != full if not filtered else count % current["responses_per_prompt"]):
                errors.append(f"rollout {number} of rank {self.rank} holds {count} trajectories, this run's batch "
                              f"{full} (data.batch_size x model.rollout.responses_per_prompt)")
        return errors

    def rollout(self, index: int, prompts: list[Prompt] | None) -> Rollout:
        """Rollout `index` (0-based, as sampled) as the callback built it, without its timings.

        Args:
            index: the rollout's index (the task's completed rollouts).
            prompts: the batch's prompts, to check against the dumped groups' (None: not checked, as under dynamic
                sampling, which draws its own).

        Raises:
            ConfigError: the dumped groups sampled other prompts than this batch holds (other data or shuffling).
        """
        lines = self.lines[index + 1]
        first = lines[0]
        trajectories = [_trajectory(line) for line in lines]
        if prompts is not None:
            dumped = [t.prompt.index for t in trajectories[:: first["group_size"]]]
            if dumped != [p.index for p in prompts]:
                raise ConfigError(f"{self.key}: rollout {index + 1} of rank {self.rank} sampled prompts {dumped}, "
                                  f"this run's batch holds {[p.index for p in prompts]}: replay with the dumped "
                                  "run's data.path, data.shuffle and seed")
        return Rollout(trajectories, first["group_size"], first["reward_names"], first["reward_failures"],
                       first["refills"])


def _read_rollouts(dirpath: Path, rank: int) -> dict[int, list[dict[str, Any]]]:
    """Rank `rank`'s training lines by rollout number; a rollout written again (a resumed run) keeps the last.

    Raises:
        ConfigError: one line: a stray file name, or a line that is not a trajectory record (see the module).
    """
    rollouts: dict[int, list[dict[str, Any]]] = {}
    for path in dump_files(dirpath, rank):
        for number, line in _records(dirpath, path):
            if line.get("split") != "train":
                continue
            missing = [key for key in LINE_KEYS if key not in line]
            if line.get("format") != FORMAT_VERSION or missing:
                what = f"lacks {', '.join(missing[:3])}" if line.get("format") == FORMAT_VERSION else \
                    f"is not a format {FORMAT_VERSION} line"
                raise ConfigError(f"model.rollout.replay={dirpath}: {path.name} line {number} {what}; dump the run "
                                  "again with this version")
            error = _length_error(line)
            if error:
                raise ConfigError(f"model.rollout.replay={dirpath}: {path.name} line {number} {error}; the dump is "
                                  "damaged: dump the run again")
            if line["trajectory"] == 0:  # a rollout starts (again)
                rollouts[line["rollout"]] = []
            rollouts.setdefault(line["rollout"], []).append(line)
    return rollouts


def dump_files(dirpath: Path, rank: int, where: str = "model.rollout.replay") -> list[Path]:
    """Rank `rank`'s dump files in write order; a stray name among them is refused in one line naming `where`."""
    named = re.compile(rf"rollouts-rank{rank}-(\d+)\.jsonl")
    files = sorted(dirpath.glob(f"rollouts-rank{rank}-*"))
    stray = [p.name for p in files if not named.fullmatch(p.name)]
    if stray:
        raise ConfigError(f"{where}={dirpath}: {stray[0]} is not a dump file (rollouts-rank{rank}-<n>"
                          ".jsonl, as RolloutDump names them); move it out of the folder")
    return sorted(files, key=lambda p: int(named.fullmatch(p.name).group(1)))  # type: ignore[union-attr]


def _records(dirpath: Path, path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The JSON objects of dump file `path` with their line numbers; a torn last line (no newline) is skipped."""
    key = f"model.rollout.replay={dirpath}"
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {path.name} is not UTF-8 text ({e.reason} at byte {e.start}); dump the run "
                          "again") from None
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as e:  # json.JSONDecodeError, or an integer too long to convert
            if number == len(lines) and not text.endswith("\n"):
                log.warning("%s: %s line %d is cut short (the run was stopped while writing it): skipped", key,
                            path.name, number)
                break
            why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e).split(";")[0]
            raise ConfigError(f"{key}: {path.name} line {number} is not JSON ({why}); "
                              "dump the run again, or remove the line and replay a rollout before it") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{key}: {path.name} line {number} is not a trajectory record (a JSON object); dump "
                              "the run again")
        records.append((number, record))
    return records


def _ranges(numbers: list[int]) -> str:
    """``1-3, 5`` for [1, 2, 3, 5]."""
    parts: list[str] = []
    for n in sorted(numbers):
        if parts and int(parts[-1].rpartition("-")[2]) == n - 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{n}"
        else:
            parts.append(str(n))
    return ", ".join(parts)
