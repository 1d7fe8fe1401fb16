"""The step shared by the pairwise-preference tasks (reward modelling, DPO).

Chosen and rejected sequences are packed together, the loss averaged over the global number of pairs, metrics logged
as global means per pair.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_lightning.memory.phases import phase
from rl_lightning.models.optim import optimizer_step
from rl_lightning.parallel.reductions import data_parallel_sum


def pair_slices(values: torch.Tensor, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) chosen and (P,) rejected entries of per-sequence values laid out chosen, rejected, chosen, ..."""
    return values[0 : 2 * num_pairs : 2], values[1 : 2 * num_pairs : 2]


def log_global_means(module: Any, sums: dict[str, torch.Tensor], count: torch.Tensor, prefix: str) -> None:
    """Log ``prefix/<name>`` = (sum over data-parallel ranks of sums[name]) / count (count already global)."""
    names = sorted(sums)
    totals = data_parallel_sum(module.groups, torch.stack([sums[n].float() for n in names]))
    module.log_dict({f"{prefix}/{n}": totals[i] / count.clamp(min=1) for i, n in enumerate(names)})


def pairwise_step(module: Any, micro_batches: list[dict[str, Any]], pair_loss: Any, extras: list[Any]) -> None:
    """One optimizer step: per-micro-batch pair loss, backward, step, and global-mean logging of the metrics per pair.

    ``pair_loss(micro_batch, extra, normaliser) -> (loss, metric sums)`` runs per micro-batch (`extras` aligned with
    them, e.g. reference log-probabilities).
    """
    num_pairs = data_parallel_sum(module.groups, sum(mb["num_units"] for mb in micro_batches))
    normaliser = num_pairs / module.groups.grad_average_size
    sums: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), device=module.device)
    for micro_batch, extra in zip(micro_batches, extras, strict=True):
        with phase("train/forward"):
            loss, metrics = pair_loss(micro_batch, extra, normaliser)
        with phase("train/backward"):
            module.manual_backward(loss)
        loss_sum += loss.detach() * normaliser
        sums = {k: sums.get(k, 0) + v for k, v in metrics.items()}
    schedule = module.lr_schedulers()
    lr = schedule.get_last_lr()[0]
    grad_norm, logged = optimizer_step(module.optimizers(), schedule, module.parameters(), module.optim,
                                       module.skip_counter)
    module.log_dict(logged)
    log_global_means(module, {**sums, "loss": loss_sum}, num_pairs, "train")
    module.log_dict({"train/grad_norm": grad_norm, "train/lr": lr, "train/pairs": num_pairs})


def pairwise_validation(records: list[dict[str, torch.Tensor]], micro_batches: list[dict[str, Any]], pair_loss: Any,
                        extras: list[Any]) -> None:
    """Append each micro-batch's metric sums (and pair count) to `records` for `log_validation_means`."""
    for micro_batch, extra in zip(micro_batches, extras, strict=True):
        loss, metrics = pair_loss(micro_batch, extra, 1.0)
        records.append({**metrics, "loss": loss.detach(), "pairs": micro_batch["num_units"].float()})


def log_validation_means(module: Any, records: list[dict[str, torch.Tensor]]) -> None:
    """Log ``val/<name>`` global means per pair of the records' metric sums; clears `records`."""
    if records:
        sums = {k: sum(r[k] for r in records) for k in records[0]}
        count = data_parallel_sum(module.groups, sums.pop("pairs"))
        log_global_means(module, sums, count, "val")
    records.clear()
