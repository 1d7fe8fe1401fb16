"""The memory plan at start-up: every task's ``setup`` calls `check_memory` before any model weights load.

It reads the model's config (no weights: `rl_lightning.memory.model_shape`), the task's arguments, the trainer
(precision, strategy, device) and the prepared data (token budget, the share of tokens the output head runs on, the
longest packing unit), asks `rl_lightning.memory.plan.plan_memory` for the peak per device, prints the plan
once (global rank 0) and refuses, in one line naming the keys that would fit (`rl_lightning.memory.fit`), a
run whose predicted peak exceeds the device's memory, unless ``model.lm.memory_check: false``. PPO's
``max_length_per_device: auto`` becomes the largest budget whose predicted peak fits in `SAFETY` of the device.

The device's memory: on CUDA the free memory (``torch.cuda.mem_get_info``) plus what this process holds already; on
CPU the resident memory now plus ``MemAvailable`` (or the cgroup's limit, if lower) shared among this node's
training processes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from rl_lightning.data.steps import unit_sequences
from rl_lightning.errors import ConfigError, UserError
from rl_lightning.memory.extras import DistillSetup
from rl_lightning.memory.fit import Keys, largest_budget, refusal
from rl_lightning.memory.model_shape import ModelShape, load_model_shape
from rl_lightning.memory.phases import rss_mib
from rl_lightning.memory.plan import MIB, SAFETY, EngineSetup, Layout, MemoryPlan, TrainSetup, plan_memory
from rl_lightning.parallel.reductions import min_max_over_world


def host_memory_available() -> int:
    """Bytes this machine can still give (``MemAvailable``, or the cgroup v2 limit's headroom if that is smaller)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, available)


def device_memory(trainer: Any) -> tuple[int, int]:
    """(bytes the device can give this process in all, bytes it holds now): the plan's limit and baseline."""
    device = trainer.strategy.root_device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_allocated(device)
        return free + torch.cuda.memory_reserved(device), held
    resident = int(rss_mib() * MIB)
    processes = max(1, int(getattr(trainer, "num_devices", 1) or 1))  # this node's ranks share its memory
    return resident + host_memory_available() // processes, resident


def agreed_device_memory(trainer: Any) -> tuple[int, int]:
    """`device_memory` agreed by every rank: the least memory and the largest baseline of any rank.

    Every rank then plans the same run: a refusal stops all of them (none waits in a collective for a rank that
    stopped), and ``max_length_per_device: auto`` picks one budget (micro-batches packed alike on every rank).
    """
    limit, baseline = device_memory(trainer)
    low, high = min_max_over_world(limit, baseline, trainer.strategy.root_device)
    return int(low), int(high)


def parallel_layout(trainer: Any) -> tuple[Layout, bool]:
    """The `Layout` of the trainer's strategy, and whether FSDP2 computes in bf16 (``strategy.mixed_precision``)."""
    from lightning.pytorch.strategies import DDPStrategy

    from rl_lightning.parallel.strategy import ParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, ParallelStrategy):
        shards = strategy.dp_size // strategy.replicate_size * strategy.cp_size
        return Layout(shards=shards, tp=strategy.tp_size, cp=strategy.cp_size, cpu_offload=strategy.cpu_offload,
                      reshard_after_forward=strategy.reshard_after_forward,
                      activation_offload=strategy.activation_offload, optimizer_offload=strategy.optimizer_offload,
                      offload_bucket_bytes=strategy.offload_bucket_mb << 20,
                      compiled=bool(strategy.compile)), strategy.mixed_precision == "bf16"
    return Layout(ddp=isinstance(strategy, DDPStrategy) and trainer.world_size > 1), False


def _unit_stats(units: list[Any]) -> tuple[int, float]:
    """(longest unit in tokens, largest share of a unit's tokens that are targets) of the task's packing units."""
    longest, fraction = 1, 0.0
    for unit in units:
        sides = unit_sequences(unit)
        tokens = sum(len(side.input_ids) for side in sides)
        targets = sum(sum(side.loss_mask) for side in sides)
        longest, fraction = max(longest, tokens), max(fraction, targets / max(1, tokens))
    return longest, fraction or 1.0


