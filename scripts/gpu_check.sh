#!/usr/bin/env bash
# One command for a CUDA machine (issue 26, item 7): build cuda_ext, run the GPU tests, run the GPU benches.
# Needs no Ray and no install of the project: python (torch with CUDA, numba, pyarrow, pytest, triton) and nvcc,
# with the repository root on PYTHONPATH. Each step has a time limit (together 590 s at worst, under 10 minutes:
# warm runs beside two others); a step that fails or runs out of time does not stop the later ones, and the script
# then exits 1.
#
#   scripts/gpu_check.sh [OUT]        (or: make gpu-check OUT=... PYTHON=...)
#
# OUT (default out/gpu) receives one log per step (build, warm, overlap_gpu, attention_gpu, pytest_gpu, train_gpu),
# overlap_gpu.json, train_gpu.json, attention_gpu.json and summary.txt.
# PYTHON (default python3) is the interpreter.
set -uo pipefail

usage="usage: scripts/gpu_check.sh [OUT]   (OUT: the folder for logs and JSON, default out/gpu; PYTHON: the interpreter, default python3)"
case "${1:-}" in
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "gpu_check: unknown option '$1'; $usage" >&2; exit 2 ;;
esac
if [ "$#" -gt 1 ]; then
    echo "gpu_check: one argument (the output folder) expected, got $#: $*; $usage" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-out/gpu}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-${TMPDIR:-/tmp}/freescale-numba-cache}"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_check: no python: '$PYTHON' is not on PATH (set PYTHON=/path/to/python)" >&2
    exit 2
fi
probe='import torch
if not torch.cuda.is_available():
    raise SystemExit(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees none")
print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")'
if ! device=$(timeout 60 "$PYTHON" -c "$probe" 2>&1); then
    echo "gpu_check: no CUDA device: $PYTHON: ${device##*$'\n'}; run it where a CUDA build of torch sees a GPU" \
         "(PYTHON=... names another interpreter)" >&2
    exit 2
fi
mkdir -p "$OUT" || { echo "gpu_check: cannot create the output folder '$OUT'" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
echo "gpu_check: $device; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); output in $OUT"

failed=()
summary="$OUT/summary.txt"
echo "$device" > "$summary"

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output in OUT/NAME.log and on the terminal
step() {
    local name=$1 limit=$2 rc start
    shift 2
    echo "== $name (limit ${limit}s): $*"
    start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        echo "$name: ok in $((SECONDS - start))s" | tee -a "$summary"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "$name: TIMED OUT after ${limit}s" | tee -a "$summary"
        failed+=("$name")
    else
        echo "$name: FAILED (exit $rc) in $((SECONDS - start))s, see $OUT/$name.log" | tee -a "$summary"
        failed+=("$name")
    fi
}

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L > "$OUT/nvidia-smi.txt" 2>&1
step build 30 "$PYTHON" -m cuda_ext.build
# The planner's and the loader's numba kernels compile once per machine into NUMBA_CACHE_DIR (about a minute on
# one core; the tenth run's tests, each rank process compiling them itself, ran out of time). `freescale warm`
# compiles them in the background, beside the two benches that call no numba kernel; the tests' rank processes
# and train_gpu then load them.
( failed=(); step warm 150 "$PYTHON" -m freescale warm; [ "${#failed[@]}" -eq 0 ] ) >/dev/null 2>&1 &
warm_pid=$!
step overlap_gpu 75 "$PYTHON" bench/overlap_gpu.py --json-out "$OUT/overlap_gpu.json"
step attention_gpu 60 "$PYTHON" bench/attention_gpu.py --json-out "$OUT/attention_gpu.json"
wait "$warm_pid" || failed+=(warm)
grep "^warm:" "$summary"
step pytest_gpu 240 "$PYTHON" -m pytest -m gpu -rs --durations=15 tests/cuda_ext tests/bench tests/trainer
step train_gpu 170 "$PYTHON" bench/train_gpu.py --json-out "$OUT/train_gpu.json"

if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_check: ${#failed[@]} step(s) failed: ${failed[*]} (logs in $OUT)" | tee -a "$summary" >&2
    exit 1
fi
echo "gpu_check: every step passed (logs and JSON in $OUT)" | tee -a "$summary"
