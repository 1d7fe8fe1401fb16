"""Benchmarks at smoke scale on the tiny model, so they cannot rot between the runs whose figures the README quotes:
the side-by-side against TRL (same data and tokens), LoRA weight sync full vs adapter, async vs sync rollouts, peak
memory against TRL and over the token budget."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_vs_trl_runs_ours_and_trl_on_the_same_tokens(tmp_path):
    out = tmp_path / "vs_trl.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/vs_trl.py", "--quick", "--tasks", "sft,dpo,grpo-hf", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {row["task"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"sft", "dpo", "grpo-hf"}
    for task in ("sft", "dpo"):  # the same real tokens per step on both sides
        assert rows[task]["ours_tokens"] == rows[task]["trl_tokens"] > 0
    budget = 2 * 4 * 8  # --quick: 2 prompts x 4 completions x 8 new tokens per rollout
    assert 0 < rows["grpo-hf"]["ours_tokens"] <= budget and 0 < rows["grpo-hf"]["trl_tokens"] <= budget
    assert all(row["ours_s"] > 0 and row["trl_s"] > 0 and row["ratio"] > 0 for row in rows.values())
    assert "| grpo-hf |" in result.stdout  # the markdown table the README quotes


def _run_benchmark(args, tmp_path, timeout=600):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, *args, "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(out.read_text())["rows"], result.stdout


@pytest.mark.slow  # a vLLM-CPU engine per sync mode
def test_lora_sync_benchmark_moves_only_the_adapter_and_matches_the_trainer(tmp_path):
    rows, stdout = _run_benchmark(["benchmarks/lora_sync.py", "--quick"], tmp_path)
    by_mode = {row["mode"]: row for row in rows if row["model"] == "tiny-qwen2"}
    full, adapter = by_mode["full"], by_mode["adapter"]
    # bytes follow from the shapes: fp32 base (1.29 MB) vs the rank-16 adapter (65,536 parameters x 4 bytes)
    assert adapter["mb"] == pytest.approx(adapter["adapter_parameters"] * 4 / 2**20)
    assert full["mb"] > 4 * adapter["mb"]
    assert full["diff"] < 1e-4 and adapter["diff"] < 1e-4  # engine vs trainer log-probs after each kind of sync
    assert full["sync_s"] > 0 and adapter["sync_s"] > 0 and "full / adapter" in stdout


@pytest.mark.slow  # two fits sharing one vLLM-CPU engine
def test_async_rollout_benchmark_compares_sync_and_async_in_one_run(tmp_path):
    rows, stdout = _run_benchmark(["benchmarks/async_rollout.py", "--rollouts", "3", "--prompts", "2", "--responses",
                                   "2", "--max-new-tokens", "8"], tmp_path)
    by_mode = {row["mode"]: row for row in rows}
    assert by_mode["sync"]["staleness"] == [0.0, 0.0, 0.0] and by_mode["async"]["staleness"] == [0.0, 1.0, 1.0]
    assert all(row["step_s"] > 0 for row in rows) and "async / sync step time:" in stdout


def _memory_rows_failed(rows):
    return "\n".join(f"{r['task']} {r['side']} {r['head']}: {r['result']['error']}\n{r['result'].get('log', '')}"
                     for r in rows if "error" in r["result"])


@pytest.mark.slow  # 19 trials of a 2-layer model, each a fresh process, two at a time
def test_memory_benchmark_compares_peaks_and_sweeps_the_token_budget(tmp_path):
    """The quick model has SmolLM2's 49152-token vocabulary, so the output head's memory is measurable: the chunked
    head (64 tokens at a time) must peak below the full logits on the same config and grow far slower with tokens."""
    from rl_lightning.assets import real

    if importlib.util.find_spec("gguf") is None and not real.is_built(real.model_dir()):
        pytest.skip("needs SmolLM2-135M-Instruct's tokenizer: the real model is not built and [real] is missing")
    out = tmp_path / "memory.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--quick", "--jobs", "2", "--budget-ckpt", "on", "--env",
         "MALLOC_MMAP_THRESHOLD_=65536", "--json", str(out), "--out-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert not _memory_rows_failed(rows), _memory_rows_failed(rows)
    ours_heads = ("chunked 64", "full logits")
    expected = ([("sft", "ours", h, c) for c in (False, True) for h in ours_heads]
                + [("sft", "TRL", "fused (padding_free)", c) for c in (False, True)]
                + [("sft", "TRL", "fused (padded)", False)]
                + [(t, "ours", h, False) for t in ("dpo", "grpo-hf") for h in ours_heads]
                + [("dpo", "TRL", "fused (padded)", False), ("grpo-hf", "TRL", "fused (generate)", False)])
    assert sorted((r["task"], r["side"], r["head"], r["ckpt"]) for r in rows) == sorted(expected)
    for r in rows:
        res = r["result"]
        assert 0 < res["load_rss_mib"] <= res["peak_rss_mib"] < 4096 and math.isfinite(res["peak_rss_mib"])
    for task in ("sft", "dpo"):  # the same real tokens per step on both sides
        assert len({r["result"]["tokens"][-1] for r in rows if r["task"] == task}) == 1
    ours = {(r["task"], r["head"], r["ckpt"]): r for r in rows if r["side"] == "ours"}
    for (task, head, ckpt), r in ours.items():
        assert 0 < r["vs_trl_peak"] < 1 and 0 < r["vs_trl_increment"] < 1  # TRL: 4096 x V tiles of logits on CPU
        if head == "chunked 64":  # the chunked head below the full logits, same task and checkpointing
            assert r["result"]["peak_rss_mib"] < ours[(task, "full logits", ckpt)]["result"]["peak_rss_mib"]
            assert r["vs_full_peak"] < 1
    points = report["budget"]
    assert [(p["budget"], p["chunk"]) for p in points] == [(b, c) for c in (64, None) for b in (256, 512, 1024)]
    assert all(p["micro_batches"] == 1 and p["budget"] / 2 < p["tokens"] <= p["budget"] for p in points)
    peak = {(p["budget"], p["chunk"]): p["result"]["peak_rss_mib"] for p in points}
    full = [peak[(b, None)] for b in (256, 512, 1024)]
    assert full[0] < full[1] < full[2]  # the full logits grow with the budget: (T, 49152) fp32 tensors
    assert all(peak[(b, 64)] < peak[(b, None)] for b in (256, 512, 1024))
    [slope] = report["slopes"]  # MiB per 1k tokens: issue 26's target, chunked <= half the full logits'
    assert slope["budgets"] == [256, 512, 1024] and slope["full"] > 100 and slope["chunked"] < 0.5 * slope["full"]
    assert (tmp_path / "memory_budget_cpu.png").stat().st_size > 0
    assert "| sft | ours | chunked 64 |" in (tmp_path / "memory_cpu.md").read_text()


@pytest.mark.slow  # two CLI fits of one rollout each
def test_distill_benchmark_measures_the_teacher_at_zero_and_the_students_against_it(tmp_path):
    rows, stdout = _run_benchmark(["benchmarks/distill.py", "--rollouts", "1", "--arms", "reward", "control",
                                   "--prompts", "4", "--samples", "1"], tmp_path)
    kl = {row["model"].split(",")[-1].strip(): row["kl"] for row in rows}
    assert list(kl) == ["teacher (tiny-qwen2-sft)", "student at start (tiny-qwen2)", "reward", "control"]
    assert kl["teacher (tiny-qwen2-sft)"] == 0.0  # the teacher against itself: exactly 0
    assert kl["student at start (tiny-qwen2)"] > 1.0  # random init vs the SFT'd teacher
    assert kl["reward"] != kl["student at start (tiny-qwen2)"] and kl["control"] != kl["reward"]  # both fits moved
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in rows) and "| student after 1 rollouts, reward |" in stdout


def test_cli_help_benchmark_times_the_light_commands(tmp_path):
    """The help benchmark's light rows (the issue-37 target: under 2 s each on an idle machine; fit's help and the
    `import lightning` floor are its slow rows, measured by hand: docs/benchmarks.md)."""
    rows, stdout = _run_benchmark(["benchmarks/cli_help.py", "--runs", "1", "--rows", "help", "eval", "demo"],
                                  tmp_path)
    assert [row["command"] for row in rows] == ["python -m rl_lightning --help", "python -m rl_lightning eval --help",
                                                "python -m rl_lightning demo --help"]
    assert all(0 < row["s"] < 20 for row in rows) and "| `python -m rl_lightning eval --help` |" in stdout
