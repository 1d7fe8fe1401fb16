"""`benchmarks/lm_head_chunk.py` at smoke scale (hidden 64, vocabulary 1000), so it cannot rot between the runs whose
figures the docs quote: both paths give the same gradients, and the full path's (N, V) logits show in its peak."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow  # eight child processes
def test_lm_head_chunk_benchmark_runs_and_compares(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run([sys.executable, "benchmarks/lm_head_chunk.py", "--quick", "--json", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {(row["head"], row["n"]): row for row in report["rows"]}
    assert report["chunk"] == 128 and set(rows) == {(h, n) for h in ("trained", "frozen") for n in (256, 1024)}
    assert all(row["same_gradients"] and row["full_s"] > 0 and row["chunked_s"] > 0 for row in rows.values())
    for head in ("trained", "frozen"):  # 1024 x 1000 fp32 logits are 3.9 MiB a tensor; a chunk's are 0.5 MiB
        assert rows[head, 1024]["chunked_mib"] < rows[head, 1024]["full_mib"], rows[head, 1024]
    assert "| 1024 | trained |" in result.stdout and "WARNING" not in result.stdout
