"""Benchmarks at smoke scale on the tiny model, so they cannot rot between the runs whose figures the README quotes:
the side-by-side against TRL (same data and tokens), LoRA weight sync full vs adapter, async vs sync rollouts."""

import json
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
