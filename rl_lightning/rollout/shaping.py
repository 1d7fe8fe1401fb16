"""What happens to a rollout's scored trajectories before training: length punishment, shaping gate, masks.

DAPO's soft overlong punishment, the gate that lets shaping count only in groups with a correct completion, and
DAPO's overlong filtering (truncation masks).

The order is fixed: the length punishment is added first, so that the gate drops it together with the other
shaping terms in a group of wrong answers; masks change no reward.
"""

from __future__ import annotations

from rl_lightning.algorithms.dapo import gated_shaping, overlong_shaped, truncation_masked
from rl_lightning.rollout.config import DAPOConfig, RolloutConfig
from rl_lightning.rollout.shaping_monitor import DEFAULT_CORRECTNESS
from rl_lightning.rollout.trajectory import Trajectory


def correctness_name(config: RolloutConfig) -> str:
    """The reward component that says an answer is right (``model.rollout.correctness_component``)."""
    return config.correctness_component or DEFAULT_CORRECTNESS


def shaping_errors(config: RolloutConfig, component_names: list[str]) -> list[str]:
    """What the environment's reward components cannot do with the shaping settings (checked at start-up)."""
    name = correctness_name(config)
    if config.gate_shaping and name not in component_names:
        return [f"model.rollout.gate_shaping needs a correctness component, got none named '{name}' among the "
                f"environment's {component_names}; set model.rollout.correctness_component to one of them"]
    return []


def shape(trajectories: list[Trajectory], config: RolloutConfig, dapo: DAPOConfig, group_size: int) -> None:
    """Shape `trajectories` (contiguous groups of `group_size` per prompt) in place, by the settings."""
    if dapo.overlong_cache_length is not None:  # DAPO's soft overlong punishment
        shaped = overlong_shaped([t.reward for t in trajectories], [t.completion_length for t in trajectories],
                                 config.max_completion_tokens, dapo.overlong_cache_length)
        for t, reward in zip(trajectories, shaped, strict=True):
            t.reward = reward
    if config.gate_shaping:
        name = correctness_name(config)
        model = config.reward_model  # the correctness may be the reward model's component, with its own weight
        weight = float(model.weight if model is not None and model.name == name else
                       (config.reward_weights or {}).get(name, 1.0))
        gated = gated_shaping([t.reward for t in trajectories], [t.reward_components[name] for t in trajectories],
                              group_size, weight)
        for t, reward in zip(trajectories, gated, strict=True):
            t.reward = reward
    if dapo.mask_truncated:  # DAPO's overlong filtering
        for t in trajectories:
            t.generated_tokens = t.completion_length  # what was generated, for the metrics, whatever the loss counts
            t.completion_mask = truncation_masked(t.completion_mask, t.finished)
