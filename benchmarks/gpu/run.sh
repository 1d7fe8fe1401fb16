#!/usr/bin/env bash
# The GPU checks of rl_lightning in one run, ending in one results table (issue 13):
#   attention  varlen attention vs SDPA, ring merge with the CUDA kernels (benchmarks/gpu/attention.py, if present)
#   sft        SFT tokens/s, MFU and peak memory, Qwen3-0.6B / Qwen2.5-1.5B shapes, activation checkpointing on/off
#   fsdp       FSDP2 bf16 mixed precision vs fp32 loss curves
#   gather     FSDP2 weight gather for the rollout engine: seconds and peak memory per bucket size
#   grpo       one GRPO step through the PPO task with the HF engine: seconds, generation share
# (benchmarks/gpu/train.py's docstring gives each measurement and formula.) With --quick, issue 39's checks instead,
# one call under 8 minutes on an H100/H200 (the sum of the limits below, 400 s, plus start-up and the table):
#   offload    activation / optimizer offload, and checkpointing + offload: step time vs none / checkpointing
#              (targets <= 1.2x, <= 1.15x, <= 1.2x), peak memory, losses
#              (offload.py; in --quick only, so that CI's two dry runs do not run it twice)
#   sft-mfu    SFT MFU, Qwen2.5-1.5B shape, the SFT task with strategy.compile (target >= 40%) (quick_speed.py)
#   rl         the RL trainer on prime-rl's shape: Qwen3-0.6B, 16k tokens/step, synthetic rollouts (quick_speed.py)
#   memory     the memory plan against measured peaks of SFT, GRPO and GKD fits (target within 15%) (quick_memory.py)
#   resume     an optimizer-offloaded save + resume: losses continue equal, moments on the host (quick_memory.py)
#   threads    the HF engine driven off the main thread: device selected, own stream (thread_probe.py)
#
#   bash benchmarks/gpu/run.sh [--quick] [--dry] [--wheels DIR] [--out DIR]
#
# --quick    issue 39's checks (above) instead of the full set
# --dry      CPU, tiny shapes, the same code (CI runs it: tests/test_gpu_script.py); 1-2.5 minutes on 2 cores
# --wheels   install DIR/*.whl (benchmarks/gpu/wheels.sh DIR makes it where pip reaches PyPI) into OUT/site first,
#            for a CUDA machine with torch, transformers and lightning but without the project's other dependencies
# --out      where results.jsonl, one log per check and the installed wheels go (default: a new /tmp folder)
# PYTHON     the interpreter (default: the repo's .venv/bin/python if there is one, else python, else python3)
#
# Each check runs in its own process under a time limit; one that crashes or times out is recorded as failed with
# the last line of its log and the rest still run. Exit status: 0 when every check is ok, 1 when one failed,
# 2 when nothing could run (no CUDA without --dry, the project does not import).
set -uo pipefail

usage() { sed -n '19,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
DRY=0 QUICK=0 WHEELS="" OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1; shift ;;
        --quick) QUICK=1; shift ;;
        --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
        --out) OUT=${2:?--out needs a folder}; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "run.sh: error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

OUT=${OUT:-$(mktemp -d /tmp/rl_lightning_gpu.XXXXXX)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
if [ -n "$WHEELS" ] && ! WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd); then echo "run.sh: error: --wheels: no such folder" >&2; exit 2; fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=$(command -v python || command -v python3); fi
fi
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ -n "$WHEELS" ]; then
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "run.sh: error: no .whl files in '$WHEELS' (make them with benchmarks/gpu/wheels.sh DIR)" >&2
        exit 2
    fi
    "$PYTHON" -m pip install --quiet --upgrade --no-index --no-deps --target "$OUT/site" "${wheels[@]}" >"$OUT/pip.log" 2>&1 || {
        echo "run.sh: error: pip could not install the wheels from '$WHEELS': $(tail -n 1 "$OUT/pip.log")" >&2
        exit 2
    }
    export PYTHONPATH="$OUT/site:$PYTHONPATH"
    echo "installed ${#wheels[@]} wheels from $WHEELS into $OUT/site"
fi

if [ $DRY -eq 0 ] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "run.sh: error: torch sees no CUDA device (torch.cuda.is_available() is False); run on a GPU machine, or pass --dry for the CPU run" >&2
    exit 2
