"""`benchmarks/lean_activations.py` at smoke scale (the tiny model, N 256/512), so it cannot rot between the runs
whose figures are quoted: stock and lean give the same gradients and lean saves the closed form's share."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow  # four child processes
def test_lean_activations_benchmark_runs_and_compares(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, "benchmarks/lean_activations.py", "--quick", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {row["n"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {256, 512}
    for row in rows.values():
        assert row["same_gradients"] and row["patched"] == 7 and row["stock_s"] > 0 and row["lean_s"] > 0
        # tiny model per token per layer: 2342 values stock, 1574 lean (0.67), plus the embedding's and head's share
        assert 0.6 < row["saved_ratio"] < 0.75, row
    assert "| 512 |" in result.stdout and "WARNING" not in result.stdout
