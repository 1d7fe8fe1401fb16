"""The budget sweep of `benchmarks/memory.py`: ours SFT's peak RSS vs tokens per packed micro-batch, chunked vs full.

`sweep` runs one trial per (checkpointing, head, budget) through a caller-given `run` (a fresh process each);
`budget_summary` turns the points into a markdown table and least-squares slopes; `plot` draws them (matplotlib, Agg).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from memory_data import sft_rows, write_jsonl

SLOPE_TARGET = 0.5  # issue 26: chunked head's MiB per 1k tokens <= half the full logits'


def meminfo_available_mib() -> float:
    line = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemAvailable:"))
    return int(line.split()[1]) / 1024


def skip_reason(points: list[dict], budget: int, a: argparse.Namespace) -> str | None:
    """Why the trial at `budget` tokens is not run, predicted from the sizes before it (None: run it)."""
    if len(points) < 2:
        return None
    (b0, p0), (b1, p1) = ((p["budget"], p["result"]) for p in points[-2:])
    seconds = p1["process_s"] + (p1["process_s"] - p0["process_s"]) * (budget - b1) / (b1 - b0)
    peak = p1["peak_rss_mib"] + (p1["peak_rss_mib"] - p0["peak_rss_mib"]) * (budget - b1) / (b1 - b0)
    if seconds > a.max_trial_s:
        return f"skipped: predicted {seconds / 60:.0f} min > --max-trial-s {a.max_trial_s}"
    if peak > 0.7 * (available := meminfo_available_mib()):
        return f"skipped: predicted peak {peak / 1024:.1f} GiB > 70% of the {available / 1024:.1f} GiB available"
    return None


def sweep(a: argparse.Namespace, tokenizer, workdir: Path, run: Callable[..., dict]) -> list[dict]:
    """Ours SFT at each of ``a.budgets``, chunked and full, with the checkpointing settings of ``a.budget_ckpt``.

    `run(label, data_folder, **spec_arguments)` runs one trial in a fresh process and returns its result. The
    sweep's data: per budget, B / ``a.conv_tokens`` one-line conversations (the warm-up step) then as many conversations
    of at most ``a.conv_tokens`` tokens (the measured step, one packed micro-batch of about B tokens). Each series
    (checkpointing, head) runs its budgets in order (a size is skipped from the ones before it); ``a.jobs`` series run
    side by side.
    """
    for budget in a.budgets:
        rows = max(1, budget // a.conv_tokens)
        write_jsonl(workdir / f"budget-{budget}" / "sft.jsonl", sft_rows(tokenizer, rows, 0, seed=10)
                    + sft_rows(tokenizer, rows, a.conv_tokens, seed=20))
    series = [(ckpt, chunk) for ckpt in {"on": (True,), "off": (False,), "both": (True, False)}[a.budget_ckpt]
              for chunk in (a.chunk, None)]
    with ThreadPoolExecutor(a.jobs) as pool:  # trials are processes: threads only wait for them
        done = pool.map(lambda s: one_series(a, workdir, run, *s), series)
        return [point for points in list(done) for point in points]


def one_series(a: argparse.Namespace, workdir: Path, run: Callable[..., dict], ckpt: bool,
               chunk: int | None) -> list[dict]:
    """The sweep's budgets for one (checkpointing, head), stopping at the first skipped or failed size."""
    points, done, reason = [], [], None
    for budget in a.budgets:
        point = {"budget": budget, "ckpt": ckpt, "chunk": chunk}
        reason = reason or skip_reason(done, budget, a)
        if reason:
            points.append({**point, "skipped": reason})
            continue
        label = f"budget {budget} {'chunked' if chunk else 'full'} ckpt {'on' if ckpt else 'off'}"
        point["result"] = run(label, workdir / f"budget-{budget}", chunk=chunk, ckpt=ckpt, per_device=budget,
                              warmup=1, steps=1, sft_rows=max(1, budget // a.conv_tokens))
        if "error" in point["result"]:
            reason = f"skipped: the {budget}-token trial failed"
            points.append({**point, "skipped": "failed: " + point["result"]["error"]})
            continue
        measured = point["result"]["micro_batch_tokens"][-1]  # the measured step's micro-batches
        point["tokens"], point["micro_batches"] = max(measured), len(measured)
        done.append(point)
        points.append(point)
    return points


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares MiB per 1k tokens."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return 1024 * sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def budget_summary(points: list[dict]) -> tuple[str, list[dict]]:
    """The sweep's markdown table and the slopes (chunked vs full over the sizes both ran) per checkpointing."""
    lines = ["| act. ckpt | budget | tokens in the micro-batch | chunked peak MiB | full peak MiB | "
             "chunked / full peak |", "|---|---|---|---|---|---|"]
    slopes = []
    for ckpt in sorted({p["ckpt"] for p in points}, reverse=True):
        by = {(p["budget"], p["chunk"] is not None): p for p in points if p["ckpt"] == ckpt}
        for budget in sorted({b for b, _ in by}):
            c, f = by.get((budget, True)), by.get((budget, False))
            cell = [p["skipped"] if "skipped" in p else f"{p['result']['peak_rss_mib']:.0f}" for p in (c, f)]
            both = "skipped" not in c and "skipped" not in f
            ratio = f"{c['result']['peak_rss_mib'] / f['result']['peak_rss_mib']:.2f}x" if both else ""
            tokens = c.get("tokens") or f.get("tokens") or ""
            lines.append(f"| {'on' if ckpt else 'off'} | {budget} | {tokens} | {cell[0]} | {cell[1]} | {ratio} |")
        common = [b for b in sorted({b for b, _ in by}) if all("skipped" not in by[(b, k)] for k in (True, False))]
        if len(common) >= 2:
            fit = {k: slope([(by[(b, k)]["tokens"], by[(b, k)]["result"]["peak_rss_mib"]) for b in common])
                   for k in (True, False)}
            slopes.append({"ckpt": ckpt, "budgets": common, "chunked": fit[True], "full": fit[False],
                           "ratio": fit[True] / fit[False] if fit[False] > 0 else math.inf})
    notes = [f"\nSlope, act. ckpt {'on' if s['ckpt'] else 'off'} ({s['budgets'][0]}-{s['budgets'][-1]} tokens): "
             f"chunked {s['chunked']:.0f} MiB per extra 1k tokens, full {s['full']:.0f}; chunked / full "
             f"{s['ratio']:.2f}x ({'met' if s['ratio'] <= SLOPE_TARGET else 'not met'}: <= {SLOPE_TARGET})"
             for s in slopes]
    return "\n".join(lines) + "\n" + "\n".join(notes), slopes


def plot(points: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ckpt in sorted({p["ckpt"] for p in points}, reverse=True):
        for chunked in (True, False):
            done = [p for p in points if p["ckpt"] == ckpt and (p["chunk"] is not None) == chunked and "result" in p
                    and "error" not in p["result"]]
            if done:
                ax.plot([p["tokens"] / 1024 for p in done], [p["result"]["peak_rss_mib"] / 1024 for p in done], "o-",
                        label=f"{'chunked head' if chunked else 'full logits'}, act. ckpt {'on' if ckpt else 'off'}")
    ax.set(xlabel="tokens in the packed micro-batch (thousands)", ylabel="peak RSS of the process (GiB)",
           title=f"ours SFT, {model}, fp32, CPU: peak memory vs tokens", xlim=(0, None), ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

