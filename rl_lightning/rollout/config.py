"""Rollout settings: `RolloutConfig`, the ``model.rollout.*`` argument group of the PPO task, and its validation.

The config is checked once, at construction, with every error reported together (``model.rollout.<field>: ...``);
the `rl_lightning.rollout.callback.RolloutCallback` then runs it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rl_lightning.engines.registry import EngineConfig, EngineSpec, engine_spec, resolve
from rl_lightning.engines.vllm import INSTALL_HINT, vllm_available
from rl_lightning.errors import ConfigError
from rl_lightning.rewards.reward_model import RewardModelConfig
from rl_lightning.rollout.async_rollout import async_errors

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class RolloutConfig:
    """How trajectories are sampled and scored: ``model.rollout.*``.

    Args:
        env_path: Python file defining ``reward_fn(messages, answer)`` (and optionally ``interact(messages)``), or a
            standard environment: ``verifiers:<taskset>``, ``openenv:<module>`` (`rl_lightning.envs.adapters`).
        responses_per_prompt: completions sampled per prompt (the group size of group-baseline estimators).
        max_turns: assistant turns per conversation (> 1 needs ``interact``).
        temperature: sampling temperature; the task recomputes old, reference and current log-probabilities at it.
        top_p: nucleus sampling threshold.
        top_k: top-k sampling (0 = off).
        max_new_tokens: tokens generated per turn.
        engine: the engine group ``{kind: ..., <its keys>}`` (`rl_lightning.engines.registry.EngineConfig`), or the
            shorthand ``engine: <kind>`` (that kind with its defaults). Kinds: ``hf`` (transformers generate on the
            policy itself: simple, slow; no keys), ``vllm`` (vLLM colocated in the training processes, fed the
            policy's weights after every optimizer step; keys ``tp_size``, ``max_model_len``,
            ``kv_cache_memory_bytes``, ``gpu_memory_utilization``, ``weight_bucket_mb``, ``weight_sync``; see
            `rl_lightning.engines.vllm`) and ``vllm_process`` (vLLM in a process of its own, fed full weights over a
            group of its own; several trainer ranks share the one global rank 0 starts; keys ``devices``,
            ``timeout_s``, ``restarts`` and the memory keys of ``vllm``; see `rl_lightning.engines.process`). A key
            the kind does not take is refused in one line naming the kinds that take it.
        on_error: reward_fn failures (exceptions, non-finite values, timeouts): ``raise`` (stop, naming the prompt
            row) or ``zero`` (score 0 and count); ``interact`` failures alike (``zero``: the conversation ends there,
            counted in ``rollout/interact_failures``).
        reward_workers: processes scoring trajectories in parallel, each importing `env_path` (default: the CPUs
            shared among this node's training processes, at most 16); 0 scores in the trainer process, without a
            time limit (for debugging).
        reward_timeout_s: per-call limit of ``reward_fn`` in seconds with `reward_workers` > 0 (the worker is killed
            and replaced, the call counts as a failure under `on_error`); null: no limit.
        interact_timeout_s: per-call limit of ``interact`` in seconds with `reward_workers` > 0 (``interact`` runs in
            the same workers; the worker is killed and replaced, and under `on_error` the run stops or that
            conversation ends there); null: no limit.
        worker_env: names of variables of the trainer's environment that the reward and interact workers get besides
            their minimal allow-list (locale, paths, thread counts, ``HF_HOME``/offline switches, ``RL_LIGHTNING_*``;
            see `rl_lightning.envs.workers`), e.g. ``[OPENAI_API_KEY]`` for an LLM judge; a listed name missing
            from the trainer's environment stops the run at start-up. The trainer's other variables (tokens, cloud
            credentials) never reach a worker; with ``reward_workers: 0`` scoring runs in the trainer and sees them all.
        max_tool_chars: characters of content one ``interact`` call may add to a conversation (all its messages
            together); more is cut, with a note the model reads, and counted in ``rollout/tool_truncations``; null:
            no cap. Multi-turn conversations also end (``rollout/overlong_conversations``) when the next turn would
            pass the engine's ``max_model_len``.
        reward_weights: for a ``reward_fn`` returning named components (a dict): one weight per component; each
            component is logged as ``train/reward/<name>``.
        reward_combination: ``weighted_sum`` or ``tchebycheff`` (-max_k w_k |ideal_k - r_k|).
        reward_ideal: Tchebycheff ideal point per component (default 1.0 each).
        pareto_archive_size: keep the Pareto front of the rollouts' mean reward components, at most this many
            (evicting the least hypervolume contributor), log ``train/hypervolume`` and ``train/pareto_size`` and
            the MLflow table ``pareto_archive.json`` (see `rl_lightning.rollout.pareto_archive`); null: off. Needs
            >= 2 components in `reward_weights`.
        pareto_reference: hypervolume reference point per component (default 0.0 each: fixed, so hypervolumes
            compare across runs); set it below the lowest value a component can take, e.g. for negative rewards.
        val_temperature: validation sampling temperature (0: greedy).
        val_responses_per_prompt: completions per held-out prompt at validation (> 1 needs `val_temperature` > 0);
            their seeds stay the same across validations, so successive scores compare the same draws.
        reward_model: a reward model scoring every trajectory as one more reward component (served: ``url``; or an
            RM folder in the trainer process: ``path``), see `rl_lightning.rewards.reward_model.RewardModelConfig`.
        async_steps: 0: synchronous rollouts (each sampled by the policy it trains); 1: one-step-off-policy, rollout
            k+1 is generated (and scored) in the background while the trainer updates on rollout k, by the policy
            one update older (``vllm`` with ``tp_size: 1``, or ``vllm_process``; the engine stays awake, so on GPU
            it keeps its memory while the trainer trains; pair it with the task's mismatch correction, ``model.correction``; see
            `rl_lightning.rollout.async_rollout`).
        inflight_segment_tokens: ``async_steps: 1`` with ``engine: vllm``: in-flight weight updates (partial rollouts):
            generation runs in segments of this many tokens, new weights load between segments while long completions
            continue, each token records its policy version (`rl_lightning.rollout.inflight`); null: off.
        replay: a rollout dump's folder (``rl_lightning.callbacks.rollout_dump.RolloutDump``): train on its rollouts instead of
            sampling and scoring (no engine is built, no reward function runs; the engine settings are ignored): the
            same seed on the same device makes the dumped run's updates bit for bit (see
            `rl_lightning.rollout.replay`); null: sample.
        shaping_window: rollouts over which the reward-hacking monitor compares the trend of the total reward with
            that of correctness (`rl_lightning.rollout.shaping_monitor`): ``train/shaping_dominates`` is 1 when the
            total rose while correctness fell, each beyond noise.
        correctness_component: the reward component that says the answer is right (default: ``correct`` if the
            environment has one); the other components and the length punishment are the shaping.
        stop_on_shaping: stop the run, in one line, the first time the shaping dominates, with the trainable weights
            that scored the best correctness put back (held-out once validation ran; kept on the host: two copies of
            the trainable weights, the best and the candidate, one taken per rollout, each rank its shards).
        gate_shaping: the shaping (every component but `correctness_component`, and DAPO's length punishment) counts
            only in prompt groups with at least one correct completion (correctness > 0); in the others each reward
            is its weighted correctness, so a group of wrong answers learns nothing from the shaping (and nothing at
            all when wrong answers score 0; `rl_lightning.algorithms.dapo.gated_shaping`). Needs
            ``reward_combination: weighted_sum``.

    Validation (``data.val_path``, or each named set of ``data.val_paths``) scores `val_responses_per_prompt`
    completions per held-out prompt (``val/reward``, the mean); with ``trainer.num_sanity_val_steps: -1`` the
    untrained policy's value is logged at step 0.
    """

    env_path: str
    responses_per_prompt: int = 8
    max_turns: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    engine: EngineConfig | str = "hf"
    on_error: str = "raise"
    reward_workers: int | None = None
    reward_timeout_s: float | None = 60.0
    interact_timeout_s: float | None = 60.0
    worker_env: list[str] | None = None
    max_tool_chars: int | None = 8192
    reward_weights: dict[str, float] | None = None
    reward_combination: str = "weighted_sum"
    reward_ideal: dict[str, float] | None = None
    pareto_archive_size: int | None = None
    pareto_reference: dict[str, float] | None = None
    val_temperature: float = 0.0
    val_responses_per_prompt: int = 1
    reward_model: RewardModelConfig | None = None
    async_steps: int = 0
    inflight_segment_tokens: int | None = None
    replay: str | None = None
    shaping_window: int = 8
    correctness_component: str | None = None
    stop_on_shaping: bool = False
    gate_shaping: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.reward_model, dict):  # from a checkpoint's hyperparameters
            object.__setattr__(self, "reward_model", RewardModelConfig(**self.reward_model))
        errors, engine_error = [], None
        try:  # the kind's own settings, with its defaults (a foreign key or a bad value: one line of its own)
            object.__setattr__(self, "engine", resolve(self.engine))
        except ConfigError as e:
            engine_error = str(e)
        if self.val_temperature < 0 or self.val_responses_per_prompt < 1 or (self.val_temperature == 0 and
                                                                             self.val_responses_per_prompt > 1):
            errors.append(f"val_temperature must be >= 0 and val_responses_per_prompt >= 1 (1 when greedy), got "
                          f"{self.val_temperature}, {self.val_responses_per_prompt}")
        if self.responses_per_prompt < 1:
            errors.append(f"responses_per_prompt must be >= 1, got {self.responses_per_prompt}")
        if self.max_turns < 1:
            errors.append(f"max_turns must be >= 1, got {self.max_turns}")
        if isinstance(self.shaping_window, bool) or not isinstance(self.shaping_window, int) or self.shaping_window < 3:
            errors.append(f"shaping_window must be a number of rollouts >= 3, got {self.shaping_window!r}")
        if engine_error is None:
            errors += _engine_errors(self) + async_errors(self)
        errors += _pareto_errors(self)
        if self.gate_shaping and self.reward_combination != "weighted_sum":
            errors.append(f"gate_shaping needs reward_combination: weighted_sum (a reward that is correctness plus "
                          f"shaping), got '{self.reward_combination}'; set gate_shaping: false")
        if self.temperature <= 0 or self.max_new_tokens < 1:
            errors.append(f"temperature must be > 0 (training samples) and max_new_tokens >= 1, got "
                          f"{self.temperature}, {self.max_new_tokens}")
        if (self.reward_workers is not None and self.reward_workers < 0) or (
                self.reward_timeout_s is not None and not self.reward_timeout_s > 0):
            errors.append(f"reward_workers must be >= 0 (0: inline) and reward_timeout_s > 0 or null, got "
                          f"{self.reward_workers}, {self.reward_timeout_s}")
        if self.interact_timeout_s is not None and not self.interact_timeout_s > 0:
            errors.append(f"interact_timeout_s must be > 0 (seconds) or null (no limit), got {self.interact_timeout_s}")
        bad_names = [n for n in self.worker_env or [] if not isinstance(n, str) or not _ENV_NAME.fullmatch(n)]
        if bad_names:
            errors.append(f"worker_env must list environment variable names (letters, digits, _), got {bad_names}")
        if self.max_tool_chars is not None and self.max_tool_chars < 0:
            errors.append(f"max_tool_chars must be >= 0 (characters) or null (no cap), got {self.max_tool_chars}")
        if errors or engine_error:
            raise ConfigError("; ".join([*([engine_error] if engine_error else []),
                                         *(f"model.rollout.{e}" for e in errors)]))

    @property
    def engine_settings(self) -> Any:
        """The engine kind's settings (`engine` resolved at construction: ``kind`` and the keys it takes)."""
        return self.engine

    @property
    def engine_spec(self) -> EngineSpec:
        """The engine kind's registry entry: its builder and its traits."""
        return engine_spec(self.engine_settings.kind)

    @property
    def max_completion_tokens(self) -> int:
        """The generation budget of one trajectory: `max_new_tokens` per turn x `max_turns`."""
        return self.max_new_tokens * self.max_turns



def _pareto_errors(c: RolloutConfig) -> list[str]:
    names = sorted(c.reward_weights or {})
    if names and c.reward_model is not None:  # the reward model is one more component of the combination
        names = sorted({*names, c.reward_model.name})
    if c.pareto_archive_size is not None and (c.pareto_archive_size < 1 or len(names) < 2):
        return [f"pareto_archive_size={c.pareto_archive_size} needs a size >= 1 and >= 2 reward components in "
                f"reward_weights (got {names}); name the components in model.rollout.reward_weights or set "
                "pareto_archive_size: null"]
    if c.pareto_reference is not None and (sorted(c.pareto_reference) != names or not all(
            math.isfinite(v) for v in c.pareto_reference.values())):
        return [f"pareto_reference={c.pareto_reference} must give a finite value for each component of "
                f"reward_weights {names}"]
    return []


def _engine_errors(c: RolloutConfig) -> list[str]:
    """What the engine kind cannot do with the other rollout settings (its own values checked themselves)."""
    errors, spec, tp = [], c.engine_spec, getattr(c.engine_settings, "tp_size", 1)
    kind = spec.kind
    if getattr(c.engine_settings, "weight_sync", None) == "adapter" and not spec.adapter_sync:
        errors.append(f"engine.weight_sync=adapter needs a kind that takes adapter syncs, got kind '{kind}'")
    if tp > 1 and not spec.tensor_parallel:
        errors.append(f"engine.tp_size={tp}: kind '{kind}' runs engines of tp_size 1")
    if spec.needs_vllm and c.replay is None and not vllm_available():  # a replay builds no engine
        errors.append(f"engine={kind} needs vllm, which is not installed; {INSTALL_HINT}, or set engine: hf")
    if tp > 1 and c.max_turns > 1:
        # the ranks of an engine generate together, but this loop decides per rank how often to generate (DAPO's
        # refill likewise: `rl_lightning.tasks.ppo.config.dapo_errors`)
        errors.append(f"engine.tp_size={tp} does not support multi-turn rollouts (max_turns={c.max_turns}) yet; use "
                      "tp_size: 1")
    return errors


def engine_process_devices(devices: Sequence[int] | None, device_type: str, device_count: int,
                           trainer_devices: Sequence[int], tp_size: int = 1) -> list[int] | None:
    """The GPUs of the engine process (``model.rollout.engine.devices``), checked against the machine.

    Args:
        devices: ``model.rollout.engine.devices`` (None: the first `tp_size` GPUs the trainer does not use).
        device_type: the trainer's device type (``cuda``, ``cpu``).
        device_count: the GPUs this process sees (``torch.cuda.device_count()``).
        trainer_devices: the trainer's GPU indices on this node (``trainer.device_ids``).
        tp_size: GPUs per engine.

    Returns:
        The engine's GPU indices (numbered as this process sees them); None off CUDA (the engine process shares
        the host).

    Raises:
        ConfigError: one line naming ``model.rollout.engine.devices``, its value and the fix: GPUs named off CUDA,
            a GPU that does not exist, one of the trainer's, or none left free for the default.
    """
    key, trainer = "model.rollout.engine.devices", sorted(set(trainer_devices))
    if device_type != "cuda":
        if devices is not None:
            raise ConfigError(f"{key}={list(devices)} names GPUs, but the trainer runs on {device_type}: set {key}: "
                              "null (the engine process then shares the host)")
        return None
    free = [d for d in range(device_count) if d not in trainer]
    if devices is None:
        if len(free) < tp_size:
            raise ConfigError(f"{key}=null needs {tp_size} GPU(s) the trainer does not use, but the trainer uses "
                              f"{trainer} of the {device_count} visible: train on fewer (trainer.devices), make "
                              "more GPUs visible (CUDA_VISIBLE_DEVICES), or use engine: vllm (colocated)")
        return free[:tp_size]
    missing = [d for d in devices if not 0 <= d < device_count]
    if missing:
        raise ConfigError(f"{key}={list(devices)} names GPU(s) {missing} that do not exist: this process sees "
                          f"{device_count} (0..{device_count - 1}); pick among the free ones {free}")
    shared = sorted(set(devices) & set(trainer))
    if shared:
        raise ConfigError(f"{key}={list(devices)} overlaps the trainer's GPUs {trainer} (GPU(s) {shared}): the "
                          f"engine needs GPUs of its own; pick among the free ones {free}")
    return list(devices)


@dataclass(frozen=True)
class DAPOConfig:
    """DAPO's sampling-side settings (``model.dapo.*`` of PPO); each is off by default.

    Args:
        filter_range: dynamic sampling: keep only prompt groups whose mean reward lies strictly inside (low, high),
            and refill the batch with more prompts (drawn from the training set) until it is full or
            `max_refill_rounds` rounds were tried; null disables.
        max_refill_rounds: generation rounds per rollout when filtering (the first included).
        overlong_cache_length: soft overlong punishment: completions longer than ``model.rollout.max_new_tokens -
            overlong_cache_length`` tokens lose up to 1 reward, linearly; null disables.
        mask_truncated: drop completions cut at ``model.rollout.max_new_tokens`` from the loss (overlong filtering).
    """

    filter_range: tuple[float, float] | None = None
    max_refill_rounds: int = 4
    overlong_cache_length: int | None = None
    mask_truncated: bool = False

    def __post_init__(self) -> None:
        errors = []
        if self.filter_range is not None and not self.filter_range[0] < self.filter_range[1]:
            errors.append(f"filter_range must be (low, high) with low < high, got {self.filter_range}")
        if self.max_refill_rounds < 1:
            errors.append(f"max_refill_rounds must be >= 1, got {self.max_refill_rounds}")
        if self.overlong_cache_length is not None and self.overlong_cache_length <= 0:
            errors.append(f"overlong_cache_length must be > 0 or null, got {self.overlong_cache_length}")
        if errors:
            raise ConfigError("; ".join(f"model.dapo.{e}" for e in errors))

    def errors_with(self, max_new_tokens: int) -> list[str]:
        """What this group cannot be combined with: the cache longer than the completions it shapes."""
        if self.overlong_cache_length is not None and self.overlong_cache_length > max_new_tokens:
            return [f"model.dapo.overlong_cache_length must be in (0, model.rollout.max_new_tokens={max_new_tokens}], "
                    f"got {self.overlong_cache_length}"]
        return []
