"""`skip_mask` against values worked out by hand."""

import math

import pytest
import torch

from rl_lightning.algorithms.policy import skip_mask


def test_skip_mask_judges_each_trajectory_on_its_geometric_mean_ratio():
    """threshold 2, log 2 = 0.693. Trajectory sums / tokens: 1.2 / 2 = 0.6 (ratio 1.82, kept); 1.6 / 2 = 0.8 (2.23,
    skipped); -3.0 / 4 = -0.75 (ratio 0.47 < 1/2, skipped); 5.0 / 10 = 0.5 (kept, although one token alone could be
    far off: the mean decides); 0 tokens (nothing to skip)."""
    sums = torch.tensor([1.2, 1.6, -3.0, 5.0, 0.0])
    counts = torch.tensor([2.0, 2.0, 4.0, 10.0, 0.0])
    assert skip_mask(sums, counts, 2.0).tolist() == [False, True, True, False, False]


def test_skip_mask_boundary_and_validation():
    """exactly log(threshold) is kept: the ratio must exceed the threshold."""
    assert skip_mask(torch.tensor([math.log(3.0) * 3]), torch.tensor([3.0]), 3.0).tolist() == [False]
    assert skip_mask(torch.tensor([math.log(3.0) * 3 + 1e-3]), torch.tensor([3.0]), 3.0).tolist() == [True]
    with pytest.raises(ValueError, match="skip threshold must be > 1, got 1.0"):
        skip_mask(torch.zeros(1), torch.ones(1), 1.0)
