"""GPU checks of the training path; each subcommand appends JSONL records to ``--results`` (run.sh tabulates them):
``{"check", "value" (float or str), "unit", "target", "ok", "detail"}``. ``--dry`` runs the same code on CPU with
2-layer stand-ins under the same check names (fp32 where the GPU computes in bf16), so CI keeps it working.

- ``sft``: random-init Qwen3-0.6B- and Qwen2.5-1.5B-shaped models (``rl_varlen`` attention), fp32 masters computed in
  bf16 by the project's FSDP2 wrapping (`parallelize` under ``ParallelStrategy(mixed_precision="bf16")``, one
  process), fp32 AdamW state; one packed micro-batch of 16,384 tokens per step (sequences of 512-4096 tokens, position
  ids restarting per sequence, loss on the last 3/4 of each); the SFT task's step (`target_logprobs`, head chunked -> `sft_loss` ->
  backward -> `clip_grad_norm` 1.0 -> AdamW lr 1e-5); activation checkpointing on and off. Step time: the median of
  6 steps after 2 warm-up steps, CUDA synchronised around each. tokens/s = T / step time. MFU = (6 (N_blocks T +
  N_head K) + 12 L H d sum_i l_i (l_i + 1) / 2) / (step time x peak): N_blocks the decoder blocks' linear weights,
  N_head = vocab x hidden (tied or not), T tokens per step, K the positions with a target (`target_logprobs` runs the
  head there only), L layers, H query heads, d head dim, l_i the sequence lengths (causal: query t sees t keys; QK^T
  and AV cost 2 d FLOPs each per head and pair, x3 for forward + backward). Not counted: embedding lookups, norms,
  biases, recomputation under checkpointing (MFU, not HFU). Peak dense bf16 FLOP/s: H100 SXM and H200 989e12, H100
  NVL 835e12, H100 PCIe 756e12, A100 312e12, else n/a. Compared too: packed vs per-sequence log-probabilities (no
  leak across packed sequences) and checkpointing on vs off (same losses and gradient norms).
- ``fsdp``: FSDP2 bf16 mixed precision vs plain fp32, same init and data, 20 AdamW steps on one packed batch: the
  max relative difference of the loss curves and the ratio of their loss drops (`fsdp`'s docstring).
- ``gather``: `benchmarks/rollout_engines.py`'s ``--gather`` (FSDP2 shards of a Qwen2-1.5B-shaped model streamed as
  bf16 buckets into a preallocated copy): seconds and peak extra memory per bucket size.
- ``grpo``: the recipe's Dr. GRPO settings through the real PPO task, HF engine and a Lightning Trainer (GPU: a
  Qwen3-0.6B-shaped random checkpoint, bf16-true, 8 prompts x 8 completions x <= 256 new tokens): seconds per step
  after the first, the share of ``rollout/generate_s`` (generation and scoring), and ``train/engine_logprob_diff``.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from table import record  # the record format, next to this file

ROOT = Path(__file__).resolve().parents[2]
TINY_SFT = ROOT / "rl_lightning" / "assets" / "tiny-qwen2-sft"
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
              "tie_word_embeddings": True, "max_position_embeddings": 40960}
QWEN2_5_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True,
                "max_position_embeddings": 32768}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 4096}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen2.5-1.5b": QWEN2_5_1_5B}
DRY_SHAPES = {"qwen3-0.6b": {**TINY, "model_type": "qwen3"}, "qwen2.5-1.5b": {**TINY, "model_type": "qwen2"}}
MFU_SHAPE, MFU_TARGET, LM_HEAD_CHUNK = "qwen2.5-1.5b", 40.0, 1024  # the last: the SFT/PPO tasks' default lm_head_chunk
# Dense bf16 tensor-core peaks from NVIDIA's data sheets; the first name contained in the device name wins.
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def setup(dry: bool, process_group: bool = True) -> torch.device:
    """The device (CPU when `dry`) and, for FSDP2, a one-process group (NCCL / gloo) on a free port."""
    if not dry and not torch.cuda.is_available():
        raise SystemExit("train.py: error: no CUDA device visible to torch; use --dry for the CPU run")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the fsdp check's reference)
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    if process_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_RANK": "0"})
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A random-init causal LM of `shape` with ``rl_varlen`` attention, set up for training as
    `rl_lightning.models.loading.load_causal_lm` sets up a loaded one (no KV cache, train mode); equal seeds, equal weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_lightning.attention.packed import NAME, register_varlen_attention

    register_varlen_attention()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape), attn_implementation=NAME, dtype=dtype)
    model.config.use_cache = False
    return model.train()


def shard(model: Any, device: torch.device, mixed_precision: str | None, activation_checkpointing: bool) -> Any:
    """FSDP2 over this one process through the project's `parallelize`, as `ParallelStrategy` configures it."""
    from torch.distributed.device_mesh import init_device_mesh

    from rl_lightning.parallel.parallelize import parallelize
    from rl_lightning.parallel.strategy import ParallelStrategy

    strategy = ParallelStrategy(mixed_precision=mixed_precision)
    strategy.fsdp_mesh = init_device_mesh(device.type, (1,))
    return parallelize(model, strategy, checkpointing=activation_checkpointing)  # model.lm.gradient_checkpointing