fi
if ! "$PYTHON" -c "import rl_lightning.tasks, rl_lightning.data, rl_lightning.parallel.strategy" 2>"$OUT/imports.log"; then
    echo "run.sh: error: the project does not import ($(tail -n 1 "$OUT/imports.log")); install its dependencies or pass --wheels DIR (benchmarks/gpu/wheels.sh DIR)" >&2
    exit 2
fi

KILL_AFTER=15
if [ $QUICK -eq 1 ]; then
    # one call under 8 minutes on a lent H100/H200: 400 s of limits + 6 x 5 s of kill grace + start-up and the table
    KILL_AFTER=5
    if [ $DRY -eq 1 ]; then
        FLAGS=(--dry)
        declare -A LIMIT=([offload]=180 [sft-mfu]=180 [rl]=180 [memory]=240 [resume]=180 [threads]=120)  # hang guards: 2x what a busy 2-core CI needs
        echo "rl_lightning quick GPU checks (issue 39), DRY run (CPU, tiny shapes); results in $RESULTS"
    else
        FLAGS=()
        declare -A LIMIT=([offload]=90 [sft-mfu]=80 [rl]=75 [memory]=80 [resume]=40 [threads]=35)
        echo "rl_lightning quick GPU checks (issue 39); results in $RESULTS"
    fi
elif [ $DRY -eq 1 ]; then
    FLAGS=(--dry)
    declare -A LIMIT=([attention]=240 [sft]=240 [fsdp]=180 [gather]=180 [grpo]=240)  # hang guards, as above
    echo "rl_lightning GPU checks, DRY run (CPU, tiny shapes); results in $RESULTS"
else
    FLAGS=()
    # per-check limits on one H100: 525 s in all, under the 10 minutes a command may take on the lent machines
    declare -A LIMIT=([attention]=90 [sft]=150 [fsdp]=75 [gather]=60 [grpo]=150)
    echo "rl_lightning GPU checks; results in $RESULTS"
fi

run_check() {  # NAME COMMAND...: run one check under its time limit; a crash or a timeout becomes a failed record
    local name=$1 limit=${LIMIT[$1]} log="$OUT/$1.log" start=$SECONDS rc=0 reason records
    shift
    records=$(wc -l <"$RESULTS")
    timeout --kill-after=$KILL_AFTER "$limit" "$@" >"$log" 2>&1 || rc=$?
    reason="exit status $rc"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then reason="timed out after $limit s"; fi
    if [ $rc -eq 0 ] && [ "$(wc -l <"$RESULTS")" -eq "$records" ]; then rc=1 reason="no results written"; fi
    if [ $rc -eq 0 ]; then
        printf '%-10s %4d s  done\n' "$name" $((SECONDS - start))
        return
    fi
    printf '%-10s %4d s  FAILED (%s), log %s:\n' "$name" $((SECONDS - start)) "$reason" "$log"
    tail -n 12 "$log" | sed 's/^/    /'
    "$PYTHON" benchmarks/gpu/table.py "$RESULTS" --add-failure "$name" --log "$log" --reason "$reason" >/dev/null
}

if [ $QUICK -eq 1 ]; then
    run_check offload "$PYTHON" benchmarks/gpu/offload.py "${FLAGS[@]}" --results "$RESULTS"
    run_check sft-mfu "$PYTHON" benchmarks/gpu/quick_speed.py sft "${FLAGS[@]}" --results "$RESULTS"
    run_check rl "$PYTHON" benchmarks/gpu/quick_speed.py rl "${FLAGS[@]}" --results "$RESULTS"
    run_check memory "$PYTHON" benchmarks/gpu/quick_memory.py memory "${FLAGS[@]}" --results "$RESULTS"
    run_check resume "$PYTHON" benchmarks/gpu/quick_memory.py resume "${FLAGS[@]}" --results "$RESULTS"
    run_check threads "$PYTHON" benchmarks/gpu/thread_probe.py "${FLAGS[@]}" --results "$RESULTS"
    echo
    "$PYTHON" benchmarks/gpu/table.py "$RESULTS" "${FLAGS[@]}"
    exit $?
fi

if [ -f benchmarks/gpu/attention.py ]; then
    run_check attention "$PYTHON" benchmarks/gpu/attention.py "${FLAGS[@]}" --results "$RESULTS"
else
    echo "attention checks: benchmarks/gpu/attention.py missing"
fi
for check in sft fsdp gather grpo; do
    run_check "$check" "$PYTHON" benchmarks/gpu/train.py "$check" "${FLAGS[@]}" --results "$RESULTS"
done

echo
"$PYTHON" benchmarks/gpu/table.py "$RESULTS" "${FLAGS[@]}"
