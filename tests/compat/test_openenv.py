"""Pins `rl_lightning.compat.openenv` and `rl_lightning.compat.verifiers`: the private names they read still hold
what they rely on. A failure names the private name, the versions tested and the module to update.
"""

from importlib.metadata import version

import pytest

from rl_lightning.compat import openenv, verifiers


def test_a_weighted_sums_children_and_weights():
    rubrics = pytest.importorskip("openenv.core.rubrics")

    class Constant(rubrics.Rubric):
        def forward(self, action, observation):
            return 1.0

    first, second = Constant(), Constant()
    total = rubrics.WeightedSum([first, second], weights=[0.25, 0.75])
    assert hasattr(total, "_rubric_list") and hasattr(total, "_weights"), (
        f"{openenv.TESTED} (installed {version('openenv-core')}): WeightedSum._rubric_list/_weights is gone; "
        "update rl_lightning/compat/openenv.py")
    assert openenv.weighted_sum_parts(total) == [(first, 0.25), (second, 0.75)]


def test_a_rewards_weight():
    vf = pytest.importorskip("verifiers.v1.utils.decorators")

    @vf.reward(weight=2.5)
    async def weighted(trace):
        return 1.0

    async def plain(trace):
        return 1.0

    assert getattr(weighted, "_vf_weight", None) == 2.5, (
        f"{verifiers.TESTED} (installed {version('verifiers')}): a reward's _vf_weight is gone; "
        "update rl_lightning/compat/verifiers.py")
    assert (verifiers.reward_weight(weighted), verifiers.reward_weight(plain)) == (2.5, 1.0)
