"""What an evaluation reads, resolved from what the user wrote, each problem one `ConfigError` / `DataError` line.

- the model: a Hugging Face folder, a run's folder or its ``export/`` (``outputs/<run>/<time>[/export]``), an
  ``asset:<name>`` (`rl_lightning.assets.real.resolve_model`), a ``.gguf`` file or a hub id;
- the data: any path ``fit`` accepts (`rl_lightning.data.loading.load_rows`), rows ``{"messages", "answer"}``;
- the environment: a file defining ``reward_fn(messages, answer)`` (`rl_lightning.envs.environment.load_environment`), or,
  without one, the rows' built-in reward: reasoning-gym rows (``answer: {"task", "answer", "metadata"}``) score with
  `rl_lightning.rewards.reasoning_gym`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl_lightning.assets.real import resolve_model
from rl_lightning.data.loading import load_rows
from rl_lightning.data.prompts import Prompt, encode_prompt
from rl_lightning.data.rows import check_prompt_rows
from rl_lightning.envs.environment import Environment, load_environment
from rl_lightning.errors import ConfigError, DataError

MODEL_FIX = "give a Hugging Face model folder (with config.json), a run's folder or its export/, or asset:<name>"
BUILTIN_REWARDS = {"reasoning_gym": "rl_lightning.rewards.reasoning_gym"}


def model_dir(name: str) -> str:
    """The model folder `name` stands for (a run's folder stands for its ``export/``), or a hub id as written."""
    try:
        path = Path(resolve_model(name)).expanduser()
    except ConfigError as e:
        raise ConfigError(f"--model: {e}") from None
    if path.is_dir():
        for folder in (path, path / "export"):
            if (folder / "config.json").is_file():
                return str(folder)
        what = ("a LoRA adapter folder; evaluate the merged export folder that holds it"
                if (path / "adapter_config.json").is_file() else f"not a model folder: {path} has no config.json")
        raise ConfigError(f"--model '{name}' is {what}; {MODEL_FIX}")
    if path.exists():
        raise ConfigError(f"--model '{name}' is a file, not a model folder; {MODEL_FIX}")
    if name.startswith(("/", ".", "~")) or str(path).count("/") != 1:
        raise ConfigError(f"--model '{name}' does not exist (resolved to {path.resolve()}); {MODEL_FIX}")
    return str(path)  # a hub id (org/name)


def source_run_id(folder: str) -> str | None:
    """The MLflow run that trained the model in `folder` (a run's ``export/``), when its run folder records one."""
    from rl_lightning.cli.outputs import read_run_file  # imports lightning: only once a model is being evaluated

    path = Path(folder)
    return read_run_file(path.parent if path.name == "export" else path).get("mlflow_run_id")


def load_tokenizer_for(name: str, folder: str) -> Any:
    """The model's tokenizer; a folder without one is a one-line error naming ``--model``."""
    from rl_lightning.models.loading import load_tokenizer

    try:
        return load_tokenizer(folder)
    except ConfigError as e:
        raise ConfigError(f"--model '{name}': {e}".replace("; check model.lm.name", f"; {MODEL_FIX}")) from None


def load_prompts(data: str, tokenizer: Any, split: str = "train", limit: int | None = None,
                 chat_template: bool = True) -> list[Prompt]:
    """The first `limit` rows of `data` (all by default) as prompts, checked for ``messages`` and ``answer``."""
    try:
        rows = load_rows(data, split)
    except (DataError, ConfigError) as e:
        raise type(e)(f"--data: {str(e).replace('check the `path` setting', 'check --data')}") from None
    if limit is not None:
        rows.rows = rows.rows[:limit]
        if rows.line_numbers is not None:
            rows.line_numbers = rows.line_numbers[:limit]
    try:
        check_prompt_rows(rows)
    except DataError as e:
        raise DataError(f"--data: {str(e).replace('RL prompt rows', 'eval rows')} (a completion is scored against its "
                        "row's answer)") from None
    if chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError("--model has no chat template; pass --no-chat-template to feed the prompt's message "
                          "contents concatenated (a base model), or evaluate a chat model")
    return [Prompt(encode_prompt(tokenizer, row["messages"], chat_template), row["messages"], row["answer"],
                   rows.locate(i), i) for i, row in enumerate(rows.rows)]


def builtin_reward(prompts: list[Prompt]) -> str | None:
    """The name of the rows' built-in reward (a key of `BUILTIN_REWARDS`), or None when they have none."""
    shape = {"task", "answer"}
    if prompts and all(isinstance(p.answer, dict) and shape <= set(p.answer) for p in prompts):
        return "reasoning_gym"
    return None


def load_env(env: str | None, prompts: list[Prompt], weights: dict[str, float] | None = None) -> Environment:
    """The environment that scores the completions: `env`'s file, else the rows' built-in reward."""
    if env is not None:
        return load_environment(env, key="--env", weights=weights)
    builtin = builtin_reward(prompts)
    if builtin is None:
        answer = json.dumps(prompts[0].answer, default=str)[:60] if prompts else ""
        raise ConfigError(f"--env is needed: these rows (answer {answer}) have no built-in reward; give --env "
                          "my_env.py, a file defining reward_fn(messages, answer) -> float or dict of components "
                          "(rl_lightning/recipes/envs/arithmetic.py is one)")
    import importlib

    module = importlib.import_module(BUILTIN_REWARDS[builtin])
    return load_environment(str(module.__file__), key=f"the built-in {builtin} reward", weights=weights)


def parse_weights(text: str | None) -> dict[str, float] | None:
    """``--reward-weights '{"correct": 1, "format": 0.5}'`` as a dict (None stays None)."""
    if text is None:
        return None
    try:
        weights = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--reward-weights {text!r} is not JSON ({e.msg}); write it as "
                          "'{\"correct\": 1.0, \"format\": 0.5}'") from None
    if not isinstance(weights, dict) or not all(isinstance(v, int | float) for v in weights.values()):
        raise ConfigError(f"--reward-weights {text!r} must map component names to numbers, e.g. "
                          "'{\"correct\": 1.0, \"format\": 0.5}'")
    return {str(k): float(v) for k, v in weights.items()}
