"""Pins `rl_lightning.compat.transformers`: a config's private attention implementation and the helper the
ring-flash-attn shim restores.

A failure names the private name, the versions tested and the module to update (`_pinned`).
"""

from importlib.metadata import version
from pathlib import Path

import transformers
from transformers import AutoConfig

from rl_lightning.compat import transformers as compat

TINY_MODEL = Path(__file__).resolve().parents[2] / "rl_lightning" / "assets" / "tiny-qwen2"


def _pinned(condition: object, name: str, change: str = "is gone") -> None:
    assert condition, (f"{compat.TESTED} (installed {version('transformers')}): {name} {change}; "
                       "update rl_lightning/compat/transformers.py")


def test_a_configs_attention_implementation():
    config = AutoConfig.from_pretrained(TINY_MODEL, attn_implementation="eager")
    _pinned(hasattr(config, "_attn_implementation"), "PretrainedConfig._attn_implementation")
    assert compat.attention_implementation(config) == "eager"


def test_the_flash_attn_helper_is_restored():
    import transformers.modeling_flash_attention_utils as flash_utils

    _pinned(callable(getattr(transformers.utils, "is_flash_attn_greater_or_equal_2_10", None)),
            "transformers.utils.is_flash_attn_greater_or_equal_2_10")
    compat.restore_flash_attn_helper()
    compat.restore_flash_attn_helper()  # idempotent
    assert flash_utils.is_flash_attn_greater_or_equal_2_10 is transformers.utils.is_flash_attn_greater_or_equal_2_10
