"""Pareto dominance, exact hypervolume and the bounded archive on hand-worked fronts (all objectives maximised).

Hand-worked values (reference r, HV = area/volume of the union of the boxes [r, p]):

- 2-D, (1,3), (2,2), (3,1) vs (0,0): sweep x from high to low: 3*1 + 2*(2-1) + 1*(3-2) = 6.
- the same vs (1,1): (1,3) and (3,1) span empty boxes (x = 1 or y = 1 is not above r); (2,2) spans 1*1 = 1.
- 3-D, (2,1,1), (1,2,1), (1,1,2) vs 0, by inclusion-exclusion: three boxes of 2, each pairwise intersection (the
  componentwise min, (1,1,1)) 1, the triple one 1: 6 - 3 + 1 = 4.
- 3-D, (2,2,1), (2,1,2), (1,2,2) vs 0: boxes of 4, pairwise intersections e.g. (2,1,1) of 2, triple (1,1,1) of 1:
  12 - 6 + 1 = 7.
- 4-D, (2,1,1,1), (1,1,1,2) vs 0: 2 + 2 - 1 = 3.
- exclusive contributions of (1,4), (2,2), (4,1) vs (0,0): HV = 4*1 + 2*(2-1) + 1*(4-2) = 8; without (1,4): 4 + 2 = 6,
  without (2,2): 4 + 1*(4-1) = 7, without (4,1): 4 + 1*2 = 6; so 2, 1, 2: a bound of 2 evicts (2,2).
"""

import itertools

import pytest
import torch

from rl_lightning.algorithms.pareto import (
    dominates,
    exclusive_contributions,
    hypervolume,
    non_dominated,
    update_archive,
)


def t(*rows):
    """(N, K) points."""
    return torch.tensor(rows, dtype=torch.float64)


def v(*coordinates):
    """(K,) one point."""
    return torch.tensor(coordinates, dtype=torch.float64)


def test_dominates_needs_no_worse_everywhere_and_better_somewhere():
    assert dominates(v(2, 2), v(1, 2)) and not dominates(v(1, 2), v(2, 2))
    assert not dominates(v(2, 2), v(2, 2))  # equal points do not dominate each other
    assert not dominates(v(3, 1), v(1, 3)) and not dominates(v(1, 3), v(3, 1))  # a trade-off


def test_non_dominated_keeps_the_front_and_duplicates():
    points = t((1, 3), (2, 2), (1, 1), (3, 1), (2, 2), (0, 3))
    assert non_dominated(points).tolist() == [True, True, False, True, True, False]
    assert non_dominated(torch.zeros(0, 2)).tolist() == []


@pytest.mark.parametrize("points, reference, expected", [
    (t((1, 3), (2, 2), (3, 1)), (0, 0), 6.0),
    (t((1, 3), (2, 2), (3, 1)), (1, 1), 1.0),  # points on the reference's boundary span nothing
    (t((1, 3), (2, 2), (3, 1), (1, 1), (2, 1), (0.5, 2.5)), (0, 0), 6.0),  # dominated points add nothing
    (t((1, 3), (2, 2), (2, 2), (3, 1), (3, 1)), (0, 0), 6.0),  # duplicates add nothing
    (t((1, 3), (2, 2), (3, 1), (-1, 5), (4, 0)), (0, 0), 6.0),  # not above the reference: nothing
    (t((2, 2),), (3, 0), 0.0),
    (t((2, 1, 1), (1, 2, 1), (1, 1, 2)), (0, 0, 0), 4.0),
    (t((2, 2, 1), (2, 1, 2), (1, 2, 2)), (0, 0, 0), 7.0),
    (t((2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 1), (2, 2, 1)), (0, 0, 0), 7.0),
    (t((3, 3, 2), (3, 2, 3), (2, 3, 3)), (1, 1, 1), 7.0),  # the previous front shifted by the reference
    (t((1, 2, 3),), (0, 0, 0), 6.0),
    (t((2, 1, 1, 1), (1, 1, 1, 2)), (0, 0, 0, 0), 3.0),
    (t((5,), (2,)), (1,), 4.0),
])
def test_hypervolume_of_hand_worked_fronts(points, reference, expected):
    assert hypervolume(points, torch.tensor(reference, dtype=torch.float64)) == expected


