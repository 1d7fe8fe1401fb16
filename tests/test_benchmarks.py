"""The side-by-side benchmark against TRL runs both frameworks on the same data and tokens (at smoke scale, on the
tiny model), so it cannot rot between the runs whose figures the README quotes."""

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
