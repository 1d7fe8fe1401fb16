"""Numbers for the attention kernels that the CPU tests cannot give: torch's flash kernels on a GPU.

Two checks, each against exact attention: per-sequence SDPA with torch's math backend in fp64 on the same
(low-precision-rounded) inputs, so the reference shares no kernel with what it checks:

(a) ``rl_varlen``'s packed kernel (`rl_lightning.attention.packed.packed_varlen_attn`: one ``varlen_attn`` call for a
    packed row of uneven sequences, bf16) -- output and dq/dk/dv errors, and the forward + backward time of that call
    against the per-sequence SDPA loop it replaces on CUDA.
(b) the zigzag ring's block kernels and log-sum-exp merge (aten ``_flash_attention_forward/backward`` per step),
    run for cp = 2 and 4 in one process by `ring_attention_emulated` (the training loop with hops as rolls) --
    output and gradient errors over the real (non-padding) tokens.

Tolerances on GPU (bf16): 2e-2 on the output's max absolute error, and on each gradient's max absolute error
divided by that gradient's max magnitude. bf16 keeps 8 significant bits: the output (a convex combination of
N(0, 1) values) is rounded once to a grid of 2^-7 = 7.8e-3 near 1, and the kernels round the probabilities to bf16
before the P V and dS K products, so a few grid steps over 2^25 elements is expected; a kernel that mixed sequences
or mis-merged a ring step is off by O(1). The per-sequence SDPA loop in bf16 is reported against the same
reference for comparison. ``--dry`` runs everything on CPU in fp32 with tiny shapes and the fp32 kernels, where
the tolerance is 1e-5 (fp32 summation order only).

    python benchmarks/gpu/attention.py --results results.jsonl        # GPU: 16k tokens, H 16, H_kv 4, D 128
    python benchmarks/gpu/attention.py --dry --results results.jsonl  # CPU, seconds

Each check appends one JSON line ``{"check", "value", "unit", "target", "ok"}`` to ``--results``; the exit status
is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_lightning.attention.kernels import block_backend
from rl_lightning.attention.packed import packed_backend, packed_sdpa, packed_varlen_attn
from rl_lightning.attention.ring import ring_attention_emulated, shard_tokens, zigzag_layout


@dataclass
class Setup:
    device: str
    dtype: torch.dtype
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    tolerance: float
    kernels: tuple[str, str]  # what packed_backend and block_backend must pick here
    timing_iters: int


GPU = Setup("cuda", torch.bfloat16, 16384, 16, 4, 128, 2e-2, ("varlen_attn", "flash"), 20)
DRY = Setup("cpu", torch.float32, 96, 4, 2, 16, 1e-5, ("sdpa", "math"), 2)


class Results:
    def __init__(self, path: Path):
        self.path, self.failed = path, []

    def add(self, check: str, value: float | str, unit: str, target: str, ok: bool) -> None:
        line = {"check": check, "value": value, "unit": unit, "target": target, "ok": bool(ok)}
        print(json.dumps(line), flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        if not ok:
            self.failed.append(check)

    def error(self, check: str, error: float, tolerance: float, unit: str = "max_abs") -> None:
        self.add(check, error, unit, f"<= {tolerance:g}", error <= tolerance)


def lengths(total: int, seed: int = 0) -> list[int]:
    """Uneven sequence lengths summing to `total`, the first of length 1, the others up to total / 8 (16k tokens:
    about 16 sequences of up to 2k tokens, an RL micro-batch of completions)."""
    generator = torch.Generator().manual_seed(seed)
    out = [1]
    while sum(out) < total:
        out.append(int(torch.randint(2, max(3, total // 8), (1,), generator=generator)))
    out[-1] = total - sum(out[:-1])
    return out


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max absolute error over the reference's max magnitude (gradients grow with the sequence length)."""
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def reference_sdpa(q, k, v, bounds, scaling):
    """`packed_sdpa` forced onto the math backend: no flash/efficient kernel, exact in fp64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return packed_sdpa(q, k, v, bounds, scaling)


def forward_backward(kernel, q, k, v, bounds, dout):
    """(output (1, N, H, D), (dq, dk, dv)) of `kernel` at leaf copies of q (1, H, N, D), k, v (1, H_kv, N, D)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves, bounds, None)
    out.backward(dout.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def time_ms(fn, device: str, iters: int) -> float:
    for _ in range(2):  # warm-up: kernel selection, allocator
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def check_packed(setup: Setup, results: Results, q, k, v, bounds, dout, reference) -> None:
    backend = packed_backend(q)
    results.add("packed_backend", backend, "name", setup.kernels[0], backend == setup.kernels[0])
    kernel = packed_varlen_attn if backend == "varlen_attn" else packed_sdpa
    candidates = {"packed_" + backend: kernel}
    if backend != "sdpa":
        candidates["packed_sdpa_loop"] = packed_sdpa  # the path it replaces, for comparison
    out_ref, grads_ref = reference
    for name, fn in candidates.items():
        out, grads = forward_backward(fn, q, k, v, bounds, dout)
        results.error(f"{name}_out_err", (out.double() - out_ref).abs().max().item(), setup.tolerance)
        for grad_name, grad, grad_ref in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
            results.error(f"{name}_{grad_name}_err", relative(grad, grad_ref), setup.tolerance, "rel_max")
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        milliseconds = time_ms(lambda fn=fn, leaves=leaves: fn(*leaves, bounds, None).backward(dout),
                               setup.device, setup.timing_iters)
        results.add(f"{name}_fwd_bwd_time", milliseconds, "ms", "report", True)


def check_ring(setup: Setup, results: Results, cp: int, q, k, v, cu, dout, reference) -> None:
    layouts = [zigzag_layout(cu, r, cp) for r in range(cp)]

    def stack(t: torch.Tensor, dim: int = 1) -> torch.Tensor:  # (1, .., N, ..) -> (cp, n, heads, D), rank r in row r
        shards = torch.cat([shard_tokens(t, layout, dim) for layout in layouts])
        return shards if dim == 1 else shards.transpose(1, 2).contiguous()

    leaves = [stack(t, dim=2).requires_grad_() for t in (q, k, v)]
    backend = block_backend(leaves[0][0])
    results.add(f"ring_cp{cp}_block_backend", backend, "name", setup.kernels[1], backend == setup.kernels[1])
    out = ring_attention_emulated(*leaves, layouts[0].local_cu_seqlens)
    out.backward(stack(dout).to(out.dtype))
    real = stack(torch.ones(1, cu[-1].item(), device=q.device)).bool()  # (cp, n): not padding
    out_ref, grads_ref = reference
    results.error(f"ring_cp{cp}_out_err", (out[real].double() - stack(out_ref)[real]).abs().max().item(),
                  setup.tolerance)
    for name, leaf, grad_ref in zip(("dq", "dk", "dv"), leaves, grads_ref, strict=True):
        results.error(f"ring_cp{cp}_{name}_err", relative(leaf.grad[real], stack(grad_ref, dim=2)[real]),
                      setup.tolerance, "rel_max")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, fp32, tiny shapes (CI)")
    parser.add_argument("--results", type=Path, required=True, help="JSONL file to append one line per check to")
    args = parser.parse_args(argv)
    setup = DRY if args.dry else GPU
    if setup.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry for the CPU version")
    results = Results(args.results)
    torch.manual_seed(0)
    sizes = lengths(setup.tokens)
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    shape = (1, setup.tokens, setup.head_dim)
    q, k, v = (torch.randn(shape[0], h, *shape[1:], device=setup.device).to(setup.dtype)
               for h in (setup.heads, setup.kv_heads, setup.kv_heads))  # (1, heads, N, D)
    dout = torch.randn(1, setup.tokens, setup.heads, setup.head_dim, device=setup.device).to(setup.dtype)
    reference = forward_backward(reference_sdpa, q.double(), k.double(), v.double(), cu.tolist(), dout.double())
    check_packed(setup, results, q, k, v, cu.tolist(), dout, reference)
    for cp in (2, 4):
        check_ring(setup, results, cp, q, k, v, cu, dout, reference)
    print(f"{len(results.failed)} failed: {results.failed}" if results.failed else "all checks passed")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
