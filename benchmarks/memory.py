"""Peak host memory of SFT, DPO and GRPO: rl_lightning vs TRL 1.16 on SmolLM2-135M-Instruct, and ours vs tokens.

What it measures. Every row is a fresh Python process (one trial) that runs `benchmarks/vs_trl.py`'s own ``run_ours`` /
``run_trl`` (the same Trainer setup, optimizer and TRL config as the speed comparison); its peak is the process's
``ru_maxrss`` (imports, data, model, every step), and "after load" its resident memory (``VmRSS``) when training
starts (Lightning ``on_train_start``, TRL ``on_train_begin``): imports, tokenised data and the weights (the policy's
and DPO's reference), before any step, so "peak - load" is what training adds. No memory profiler runs (ours' peak is
also checked against ``memory_phases.process_peak_mib``, which would count its high-water resets).

Weights are read into process memory on both sides (transformers' own non-mmap load path, ``disable_mmap``): by
default transformers 5 memory-maps fp32 safetensors, and weights never written (DPO's reference; the policy before
its first optimizer step) are then file pages the kernel may evict and re-read, so the resident set, and the peak,
move with the machine's memory pressure (TRL's DPO peak: 7.9 and 8.7 GB in two runs). ``--mmap`` keeps the mapping.

Both sides: ``asset:SmolLM2-135M-Instruct`` (134.5M parameters, vocabulary 49152, tied head), fp32, CPU, ``--threads``
torch/OpenMP threads (1), AdamW (betas 0.9/0.95, no weight decay, constant learning rate, clipping at 1.0), the data
in file order, ``--warmup`` + ``--steps`` optimizer steps (1 + 1: the second step holds AdamW's moments too).

- Data (synthetic, written per run, the same rows for both sides): an SFT conversation asks for sums and the
  assistant lists ``a + b = c`` lines up to ``--conv-tokens`` (1024) tokens with the model's chat template, so most
  tokens are loss tokens (real SFT answers are long; the demo data's 3-token answers would hide the output head). DPO:
  the same prompt, chosen = correct sums, rejected = every 4th sum (the first included) off by one, up to half of
  ``--conv-tokens`` per sequence. GRPO: the prompts of ``easy.jsonl`` and ``rl_lightning/recipes/envs/arithmetic.py``'s reward.
- ``sft``: ``--sft-rows`` conversations per step. Ours: packed (``data.max_length_per_device`` 8192, one micro-batch),
  ``rl_varlen`` attention, ``model.lm.lm_head_chunk`` 1024 (chunked output head, the default) or null (full logits),
  ``model.lm.gradient_checkpointing`` off (the main comparison) or on. TRL ``SFTTrainer``: prompt-completion rows
  (completion-only loss), ``padding_free=True`` (the step's rows flattened into one, no pad tokens), its fused chunked
  log-prob head (always on in 1.16; on CPU it scores every position in 4096 x 32768 tiles), sdpa attention; an extra
  row pads instead; ``gradient_checkpointing`` off (TRL's own default is on: the ckpt rows turn it on on both sides).
  Not used: ``activation_offloading`` (offloads to CPU memory: nothing to gain on a CPU run), ``use_liger_kernel``
  (needs the liger-kernel package and Triton).
- ``dpo``: ``--dpo-pairs`` pairs per step, sigmoid loss, beta 0.1, reference forward every step (both sides keep a
  reference copy of the model). Ours packed, chunked or full head (policy and reference); TRL ``DPOTrainer`` pads
  (its ``padding_free`` is disabled in 1.16), fused head.
- ``grpo-hf``: ``--prompts`` prompts x ``--group`` completions x ``--max-new-tokens`` tokens per rollout, temperature
  1, no KL (no reference), token-mean loss, clip 0.2, one optimizer step per rollout. Ours ``PPO`` with the HF engine
  (``model.rollout.engine: hf``, generation on the policy itself), chunked or full head; TRL ``GRPOTrainer`` with
  transformers ``generate`` (``use_vllm=False``), fused head. Completions are sampled: tokens/step can differ.
- Budget sweep (ours SFT only): one packed micro-batch of B tokens (``data.max_length_per_device`` = B, B/1024
  conversations of <= 1024 tokens) for B in ``--budgets``, chunked vs full, with gradient checkpointing on (the
  setting long sequences need) and off (``--budget-ckpt``; off stops early: see below). Each trial's measured step
  follows a warm-up step of B/1024 one-line conversations (AdamW's moments exist before the measured step, at the
  cost of a short step). A size is skipped (and said so) when the trial would exceed ``--max-trial-s`` or 70% of the
  memory available, predicted from the sizes before it. The slope is the least-squares MiB per extra 1k tokens of the
  peak over the sizes both paths ran.
- ``--quick`` (the smoke test): a 2-layer, hidden-64 model with SmolLM2's tokenizer and its 49152-token vocabulary
  (random weights, ``memory_data.quick_model``), chunk 64, budgets 256..1024: the logits are as wide as the real
  model's, so the chunked head's saving shows in seconds; the ratios to TRL say little about the real model.
- Not measured: ``strategy.activation_offload``. It moves saved activations to host memory, which on a CPU run is the
  memory they are already in (nothing moves; `rl_lightning.parallel.offload`); ``benchmarks/gpu/offload.py`` measures
  it on a GPU. ``--jobs N`` runs N trials at once (each peak is its own process's; the step times are not compared).

    OMP_NUM_THREADS=1 python benchmarks/memory.py            # writes benchmarks/results/memory_cpu.md + PNG
    OMP_NUM_THREADS=1 python benchmarks/memory.py --quick --jobs 2   # smoke check: tiny model, SmolLM2's vocabulary
    OMP_NUM_THREADS=1 python benchmarks/memory.py --rows sft --budgets 1024,2048 --json /tmp/memory.json
    python benchmarks/memory.py --report /tmp/memory.json --out-dir /tmp    # re-render a saved run, no trials
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_trl  # noqa: E402  (the runs themselves: vs_trl.run_ours / vs_trl.run_trl)
from memory_budget import budget_summary, plot, sweep  # noqa: E402
from memory_data import quick_model, write_data  # noqa: E402

REPO, RESULTS = HERE.parent, HERE / "results"
SMOL = "asset:SmolLM2-135M-Instruct"
TASKS = ("sft", "dpo", "grpo-hf")
QUICK_MODEL = "2 layers, hidden 64, SmolLM2's tokenizer and vocabulary (49152), random weights"
TARGET = 0.6  # issue 26: ours' peak <= 0.6 x TRL's (SFT, DPO, GRPO with the HF engine)


# ------------------------------------------------------------------------------------------- worker (one process)


def rss_mib() -> float:
    """Resident memory now (MiB), from /proc/self/statm (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def loaded_rss_mib(model) -> float:
    """The RSS with the weights resident (under --mmap, mapped weights are otherwise read at the first forward)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return rss_mib()


def probe(framework: str):
    """A callback that records the RSS when training starts and (ours) each step's micro-batch token counts."""
    if framework == "ours":
        import lightning as L

        class Probe(L.Callback):
            def __init__(self):
                self.load_rss, self.micro = None, []

            def on_train_start(self, trainer, pl_module):
                self.load_rss = loaded_rss_mib(pl_module)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.micro.append([int((mb["seq_index"] >= 0).sum()) for mb in batch.get("micro_batches", [])])

        return Probe()
    from transformers import TrainerCallback

    class TrlProbe(TrainerCallback):
        def __init__(self):
            self.load_rss, self.micro = None, []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.load_rss = loaded_rss_mib(model)

    return TrlProbe()


def worker(spec: dict) -> dict:
    """Run one trial in this process through vs_trl's runners; its peak and after-load RSS."""
    import torch

    torch.set_num_threads(spec["threads"])
    if not spec["mmap"]:  # both sides load through from_pretrained: the weights read into memory, not mapped
        import transformers.modeling_utils

        transformers.modeling_utils._is_on_hf_mount = lambda path: True  # the switch of its disable_mmap path
    vs_trl.DATA, vs_trl.MAX_LENGTH, vs_trl.PER_DEVICE = Path(spec["data"]), spec["max_length"], spec["per_device"]
    a = argparse.Namespace(**spec["shape"], model_dir=spec["model"], trl_sft_layout=spec["layout"],
                           gradient_checkpointing=spec["ckpt"])
    a.callbacks = [callback := probe(spec["framework"])]
    if spec["framework"] == "ours":
        # memory_check off: the start-up plan still prints, but a size it predicts too big is measured, not refused
        # (the sweep skips sizes itself, from the measured ones: see skip_reason)
        a.ours_kwargs = {"lm_head_chunk": spec["chunk"], "gradient_checkpointing": spec["ckpt"], "memory_check": False}
        out = vs_trl.run_ours(spec["task"], a)
    else:
        out = vs_trl.run_trl(spec["task"], a)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    if spec["framework"] == "ours":
        from rl_lightning.memory.phases import process_peak_mib

        peak = max(peak, process_peak_mib())
    return {**out, "peak_rss_mib": peak, "load_rss_mib": callback.load_rss, "micro_batch_tokens": callback.micro}


def trial(spec: dict, workdir: Path, label: str) -> dict:
    """`spec` in a fresh process: the worker's result, or {"error": ..., "log": its last lines} (the run goes on).

    The child imports the rl_lightning of this benchmark's own tree (``PYTHONPATH``): the editable install points at
    one checkout, and a benchmark run from another (a CI worktree) would otherwise measure that checkout's code.
    """
    name = label.replace(" ", "_").replace("/", "")
    spec_file, log = workdir / f"{name}.spec.json", workdir / f"{name}.log"
    spec_file.write_text(json.dumps(spec))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path, **spec.get("env", {})}
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run([sys.executable, __file__, "--worker", str(spec_file)], cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code:
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        tail = "\n".join(log.read_text().splitlines()[-15:])
        print(f"  {label}: FAILED ({why}, {seconds:.0f} s); the end of its log:\n{tail}", flush=True)
        return {"error": why, "log": tail, "process_s": seconds}
    out = {**json.loads(result_path(spec_file).read_text()), "process_s": seconds}
    print(f"  {label:<34} after load {out['load_rss_mib']:6.0f} MiB  peak {out['peak_rss_mib']:6.0f} MiB  "
          f"tokens/step {out['tokens']}  ({seconds:.0f} s)", flush=True)
    return out


def result_path(spec_file: Path) -> Path:
    return spec_file.with_name(spec_file.name.replace(".spec.json", ".result.json"))


# ------------------------------------------------------------------------------------------------ the comparison


def spec_for(a: argparse.Namespace, data: Path, framework: str, task: str, chunk: int | None = None,
             ckpt: bool = False, layout: str = "padding_free", per_device: int = vs_trl.PER_DEVICE, **shape) -> dict:
    base = {k: getattr(a, k) for k in ("warmup", "steps", "sft_rows", "dpo_pairs", "prompts", "group",
                                       "max_new_tokens")}
    return {"framework": framework, "task": task, "chunk": chunk, "ckpt": ckpt, "layout": layout,
            "threads": a.threads, "model": a.model_dir, "data": str(data), "max_length": a.conv_tokens,
            "per_device": per_device, "shape": {**base, **shape}, "env": dict(e.split("=", 1) for e in a.env),
            "mmap": a.mmap}


def main_rows(a: argparse.Namespace) -> list[dict]:
    """The comparison's rows (description and trial arguments), grouped by task and checkpointing."""
    trl_layouts = {"sft": ("padding_free", "padded"), "dpo": ("padded",), "grpo-hf": ("generate",)}
    rows = []
    for task in a.rows:
        for ckpt in (False, True) if task == "sft" else (False,):
            for chunk in (a.chunk, None):
                rows.append({"task": task, "side": "ours", "head": f"chunked {a.chunk}" if chunk else "full logits",
                             "ckpt": ckpt, "args": {"chunk": chunk, "ckpt": ckpt}})
            for layout in trl_layouts[task][:1 if ckpt else None]:
                rows.append({"task": task, "side": "TRL", "head": f"fused ({layout})", "ckpt": ckpt,
                             "args": {"ckpt": ckpt, "layout": "padded" if layout == "padded" else "padding_free"}})
    return rows


def tokens_per_step(result: dict) -> float:
    measured = [t for t in result.get("tokens", []) if t]
    return max(measured) if measured else 0.0


def compare(rows: list[dict]) -> None:
    """Each ours row's ratios: to TRL (same task and checkpointing; SFT: padding-free) and to our full logits."""
    def find(task: str, side: str, ckpt: bool, head: str) -> dict | None:
        return next((r for r in rows if (r["task"], r["side"], r["ckpt"]) == (task, side, ckpt)
                     and r["head"].startswith(head) and "error" not in r["result"]), None)

    for r in rows:
        if "error" in r["result"] or r["side"] != "ours":
            continue
        mine = r["result"]
        if trl := find(r["task"], "TRL", r["ckpt"], "fused (padding_free)" if r["task"] == "sft" else "fused"):
            theirs = trl["result"]
            r["vs_trl_peak"] = mine["peak_rss_mib"] / theirs["peak_rss_mib"]
            r["vs_trl_increment"] = ((mine["peak_rss_mib"] - mine["load_rss_mib"])
                                     / max(theirs["peak_rss_mib"] - theirs["load_rss_mib"], 1.0))
        if (full := find(r["task"], "ours", r["ckpt"], "full")) and full is not r:
            r["vs_full_peak"] = mine["peak_rss_mib"] / full["result"]["peak_rss_mib"]


def main_table(rows: list[dict]) -> str:
    lines = ["| task | side | output head (layout) | act. ckpt | tokens/step | RSS after load MiB | peak RSS MiB | "
             "peak - load MiB | ours / TRL peak | ours / TRL (peak - load) | chunked / full peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = r["result"]
        if "error" in res:
            lines.append(f"| {r['task']} | {r['side']} | {r['head']} | {'on' if r['ckpt'] else 'off'} | failed: "
                         f"{res['error']} | | | | | | |")
            continue
        vs = r.get("vs_trl_peak")
        met = "" if vs is None or r["ckpt"] or "full" in r["head"] else (
            f" ({'met' if vs <= TARGET else 'not met'}: <= {TARGET})")
        cells = [f"{vs:.2f}x{met}" if vs else "", f"{r['vs_trl_increment']:.2f}x" if vs else "",
                 f"{r['vs_full_peak']:.2f}x" if r.get("vs_full_peak") else ""]
        lines.append(f"| {r['task']} | {r['side']} | {r['head']} | {'on' if r['ckpt'] else 'off'} | "
                     f"{tokens_per_step(res):.0f} | {res['load_rss_mib']:.0f} | {res['peak_rss_mib']:.0f} | "
                     f"{res['peak_rss_mib'] - res['load_rss_mib']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(TASKS), help="comma-separated tasks of the comparison (empty: none)")
    p.add_argument("--budgets", help="comma-separated tokens per micro-batch of the sweep (empty: no sweep; "
                                     "default 1024..32768, --quick 256,512,1024)")
    p.add_argument("--budget-ckpt", choices=("on", "off", "both"), default="both", help="sweep's act. checkpointing")
    p.add_argument("--max-trial-s", type=float, default=900, help="sweep: skip sizes predicted to take longer")
    p.add_argument("--chunk", type=int, help="model.lm.lm_head_chunk of the chunked rows (1024; --quick 64)")
    p.add_argument("--jobs", type=int, default=1, help="trials run at once (each its own process: the peaks are "
                                                       "per process; the sweep runs its series side by side)")
    p.add_argument("--threads", type=int, default=1)
    for flag, text in (("steps", "measured steps (default 1)"), ("warmup", "steps before them (1; --quick 0)"),
                       ("sft-rows", "SFT conversations per step (2; --quick 4)"),
                       ("dpo-pairs", "DPO pairs per step (2; --quick 6)"),
                       ("prompts", "GRPO prompts per rollout (4; --quick 2)"), ("group", "completions per prompt (4)"),
                       ("max-new-tokens", "GRPO completion tokens (128; --quick 32)"),
                       ("conv-tokens", "tokens per synthetic conversation (1024; --quick 128)")):
        p.add_argument(f"--{flag}", type=int, help=text)
    p.add_argument("--quick", action="store_true", help="smoke check: a 2-layer model with SmolLM2's vocabulary, "
                                                         "tiny shapes, one step per trial")
    p.add_argument("--out-dir", type=Path, help="write memory_cpu.md and memory_budget_cpu.png here (default "
                                                "benchmarks/results; --quick: nowhere)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every trial process, ours and TRL (e.g. MALLOC_MMAP_THRESHOLD_=131072)")
    p.add_argument("--mmap", action="store_true", help="keep transformers' memory-mapped weights (see above)")
    p.add_argument("--name", default="cpu", help="output files memory_NAME.md and memory_budget_NAME.png")
    p.add_argument("--json", type=Path, help="also write the rows, sweep and settings here")
    p.add_argument("--report", type=Path, help="no trials: the report of a run saved with --json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


DEFAULTS = {"steps": (1, 1), "warmup": (1, 0), "sft_rows": (2, 4), "dpo_pairs": (2, 6), "prompts": (4, 2),
            "group": (4, 4), "max_new_tokens": (128, 32), "conv_tokens": (1024, 128),
            "chunk": (1024, 64), "budgets": ("1024,2048,4096,8192,16384,32768", "256,512,1024")}  # (default, --quick)


def settings(a: argparse.Namespace) -> str:
    model = QUICK_MODEL if a.quick else "SmolLM2-135M-Instruct"
    return (f"{model}, fp32, CPU, {a.threads} thread(s); {a.warmup} + {a.steps} steps per trial. SFT {a.sft_rows} "
            f"conversations/step, DPO {a.dpo_pairs} pairs/step (synthetic, <= {a.conv_tokens} tokens per "
            f"conversation), GRPO {a.prompts} prompts x {a.group} completions x {a.max_new_tokens} tokens/rollout. "
            f"Chunk {a.chunk}. tokens/step: SFT/DPO real tokens, GRPO completion tokens."
            + (f" Every trial process ran with {' '.join(a.env)}." if getattr(a, "env", None) else "")
            + (" Weights memory-mapped (--mmap)." if getattr(a, "mmap", False) else " Weights read into memory."))


def report(saved: dict) -> tuple[str, list[dict]]:
    """The markdown report of a run (what --json saves) and the sweep's slopes."""
    a = argparse.Namespace(**saved["settings"])
    text = f"{settings(a)}\nMachine: {saved['machine']}\nCommand: {saved['command']}\n"
    if saved["rows"]:
        text += "\n" + main_table(saved["rows"]) + "\n"
    slopes = []
    if saved["budget"]:
        sweep_text, slopes = budget_summary(saved["budget"])
        text += "\nPeak memory vs tokens per micro-batch (ours SFT):\n\n" + sweep_text + "\n"
    return text, slopes


def run(a: argparse.Namespace) -> dict:
    """Every trial of the comparison and the sweep; the run as --json saves it."""
    from rl_lightning.assets.real import resolve_model
    from rl_lightning.models.loading import load_tokenizer

    rows, points = main_rows(a), []
    with tempfile.TemporaryDirectory(prefix="memory_") as tmp:
        workdir = Path(tmp)
        real = Path(resolve_model(SMOL))  # --quick: its tokenizer and vocabulary
        a.model_dir = str(quick_model(real, workdir / "quick-model") if a.quick else real)
        tokenizer = load_tokenizer(a.model_dir)
        data = write_data(workdir / "data", tokenizer, a)

        def one(r: dict) -> dict:
            label = f"{r['task']} {r['side']} {r['head']}{' ckpt' if r['ckpt'] else ''}"
            return trial(spec_for(a, data, r["side"].lower(), r["task"], **r.pop("args")), workdir, label)

        with ThreadPoolExecutor(a.jobs) as pool:  # trials are processes: threads only wait for them
            for r, result in zip(rows, list(pool.map(one, rows)), strict=True):
                r["result"] = result
        compare(rows)
        if a.budgets:
            points = sweep(a, tokenizer, workdir, lambda label, data, **kw: trial(
                spec_for(a, data, "ours", "sft", **kw), workdir, label))
    keep = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k not in ("worker", "report")}
    command = f"OMP_NUM_THREADS={a.threads} python benchmarks/memory.py {shlex.join(sys.argv[1:])}".rstrip()
    return {"settings": keep, "machine": vs_trl.machine(), "command": command, "rows": rows, "budget": points}


def main() -> None:
    a = parser().parse_args()
    if a.worker:
        spec = json.loads(Path(a.worker).read_text())
        result_path(Path(a.worker)).write_text(json.dumps(worker(spec)))
        return
    for key, values in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, values[a.quick])
    a.rows = [t for t in a.rows.split(",") if t]
    a.budgets = [int(b) for b in a.budgets.split(",") if b]
    if unknown := sorted(set(a.rows) - set(TASKS)):
        raise SystemExit(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    saved = json.loads(a.report.read_text()) if a.report else run(a)
    quick = saved["settings"]["quick"]
    out_dir = a.out_dir or (None if quick else RESULTS)
    text, saved["slopes"] = report(saved)
    print("\n" + text)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"memory_{a.name}.md").write_text(text)
        if saved["budget"]:
            plot(saved["budget"], out_dir / f"memory_budget_{a.name}.png", "quick model" if quick else "SmolLM2-135M")
    if a.json:
        a.json.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
