"""Generate completions for held-out prompts with a rollout engine and score them: `evaluate`.

Two passes over the prompts, with the training rollout's own code (`rl_lightning.rollout.trajectory.rollout`, so
multi-turn environments work too):

- greedy: temperature 0, one completion per prompt;
- sampled (when ``n`` > 0): ``n`` completions per prompt at ``temperature``, each prompt seeded ``seed + row index``
  (the same completions whatever ``batch_size`` or ``limit``), giving the unbiased pass@k for each ``k``
  (`rl_lightning.algorithms.pass_at_k`).

A completion is *correct* when the reward's ``correct`` component, or, for a reward without one, the reward itself,
is at least ``threshold``. Accuracy is the share of correct completions; ``reward`` the mean combined reward (a dict
of components combines by ``reward_weights``, each component weighted 1 when none are given) and ``reward/<name>``
each component's mean; ``completion_length`` the mean of generated tokens, ``truncated`` the share cut at
``max_new_tokens``.

The engine: ``vllm`` (`rl_lightning.engines.vllm.VLLMEngine`, loading the folder's weights itself; on CPU its KV cache
is ``kv_cache_bytes``, and the model's head size must be one vLLM's CPU attention supports) or ``hf``
(`rl_lightning.engines.hf.HFEngine`, transformers on the model itself); ``auto`` picks vLLM when it is installed and
supports the model here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rl_lightning.algorithms.pass_at_k import pass_at_k
from rl_lightning.cli.eval.inputs import (
    load_env,
    load_prompts,
    load_tokenizer_for,
    model_dir,
    parse_weights,
    source_run_id,
)
from rl_lightning.data.prompts import Prompt
from rl_lightning.engines.protocol import RolloutEngine, SamplingParams
from rl_lightning.envs.environment import Environment
from rl_lightning.errors import ConfigError
from rl_lightning.rollout.trajectory import Trajectory, rollout

ENGINES = ("auto", "vllm", "hf")


@dataclass
class EvalConfig:
    """One evaluation: the command's flags (``python -m rl_lightning eval --help`` documents each)."""

    model: str
    data: str
    env: str | None = None
    engine: str = "auto"
    n: int = 4
    k: list[int] | None = None  # default: 1 and n
    temperature: float = 1.0
    max_new_tokens: int = 256
    limit: int | None = None
    seed: int = 0
    threshold: float = 1.0
    reward_weights: str | None = None  # JSON
    split: str = "train"
    chat_template: bool = True
    max_turns: int = 1
    batch_size: int = 64
    kv_cache_bytes: int = 512 << 20

    def ks(self) -> list[int]:
        """The pass@k values to report: `k`, or 1 and `n`, ascending (none without samples)."""
        if self.n == 0:
            return []
        return sorted(set(self.k or [1, self.n]))

    def check(self) -> None:
        """Every out-of-range flag, reported together as one `ConfigError`."""
        errors = []
        if self.engine not in ENGINES:
            errors.append(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.n < 0:
            errors.append(f"--n must be >= 0 (0: greedy only), got {self.n}")
        if self.k and (self.n == 0 or any(k < 1 or k > self.n for k in self.k)):
            errors.append(f"--k values must be between 1 and --n={self.n} samples per prompt, got {self.k}")
        if self.n and not (self.temperature > 0 and math.isfinite(self.temperature)):
            errors.append(f"--temperature must be > 0 for sampling (greedy is always measured), got {self.temperature}")
        for flag, value in (("--max-new-tokens", self.max_new_tokens), ("--limit", self.limit),
                            ("--max-turns", self.max_turns), ("--batch-size", self.batch_size)):
            if value is not None and value < 1:
                errors.append(f"{flag} must be >= 1, got {value}")
        if not math.isfinite(self.threshold):
            errors.append(f"--threshold must be a finite number, got {self.threshold}")
        if errors:
            raise ConfigError("; ".join(errors))


@dataclass
class EvalResult:
    """An evaluation's numbers (`metrics`: ``greedy/accuracy``, ``sampled/pass_at_4``, ...) and what produced them."""

    config: EvalConfig
    model_dir: str
    engine: str
    env: str
    prompts: int
    seconds: float
    metrics: dict[str, float]
    source_run_id: str | None = None
    component_names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, the resolved model folder, engine and environment, the metrics."""
        return {**asdict(self), "config": {**asdict(self.config), "k": self.config.ks()}}


def summarize(trajectories: list[Trajectory], group_size: int, ks: list[int], threshold: float,
              prefix: str) -> dict[str, float]:
    """The metrics of `trajectories` (`group_size` consecutive completions per prompt), named ``<prefix>/<metric>``."""
    correct = torch.tensor([t.reward_components.get("correct", t.reward) >= threshold for t in trajectories])
    metrics = {
        "accuracy": correct.double().mean().item(),
        "reward": sum(t.reward for t in trajectories) / len(trajectories),
        **{f"reward/{name}": sum(t.reward_components[name] for t in trajectories) / len(trajectories)
           for name in sorted(trajectories[0].reward_components)},
        "completion_length": sum(t.completion_length for t in trajectories) / len(trajectories),
        "truncated": sum(not t.finished for t in trajectories) / len(trajectories),
    }
    per_prompt = correct.view(-1, group_size).sum(-1)  # (B,) correct completions of each prompt
    samples = torch.full_like(per_prompt, group_size)
    for k in ks:
        metrics[f"pass_at_{k}"] = pass_at_k(samples, per_prompt, k).mean().item()
    return {f"{prefix}/{name}": value for name, value in metrics.items()}


def build_engine(kind: str, folder: str, tokenizer: Any, max_model_len: int, kv_cache_bytes: int
                 ) -> tuple[RolloutEngine, str, Callable[[], None]]:
    """The engine `kind` (``auto`` resolved), its name and how to shut it down."""
    from transformers import AutoConfig

    from rl_lightning.engines.vllm import CPU_HEAD_DIMS, head_dim, vllm_available

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = head_dim(AutoConfig.from_pretrained(folder))
    unsupported = device == "cpu" and size not in CPU_HEAD_DIMS
    if kind == "auto":
        kind = "vllm" if vllm_available() and not unsupported else "hf"
    if kind == "vllm":
        if unsupported:
            raise ConfigError(f"--engine vllm: the model's head_dim={size} is not supported by vLLM's CPU attention "
                              f"(supported: {', '.join(map(str, CPU_HEAD_DIMS))}); use --engine hf")
        from rl_lightning.engines.vllm import VLLMEngine

        # the folder's own weights (the training engine starts from dummy ones and is fed the trainer's)
        engine = VLLMEngine(folder, max_model_len=max_model_len, device_type=device, sleep_mode=False,
                            kv_cache_memory_bytes=kv_cache_bytes if device == "cpu" else None,
                            gpu_memory_utilization=0.85, load_format="auto")
        return engine, "vllm", engine.shutdown
    from rl_lightning.engines.hf import HFEngine
    from rl_lightning.models.loading import load_causal_lm

    model = load_causal_lm(folder).to(device).eval()
    return HFEngine(model, tokenizer.pad_token_id), "hf", lambda: None


def generate(engine: RolloutEngine, prompts: list[Prompt], env: Environment, tokenizer: Any, params: SamplingParams,
             config: EvalConfig) -> list[Trajectory]:
    """`params.n` scored trajectories per prompt, generated `config.batch_size` prompts at a time, seeded by row."""
    trajectories = []
    for start in range(0, len(prompts), config.batch_size):
        batch = prompts[start : start + config.batch_size]
        seeds = None if params.temperature == 0 else [config.seed + p.index for p in batch]
        batch_params = SamplingParams(params.n, params.temperature, max_new_tokens=params.max_new_tokens,
                                      stop_token_ids=params.stop_token_ids, seeds=seeds)
        trajectories += rollout(engine, batch, env, tokenizer, batch_params, config.max_turns)
    return trajectories


def scoring_env(env: Environment, trajectories: list[Trajectory], weighted: bool) -> Environment:
    """`env`, weighting each of its reward's components 1 when ``reward_fn`` returns a dict and none were given.

    Called on the first trajectory to learn the component names; if that call raises, scoring reports the error.
    """
    if weighted or not trajectories:
        return env
    first = trajectories[0]
    try:
        value = env.reward_fn(first.messages, first.prompt.answer)
    except Exception:  # noqa: BLE001 - scoring calls it again and reports the failure with its row
        return env
    if isinstance(value, dict):
        env.weights = {str(name): 1.0 for name in value}
    return env


def score(env: Environment, trajectories: list[Trajectory]) -> None:
    """Set each trajectory's reward and components (the rollout scored it with a placeholder reward)."""
    scores = env.score_all([(t.messages, t.prompt.answer, t.prompt.where) for t in trajectories])
    for t, (reward, components) in zip(trajectories, scores, strict=True):
        t.reward, t.reward_components = reward, components


def evaluate(config: EvalConfig, on_samples: Callable[[str, list[Trajectory]], None] | None = None) -> EvalResult:
    """Greedy and sampled metrics of `config.model` on `config.data` (see the module docstring).

    `on_samples` (optional) receives each pass's name (``greedy``/``sampled``) and its scored trajectories.
    """
    config.check()
    start = time.perf_counter()
    folder = model_dir(config.model)
    tokenizer = load_tokenizer_for(config.model, folder)
    prompts = load_prompts(config.data, tokenizer, config.split, config.limit, config.chat_template)
    weights = parse_weights(config.reward_weights)
    env = load_env(config.env, prompts, weights)
    env.check_answers(prompts)  # one line for a row the reward cannot score, before the engine starts
    # generation scores nothing: the real scoring (below) needs the component names from a first completion
    placeholder = Environment(lambda messages, answer: 0.0, env.interact, env.path)
    longest = max(len(p.prompt_ids) for p in prompts)
    max_model_len = longest + config.max_turns * config.max_new_tokens + (256 if config.max_turns > 1 else 0)
    engine, engine_name, shutdown = build_engine(config.engine, folder, tokenizer, max_model_len,
                                                 config.kv_cache_bytes)
    stop = [tokenizer.eos_token_id]
    passes = [("greedy", SamplingParams(n=1, temperature=0.0, max_new_tokens=config.max_new_tokens,
                                        stop_token_ids=stop))]
    if config.n:
        passes.append(("sampled", SamplingParams(n=config.n, temperature=config.temperature,
                                                 max_new_tokens=config.max_new_tokens, stop_token_ids=stop)))
    metrics: dict[str, float] = {}
    try:
        with torch.no_grad():
            for name, params in passes:
                trajectories = generate(engine, prompts, placeholder, tokenizer, params, config)
                env = scoring_env(env, trajectories, weights is not None)
                score(env, trajectories)
                metrics.update(summarize(trajectories, params.n, config.ks() if name == "sampled" else [],
                                         config.threshold, name))
                if on_samples is not None:
                    on_samples(name, trajectories)
    finally:
        shutdown()
    return EvalResult(config, folder, engine_name, env.path, len(prompts), time.perf_counter() - start, metrics,
                      source_run_id(folder), env.component_names)
