"""Weight sync of a LoRA policy into the colocated vLLM engine: full (merged) weights vs the adapter alone, same run.

For each model (the tiny demo model, and SmolLM2-135M-Instruct when built: ``python -m rl_lightning.assets.build
--real``) and each mode, one spawned process builds the PEFT policy (rank ``--rank`` on every linear projection,
random B factors), a vLLM engine (with LoRA support in adapter mode) and pushes the policy ``--repeats`` times after
a warm-up push, each time after an optimizer-like change of the adapter:

- ``full``: `WeightSync` streams every weight, LoRA layers merged (``W + scaling * B @ A``), through vLLM's
  layerwise ``reload_weights``;
- ``adapter``: the base weights went in once (the warm-up push); each push writes the adapter (PEFT layout, under
  /dev/shm) and hands vLLM a new ``LoRARequest``. vLLM loads it at the next generate, so the table also times
  "sync + first token": the push plus a one-token generate, which includes that load in adapter mode; "one token"
  is the same generate again (nothing to load), and "engine-side load" the difference of the two beyond the push.

It prints per model and mode the median seconds and MB per push, the ratios full / adapter, generation tokens/s
(4 prompts x 2 samples x <= 32 tokens: vLLM's LoRA kernels run on every token, and on CPU they are slow), and the
largest |engine - trainer| log-probability of greedy tokens after the last push (the acceptance check, on the real
model too).

    OMP_NUM_THREADS=1 python benchmarks/lora_sync.py                 # ~2-3 min on 2 CPU cores
    OMP_NUM_THREADS=1 python benchmarks/lora_sync.py --quick         # tiny model only, 2 repeats (smoke)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parents[1] / "rl_lightning" / "assets"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_policy(model_dir: str, rank: int):
    from peft import LoraConfig, get_peft_model

    from rl_lightning.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = get_peft_model(load_causal_lm(model_dir), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    nudge(model, 0.02)
    return model


def nudge(model, scale: float) -> None:
    """An optimizer-like change of the adapter (the base is frozen)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * scale)


def greedy_logprob_diff(engine, model, prompt: list[int]) -> float:
    from rl_lightning.algorithms import token_logprobs
    from rl_lightning.engines.protocol import SamplingParams

    completion = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=16))[0][0]
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, len(prompt) - 1 : -1]
    trainer = token_logprobs(logits, ids[:, len(prompt) :])[0]
    return (torch.tensor(completion.logprobs) - trainer).abs().max().item()


def measure(rank_id: int, model_dir: str, mode: str, args: argparse.Namespace, out: str) -> None:
    """One process: engine + policy, a warm-up push, then `repeats` timed pushes (results as JSON to `out`)."""
    from rl_lightning.data.prompts import encode_prompt
    from rl_lightning.engines.protocol import SamplingParams
    from rl_lightning.engines.vllm import VLLMEngine
    from rl_lightning.engines.weights import WeightSync
    from rl_lightning.models.loading import load_tokenizer

    model = lora_policy(model_dir, args.rank)
    adapter = mode == "adapter"
    engine = VLLMEngine(model_dir, max_model_len=512, kv_cache_memory_bytes=128 << 20,
                        lora_rank=args.rank if adapter else None)
    row = json.loads((ASSETS / "data" / "arithmetic.jsonl").read_text().splitlines()[0])
    prompt = encode_prompt(load_tokenizer(model_dir), row["messages"], True)
    one_token = SamplingParams(n=1, temperature=0.0, max_new_tokens=1)
    sync = WeightSync(args.bucket_mb << 20, adapter=adapter)
    sync(engine, model, step=0)  # warm-up; in adapter mode the base weights' one push
    first = {"seconds": sync.seconds, "mb": sync.stats.bytes / 2**20}
    engine.generate([prompt], one_token)
    rows = []
    for step in range(1, args.repeats + 1):
        nudge(model, 0.002)
        start = time.perf_counter()
        sync(engine, model, step=step)
        engine.generate([prompt], one_token)
        to_token = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate([prompt], one_token)  # the same, with nothing new to load
        rows.append({"sync_s": sync.seconds, "to_token_s": to_token, "token_s": time.perf_counter() - start,
                     "mb": sync.stats.bytes / 2**20})
    start = time.perf_counter()  # generation throughput: vLLM's LoRA kernels cost time on every token
    groups = engine.generate([prompt] * 4, SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=0))
    tokens_per_s = sum(len(c.token_ids) for g in groups for c in g) / (time.perf_counter() - start)
    result = {"mode": mode, "first": first, "diff": greedy_logprob_diff(engine, model, prompt), "tps": tokens_per_s,
              "parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
              "adapter_parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n),
              **{key: statistics.median(r[key] for r in rows) for key in rows[0]}}
    Path(out).write_text(json.dumps(result))
    engine.shutdown()


def run(model_dir: str, mode: str, args: argparse.Namespace) -> dict:
    """`measure` in a fresh spawned process (vLLM takes over process-wide state: one engine per process)."""
    import tempfile

    from torch.multiprocessing import start_processes

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        start_processes(measure, args=(model_dir, mode, args, out), nprocs=1, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    from rl_lightning.assets.real import is_built, model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (every linear projection)")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per model and mode (median)")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="tiny model only, 2 repeats")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    models = {"tiny-qwen2": str(ASSETS / "tiny-qwen2")}
    if args.quick:
        args.repeats = 2
    elif is_built(model_dir()):
        models["SmolLM2-135M"] = str(model_dir())
    else:
        print("SmolLM2-135M-Instruct not built (python -m rl_lightning.assets.build --real): tiny model only")
    print(f"CPU, torch threads {torch.get_num_threads()}, LoRA rank {args.rank} on {', '.join(TARGETS)}, "
          f"median of {args.repeats} pushes after a warm-up push")
    print("| model | mode | params | sync s | sync MB | sync + first token s | one token s | engine-side load s | "
          "generate tok/s | max logprob diff | first push s, MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, path in models.items():
        results = {mode: run(path, mode, args) for mode in ("full", "adapter")}
        for mode, r in results.items():
            print(f"| {name} | {mode} | {r['parameters'] / 1e6:.2f}M + {r['adapter_parameters'] / 1e6:.2f}M | "
                  f"{r['sync_s']:.4f} | {r['mb']:.2f} | {r['to_token_s']:.4f} | {r['token_s']:.4f} | "
                  f"{r['to_token_s'] - r['sync_s'] - r['token_s']:.4f} | {r['tps']:.1f} | {r['diff']:.1e} | "
                  f"{r['first']['seconds']:.3f}, {r['first']['mb']:.1f} |")
            rows.append({"model": name, **r})
        full, adapter = results["full"], results["adapter"]
        print(f"|   | full / adapter | | x{full['sync_s'] / adapter['sync_s']:.1f} | x{full['mb'] / adapter['mb']:.1f} | "
              f"x{full['to_token_s'] / adapter['to_token_s']:.1f} | | | x{full['tps'] / adapter['tps']:.2f} | | |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