def test_hypervolume_of_no_points_is_zero_and_dimensions_must_agree():
    assert hypervolume(torch.zeros(0, 3), torch.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="3 objectives but the reference has 2"):
        hypervolume(torch.ones(2, 3), torch.zeros(2))


def _inclusion_exclusion(points, reference):
    """HV = sum over non-empty subsets S of (-1)^(|S|+1) vol(box of the componentwise min of S): exact, O(2^N)."""
    clipped = torch.maximum(points, reference)
    total = 0.0
    for size in range(1, len(points) + 1):
        for subset in itertools.combinations(range(len(points)), size):
            corner = clipped[list(subset)].min(dim=0).values
            total += (-1) ** (size + 1) * float((corner - reference).prod())
    return total


@pytest.mark.parametrize("dims", [2, 3, 4])
def test_hypervolume_matches_inclusion_exclusion_on_integer_fronts(dims):
    """Integer coordinates: both methods are exact in float64, so they agree exactly."""
    generator = torch.Generator().manual_seed(dims)
    for _ in range(20):
        points = torch.randint(-1, 5, (6, dims), generator=generator).double()
        reference = torch.randint(-1, 2, (dims,), generator=generator).double()
        assert hypervolume(points, reference) == _inclusion_exclusion(points, reference)


def test_results_do_not_depend_on_the_order_of_the_points():
    """HV = 4*1 + 2*(2-1) + 1*(4-2) + 0.5*(5-4) = 8.5; (1,1) is dominated; the exclusive contributions of (1,4), (2,2),
    (4,1), (0.5,5) are 1, 1, 2, 0.5, so a bound of 3 evicts (0.5,5) whatever the order (no tie)."""
    points = t((1, 4), (2, 2), (4, 1), (1, 1), (0.5, 5))
    reference = v(0, 0)
    for order in itertools.permutations(range(len(points))):
        shuffled = points[list(order)]
        assert hypervolume(shuffled, reference) == hypervolume(points, reference) == 8.5
        assert non_dominated(shuffled).tolist() == non_dominated(points)[list(order)].tolist()
        kept = {tuple(p) for p in shuffled[update_archive(shuffled, reference, 3)].tolist()}
        assert kept == {(1.0, 4.0), (2.0, 2.0), (4.0, 1.0)}  # (0.5, 5) adds only 0.5


def test_exclusive_contributions_by_hand():
    assert exclusive_contributions(t((1, 4), (2, 2), (4, 1)), v(0, 0)).tolist() == [2.0, 1.0, 2.0]
    # duplicates, dominated points and points outside the reference box contribute nothing
    assert exclusive_contributions(t((2, 2), (2, 2), (1, 1), (-1, 9)), v(0, 0)).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_size_bound_evicts_the_least_contributing_point():
    reference = v(0, 0)
    points = t((1, 4), (2, 2), (4, 1))  # contributions 2, 1, 2 (see the module docstring)
    assert update_archive(points, reference, 3).tolist() == [0, 1, 2]
    assert update_archive(points, reference, 2).tolist() == [0, 2]  # HV 8 -> 7, the best 2-point subset
    assert hypervolume(points[[0, 2]], reference) == 7.0
    # one more: contributions of (1,4), (4,1) are now 3, 3: a tie drops the newest
    assert update_archive(points, reference, 1).tolist() == [0]


def test_archive_drops_dominated_points_and_later_duplicates():
    reference = v(0, 0)
    points = t((1, 3), (2, 2), (1, 1), (2, 2), (3, 1))
    assert update_archive(points, reference, 10).tolist() == [0, 1, 4]
    # ties: (1,3), (2,2), (3,1) each contribute 1 -> the newest leaves; a newcomer that adds nothing never enters
    assert update_archive(t((1, 3), (2, 2), (3, 1)), reference, 2).tolist() == [0, 1]
    assert update_archive(t((1, 3), (3, 1), (4, 0)), reference, 2).tolist() == [0, 1]  # (4,0) adds 0: evicted
    with pytest.raises(ValueError, match="max_size must be >= 1"):
        update_archive(points, reference, 0)
