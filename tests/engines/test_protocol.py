"""The engine protocol's seeds: `derive_seed` is a stable 63-bit hash of its keys, and every completion of a
`generate` call (prompt i, sample j) has a seed of its own, so no two share a random stream (``seed + j`` of one
prompt met ``seed + (j - 1)`` of the next under the old offsets)."""

from rl_lightning.engines.protocol import SamplingParams, derive_seed


def test_derive_seed_is_a_stable_63_bit_hash_of_its_keys():
    """The same keys give the same seed in every process and Python version (BLAKE2b, not ``hash``): pinned values;
    order and length matter; negative keys are keys too."""
    assert derive_seed(42, 1, 2, 3) == 1724463284092272408
    assert derive_seed(0) == 893442142816765029
    seeds = {derive_seed(42, 1, 2, 3), derive_seed(42, 3, 2, 1), derive_seed(42, 1, 2), derive_seed(42, 1, 2, 3, 0),
             derive_seed(42, -1, 2, 3)}
    assert len(seeds) == 5 and all(0 <= s < 2**63 for s in seeds)


def test_every_sample_of_a_call_has_its_own_seed():
    """100 prompts x 8 samples, seeded by a base `seed` or per-prompt `seeds`: 800 distinct sample seeds; sample j of
    prompt i and sample j - 1 of prompt i + 1 differ (they shared a stream as seed + i + j); a prompt's sample seeds
    do not depend on n or on the other prompts of the call."""
    for params in (SamplingParams(n=8, seed=5), SamplingParams(n=8, seeds=list(range(100)))):
        seeds = [params.sample_seed(i, j) for i in range(100) for j in range(8)]
        assert len(set(seeds)) == 800 and None not in seeds
        assert all(params.sample_seed(i, j) != params.sample_seed(i + 1, j - 1) for i in range(99) for j in range(1, 8))
    assert SamplingParams(n=2, seeds=[7, 9]).sample_seed(1, 1) == SamplingParams(n=4, seeds=[9]).sample_seed(0, 1)
    assert SamplingParams(n=2).sample_seed(0, 1) is None  # unseeded: fresh randomness
