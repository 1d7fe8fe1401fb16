"""Any reasoning-gym task as RL, SFT or preference data (optional: ``pip install -e ".[reasoning]"``).

reasoning-gym generates verifiable reasoning problems procedurally (``basic_arithmetic``, ``chain_sum``,
``gsm_symbolic``, ``countdown``, … 100+ tasks) and scores answers with each task's own ``score_answer``. Here a task
becomes rows in the project's formats:

- RL: ``{"messages": [system, user], "answer": {"task", "answer", "metadata"}}``: the answer field carries what the
  task's scorer needs, so one reward function (`rl_lightning.rewards.reasoning_gym.reward_fn`) scores every task;
- SFT: the same prompt with the reference answer as the assistant turn;
- preference: chosen = the reference answer, rejected = a wrong one (a nearby number, or another question's answer).

Two ways in. A data path ``reasoning_gym:TASK[:SPLIT][?key=value&...]`` is generated in memory wherever a data file is
accepted (``data.path``, ``data.val_path``; `rl_lightning.data.loading.load_rows`): SPLIT (or the key ``split``) is
``train`` (default) or ``test``; keys ``train_size`` (default 1000), ``test_size`` (200), ``seed`` (0), ``format`` (``rl``, ``sft`` or
``preference``), ``system_prompt``, and any field of the task's config (``min_terms=2``). The two splits are drawn from
one seeded stream and share no question. Or write JSONL files to look at, edit or ship:
``python -m rl_lightning.data.reasoning_gym chain_sum --out data/chain_sum`` (``--list`` names the tasks).
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import re
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from rl_lightning.errors import ConfigError

SCHEME = "reasoning_gym:"
EXTRA_HINT = 'pip install -e ".[reasoning]"'
SYSTEM_PROMPT = "Reply with the final answer only."
FORMATS = ("rl", "sft", "preference")
SPLITS = ("train", "test")
_DEFAULTS = {"train_size": 1000, "test_size": 200, "seed": 0, "format": "rl", "system_prompt": SYSTEM_PROMPT}


def import_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module; a `ConfigError` with the install hint when it is not installed."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"reasoning-gym is not installed; install it with {EXTRA_HINT}") from None
    return reasoning_gym


def task_names() -> list[str]:
    """The names of all reasoning-gym tasks, sorted."""
    from reasoning_gym.factory import DATASETS

    import_reasoning_gym()
    return sorted(DATASETS)


def check_task(task: str) -> None:
    """Raise a `ConfigError` suggesting close names when reasoning-gym has no task `task`."""
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"reasoning-gym has no task '{task}'; {hint}`python -m rl_lightning.data.reasoning_gym "
                          "--list` names all of them")


def _json_safe(value: Any) -> Any:
    """Metadata as JSON would store it (tuples become lists, unknown objects strings).

    So in-memory rows score exactly like rows read back from a written file.
    """
    return json.loads(json.dumps(value, default=str))


@lru_cache(maxsize=8)
def generate(task: str, train_size: int, test_size: int, seed: int, config: tuple = ()) -> dict[str, list[dict]]:
    """Entries (``question``, ``answer``, ``metadata``) of both splits.

    The first `test_size` distinct questions of the seeded stream are the test split, the next `train_size` distinct
    ones the training split.
    """
    rg = import_reasoning_gym()
    check_task(task)
    if train_size < 0 or test_size < 0 or train_size + test_size < 1:
        raise ConfigError(f"reasoning_gym:{task}: train_size and test_size must be >= 0 (not both 0), got "
                          f"{train_size}, {test_size}")
    wanted = train_size + test_size
    try:
        dataset = rg.create_dataset(task, seed=seed, size=4 * wanted + 100, **dict(config))
    except (TypeError, AssertionError, ValueError) as e:
        raise ConfigError(f"reasoning_gym:{task}: bad task config {dict(config)} ({e})") from None
    seen, entries = set(), []
    for index in range(len(dataset)):
        entry = dataset[index]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            entries.append({"question": entry["question"], "answer": str(entry["answer"]),
                            "metadata": _json_safe(entry.get("metadata", {}))})
        if len(entries) == wanted:
            break
    if len(entries) < wanted:
        raise ConfigError(f"reasoning_gym:{task}: only {len(entries)} distinct questions in {len(dataset)} draws, "
                          f"{wanted} wanted; lower train_size/test_size or widen the task config")
    return {"test": entries[:test_size], "train": entries[test_size:]}


def _prompt(entry: dict, system_prompt: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": entry["question"]}]


def _wrong_answer(entry: dict, others: list[dict], rng: random.Random) -> str:
    answer = entry["answer"]
    if re.fullmatch(r"-?\d+", answer.strip()):
        return str(int(answer) + rng.choice([-10, -2, -1, 1, 2, 10]))
    candidates = [o["answer"] for o in others if o["answer"] != answer]
    return rng.choice(candidates) if candidates else f"not {answer}"


def to_rows(task: str, entries: list[dict], format: str = "rl", system_prompt: str = SYSTEM_PROMPT,
            seed: int = 0) -> list[dict]:
    """Rows in the project's formats (see the module docstring) for `entries` of `task`."""
    if format not in FORMATS:
        raise ConfigError(f"reasoning_gym:{task}: format must be one of {', '.join(FORMATS)}, got '{format}'")
    rng = random.Random(seed)
    rows = []
    for entry in entries:
        messages = _prompt(entry, system_prompt)
        if format == "rl":
            answer = {"task": task, "answer": entry["answer"], "metadata": entry["metadata"]}
            rows.append({"messages": messages, "answer": answer})
        elif format == "sft":
            rows.append({"messages": messages + [{"role": "assistant", "content": entry["answer"]}]})
        else:
            rows.append({"messages": messages, "chosen": entry["answer"],
                         "rejected": _wrong_answer(entry, entries, rng)})
    return rows


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_spec(spec: str) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """``reasoning_gym:TASK[:SPLIT][?k=v&...]`` → (task, split, our options, the task's config)."""
    body, sep, query = spec[len(SCHEME):].partition("?")
    if not sep:  # "reasoning_gym:TASK&split=test", as `${.path}&split=test` in a recipe gives for a bare task path
        body, _, query = body.partition("&")
    task, _, split = body.partition(":")
    split = split or "train"
    options, config = dict(_DEFAULTS), {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key == "split":
            split = value
        elif key in _DEFAULTS:
            options[key] = value if key in ("format", "system_prompt") else _parse_value(value)
        else:
            config[key] = _parse_value(value)
    if split not in SPLITS:
        raise ConfigError(f"'{spec}': split must be one of {', '.join(SPLITS)}, got '{split}'")
    for key in ("train_size", "test_size", "seed"):
        if not isinstance(options[key], int):
            raise ConfigError(f"'{spec}': {key} must be an integer, got '{options[key]}'")
    return task, split, options, config


def load_spec_rows(spec: str) -> list[dict]:
    """The rows a ``reasoning_gym:`` data path names."""
    task, split, options, config = parse_spec(spec)
    entries = generate(task, options["train_size"], options["test_size"], options["seed"],
                       tuple(sorted(config.items())))[split]
    return to_rows(task, entries, options["format"], options["system_prompt"], options["seed"])


def main(argv: list[str] | None = None) -> None:
    """Command line: write a reasoning-gym task as ``train.jsonl``/``test.jsonl`` in ``--out`` (or ``--list`` tasks)."""
    parser = argparse.ArgumentParser(description="Write a reasoning-gym task as train/test JSONL files.")
    parser.add_argument("task", nargs="?", help="reasoning-gym task name (see --list)")
    parser.add_argument("--out", type=Path, help="output folder: {train,test}.jsonl")
    parser.add_argument("--format", choices=FORMATS, default="rl")
    parser.add_argument("--train-size", type=int, default=_DEFAULTS["train_size"])
    parser.add_argument("--test-size", type=int, default=_DEFAULTS["test_size"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-prompt", default=SYSTEM_PROMPT)
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE", help="task config fields")
    parser.add_argument("--list", action="store_true", help="print the task names and exit")
    args = parser.parse_args(argv)
    try:
        if args.list:
            print("\n".join(task_names()))
            return
        if not args.task or not args.out:
            parser.error("give a task and --out (or --list)")
        config = tuple(sorted((k, _parse_value(v)) for k, _, v in (item.partition("=") for item in args.config)))
        splits = generate(args.task, args.train_size, args.test_size, args.seed, config)
        args.out.mkdir(parents=True, exist_ok=True)
        for split, entries in splits.items():
            rows = to_rows(args.task, entries, args.format, args.system_prompt, args.seed)
            with open(args.out / f"{split}.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            print(f"wrote {len(rows)} rows to {args.out / f'{split}.jsonl'}")
    except ConfigError as e:
        raise SystemExit(f"rl_lightning: error: {e}") from None


if __name__ == "__main__":
    main()
