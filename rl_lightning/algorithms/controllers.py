"""The rollout-level feedback loops of policy optimisation: the KL coefficient and the Lagrange multipliers.

Both move once per rollout from the rollout's *global* per-token means (the caller reduces them over every rank), so
every rank holds the same state; both are checkpointed through `state_dict`.
"""

from __future__ import annotations

import math

import torch

from rl_lightning.algorithms.kl import AdaptiveKLController, KLController, make_kl_controller
from rl_lightning.algorithms.policy import lagrangian_terms


class Controllers:
    """A KL controller and the Lagrangian constraints (``entropy`` floor, ``kl`` ceiling).

    Args:
        kl_controller: the KL controller's kind (`rl_lightning.algorithms.kl.make_kl_controller`'s `kind`).
        kl_coef: the initial KL coefficient.
        kl_target: target per-token KL.
        kl_horizon: adaptive controller horizon, in trajectories.
        kl_rate: linear controller rate.
        kl_pid: PID controller gains (kp, ki, kd).
        kl_final_coef: scheduled controller end value.
        kl_total_rollouts: scheduled controller length, in rollouts.
        entropy_min: keep the per-token entropy above this; None: no constraint.
        kl_max: keep the per-token KL to the reference below this; None: no constraint.
        multiplier_lr: dual-ascent step size on the log-multipliers.
        multiplier_init: initial multiplier value.
    """

    def __init__(self, kl_controller: str, kl_coef: float, kl_target: float, kl_horizon: float, kl_rate: float,
                 kl_pid: tuple[float, float, float], kl_final_coef: float, kl_total_rollouts: int,
                 entropy_min: float | None = None, kl_max: float | None = None, multiplier_lr: float = 0.05,
                 multiplier_init: float = 0.1) -> None:
        kp, ki, kd = kl_pid  # a list from a checkpoint's hyperparameters, too
        self.kl: KLController = make_kl_controller(kl_controller, kl_coef, kl_target, kl_horizon, kl_rate,
                                                   (kp, ki, kd), kl_final_coef, kl_total_rollouts)
        # name -> (target, sign): the constraint is sign * (measured - target) <= 0
        self.constraints = {name: (target, sign) for name, target, sign in (("entropy", entropy_min, -1.0),
                                                                            ("kl", kl_max, 1.0)) if target is not None}
        self.multiplier_lr = multiplier_lr
        self.log_multipliers = {name: math.log(multiplier_init) for name in self.constraints}

    @property
    def kl_coef(self) -> float:
        """The KL coefficient of the current rollout."""
        return self.kl.coef

    def penalty(self, measured: dict[str, torch.Tensor]) -> torch.Tensor | float:
        """The sum over constraints of lambda x (violation per token), lambda fixed within the rollout.

        The gradient flows into `measured`.

        Args:
            measured: (B, T) per-token values of the constrained quantities, by name (``entropy``, ``kl``).

        Returns:
            (B, T) penalties, or 0.0 without constraints.
        """
        total: torch.Tensor | float = 0.0
        for name, (target, sign) in self.constraints.items():
            term, _ = lagrangian_terms(torch.tensor(self.log_multipliers[name]), measured[name], target, sign)
            total = total + term
        return total

    def update(self, means: dict[str, float], trajectories: int, move_multipliers: bool = True) -> dict[str, float]:
        """Move the KL coefficient and the multipliers once, from the rollout's global per-token `means`.

        Args:
            means: global per-token means of the rollout (``kl`` moves the KL coefficient; each constraint reads
                its own).
            trajectories: the rollout's global count (the adaptive controller's step unit, Ziegler et al.'s n_steps;
                the others count rollouts).
            move_multipliers: take one dual-ascent step per constraint.

        Returns:
            The new values to log.
        """
        logged: dict[str, float] = {}
        if "kl" in means:
            steps = trajectories if isinstance(self.kl, AdaptiveKLController) else 1
            logged["kl_coef"] = self.kl.update(means["kl"], steps)
        if move_multipliers:
            for name, (target, sign) in self.constraints.items():
                log_multiplier = torch.tensor(self.log_multipliers[name], requires_grad=True)
                _, multiplier_loss = lagrangian_terms(log_multiplier, torch.tensor(means[name]), target, sign)
                (grad,) = torch.autograd.grad(multiplier_loss, log_multiplier)
                self.log_multipliers[name] -= self.multiplier_lr * float(grad)
                logged[f"{name}_multiplier"] = math.exp(self.log_multipliers[name])
        return logged

    def state_dict(self) -> dict:
        """The KL controller's and the multipliers' state, for checkpoints."""
        return {"kl_controller": dict(vars(self.kl)), "log_multipliers": dict(self.log_multipliers)}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s state (multipliers of constraints no longer set are ignored)."""
        vars(self.kl).update(state.get("kl_controller", {}))
        for name, value in state.get("log_multipliers", {}).items():
            if name in self.log_multipliers:
                self.log_multipliers[name] = float(value)