def _data_fields(module: Any, trainer: Any, pairs: bool) -> tuple[dict[str, Any], int]:
    """The `TrainSetup` fields of a packed (or padded) DataModule's step, and the smallest budget (longest unit)."""
    hp = trainer.datamodule.hparams
    units = getattr(trainer.datamodule, "units", {}).get("train") or []
    longest, fraction = _unit_stats(units) if units else (hp.max_length * (2 if pairs else 1), 1.0)
    if not hp.packing:  # padded rows: every column may hold a target
        tokens = hp.micro_batch_size * longest
        return {"tokens": tokens, "accumulates": hp.batch_size > hp.micro_batch_size}, tokens
    cap = hp.batch_size * longest
    return {"tokens": hp.max_length_per_device, "tokens_cap": cap, "target_fraction": fraction,
            "accumulates": cap > hp.max_length_per_device}, longest


def _ppo_fields(module: Any, trainer: Any) -> tuple[dict[str, Any], int]:
    """The `TrainSetup` fields of a PPO run, and the smallest budget (its longest trajectory)."""
    from rl_lightning.algorithms.advantages import CRITIC_ESTIMATORS

    hp, rollout = module.hparams, module.rollout_config
    prompts = [len(p.prompt_ids) for p in getattr(trainer.datamodule, "prompts", {}).get("train") or []]
    completion = rollout.max_completion_tokens
    longest = max(prompts, default=trainer.datamodule.hparams.max_prompt_length) + completion
    rows = trainer.datamodule.hparams.batch_size * rollout.responses_per_prompt
    single_turn = rollout.max_turns == 1 and prompts
    settings = rollout.engine_settings  # a kind's keys, else the plan's defaults
    engine = EngineSetup(kind=rollout.engine_spec.memory, rows=rows, sequence=longest,
                         kv_cache_bytes=getattr(settings, "kv_cache_memory_bytes", None),
                         gpu_memory_utilization=getattr(settings, "gpu_memory_utilization", 0.3),
                         awake_while_training=rollout.async_steps > 0,
                         weight_bucket_bytes=getattr(settings, "weight_bucket_mb", 512) * MIB,
                         # adapter sync (as `auto` resolves it with a LoRA policy; the plan errs large where it falls
                         # back to full sync): the engine's base weights stay on the device while it sleeps
                         weights_stay=module.lm.lora is not None
                         and getattr(settings, "weight_sync", None) in ("auto", "adapter"))
    cap = -(-rows // hp.update_per_rollout) * longest
    return {"tokens": module.max_length_per_device, "tokens_cap": cap,
            "target_fraction": completion / (min(prompts) + completion) if single_turn else 1.0,
            "entropy": "grad" if module.objective.entropy_needs_grad else "value",
            "reference": ("adapters" if module.lm.lora is not None else "model") if module.needs_reference else "none",
            "critic": hp.advantage_estimator in CRITIC_ESTIMATORS, "host_trim": True,
            "accumulates": cap > module.max_length_per_device,
            "engine": None if rollout.replay else engine}, longest  # a replay builds no engine


def _lora_fields(lora: Any, shape: ModelShape) -> dict[str, Any]:
    """LoRA's `TrainSetup` fields (``model.lm.lora`` as a dict or dataclass, or None)."""
    from rl_lightning.models.lora import lora_config

    if lora is None:
        return {}
    values = vars(lora_config(lora))  # a dict (a checkpoint, a test) gets the dataclass's defaults
    saved = tuple(values.get("modules_to_save") or ())
    targets = values["target_modules"]
    return {"lora_rank": values["r"], "lora_targets": targets if isinstance(targets, str) else tuple(targets),
            "lora_saved": sum(shape.embedding if name in ("lm_head", "embed_tokens") else 0 for name in saved),
            "head_trainable": bool({"lm_head", "embed_tokens"} & set(saved))}


def _distill_setup(module: Any) -> DistillSetup | None:
    """PPO's distillation for the plan: the teacher's shape (none for the policy's base under LoRA), GKD's JSD."""
    config = getattr(module, "distill", None)
    if config is None:
        return None
    base = config.teacher == module.lm.name and module.lm.lora is not None
    return DistillSetup(teacher=None if base else load_model_shape(config.teacher), jsd=config.type == "loss",
                        jsd_chunk=module.lm.lm_head_chunk)


def _mesh_groups(trainer: Any) -> int:
    """NCCL communicators a rank holds: one per mesh group of more than one rank, and the world's."""
    strategy, world = trainer.strategy, trainer.world_size
    sizes = [getattr(strategy, name, 1) for name in ("dp_size", "cp_size", "tp_size")]
    return (world > 1) + sum(size > 1 for size in sizes if isinstance(size, int))


def plan_for(module: Any, task: str, shape: ModelShape) -> tuple[TrainSetup, Keys, int]:
    """The `TrainSetup` of `module`'s run (``task``: ``sft``, ``dpo``, ``reward`` or ``ppo``), its keys and minimum."""
    trainer, hp = module.trainer, module.hparams
    layout, fsdp_bf16 = parallel_layout(trainer)
    limit, baseline = agreed_device_memory(trainer)
    if task == "ppo":
        fields, minimum = _ppo_fields(module, trainer)
        keys = Keys(budget="model.max_length_per_device")
    else:
        fields, minimum = _data_fields(module, trainer, pairs=task != "sft")
        keys = Keys() if trainer.datamodule.hparams.packing else Keys(budget="data.micro_batch_size")
    if task == "dpo" and not hp.reference_free:
        fields.update(reference="adapters" if module.lm.lora is not None else "model",
                      reference_offload=hp.reference_offload)
    if task == "ppo":
        fields["distill"] = _distill_setup(module)
    fields["mesh_groups"] = _mesh_groups(trainer)
    setup = TrainSetup(
        model=shape, device=trainer.strategy.root_device.type, device_memory=limit, baseline=baseline,
        precision=str(trainer.precision), fsdp_bf16=fsdp_bf16,
        lm_head_chunk=None if task == "reward" else module.lm.lm_head_chunk,
        gradient_checkpointing=module.lm.gradient_checkpointing, lean_activations=bool(module.lm.lean_activations),
        lm_head=task != "reward", layout=layout,
        **_lora_fields(module.lm.lora, shape), **fields)
    return setup, keys, minimum


def check_memory(module: Any, stage: str, task: str) -> int | None:
    """Plan the run's memory, print the plan, refuse one that cannot fit; PPO ``auto``: the budget to use.

    Args:
        module: the task (its ``lm`` group, ``hparams``, trainer and DataModule are read).
        stage: Lightning's stage: only ``fit`` is planned.
        task: ``sft``, ``dpo``, ``reward`` or ``ppo``.

    Returns:
        The token budget ``max_length_per_device: auto`` resolves to (PPO), else None.

    Raises:
        ConfigError: the predicted peak exceeds the device's memory and ``model.lm.memory_check`` is true.
    """
    if stage != "fit" or getattr(module.trainer, "datamodule", None) is None:
        return None
    try:
        shape = load_model_shape(module.lm.name)
    except UserError:
        raise
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:  # the loader reports a bad name itself
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"no memory plan for {module.lm.name}: {str(e).splitlines()[0] if str(e) else e!r}")
        return None
    setup, keys, minimum = plan_for(module, task, shape)
    budget = None
    if module.hparams.get("max_length_per_device") == "auto":
        budget = largest_budget(setup, SAFETY * setup.device_memory, minimum) or minimum
        setup = replace(setup, tokens=budget)
    plan = plan_memory(setup)
    module.memory_plan = plan  # for callbacks and tests: what was predicted
    report(plan, budget)
    if not plan.fits and module.lm.memory_check:
        raise ConfigError(refusal(plan, keys, minimum))
    return budget


def report(plan: MemoryPlan, budget: int | None) -> None:
    """Print the plan (and the budget ``auto`` chose) once, on global rank 0, as Lightning's info log."""
    from lightning.pytorch.utilities import rank_zero_info

    text = plan.table()
    if budget is not None:
        text += f"\n  max_length_per_device: auto -> {budget} (the largest that fits in {SAFETY:.0%} of the device)"
    rank_zero_info(text)
