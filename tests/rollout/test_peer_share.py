"""One trajectory per context x tensor parallel group: real gloo ranks whose "engines" sample differently."""

import random

import pytest
import torch
from helpers import run_on_cpu_ranks

from rl_lightning.data.prompts import Prompt
from rl_lightning.errors import TrainingError
from rl_lightning.rollout.peer_share import check_identical, is_leader, share_from_leader, trajectory_digest
from rl_lightning.rollout.trajectory import Trajectory


def _trajectories(seed: int, n: int = 4) -> list[Trajectory]:
    """What one peer's engine would sample: lengths, tokens and rewards drawn from its own seed."""
    rng = random.Random(seed)
    out = []
    for row in range(n):
        length = rng.randint(3, 9)
        ids = [rng.randrange(1000) for _ in range(4 + length)]
        out.append(Trajectory(Prompt(ids[:4], [{"role": "user", "content": "q"}], "1", f"row {row}", row), ids,
                              [0] * 4 + [1] * length, [0.0] * (4 + length), [], True, reward=rng.random()))
    return out


def test_the_digest_sees_tokens_masks_rewards_and_order():
    base = _trajectories(0)
    digest = trajectory_digest(base)
    assert digest == trajectory_digest(_trajectories(0)) and len(digest) == 32
    changed = _trajectories(0)
    changed[1].input_ids[-1] += 1
    masked = _trajectories(0)
    masked[2].completion_mask[-1] = 0
    rewarded = _trajectories(0)
    rewarded[3].reward += 1e-9
    for other in (changed, masked, rewarded, base[::-1]):
        assert trajectory_digest(other) != digest


def test_a_single_rank_shares_and_checks_trivially():
    values = _trajectories(1)
    assert is_leader(None) and share_from_leader(values, None) is values
    check_identical(trajectory_digest(values), None, rollout=0)  # no group: nothing to compare


def _peers(rank: int, outcome: dict) -> None:
    torch.distributed.init_process_group("gloo")
    group = torch.distributed.new_group([0, 1])
    own = _trajectories(seed=100 + rank)  # peers' engines seeded differently on purpose
    with pytest.raises(TrainingError) as error:  # sampled separately: caught before training
        check_identical(trajectory_digest(own), group, rollout=7)
    message = str(error.value)
    assert message.startswith("rollout 7: context/tensor-parallel peers hold different trajectories (global ranks [1]")
    assert "\n" not in message
    shared = share_from_leader(own if is_leader(group) else None, group)
    assert is_leader(group) == (rank == 0)
    assert trajectory_digest(shared) == trajectory_digest(_trajectories(seed=100))  # the leader's, on both ranks
    assert [t.input_ids for t in shared] == [t.input_ids for t in _trajectories(seed=100)]
    check_identical(trajectory_digest(shared), group, rollout=7)


def test_peers_with_differently_seeded_engines_end_with_the_leaders_trajectories():
    run_on_cpu_ranks(_peers, 2, {})
