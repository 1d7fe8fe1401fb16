"""The activation formula's lean savings (`rl_lightning.memory.activations.lean_saved_bytes`) against the bytes the
lean forwards (`rl_lightning.models.lean`) really leave unsaved in a whole model's training forward, per precision."""

import pytest
import torch
from conftest import TINY_MODEL

from rl_lightning.memory.activations import lean_saved_bytes
from rl_lightning.memory.model_shape import load_model_shape
from rl_lightning.memory.plan import TrainSetup
from rl_lightning.models.lean import apply_lean_activations, remove_lean_activations
from rl_lightning.models.loading import load_causal_lm

TOKENS = 101  # a prime: no weight (or its autocast copy) has a dimension of this size, every activation has one


def saved_bytes_per_token(model, autocast):
    """Bytes of the distinct non-parameter tensors with a token dimension that a training forward saves, per token."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if TOKENS in tensor.shape and storage.data_ptr() not in params | seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return tensor

    ids = torch.randint(0, 250, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(input_ids=ids, use_cache=False)
    return total[0] / TOKENS


@pytest.mark.parametrize(("precision", "dtype", "autocast"), [("32-true", torch.float32, False),
                                                              ("bf16-mixed", torch.float32, True),
                                                              ("bf16-true", torch.bfloat16, False)])
def test_the_plans_lean_savings_are_what_the_lean_forwards_do_not_save(precision, dtype, autocast):
    model = load_causal_lm(str(TINY_MODEL), lean_activations=False).to(dtype)  # 2 layers, h 128, i 256
    stock = saved_bytes_per_token(model, autocast)
    assert apply_lean_activations(model) == 2 * 3 + 1  # per layer the MLP and two norms; the final norm
    lean = saved_bytes_per_token(model, autocast)
    remove_lean_activations(model)
    shape = load_model_shape(str(TINY_MODEL))
    per_layer, outside = lean_saved_bytes(TrainSetup(model=shape, tokens=TOKENS, precision=precision,
                                                     lean_activations=True))
    assert stock - lean == shape.layers * per_layer + outside == {"32-true": 6656, "bf16-mixed": 4608,
                                                                  "bf16-true": 4608}[precision]
