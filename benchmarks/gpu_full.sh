#!/usr/bin/env bash
# The released 26B-A4B's full shape on one GPU, random weights made on the device (benchmarks/bench_gpu_full.py).
#
# Run it on a fresh GPU machine, from the repository root, with nothing fetched from the network:
#     bash benchmarks/gpu_full.sh [RESULTS_DIR]
# RESULTS_DIR defaults to $OUT (the folder a remote run copies back), else ./gpu_full_results. It receives:
#     environment.txt      nvidia-smi, python, package versions, commit
#     build.log            the editable install's output
#     bench_gpu_full.json  every measurement, rewritten after each one (a run cut short keeps what finished)
#     bench_gpu_full.md    the same as tables
#     bench.log            the benchmark's output
#     summary.txt          one line per stage with its exit status and duration
# Needs what benchmarks/gpu_check.sh needs (wheels for anything missing in ./.whl/). Budget: under 8 minutes
# on one H200. Every stage is bounded by `timeout` (wheels 20 s, build 50 s, environment 15 s, benchmark what
# is left of DG_FULL_BUDGET, default 450 s, less 15 s); the benchmark itself skips a part that would not fit
# in its --budget and says so. DG_SKIP_BUILD=1 skips the install when the project is already installed;
# DG_COMMIT names the commit when the copied tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-$PWD/gpu_full_results}}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
BUDGET="${DG_FULL_BUDGET:-450}"
START=$(date +%s)

. benchmarks/gpu_stages.sh  # stage (time-boxed, logged), set_up (wheels, editable install) and environment

set_up

stage environment 15 bash -c "$(declare -f environment); PY='$PY' environment" > "$RESULTS/environment.txt"
head -20 "$RESULTS/environment.txt"

LEFT=$(( BUDGET - ($(date +%s) - START) - 15 ))
stage bench $(( LEFT + 10 )) "$PY" benchmarks/bench_gpu_full.py --out "$RESULTS" --budget "$LEFT" \
    2>&1 | tee "$RESULTS/bench.log" | tail -40
RC=$?

echo "total: $(( $(date +%s) - START )) s of a ${BUDGET} s budget" | tee -a "$SUMMARY"
exit $RC  # the benchmark's status: 2 without a GPU, 124 when cut short by its timeout
