"""``model.lm`` (`rl_lightning.models.config.LMConfig`): one group for every task; the optimizer's unset fields take
each task's own default; a checkpoint's plain dict loads back; bad values are one line naming ``model.lm.<key>``."""

import pytest
from conftest import TINY_MODEL

from rl_lightning.errors import ConfigError
from rl_lightning.models.config import LMConfig, lm_config
from rl_lightning.models.lora import LoRAConfig
from rl_lightning.models.optim import OptimConfig


def test_each_task_fills_the_unset_optimizer_fields_with_its_own_defaults():
    from rl_lightning.tasks import DPO, SFT, RewardModel

    expected = {SFT: (1e-5, "cosine"), DPO: (5e-7, "cosine"), RewardModel: (5e-6, "cosine")}
    for task, (lr, schedule) in expected.items():
        module = task(LMConfig(str(TINY_MODEL)))
        assert (module.optim.lr, module.optim.lr_schedule) == (lr, schedule), task.__name__
        assert module.lm.optim == module.optim and module.hparams.lm["optim"]["lr"] == lr
    set_here = SFT(LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=3e-4, lr_schedule="linear")))
    assert (set_here.optim.lr, set_here.optim.lr_schedule) == (3e-4, "linear")  # a value given wins


def test_a_checkpoints_plain_dict_is_the_group_again():
    config = LMConfig(str(TINY_MODEL), optim=OptimConfig(lr=1e-3), lora=LoRAConfig(r=4), lm_head_chunk=None)
    assert lm_config(config.as_dict()) == config
    assert lm_config({"name": "m", "optim": {"lr": 2e-3}, "lora": {"r": 2}}) == LMConfig(
        "m", optim=OptimConfig(lr=2e-3), lora=LoRAConfig(r=2))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": ""}, "model.lm.name must name a model (a folder, hub name or asset:<name>), got ''"),
    ({"name": "m", "lm_head_chunk": 0}, "model.lm.lm_head_chunk must be a number of positions >= 1 or null, got 0"),
    ({"name": "m", "optim": {"lr": -1.0}}, "model.lm.optim.lr must be > 0, got -1.0"),
])
def test_bad_values_are_one_line_naming_the_key(kwargs, message):
    with pytest.raises(ConfigError) as info:
        lm_config(kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_reward_model_has_no_output_head_to_chunk():
    """RewardModel keeps its behaviour (a scalar head, never chunked): the default and null pass, another is refused."""
    from rl_lightning.tasks import RewardModel

    assert RewardModel(LMConfig(str(TINY_MODEL), lm_head_chunk=None)).lm.lm_head_chunk is None
    with pytest.raises(ConfigError) as info:
        RewardModel(LMConfig(str(TINY_MODEL), lm_head_chunk=8))
    assert str(info.value) == ("model.lm.lm_head_chunk=8: the RewardModel has a scalar head, no output head to chunk; "
                               "leave model.lm.lm_head_chunk unset")
