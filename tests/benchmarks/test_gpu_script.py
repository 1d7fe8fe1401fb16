"""benchmarks/gpu/run.sh: the GPU checks run end to end on CPU in their dry mode (tiny shapes, fp32), so the script
cannot rot between the runs on a GPU machine; its failure paths report instead of stopping. The full dry run and the
``--quick`` dry run (issue 39's one-call check) run at once, one per core: each is a chain of single-threaded
processes."""

import json
import math
import os
import re
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
OFFLOADS = ("none", "activations", "optimizer", "both", "checkpointing", "checkpointing+activations")
# `run.sh --quick`'s rows (the dry run names the device cpu-x1 where the GPU run says e.g. nvidia-h100-x1)
QUICK_MEASURED = [
    *(f"offload/{name}/{what}" for name in OFFLOADS for what in ("loss_gap", "step_s")),
    "offload/activations/step_ratio", "offload/optimizer/step_ratio", "offload/checkpointing+activations/step_ratio",
    "quick sft qwen2.5-1.5b tokens/s",
    "quick rl qwen3-0.6b cpu-x1 tokens/s", *(f"quick memory {task} measured/planned" for task in ("sft", "grpo", "gkd")),
    "quick resume offloaded losses gap", "quick threads engine calls off the main thread",
]
QUICK_NOT_ON_CPU = [
    "quick sft qwen2.5-1.5b MFU", "quick sft qwen2.5-1.5b peak memory", "quick rl qwen3-0.6b cpu-x1 MFU",
    "quick rl qwen3-0.6b cpu-x1 peak memory", "quick threads own stream",
]


def script_env():
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}


def run_script(*args, timeout=600):
    return subprocess.run(["bash", str(RUN), *map(str, args)], env=script_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """The full and the quick dry runs, started together: {"full"|"quick": (CompletedProcess, records)}."""
    outs = {kind: tmp_path_factory.mktemp(f"gpu_dry_{kind}") for kind in ("full", "quick")}
    flags = {"full": ["--dry"], "quick": ["--quick", "--dry"]}
    started = {kind: subprocess.Popen(["bash", str(RUN), *flags[kind], "--out", str(outs[kind])], env=script_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kind in outs}
    runs = {}
    for kind, process in started.items():
        stdout, stderr = process.communicate(timeout=1500)  # above the dry limits (hang guards) summed
        records = [json.loads(line) for line in (outs[kind] / "results.jsonl").read_text().splitlines()]
        runs[kind] = (subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), records)
    return runs


@pytest.fixture(scope="module")
def dry_run(dry_runs):
    return dry_runs["full"]


@pytest.fixture(scope="module")
def quick_dry_run(dry_runs):
    return dry_runs["quick"]


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


@pytest.mark.slow
def test_quick_dry_run_tables_every_check(quick_dry_run):
    result, records = quick_dry_run
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    rows = {line.split("  ")[0]: line for line in result.stdout.splitlines()}
    for check in QUICK_MEASURED + QUICK_NOT_ON_CPU:
        assert check in rows, f"{check!r} is not in the table:\n{result.stdout[-6000:]}"
        assert "  ok" in rows[check]
    for check in ("offload", "sft-mfu", "rl", "memory", "resume", "threads"):  # each check's own process, timed
        assert re.search(rf"^{check} +\d+ s  done$", result.stdout, re.M), result.stdout[-3000:]
    assert f"{len(records)}/{len(records)} checks ok" in result.stdout and "device: CPU" in result.stdout


@pytest.mark.slow
def test_quick_dry_records_numbers_where_measured(quick_dry_run):
    _, records = quick_dry_run
    by_check = {r["check"]: r for r in records}
    assert len(by_check) == len(records), "a check was recorded twice"
    assert all(r["ok"] is True for r in records), [r for r in records if not r["ok"]]
    for check in QUICK_MEASURED:
        value = by_check[check]["value"]
        assert isinstance(value, (int, float)) and math.isfinite(value), by_check[check]
    for check in QUICK_NOT_ON_CPU:
        assert str(by_check[check]["value"]).startswith("n/a"), by_check[check]
    # offload on CPU copies nothing: every configuration trains to the losses without offload, bit for bit
    for name in OFFLOADS:
        assert by_check[f"offload/{name}/loss_gap"]["value"] == 0.0
        assert by_check[f"offload/{name}/step_s"]["value"] > 0
    assert by_check["offload/activations/step_ratio"]["target"] == "<= 1.2"
    assert by_check["offload/optimizer/step_ratio"]["target"] == "<= 1.15"
    assert by_check["offload/checkpointing+activations/step_ratio"]["target"] == "<= 1.2"
    assert "(checkpointing)" in by_check["offload/checkpointing+activations/step_ratio"]["detail"]
    # the resumed run (optimizer offload on) continues with the uninterrupted run's losses, bit for bit on CPU
    assert by_check["quick resume offloaded losses gap"]["value"] == 0.0
    # the plan predicts the CPU peak (VmHWM) within 7% on real fits (benchmarks/results/memory_plan_cpu.md)
    for task in ("sft", "grpo", "gkd"):
        assert abs(by_check[f"quick memory {task} measured/planned"]["value"] - 1) < 0.15
    assert by_check["quick threads engine calls off the main thread"]["value"] == 2  # both rollouts, off main
    # the engine thread selected the rank's device before its first engine call (rl_lightning.rollout.engine_thread)
    assert by_check["quick threads device selected before engine call"]["value"] == "yes"
    assert by_check["quick sft qwen2.5-1.5b tokens/s"]["value"] > 0
    assert by_check["quick rl qwen3-0.6b cpu-x1 tokens/s"]["target"] == ">= 23,800"  # 2x prime-rl's 11.9k


def test_quick_limits_fit_one_call_of_eight_minutes():
    """The GPU run's per-check limits, plus the kill grace of each, leave room under 8 minutes for start-up and the
    table (one call on a lent machine)."""
    text = RUN.read_text()
    gpu = re.search(r"--quick.*?else\n\s*FLAGS=\(\)\n\s*declare -A LIMIT=\(([^)]*)\)", text, re.S)
    limits = {name: int(value) for name, value in re.findall(r"\[([\w-]+)\]=(\d+)", gpu.group(1))}
    assert set(limits) == {"offload", "sft-mfu", "rl", "memory", "resume", "threads"}
    grace = int(re.search(r"KILL_AFTER=(\d+)\n\s*if \[ \$DRY", text).group(1))
    assert sum(limits.values()) + grace * len(limits) <= 450, limits
