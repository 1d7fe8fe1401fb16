"""Benchmarks at smoke scale on the tiny model, so they cannot rot between the runs whose figures the README quotes:
the side-by-side against TRL (same data and tokens), LoRA weight sync full vs adapter, async vs sync rollouts, peak
memory against TRL and over the token budget."""

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


@pytest.mark.slow  # ~20 tiny trials, each a fresh process
def test_memory_benchmark_compares_peaks_and_sweeps_the_token_budget(tmp_path):
    out = tmp_path / "memory.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--quick", "--budget-ckpt", "on", "--json", str(out),
         "--out-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["task"], r["side"]) for r in rows} == {(t, s) for t in ("sft", "dpo", "grpo-hf") for s in ("ours", "TRL")}
    assert not [r for r in rows if "error" in r["result"]]
    for r in rows:
        assert 0 < r["result"]["load_rss_mib"] <= r["result"]["peak_rss_mib"]
    ours = [r for r in rows if r["side"] == "ours"]
    for r in ours:  # every ours row against TRL's; the chunked ones against our full logits
        assert 0 < r["vs_trl_peak"] < float("inf") and 0 < r["vs_trl_increment"] < float("inf")
    assert all(0 < r["vs_full_peak"] < float("inf") for r in ours if r["head"].startswith("chunked"))
    sft, dpo = ({r["result"]["tokens"][-1] for r in rows if r["task"] == t} for t in ("sft", "dpo"))
    assert len(sft) == 1 and len(dpo) == 1  # the same real tokens per step on both sides
    points = report["budget"]
    assert [(p["budget"], p["chunk"]) for p in points] == [(128, 1024), (256, 1024), (128, None), (256, None)]
    assert all(p["micro_batches"] == 1 and 0 < p["tokens"] <= p["budget"] for p in points)
    [slope] = report["slopes"]  # MiB per 1k tokens, chunked and full (tiny shapes: any sign)
    assert math.isfinite(slope["chunked"]) and math.isfinite(slope["full"]) and slope["budgets"] == [128, 256]
    assert (tmp_path / "memory_budget_cpu.png").stat().st_size > 0
    assert "| sft | ours | chunked 1024 |" in (tmp_path / "memory_cpu.md").read_text()
