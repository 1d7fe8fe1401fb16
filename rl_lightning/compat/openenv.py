"""OpenEnv's private names, behind a named function (tested on openenv-core 0.3).

A ``WeightedSum`` rubric keeps its children and weights in ``_rubric_list`` and ``_weights`` (no public accessor).
"""

from __future__ import annotations

from typing import Any

TESTED = "openenv-core 0.3"


def weighted_sum_parts(rubric: Any) -> list[tuple[Any, float]]:
    """A ``WeightedSum`` rubric's (child, weight) pairs, in order (``_rubric_list``, ``_weights``)."""
    return list(zip(rubric._rubric_list, (float(w) for w in rubric._weights), strict=True))
