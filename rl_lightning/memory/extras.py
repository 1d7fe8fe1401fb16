"""What the memory plan adds beyond the policy's own training step: distillation, and memory PyTorch does not count.

- **Distillation** (``model.distill``): a frozen teacher's weights (in the training precision's parameter dtype:
  bf16 when training is bf16, sharded like the reference; none when the teacher is the policy's own base under
  LoRA), and GKD's JSD (``type: loss``): a second policy forward with logits at every target position, the teacher's
  logits, their fp32 log-softmaxes and the mixture (`JSD_COPIES` (positions, vocabulary) fp32 tensors), chunked by
  positions like the output head when ``jsd_chunk`` is set.
- **Non-torch memory on CUDA**, as margins the allocator's peak does not show but the device must hold: NCCL's
  buffers per communicator (one per mesh group of more than one rank), cuBLAS/cuBLASLt workspaces, and what a
  sleeping vLLM engine keeps (its CUDA-graph pool and runtime). These constants are provisional until the GPU check
  (``benchmarks/gpu/run.sh --quick``) measures them against ``torch.cuda.mem_get_info``; they err on the large side.
- **``vllm_process``'s gather bucket**: the trainer gathers the full weights bucket by bucket to send them.

Pure functions of numbers, like `rl_lightning.memory.plan`, which calls them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rl_lightning.memory.model_shape import ModelShape

MIB = 1 << 20
JSD_COPIES = 6.0
"""(positions, vocabulary) fp32 tensors alive at the JSD's peak: student and teacher logits, their log-softmaxes, the
mixture's log and the backward's logits gradient."""
NCCL_PER_GROUP = 256 * MIB
"""CUDA: NCCL's buffers per communicator (NCCL_BUFFSIZE 4 MiB x up to 32 channels x send/receive), provisional."""
CUDA_WORKSPACES = 64 * MIB
"""CUDA: cuBLAS and cuBLASLt workspaces for the trainer's stream and the engine thread's, provisional."""
VLLM_ASLEEP = 1024 * MIB
"""CUDA: what a colocated vLLM 0.32 engine keeps through ``sleep()`` (CUDA-graph pool, runtime), provisional."""


@dataclass(frozen=True)
class DistillSetup:
    """The distillation of a PPO run (``model.distill``).

    Args:
        teacher: the teacher's shape, or None when the teacher is the policy's base under LoRA (no second copy).
        jsd: GKD's JSD loss (``type: loss``) runs on every micro-batch.
        jsd_chunk: positions per chunk of the JSD (None: all target positions at once).
    """

    teacher: ModelShape | None = None
    jsd: bool = False
    jsd_chunk: int | None = None


def teacher_bytes(distill: DistillSetup | None, param_bytes: int, tp: int, shards: int) -> float:
    """The frozen teacher's weights on this device (its tensor-parallel share, sharded like the reference)."""
    if distill is None or distill.teacher is None:
        return 0.0
    t = distill.teacher
    local = t.params - t.linear_params + t.linear_params / tp
    return local * param_bytes / max(1, shards)


def jsd_bytes(distill: DistillSetup | None, targets: int, vocab: int, cp: int) -> float:
    """GKD's JSD peak for a micro-batch with `targets` target positions (this context-parallel rank's share)."""
    if distill is None or not distill.jsd:
        return 0.0
    k = max(1, math.ceil(targets / cp))
    positions = k if distill.jsd_chunk is None else min(distill.jsd_chunk, k)
    return JSD_COPIES * positions * vocab * 4


def non_torch_bytes(device: str, mesh_groups: int) -> dict[str, float]:
    """CUDA's margins beside the allocator, held all run: NCCL per mesh group, the workspaces."""
    if device != "cuda":
        return {}
    return {"NCCL buffers": float(NCCL_PER_GROUP * mesh_groups), "CUDA workspaces": float(CUDA_WORKSPACES)}


def asleep_bytes(device: str, engine_kind: str | None, awake_while_training: bool) -> float:
    """CUDA: what a colocated vLLM engine keeps while it sleeps and the trainer trains (awake: counted as awake)."""
    return float(VLLM_ASLEEP) if device == "cuda" and engine_kind == "vllm" and not awake_while_training else 0.0


def gather_bucket_bytes(engine_kind: str | None, bucket: int, weights: float) -> float:
    """An engine process (memory kind ``process``): a bucket of gathered full weights, twice (the rollout).

    The gathered tensors and the flat buffer they are copied into for the broadcast.
    """
    return 2.0 * min(bucket, weights) if engine_kind == "process" else 0.0
