"""benchmarks/gpu/run.sh: the GPU checks run end to end on CPU in their dry mode (tiny shapes, fp32), so the script
cannot rot between the runs on a GPU machine; its failure paths report instead of stopping."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

RUN = REPO / "benchmarks" / "gpu" / "run.sh"
TABLE = REPO / "benchmarks" / "gpu" / "table.py"
SHAPES = ("qwen3-0.6b", "qwen2.5-1.5b")
# The check names of benchmarks/gpu/train.py; the dry run keeps the GPU run's names (values: `n/a` where no number
# exists on CPU, such as MFU without a peak FLOP/s or the allocator's peak memory).
MEASURED = [f"sft {s} ac={ac} tokens/s" for s in SHAPES for ac in ("off", "on")] + [
    *(f"sft {s} {name}" for s in SHAPES for name in ("packed vs per-sequence logprobs", "AC on vs off")),
    "fsdp bf16 mixed vs fp32 loss", "fsdp bf16 mixed vs fp32 loss drop", "gather bucket 4 MB seconds", "gather bucket 64 MB seconds", "grpo step seconds",
    "grpo generation share", "grpo engine vs trainer logprobs",
]
NOT_ON_CPU = [f"sft {s} ac={ac} {what}" for s in SHAPES for ac in ("off", "on") for what in ("MFU", "peak memory")] + [
    "sft qwen2.5-1.5b best MFU", "gather bucket 4 MB peak memory", "gather bucket 64 MB peak memory",
]
# Comparisons of two computations that must agree in fp32 (the dry run's precision) to summation order.
FP32_AGREEMENT = [f"sft {s} {name}" for s in SHAPES for name in ("packed vs per-sequence logprobs", "AC on vs off")]


def run_script(*args, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(RUN), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_dry")
    result = run_script("--dry", "--out", out)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return result, records


@pytest.mark.slow
def test_dry_run_passes_and_tables_every_check(dry_run):
    result, records = dry_run
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    rows = {line.split("  ")[0]: line for line in result.stdout.splitlines()}
    for check in MEASURED + NOT_ON_CPU:
        assert check in rows, f"{check!r} is not in the table:\n{result.stdout[-6000:]}"
        assert "  ok" in rows[check]
    assert f"{len(records)}/{len(records)} checks ok" in result.stdout
    assert "device: CPU" in result.stdout


@pytest.mark.slow
def test_dry_records_are_ok_and_numbers_where_measured(dry_run):
    _, records = dry_run
    by_check = {r["check"]: r for r in records}
    assert len(by_check) == len(records), "a check was recorded twice"
    for r in records:
        assert r["ok"] is True, r
        assert set(r) <= {"check", "value", "unit", "target", "ok", "detail"}, r
    for check in MEASURED:
        value = by_check[check]["value"]
        assert isinstance(value, (int, float)) and math.isfinite(value), by_check[check]
    for check in FP32_AGREEMENT:
        assert by_check[check]["value"] < 1e-5, by_check[check]
    # bf16 keeps 8 significant bits (~2e-3 relative per rounding): 2e-2 allows ~10 roundings on the loss, while a
    # lost fp32 master copy keeps only 0.2-0.35 of fp32's loss drop (measured), far outside 1 +- 0.1
    assert by_check["fsdp bf16 mixed vs fp32 loss"]["value"] < 2e-2
    assert abs(by_check["fsdp bf16 mixed vs fp32 loss drop"]["value"] - 1) < 0.1
    assert by_check["grpo engine vs trainer logprobs"]["value"] < 1e-4
    assert all(by_check[f"sft {s} ac={ac} tokens/s"]["value"] > 0 for s in SHAPES for ac in ("off", "on"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_and_without_dry_it_stops_with_one_line(tmp_path):
    result = run_script("--out", tmp_path, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "CUDA" in result.stderr, result.stderr
    assert not (tmp_path / "sft.log").exists()


def test_a_crashed_check_becomes_a_failed_row_and_fails_the_table(tmp_path):
    results, log = tmp_path / "results.jsonl", tmp_path / "sft.log"
    results.write_text(json.dumps({"check": "fsdp bf16 mixed vs fp32 loss", "value": 1e-3, "unit": "rel",
                                   "target": "< 2e-2", "ok": True}) + "\n")
    log.write_text("Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory\n\n")
    add = [sys.executable, str(TABLE), str(results), "--add-failure", "sft", "--log", str(log), "--reason", "exit 1"]
    assert subprocess.run(add, capture_output=True, text=True).returncode == 0
    failed = json.loads(results.read_text().splitlines()[-1])
    assert failed == {"check": "sft", "value": "failed", "unit": "", "target": "", "ok": False,
                      "detail": "exit 1: torch.OutOfMemoryError: CUDA out of memory"}
    table = subprocess.run([sys.executable, str(TABLE), str(results)], capture_output=True, text=True)
    assert table.returncode == 1
    assert "1/2 checks ok; failed: sft" in table.stdout
    assert any(line.startswith("sft ") and "FAIL" in line for line in table.stdout.splitlines())


def test_offload_check_runs_dry_with_equal_losses(tmp_path):
    """benchmarks/gpu/offload.py (not in run.sh's 10-minute budget; run it on its own on a GPU) on CPU: every
    offload configuration trains to the same losses as none."""
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "offload.py"), "--dry", "--results",
                           str(results)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["check"]: row for row in map(json.loads, results.read_text().splitlines())}
    for name in ("none", "activations", "optimizer", "both"):
        assert rows[f"offload/{name}/loss_gap"]["value"] == 0.0 and rows[f"offload/{name}/loss_gap"]["ok"]
        assert rows[f"offload/{name}/step_s"]["value"] > 0
