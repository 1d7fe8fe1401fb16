"""The activations a training forward saves for the backward, per token: the memory plan's per-layer formula.

Elements per token per decoder layer (h hidden, q heads x head_dim, kv key-value heads x head_dim, i intermediate;
counted with ``torch.autograd.graph.saved_tensors_hooks`` on Llama/Qwen2 blocks with the stock forwards, see
benchmarks/results/memory_plan_cpu.md): fp32: 6h (two RMSNorms: input, normalised input, output) + 3q (q, the
attention output and its reshaped copy) + 2kv + 4i (SwiGLU: gate, act(gate), up, act x up). bf16 autocast: the norms'
4h stay fp32, 3h + 5q + 2kv + 4i are bf16. bf16 parameters: 2h fp32 (the norms' upcast inputs), 4h + 3q + 2kv + 4i
bf16. Plus one fp32 log-sum-exp per head and one inverse RMS per norm. Tensor parallelism divides the q, kv and i terms.

Lean activations (``model.lm.lean_activations``, `rl_lightning.models.lean`) save less, derived from its autograd
Functions (`lean_saved_bytes`): the SwiGLU MLP keeps gate and up only (2i values in the compute dtype less: silu(gate)
and silu(gate) x up are recomputed), and each RMSNorm keeps its input and the per-row rstd, not the normalised
tensor: 4h bytes less per norm in every case (fp32: the normalised h x 4 bytes; bf16 autocast: the fp32 normalised
tensor, the fp32 input is kept either way; bf16 parameters: the fp32 upcast input (4h) and the bf16 normalised tensor
(2h) give way to the bf16 input (2h)). The same 4h for the final norm outside the blocks.
Where the lean forward runs (`lean_paths`): not under ``strategy.compile`` (compiled blocks run the stock forwards;
inductor's partitioner recomputes pointwise ops, counted here as the stock formula, an upper bound); the MLP not
under tensor parallelism (its projections are DTensors; the norms are not sharded and stay lean) nor where LoRA
adapts one of its projections (PEFT's layers replace the plain linears; the norms stay lean).
Every function takes a `rl_lightning.memory.plan.TrainSetup` (``Any`` here: plan imports this module).
"""

from __future__ import annotations

from typing import Any

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def precision_bytes(s: Any) -> tuple[int, int, bool]:
    """(parameter bytes, compute bytes, autocast) of `s.precision` (and FSDP2's bf16 compute)."""
    p = str(s.precision)
    param = 8 if p.startswith("64") else 2 if p in ("bf16-true", "16-true", "bf16", "16") else 4
    autocast = "mixed" in p
    compute = 2 if autocast or s.fsdp_bf16 else param
    return param, compute, autocast


def lean_paths(s: Any) -> tuple[bool, bool]:
    """(the lean MLP runs, the lean RMSNorms run) in `s`'s training forward (see the module)."""
    if not s.lean_activations or s.layout.compiled:
        return False, False
    lora_mlp = s.lora_rank is not None and (s.lora_targets == "all-linear"
                                           or any(name in s.lora_targets for name in MLP_PROJECTIONS))
    return s.layout.tp == 1 and not lora_mlp, True


def lean_saved_bytes(s: Any) -> tuple[float, float]:
    """(bytes per token per decoder layer, bytes per token outside the blocks) the lean forwards do not save."""
    mlp, norms = lean_paths(s)
    _, compute, _ = precision_bytes(s)
    h, i = s.model.hidden, s.model.intermediate / s.layout.tp
    per_layer = (2 * i * compute if mlp else 0.0) + (2 * 4 * h if norms else 0.0)  # two norms per block
    return per_layer, 4 * h if norms else 0.0  # the final norm


def layer_activation_bytes(s: Any) -> float:
    """Bytes saved for the backward per token by one decoder layer (this device's tensor-parallel share)."""
    m, tp = s.model, s.layout.tp
    _, compute, autocast = precision_bytes(s)
    h, q, kv, i = m.hidden, m.q_dim / tp, m.kv_dim / tp, m.intermediate / tp
    if compute == 4:
        size = 4 * (6 * h + 3 * q + 2 * kv + 4 * i)
    elif autocast:  # the residual stream and the norms stay fp32; linear outputs are bf16
        size = 4 * 4 * h + compute * (3 * h + 5 * q + 2 * kv + 4 * i)
    else:  # bf16 parameters: the norms upcast their input to fp32
        size = 4 * 2 * h + compute * (4 * h + 3 * q + 2 * kv + 4 * i)
    size += 4 * (m.heads / tp + 2)  # attention's log-sum-exp per head, the norms' inverse RMS
    if s.lora_rank is not None:  # each adapter keeps A x (r values per token)
        targets = [n for n, _, _ in m.linears if s.lora_targets == "all-linear" or n in s.lora_targets]
        size += compute * s.lora_rank * len(targets)
    return size - lean_saved_bytes(s)[0]


def activation_bytes(s: Any, tokens: int) -> float:
    """Bytes of one micro-batch's activations at the backward's peak (its context-parallel share of `tokens`).

    Every block's saved tensors, one block's more (the backward's working set: the gradients of a block's
    activations), and outside the blocks the embedding output and the final norm's input, normalised input and
    output (4h fp32; the lean norm keeps no normalised input). With checkpointing each block keeps only its input (h
    in the residual stream's dtype) while one block is recomputed at a time (its activations and their gradients);
    activation offload then keeps those inputs on the host (one back on the device at a time).
    """
    m = s.model
    param, _, _ = precision_bytes(s)
    local = tokens / s.layout.cp
    per_layer = layer_activation_bytes(s)
    outside = 4 * 4 * m.hidden - lean_saved_bytes(s)[1]
    if s.gradient_checkpointing:  # with offload on CUDA the block inputs wait on the host, one comes back at a time
        inputs = 1 if s.layout.activation_offload and s.device == "cuda" else m.layers
        return local * (inputs * m.hidden * min(param, 4) + 2 * per_layer + outside)
    if s.layout.activation_offload and s.device == "cuda":  # the block computed and the one prefetched stay
        return local * (3 * per_layer + outside)
    return local * ((m.layers + 1) * per_layer + outside)
