"""`rl_lightning.parallel.reductions` on real gloo groups: `process_groups` reads a device mesh once, and the
reductions take the `Groups` it returns (never the Trainer) and give the hand-computed sums.

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
    results[rank] = out


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
