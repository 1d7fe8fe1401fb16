"""The curriculum's state maths (`rl_lightning.algorithms.curriculum`) against values worked by hand."""

import pytest
import torch
from conftest import assert_close

from rl_lightning.algorithms.curriculum import (
    ACTIVE,
    HOPELESS,
    SOLVED,
    curriculum_pools,
    pass_rate_histogram,
    prompt_pass_rates,
    update_pass_rates,
)


def test_pass_counts_per_prompt():
    """Prompt 0: rewards 1.5, 0.5, 1.0 -> 2 of 3 pass at threshold 1 (1.0 counts: 'at least'); prompt 2: 0 of 1;
    prompt 1 not sampled."""
    c, n = prompt_pass_rates(torch.tensor([0, 0, 2, 0]), torch.tensor([1.5, 0.5, 0.0, 1.0]), 1.0, 3)
    assert c.dtype == n.dtype == torch.float64
    assert c.tolist() == [2.0, 0.0, 0.0] and n.tolist() == [3.0, 0.0, 1.0]


def test_moving_average_closed_form():
    """decay 0.75: r0 = 0.5 seen -> 0.5 + 0.25 * (1 - 0.5) = 0.625; unseen prompt 1 -> its first rate 0.25;
    prompt 2 not observed -> unchanged (even its garbage value), its count too."""
    rates, seen = update_pass_rates(torch.tensor([0.5, 9.0, 0.3], dtype=torch.float64), torch.tensor([2, 0, 1]),
                                    torch.tensor([4.0, 1.0, 0.0], dtype=torch.float64),
                                    torch.tensor([4.0, 4.0, 0.0], dtype=torch.float64), decay=0.75)
    assert_close(rates, torch.tensor([0.625, 0.25, 0.3], dtype=torch.float64), atol=0.0)
    assert seen.tolist() == [3, 1, 1]


@pytest.mark.parametrize("decay", [0.0, 0.1, 0.3, 0.7, 0.9, 0.99])
def test_a_rate_of_exactly_one_or_zero_stays_exact(decay):
    """decay*r + (1-decay)*x would drift off 1.0 in float64 for some decays (0.7 + 0.3 != 1.0 exactly is not
    guaranteed); the r + (1-decay)(x - r) form keeps both ends exact, which the pools' >= / <= rely on."""
    rates, seen = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([1, 1])
    for _ in range(20):
        rates, seen = update_pass_rates(rates, seen, torch.tensor([8.0, 0.0], dtype=torch.float64),
                                        torch.tensor([8.0, 8.0], dtype=torch.float64), decay)
    assert rates.tolist() == [1.0, 0.0]


def test_moving_average_converges_geometrically():
    """From r = 1 observing 0 forever: r_k = decay^k."""
    rates, seen = torch.tensor([1.0], dtype=torch.float64), torch.tensor([1])
    for _ in range(5):
        rates, seen = update_pass_rates(rates, seen, torch.zeros(1, dtype=torch.float64),
                                        torch.ones(1, dtype=torch.float64), 0.5)
    assert_close(rates, torch.tensor([0.5**5], dtype=torch.float64), atol=1e-15)


def test_pools_and_readmission():
    """Step 10, readmit_after 4: prompts last seen at 7 stay parked (10 - 7 = 3 < 4), at 6 come back (4 >= 4);
    unseen prompts are active whatever their stored rate; both thresholds hold at 1.0 / 0.0 only."""
    rates = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 0.999], dtype=torch.float64)
    seen = torch.tensor([1, 1, 1, 1, 1, 0, 3])
    last = torch.tensor([7, 7, 7, 6, 6, 0, 7])
    pools = curriculum_pools(rates, seen, last, 10, solved_at=1.0, hopeless_at=0.0, readmit_after=4)
    assert pools.tolist() == [SOLVED, HOPELESS, ACTIVE, ACTIVE, ACTIVE, ACTIVE, ACTIVE]
    never = curriculum_pools(rates, seen, last, 10**6, solved_at=0.99, hopeless_at=0.0, readmit_after=None)
    assert never.tolist() == [SOLVED, HOPELESS, ACTIVE, SOLVED, HOPELESS, ACTIVE, SOLVED]


def test_histogram_bins():
    """Seen rates 0, 0, .25 (upper edge of the 1st inner bin), .26, .5, .75, .8, 1; the unseen 1.0 is not counted."""
    rates = torch.tensor([0.0, 0.0, 0.25, 0.26, 0.5, 0.75, 0.8, 1.0, 1.0], dtype=torch.float64)
    seen = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0])
    assert pass_rate_histogram(rates, seen).tolist() == [2, 1, 2, 1, 1, 1]
