"""Re-packing a minibatch under a smaller budget (the out-of-memory back-off) carries every per-token value that
scoring and the advantages recorded, the teacher's log-probabilities too."""

import torch

from rl_lightning.parallel.reductions import Groups
from rl_lightning.rollout.trajectory import Trajectory
from rl_lightning.tasks.ppo.minibatches import completion_grid, gather, micro_batches, repack

RECORDED = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "old_values", "advantages", "returns")


def test_repack_carries_every_recorded_value():
    cpu, groups = torch.device("cpu"), Groups()
    trajectories = [Trajectory(None, [1, 2, 3, 4, 5, 6][: 3 + i], [0, 0] + [1] * (1 + i), [0.0] * (3 + i), [], True)
                    for i in range(4)]
    part = [0, 1, 2, 3]
    packed = micro_batches(trajectories, part, 100, 0, groups, cpu)
    generator = torch.Generator().manual_seed(0)
    for mb in packed:
        for key in RECORDED:
            mb[key] = torch.randn(mb["target_mask"].shape, generator=generator) * mb["target_mask"]
    fresh = repack(trajectories, part, packed, 6, 0, groups, cpu)
    assert len(packed) == 1 and len(fresh) >= 3
    grid = completion_grid(trajectories, cpu)
    for key in RECORDED:
        assert torch.equal(gather(groups, fresh, [mb[key] for mb in fresh], grid),
                           gather(groups, packed, [mb[key] for mb in packed], grid)), key


def test_a_cut_completion_left_out_of_the_loss_counts_no_loss_token():
    """Overlong filtering zeroes a cut completion's mask but keeps its generated length for the metrics: the loss's
    token count (its normaliser) and the (B, T) completion grid must follow the mask, not that length."""
    from rl_lightning.tasks.ppo.update import loss_counts

    cpu, groups = torch.device("cpu"), Groups()
    kept = Trajectory(None, [1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0.0] * 5, [], True)
    cut = Trajectory(None, [1, 2, 3, 4, 5, 6], [0] * 6, [0.0] * 6, [], False, generated_tokens=4)
    assert (cut.completion_length, cut.loss_tokens) == (4, 0)
    assert torch.equal(completion_grid([kept, cut], cpu), torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    tokens, normaliser = loss_counts(groups, [kept, cut], [0, 1], "token_mean", 6)
    assert (float(tokens), float(normaliser)) == (3.0, 3.0)
