"""verifiers' private names, behind a named function (tested on verifiers 0.4).

``@vf.reward(weight=...)`` records the weight on the function as ``_vf_weight`` (verifiers reads it the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TESTED = "verifiers 0.4"


def reward_weight(function: Callable[..., Any]) -> float:
    """The weight ``@vf.reward`` gave `function` (``_vf_weight``; 1.0 when it gave none)."""
    return float(getattr(function, "_vf_weight", 1.0))
