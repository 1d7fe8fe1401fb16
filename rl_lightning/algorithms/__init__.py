"""Pure tensor functions: inputs are tensors and scalar hyper-parameters; outputs a loss and a metrics dict.

No config objects, no logging, no torch.distributed: global normalisers are passed in as arguments.

May import: nothing of ours.
"""

from rl_lightning.algorithms.advantages import (
    estimate_advantages,
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rl_lightning.algorithms.kl import KL_ESTIMATORS
from rl_lightning.algorithms.logprobs import token_logprobs
from rl_lightning.algorithms.pass_at_k import pass_at_k
from rl_lightning.algorithms.policy import clipped_policy_loss, clipped_value_loss, token_mean
from rl_lightning.algorithms.preference import DPO_LOSSES, bradley_terry_loss, dpo_logits, dpo_loss
from rl_lightning.algorithms.preference_free import (
    kto_loss,
    kto_reference_point,
    orpo_loss,
    per_token_average,
    simpo_loss,
)
from rl_lightning.algorithms.sft import sft_loss

__all__ = [
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "bradley_terry_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "dpo_logits",
    "dpo_loss",
    "estimate_advantages",
    "gae",
    "group_advantages",
    "kto_loss",
    "kto_reference_point",
    "orpo_loss",
    "pass_at_k",
    "per_token_average",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sft_loss",
    "simpo_loss",
    "token_logprobs",
    "token_mean",
]