def packed_batch(vocab: int, tokens: int, lengths: tuple[int, int], seed: int, device: torch.device
                 ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One packed (1, `tokens`) micro-batch of random sequences with uniform lengths in `lengths` (the last one cut
    to fit), in the project's packing format (`rl_lightning.data.steps.pack`); targets: the last 3/4 of each."""
    from rl_lightning.data.steps import pack
    from rl_lightning.data.tokenization import TokenizedExample

    generator = torch.Generator().manual_seed(seed)
    sizes: list[int] = []
    while sum(sizes) < tokens:
        sizes.append(int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator)))
    sizes[-1] -= sum(sizes) - tokens
    examples = [TokenizedExample(torch.randint(0, vocab, (n,), generator=generator).tolist(),
                                 [0] * (n // 4) + [1] * (n - n // 4)) for n in sizes]
    return {k: v.to(device) for k, v in pack(examples, pad_token_id=0).items()}, sizes


def train_step(model: Any, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], num_tokens: float
               ) -> tuple[float, float]:
    """`rl_lightning.tasks.SFT.training_step` for one micro-batch, without Lightning: (loss, pre-clip grad norm)."""
    from rl_lightning.algorithms import sft_loss
    from rl_lightning.models.logprobs import target_logprobs
    from rl_lightning.models.optim import clip_grad_norm

    loss, metrics = sft_loss(target_logprobs(model, batch, chunk_size=LM_HEAD_CHUNK)[0], batch["target_mask"], num_tokens)
    loss.backward()
    grad_norm = clip_grad_norm(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(metrics["nll_sum"]) / num_tokens, float(grad_norm)


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


def step_flops(model: Any, lengths: list[int], head_positions: int) -> float:
    """Model FLOPs of one training step on packed sequences of `lengths` (module docstring)."""
    from rl_lightning.parallel.parallelize import decoder_layers

    config = model.config
    blocks = sum(m.weight.numel() for m in decoder_layers(model).modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * pairs
    return 6 * (blocks * sum(lengths) + head * head_positions) + attention


def peak_flops(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16 if name and key in name), None)


@torch.no_grad()
def packing_gap(model: Any, batch: dict[str, torch.Tensor]) -> tuple[float, float, int]:
    """|packed - per-sequence| log-probability of every target token: (mean, max, count)."""
    from rl_lightning.models.logprobs import target_logprobs

    packed = target_logprobs(model, batch)[0][0]  # (N,)
    bounds = batch["cu_seqlens"].tolist()
    alone = [target_logprobs(model, {k: batch[k][:, s:e] for k in ("input_ids", "position_ids", "target_ids")})[0][0]
             for s, e in zip(bounds[:-1], bounds[1:], strict=True)]  # each (l,), no mask: every position
    gap = (packed - torch.cat(alone)).abs()[batch["target_mask"][0].bool()]
    return gap.mean().item(), gap.max().item(), gap.numel()


def sft_run(shape: dict, ac: bool, batch: dict[str, torch.Tensor], lengths: list[int], device: torch.device,
            steps: tuple[int, int]) -> dict[str, Any]:
    """Train one configuration: step times (after the warm-up), losses, grad norms, FLOPs per step, peak GiB, and
    the packing gap on the initial weights."""
    from rl_lightning.models.optim import adamw

    model = build_model(shape, device)
    flops = step_flops(model, lengths, int((batch["target_mask"] > 0).any(0).sum()))
    model = shard(model, device, "bf16" if device.type == "cuda" else None, ac)
    out: dict[str, Any] = {"flops": flops, "packing_gap": packing_gap(model, batch), "seconds": [], "losses": [],
                           "norms": []}
    optimizer = adamw(model, 1e-5, 0.0, (0.9, 0.95), 1e-8)
    num_tokens = float(batch["target_mask"].sum())
    for _ in range(sum(steps)):
        synchronize(device)
        start = time.perf_counter()
        loss, norm = train_step(model, optimizer, batch, num_tokens)
        synchronize(device)
        out["seconds"].append(time.perf_counter() - start)
        out["losses"].append(loss)
        out["norms"].append(norm)
    out["seconds"] = out["seconds"][steps[0]:]
    out["peak"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return out


def sft_records(path: Path, label: str, ac: bool, run: dict | str, tokens: int, peak: float | None) -> float | None:
    """tokens/s, MFU and peak-memory rows of one configuration; returns the MFU (None when not measured)."""
    name = f"sft {label} ac={'on' if ac else 'off'}"
    if isinstance(run, str):  # out of memory: without checkpointing that is a finding, with it a failure
        for what, unit in (("tokens/s", "tok/s"), ("MFU", "%"), ("peak memory", "GiB")):
            record(path, f"{name} {what}", "OOM", unit, ok=not ac, detail=run)
        return None
    seconds = statistics.median(run["seconds"])
    record(path, f"{name} tokens/s", tokens / seconds, "tok/s", detail=(
        f"median step {seconds:.3f} s of {len(run['seconds'])}; {run['flops'] / tokens / 1e9:.3g} GFLOP/token; "
        f"loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}"))
    mfu = None if peak is None else 100 * run["flops"] / seconds / peak
    record(path, f"{name} MFU", "n/a" if mfu is None else mfu, "%", detail="" if mfu else "no peak FLOP/s known")
    record(path, f"{name} peak memory", "n/a (cpu)" if run["peak"] is None else run["peak"], "GiB")
    return mfu


def sft(args: argparse.Namespace) -> None:
    device = setup(args.dry)
    bf16, path = device.type == "cuda", args.results
    tokens, lengths, steps = (1024, (32, 256), (1, 3)) if args.dry else (16384, (512, 4096), (2, 6))
    for label, shape in (DRY_SHAPES if args.dry else SHAPES).items():
        batch, sizes = packed_batch(shape["vocab_size"], tokens, lengths, seed=1, device=device)
        runs: dict[bool, dict | str] = {}
        for ac in (True, False):  # checkpointing first: an out-of-memory without it comes last
            free_memory(device)
            try:
                runs[ac] = sft_run(shape, ac, batch, sizes, device, steps)
            except torch.OutOfMemoryError as e:
                runs[ac] = f"out of memory at {tokens} tokens per micro-batch: {str(e).splitlines()[0][:120]}"
        free_memory(device)
        mfus = [sft_records(path, label, ac, runs[ac], tokens, peak_flops(device)) for ac in (False, True)]
        done = [r for r in runs.values() if isinstance(r, dict)]
        if done:  # the same initial weights either way
            mean, worst, count = done[0]["packing_gap"]
            limit = 2e-2 if bf16 else 1e-5  # bf16: logits rounded to 2^-8 relative; fp32: summation order only
            record(path, f"sft {label} packed vs per-sequence logprobs", mean, "nats", f"< {limit:g} mean",
                   mean < limit, f"max {worst:.2e} over {count} target tokens of {len(sizes)} sequences")
        if len(done) == 2:
            gap = max(relative_gap(done[0][k], done[1][k]) for k in ("losses", "norms"))
            limit = 1e-2 if bf16 else 1e-5  # the same arithmetic; bf16 leaves room for non-deterministic kernels
            record(path, f"sft {label} AC on vs off", gap, "rel", f"< {limit:g}", gap < limit,
                   f"losses and grad norms of {len(done[0]['losses'])} steps")
        if label == MFU_SHAPE:
            best = max((m for m in mfus if m is not None), default=None)
            record(path, f"sft {label} best MFU", "n/a" if best is None else best, "%", f">= {MFU_TARGET:g}%",
                   not bf16 if best is None else best >= MFU_TARGET,
                   "no MFU measured (dry run or unknown device peak)" if best is None else "")
    torch.distributed.destroy_process_group()


def fsdp(args: argparse.Namespace) -> None:
    """FSDP2 bf16 mixed precision vs fp32, 20 AdamW steps at lr 3e-5. Curves: bf16 keeps 8 significant bits (2^-9 =
    2e-3 relative rounding per operation), the loss averages thousands of tokens, the steps grow the gap: 2e-2 (10
    roundings) is the budget. It misses lost fp32 masters (bf16 weights drop most updates at this lr: that run
    barely learns, its loss stays close), so the loss drops must match too: without masters 0.19-0.34 of the fp32
    drop at lr 1e-5-3e-5, mixed precision 0.999 (2-layer model on CPU)."""
    from rl_lightning.models.optim import adamw

    device = setup(args.dry)
    shape, tokens = (DRY_SHAPES["qwen3-0.6b"], 1024) if args.dry else (QWEN3_0_6B, 4096)
    batch, _ = packed_batch(shape["vocab_size"], tokens, (64, 512), seed=2, device=device)
    num_tokens = float(batch["target_mask"].sum())
    curves = {}
    for precision in (None, "bf16"):
        model = shard(build_model(shape, device, seed=0), device, precision, False)
        optimizer = adamw(model, 3e-5, 0.0, (0.9, 0.95), 1e-8)
        curves[precision] = [train_step(model, optimizer, batch, num_tokens)[0] for _ in range(20)]
        del model, optimizer
        free_memory(device)
    fp32, bf16 = curves[None], curves["bf16"]
    gap, drop, ratio = relative_gap(fp32, bf16), 1 - fp32[-1] / fp32[0], (bf16[0] - bf16[-1]) / (fp32[0] - fp32[-1])
    curve = f"fp32 {fp32[0]:.4f} -> {fp32[-1]:.4f}, bf16 {bf16[0]:.4f} -> {bf16[-1]:.4f} in 20 steps of {tokens} tokens"
    record(args.results, "fsdp bf16 mixed vs fp32 loss", gap, "rel", "< 2e-2", gap < 2e-2, curve)
    record(args.results, "fsdp bf16 mixed vs fp32 loss drop", ratio, "ratio", "0.9-1.1, fp32 drop >= 0.5%",
           abs(ratio - 1) < 0.1 and drop >= 0.005, f"fp32 loss fell {100 * drop:.2f}%")
    torch.distributed.destroy_process_group()


def gather(args: argparse.Namespace) -> None:
    """Per bucket size: the best of 3 streams (after one warm-up) and the worst peak memory beyond the engine's copy.
    Bounds: a bucket holds at most max(bucket size, largest tensor); beyond the engine's copy the stream holds one
    bucket of gathered tensors and the bf16 cast of the tensor being gathered, and the bound allows one more
    tensor-sized temporary inside the collective."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rollout_engines as bench

    from rl_lightning.engines.weights import named_weights

    device = setup(args.dry)
    model = bench.sharded_model(bench.SMALL if args.dry else bench.QWEN2_1_5B, device)
    engine = {name: torch.empty(tuple(p.shape), dtype=torch.bfloat16, device=device) for name, p in named_weights(model)}
    largest = max(t.numel() for t in engine.values()) * 2
    for bucket_mb in (4, 64) if args.dry else (64, 512, 2048):
        runs = [bench.stream_into(model, engine, bucket_mb << 20, torch.bfloat16, device) for _ in range(4)][1:]
        seconds, peak, stats = min(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]
        name = f"gather bucket {bucket_mb} MB"
        record(args.results, f"{name} seconds", seconds, "s", "bucket <= max(size, largest tensor)",
               stats.max_bucket_bytes <= max(bucket_mb << 20, largest),
               f"{stats.bytes / seconds / 1e9:.2f} GB/s, {stats.bytes / 2**20:.0f} MB in {stats.buckets} buckets, "
               f"largest {stats.max_bucket_bytes / 2**20:.0f} MB")
        limit = stats.max_bucket_bytes + 2 * largest
        if device.type == "cuda":
            record(args.results, f"{name} peak memory", peak / 2**20, "MB",
                   f"<= {limit / 2**20:.0f} (bucket + 2 tensors)", peak <= limit)
        else:
            record(args.results, f"{name} peak memory", "n/a (cpu)", "MB", detail="no allocator peak counter on CPU")
    torch.distributed.destroy_process_group()


class StepTimer(L.Callback):
    """Wall time of each training batch, rollout included (registered before the task's rollout callback, so it
    starts before generation), and the metrics logged for it."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.start, self.steps = device, 0.0, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        synchronize(self.device)
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        synchronize(self.device)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.steps.append({"seconds": time.perf_counter() - self.start, **metrics})


def random_checkpoint(shape: dict, folder: str, device: torch.device) -> str:
    """A Hugging Face folder: a random-init bf16 `shape` model, the tiny model's tokenizer (ids within its vocab)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_SFT)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    build_model({**shape, **ids}, device, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    free_memory(device)
    return folder


def grpo(args: argparse.Namespace) -> None:
    from rl_lightning.data import PromptDataModule
    from rl_lightning.models.config import LMConfig
    from rl_lightning.rollout.callback import RolloutConfig
    from rl_lightning.tasks import PPO

    device = setup(args.dry, process_group=False)
    prompts, responses, new_tokens = (2, 4, 8) if args.dry else (8, 8, 256)
    timer = StepTimer(device)
    with tempfile.TemporaryDirectory() as folder:
        model_name = str(TINY_SFT) if args.dry else random_checkpoint(QWEN3_0_6B, folder, device)
        rollout = RolloutConfig(str(ROOT / "rl_lightning" / "recipes" / "envs" / "arithmetic_format.py"), responses_per_prompt=responses,
                                max_new_tokens=new_tokens, engine="hf", reward_workers=0,
                                reward_weights={"correct": 1.0, "format": 0.5})
        task = PPO(LMConfig(model_name), rollout, max_rollouts=3, update_per_rollout=2, clip_high=0.28,  # lr 1e-6 constant
                   max_length_per_device=8192)
        data = PromptDataModule(str(ROOT / "rl_lightning" / "assets" / "data" / "easy.jsonl"), tokenizer_name=model_name,
                                max_prompt_length=256, batch_size=prompts, shuffle=False)
        trainer = L.Trainer(accelerator="cpu" if args.dry else "gpu", devices=1, max_epochs=1,
                            precision="32-true" if args.dry else "bf16-true", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            callbacks=[timer])
        trainer.fit(task, datamodule=data)
    measured = timer.steps[1:]
    seconds = statistics.median(s["seconds"] for s in measured)
    generate = statistics.median(s["rollout/generate_s"] for s in measured)
    completion_tokens = statistics.median(s["train/completion_length"] * s["train/trajectories"] for s in measured)
    record(args.results, "grpo step seconds", seconds, "s", detail=(
        f"median of {len(measured)} steps after the first; {'tiny-qwen2-sft, fp32' if args.dry else 'bf16-true'}; "
        f"{prompts} prompts x {responses} completions x <= {new_tokens} new tokens, 2 updates per rollout"))
    record(args.results, "grpo generation share", 100 * generate / seconds, "%",
           detail=f"{generate:.2f} s per step generating and scoring, {completion_tokens / generate:.0f} tokens/s")
    gap = max(s["train/engine_logprob_diff"] for s in timer.steps)
    limit = 1e-4 if args.dry else 5e-2  # fp32: summation order; bf16: cached decode vs packed forward, bf16 logits
    record(args.results, "grpo engine vs trainer logprobs", gap, "nats", f"< {limit:g} mean", gap < limit,
           "mean |engine - trainer| log-probability per completion token, worst step")


CHECKS = {"sft": sft, "fsdp": fsdp, "gather": gather, "grpo": grpo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--results", type=Path, required=True, help="JSONL file the records are appended to")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes (the CI smoke run)")
    args = parser.parse_args()
    CHECKS[args.check](args)


if __name__ == "__main__":
    main()
