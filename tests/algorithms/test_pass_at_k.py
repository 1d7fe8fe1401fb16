"""pass@k (Chen et al. 2021, eq. 1) against its closed form 1 - C(n-c, k) / C(n, k), worked by hand and by math.comb."""

import math

import pytest
import torch

from rl_lightning.algorithms.pass_at_k import pass_at_k


def test_worked_values():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    # n=10, c=3, k=1: pass@1 is the share correct, c/n = 0.3
    # n=4, c=0: never; n=4, c=4: always; n=3, c=1, k=3: n - c = 2 < k, every 3-subset holds the correct one: 1
    # n=8, c=1, k=4: 1 - C(7,4)/C(8,4) = 1 - 35/70 = 0.5
    n = torch.tensor([5, 10, 4, 4, 3, 8])
    c = torch.tensor([2, 3, 0, 4, 1, 1])
    expected = torch.tensor([0.7, 0.3, 0.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    got = torch.stack([pass_at_k(n[i : i + 1], c[i : i + 1], k)[0] for i, k in enumerate([2, 1, 1, 2, 3, 4])])
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_matches_the_binomial_closed_form_on_a_grid(k):
    n = torch.tensor([16] * 17 + [20] * 21)
    c = torch.cat([torch.arange(17), torch.arange(21)])
    expected = torch.tensor([1 - math.comb(int(a) - int(b), k) / math.comb(int(a), k) for a, b in zip(n, c, strict=True)],
                            dtype=torch.float64)
    torch.testing.assert_close(pass_at_k(n, c, k), expected, atol=1e-12, rtol=0)


def test_rejects_k_above_n_and_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(torch.tensor([4]), torch.tensor([1]), 5)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(torch.tensor([4]), torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="correct <= n"):
        pass_at_k(torch.tensor([4]), torch.tensor([5]), 1)
