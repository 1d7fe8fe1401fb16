"""Pure tensor functions: inputs are tensors and scalar hyper-parameters; outputs a loss and a metrics dict.

No config objects, no logging, no torch.distributed: global normalisers are passed in as arguments.
"""

from rl_lightning.algorithms.logprobs import token_logprobs
from rl_lightning.algorithms.preference import DPO_LOSSES, bradley_terry_loss, dpo_logits, dpo_loss
from rl_lightning.algorithms.sft import sft_loss

__all__ = ["DPO_LOSSES", "bradley_terry_loss", "dpo_logits", "dpo_loss", "sft_loss", "token_logprobs"]
