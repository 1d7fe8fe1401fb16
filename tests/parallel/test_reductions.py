"""`rl_lightning.parallel.reductions` on real gloo groups: `process_groups` reads a device mesh once, and the
reductions take the `Groups` it returns (never the Trainer) and give the hand-computed sums; `min_max_over_world` and
the memory plan's device memory agreed across ranks (`rl_lightning.tasks.memory_check.agreed_device_memory`).

One spawn of 2 processes runs every check; rank r contributes r + 1.
"""

import types

import torch
import torch.distributed as dist
from helpers import run_on_cpu_ranks

from rl_lightning.parallel.reductions import (
    Groups,
    data_parallel_max,
    data_parallel_sum,
    min_max_over_world,
    process_groups,
    shard_sum,
    shard_sum_dict,
)


def _strategy(sizes: tuple[int, int, int]) -> types.SimpleNamespace:
    """A strategy holding `ParallelStrategy`'s meshes of (data, context, tensor) parallel `sizes`, real groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("data_parallel", "context_parallel", "tensor_parallel"))
    return types.SimpleNamespace(root_device=torch.device("cpu"), dp_mesh=mesh["data_parallel"],
                                 cp_mesh=mesh["context_parallel"], tp_mesh=mesh["tensor_parallel"])


def _checks(rank: int, results: dict) -> None:
    dist.init_process_group("gloo")
    value = torch.tensor(float(rank + 1))
    out = {}
    data = process_groups(types.SimpleNamespace(strategy=_strategy((2, 1, 1))))  # 2 data-parallel ranks
    context = process_groups(types.SimpleNamespace(strategy=_strategy((1, 2, 1))))  # 2 context-parallel ranks
    ddp = process_groups(types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")),
                                               world_size=2, global_rank=rank))
    for name, groups in (("data", data), ("context", context), ("ddp", ddp)):
        out[name] = {
            "coords": (groups.dp_rank, groups.dp_size, groups.cp_rank, groups.cp_size, groups.grad_average_size,
                       groups.world_size),
            "dp_sum": float(data_parallel_sum(groups, value)), "dp_max": float(data_parallel_max(groups, rank + 1)),
            "shard_sum": float(shard_sum(groups, value)),
            "dict": {k: float(v) for k, v in shard_sum_dict(groups, {"a": value, "b": 2 * value}).items()},
        }
    out["one"] = float(data_parallel_sum(Groups(), value))  # one process: no collective at all
    out["extremes"] = min_max_over_world(100 - rank, 5 + rank, torch.device("cpu"))
    out["agreed"] = _agreed_memory(rank)
    results[rank] = out


def _agreed_memory(rank: int) -> tuple[int, int]:
    """The memory plan's device memory as each rank would see it alone, then agreed: (the least, the largest)."""
    from rl_lightning.tasks import memory_check

    alone = memory_check.device_memory
    memory_check.device_memory = lambda trainer: ((80 - 10 * rank) << 30, (2 + rank) << 30)  # rank 1: less free
    try:
        trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
        return memory_check.agreed_device_memory(trainer)
    finally:
        memory_check.device_memory = alone


def test_reductions_over_real_groups_give_the_hand_sums():
    with torch.multiprocessing.Manager() as manager:
        results = manager.dict()
        run_on_cpu_ranks(_checks, 2, results)
        results = dict(results)
    for rank in (0, 1):
        out = results[rank]
        # data parallel: counts sum over both ranks (1 + 2), and so does a shard sum (no context parallelism)
        assert out["data"] == {"coords": (rank, 2, 0, 1, 2, 2), "dp_sum": 3.0, "dp_max": 2.0, "shard_sum": 3.0,
                               "dict": {"a": 3.0, "b": 6.0}}
        # context parallel: whole-micro-batch counts are not summed (peers hold the same ones); token sums are
        assert out["context"] == {"coords": (0, 1, rank, 2, 2, 2), "dp_sum": rank + 1.0, "dp_max": rank + 1.0,
                                  "shard_sum": 3.0, "dict": {"a": 3.0, "b": 6.0}}
        # DDP: every rank is a data-parallel rank of the default group
        assert out["ddp"] == {"coords": (rank, 2, 0, 1, 2, 2), "dp_sum": 3.0, "dp_max": 2.0, "shard_sum": 3.0,
                              "dict": {"a": 3.0, "b": 6.0}}
        assert out["one"] == rank + 1.0
        assert out["extremes"] == (99.0, 6.0)  # the least low (rank 1's 99), the largest high (rank 1's 6)
        # every rank plans with the least memory and the largest baseline, so all refuse (or pick a budget) alike
        assert out["agreed"] == (70 << 30, 3 << 30)
