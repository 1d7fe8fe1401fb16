"""transformers' private names, behind named functions (tested on transformers 5.x).

A model config's attention implementation is only stored privately (``_attn_implementation``), and ring-flash-attn
0.1.8 imports a helper transformers 5 moved out of ``modeling_flash_attention_utils``: `restore_flash_attn_helper`
puts it back (a patch of the library, so it lives here).
"""

from __future__ import annotations

from typing import Any

TESTED = "transformers 5.x"


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a model was built with (``sdpa``, ``rl_varlen``; ``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def restore_flash_attn_helper() -> None:
    """Give ``transformers.modeling_flash_attention_utils`` back ``is_flash_attn_greater_or_equal_2_10`` (idempotent)."""
    import transformers.modeling_flash_attention_utils as flash_utils
    import transformers.utils

    if not hasattr(flash_utils, "is_flash_attn_greater_or_equal_2_10"):
        flash_utils.is_flash_attn_greater_or_equal_2_10 = transformers.utils.is_flash_attn_greater_or_equal_2_10
