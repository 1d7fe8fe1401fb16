"""A micro-batch's forwards and losses, as the update loop calls them: `MicroBatchLosses`.

The task builds it once its networks are loaded (`rl_lightning.tasks.ppo.PPO.configure_model`); the update loop
(`rl_lightning.tasks.ppo.update`) calls `MicroBatchLosses.policy` and `MicroBatchLosses.value` and never the task.
The policy's loss is the forward (`rl_lightning.models.logprobs.target_logprobs`), then the composed
`rl_lightning.tasks.ppo.objective.PolicyObjective`, plus GKD's JSD with ``model.distill.type: loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_lightning.algorithms.controllers import Controllers
from rl_lightning.models.logprobs import target_logprobs
from rl_lightning.tasks.ppo.distill import DatasetCompletions, DistillConfig, jsd_loss
from rl_lightning.tasks.ppo.minibatches import MicroBatch
from rl_lightning.tasks.ppo.objective import PolicyObjective, value_loss
from rl_lightning.tasks.ppo.scoring import critic_values


@dataclass
class MicroBatchLosses:
    """The policy's (and the critic's) forward and loss on one packed micro-batch.

    Args:
        model: the policy.
        objective: the policy loss, composed from the run's terms.
        controllers: the KL coefficient and the Lagrangian constraints (they move between rollouts).
        temperature: the rollout's temperature (``model.rollout.temperature``): the log-probabilities are taken at it.
        lm_head_chunk: ``model.lm.lm_head_chunk``.
        critic: the critic, or None.
        value_clip: ``model.value_clip``.
        distill: ``model.distill`` with ``type: loss`` (GKD's JSD is added to the policy loss), else None.
        teacher: the frozen distillation teacher (with `distill`).
        mix: GKD's lambda (``model.distill.lmbda`` < 1): whether the current rollout is on-policy, else None.
    """

    model: Any
    objective: PolicyObjective
    controllers: Controllers
    temperature: float = 1.0
    lm_head_chunk: int | None = None
    critic: Any = None
    value_clip: float | None = 0.2
    distill: DistillConfig | None = None
    teacher: Any = None
    mix: DatasetCompletions | None = None

    def policy(self, mb: MicroBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy's forward on `mb` and its share of the minibatch's policy loss, with metric sums.

        A rollout of dataset completions (GKD's lambda) trains on the JSD alone. The first minibatch's
        ``old_logprobs`` come from this forward (the policy has not moved since sampling).

        Args:
            mb: the packed micro-batch.
            normaliser: the minibatch's global normaliser of the policy loss, over the gradient-averaging size.

        Returns:
            The scalar loss and its metric sums over the target tokens.
        """
        if self.mix is not None and not self.mix.on_policy:
            jsd, jsd_sum = self.jsd(mb, normaliser)
            return jsd, {"distill_jsd": jsd_sum}
        logprobs, entropy = target_logprobs(self.model, mb, self.temperature,
                                            entropy="grad" if self.objective.entropy_needs_grad else "value",
                                            chunk_size=self.lm_head_chunk)
        if "old_logprobs" not in mb:  # the first minibatch: the policy has not moved since sampling
            mb["old_logprobs"] = logprobs.detach()
        loss, sums = self.objective.loss(logprobs, entropy, mb, normaliser, self.controllers.kl_coef,
                                         self.controllers.penalty)
        if self.distill is not None:  # GKD's JSD over the vocabulary
            jsd, sums["distill_jsd"] = self.jsd(mb, normaliser)
            loss = loss + jsd
        return loss, sums

    def jsd(self, mb: MicroBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``model.distill.type: loss``: coef x the token-mean JSD of `mb` and the JSD's token sum (`jsd_loss`)."""
        if self.distill is None:
            raise RuntimeError("MicroBatchLosses.jsd needs model.distill with type: loss")
        return jsd_loss(self.model, self.teacher, mb, normaliser, self.distill, self.temperature, self.lm_head_chunk)

    def value(self, mb: MicroBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critic's forward on `mb` and its share of the minibatch's value loss, with metric sums.

        Args:
            mb: the packed micro-batch (``old_values``, ``returns``).
            normaliser: the minibatch's global count of completion tokens, over the gradient-averaging size.

        Returns:
            The scalar loss and the sums of ``value_loss``, ``values`` and ``returns``.
        """
        return value_loss(critic_values(self.critic, mb), mb, normaliser, self.value_clip)
