"""`rl_lightning.rollout.refill` without a process group: two data-parallel ranks as two threads whose `total` and
`gather` meet at a barrier build exactly the one-process batch (the same groups in the same order, the same rounds),
though one rank keeps more groups per round than the other; without collectives each rank refills on its own."""

import threading
from types import SimpleNamespace

from rl_lightning.rollout.refill import Ranks, refill

GROUP = 2


def _generate(prompts, refill_round):
    """Two completions per prompt; a prompt divisible by 3 gets two equal rewards (an uninformative group)."""
    return [SimpleNamespace(prompt=p, round=refill_round, reward=float(i if p % 3 else 1)) for p in prompts
            for i in range(GROUP)]


def _run(prompts, ranks, max_rounds=4):
    return refill(_generate, prompts, _generate(prompts, 0), list(range(100)), GROUP, (0.0, 1.0), max_rounds, 7,
                  ranks)


def _threaded_ranks(size):
    """`size` Ranks whose collectives meet at a barrier (what all_reduce / all_gather_object do across processes)."""
    barrier, slots = threading.Barrier(size), [None] * size

    def collective(rank):
        def exchange(value):
            slots[rank] = value
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return exchange

    def ranks(rank):
        exchange = collective(rank)
        return Ranks(rank, size, lambda count: sum(exchange(count)), exchange)

    return [ranks(r) for r in range(size)]


def test_two_ranks_build_the_one_process_batch():
    batch = [3, 6, 4, 9]  # rank 0 holds [3, 6] (both dropped), rank 1 [4, 9] (one kept): unequal kept counts
    single, single_rounds = _run(batch, Ranks())
    results = [None, None]

    def rank(r, ranks):
        results[r] = _run(batch[2 * r : 2 * r + 2], ranks)

    threads = [threading.Thread(target=rank, args=(r, ranks)) for r, ranks in enumerate(_threaded_ranks(2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    (first, rounds0), (second, rounds1) = results
    assert single_rounds == rounds0 == rounds1 >= 1
    assert [(t.prompt, t.round) for t in first + second] == [(t.prompt, t.round) for t in single]
    assert len(first) == len(second) == 2 * GROUP  # the global batch is full and split evenly
    assert all(t.prompt % 3 for t in single)  # only informative groups


def test_without_collectives_each_rank_refills_its_own_share():
    """``async_steps: 1`` (no collective in the background thread): the rank's own target and its own stream."""
    mine, rounds = _run([3, 6], Ranks(1, 2))
    assert len(mine) == 2 * GROUP and rounds >= 1 and all(t.prompt % 3 for t in mine)
    other, _ = _run([3, 6], Ranks(0, 2))
    assert [t.prompt for t in mine] != [t.prompt for t in other]  # streams seeded by the rank
