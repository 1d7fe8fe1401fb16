"""KL estimators between the policy and the reference, and KL-coefficient controllers.

Estimators take per-token log-probabilities (B, T) of the sampled tokens under the policy (`logprobs`) and the
reference (`ref_logprobs`) and return per-token estimates of KL(policy || reference); with r = p_ref / p_policy
(Schulman 2020, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html):

- k1 = -log r            unbiased, high variance, can be negative
- k2 = (log r)^2 / 2     biased, low variance
- k3 = (r - 1) - log r   unbiased, low variance, always >= 0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 = -log r = logprobs - ref_logprobs (unbiased, high variance, can be negative).

    Args:
        logprobs: (B, T) the policy's log-probabilities of the sampled tokens.
        ref_logprobs: (B, T) the reference's.

    Returns:
        (B, T) estimates of KL(policy || reference).
    """
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 = (log r)^2 / 2 (biased, low variance).

    Args:
        logprobs: (B, T) the policy's log-probabilities of the sampled tokens.
        ref_logprobs: (B, T) the reference's.

    Returns:
        (B, T) estimates of KL(policy || reference).
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = (r - 1) - log r (unbiased, low variance, always >= 0).

    Args:
        logprobs: (B, T) the policy's log-probabilities of the sampled tokens.
        ref_logprobs: (B, T) the reference's.

    Returns:
        (B, T) estimates of KL(policy || reference).
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_reward_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, coef: float, estimator: KLEstimator = kl_k3
                      ) -> torch.Tensor:
    """KL as a reward: the per-token penalty -coef x KL_t of the sampling policy, fixed at rollout time.

    r_t^KL = -coef * KL_t(pi_old || pi_ref)   (InstructGPT, Ouyang et al. 2022, https://arxiv.org/abs/2203.02155,
    eq. 2; REINFORCE++'s token-level penalty, Hu 2025, https://arxiv.org/abs/2501.03262). The advantage estimators
    add its reward-to-go (or take it as per-token rewards).

    Args:
        logprobs: (B, T) log-probabilities of the sampled tokens under the policy that sampled them.
        ref_logprobs: (B, T) the reference's.
        coef: the KL coefficient.
        estimator: one of `KL_ESTIMATORS`' functions.

    Returns:
        (B, T) per-token rewards (<= 0 for k2 and k3).
    """
    return -coef * estimator(logprobs, ref_logprobs)


class KLController(Protocol):
    """What the KL controllers share: the coefficient in ``coef``, moved by ``update``."""

    coef: float

    def update(self, measured_kl: float, steps: int = 1) -> float:
        """Move `coef` after `steps` steps at per-token KL `measured_kl`; returns the new coefficient."""
        ...


class FixedKLController:
    """Constant coefficient."""

    def __init__(self, coef: float) -> None:
        self.coef = coef

    def update(self, measured_kl: float, steps: int = 1) -> float:
        """Keep the coefficient; returns it."""
        return self.coef


class AdaptiveKLController:
    """Multiplicative update towards a target KL (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593, section 2.2).

    e = clip(KL / target - 1, -0.2, 0.2);  coef <- coef * (1 + e * steps / horizon).
    """

    def __init__(self, coef: float, target: float, horizon: float) -> None:
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, measured_kl: float, steps: int = 1) -> float:
        """One multiplicative step over `steps` trajectories; returns the new coefficient."""
        error = min(max(measured_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * steps / self.horizon
        return self.coef


class LinearKLController:
    """Additive (integral) update towards a target: coef <- max(0, coef + rate * (KL - target))."""

    def __init__(self, coef: float, target: float, rate: float) -> None:
        self.coef, self.target, self.rate = coef, target, rate

    def update(self, measured_kl: float, steps: int = 1) -> float:
        """One additive step; returns the new coefficient."""
        self.coef = max(0.0, self.coef + self.rate * (measured_kl - self.target))
        return self.coef


class PIDKLController:
    """PID control of the coefficient on e = KL - target: coef = max(0, coef0 + kp e + ki sum(e) + kd (e - e_prev))."""

    def __init__(self, coef: float, target: float, kp: float, ki: float, kd: float) -> None:
        self.base, self.coef, self.target = coef, coef, target
        self.kp, self.ki, self.kd = kp, ki, kd
        self.integral = 0.0
        self.previous: float | None = None

    def update(self, measured_kl: float, steps: int = 1) -> float:
        """One PID step (the integral weighs the error by `steps`); returns the new coefficient."""
        error = measured_kl - self.target
        self.integral += error * steps
        derivative = 0.0 if self.previous is None else error - self.previous
        self.previous = error
        self.coef = max(0.0, self.base + self.kp * error + self.ki * self.integral + self.kd * derivative)
        return self.coef


class ScheduledKLController:
    """Open-loop schedule from `coef` to `final_coef` over `total_steps` (``cosine`` or ``linear``)."""

    def __init__(self, coef: float, final_coef: float, total_steps: int, schedule: str = "cosine") -> None:
        self.start, self.final, self.total, self.schedule = coef, final_coef, total_steps, schedule
        self.step, self.coef = 0, coef

    def update(self, measured_kl: float, steps: int = 1) -> float:
        """Advance the schedule by `steps` (the measured KL is not used); returns the new coefficient."""
        self.step = min(self.total, self.step + steps)
        progress = self.step / max(1, self.total)
        if self.schedule == "cosine":
            weight = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            weight = 1.0 - progress
        self.coef = self.final + (self.start - self.final) * weight
        return self.coef


KL_CONTROLLERS = ("fixed", "adaptive", "linear", "pid", "scheduled")


def make_kl_controller(kind: str, coef: float, target: float, horizon: float, rate: float,
                       pid: tuple[float, float, float], final_coef: float, total_steps: int) -> KLController:
    """Build a controller by name; each keeps its coefficient in ``.coef`` and moves it with ``update(kl, steps)``.

    Args:
        kind: one of `KL_CONTROLLERS`.
        coef: the initial coefficient.
        target: target per-token KL (``adaptive``, ``linear``, ``pid``).
        horizon: ``adaptive`` horizon, in trajectories.
        rate: ``linear`` rate.
        pid: ``pid`` gains (kp, ki, kd).
        final_coef: ``scheduled`` end value.
        total_steps: ``scheduled`` length.

    Returns:
        The controller.
    """
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    if kind == "linear":
        return LinearKLController(coef, target, rate)
    if kind == "pid":
        return PIDKLController(coef, target, *pid)
    if kind == "scheduled":
        return ScheduledKLController(coef, final_coef, total_steps)
    raise ValueError(f"unknown KL controller '{kind}'; use one of {', '.join(KL_CONTROLLERS)}")
