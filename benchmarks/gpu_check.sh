#!/usr/bin/env bash
# One-shot GPU check of the GPU fast path: the GPU test suite, then the benchmark against transformers.
#
# Run it on a fresh GPU machine, from the repository root, with nothing fetched from the network:
#     bash benchmarks/gpu_check.sh [RESULTS_DIR]
# RESULTS_DIR defaults to $OUT (the folder a remote run copies back), else ./gpu_results. It receives:
#     environment.txt  nvidia-smi, python, package versions
#     compile.txt      ptxas registers/spills of every kernel for this GPU's architecture (nvcc if present)
#     gpu_tests.log    pytest -m gpu output: tests/test_gpu_equivalence.py on the real device (the same tests CI
#                      runs on the simulated device "cuda-sim"), the bfloat16 run's check against the reference's
#                      (benchmarks/gpu_bf16_check.py: a ratio per call), the device's launch limits against the
#                      table cuda-sim enforces and the sampler's edge draws (tests/test_gpu_limits.py,
#                      tests/test_sampler_edges.py), and the launch checks
#     bench_gpu.md     the benchmark table (benchmarks/bench_gpu.py), bench.log its output
#     build.log        the editable install's output
#     summary.txt      one line per stage with its exit status and duration
# Needs: python3 with numpy, cupy (cuda12x or cuda13x), torch (CUDA), transformers >= 5.11, pytest,
# hypothesis, safetensors, ml_dtypes, tokenizers, tqdm, jinja2, threadpoolctl, setuptools, cython. Wheels
# for anything missing can be put in ./.whl/ (e.g. `pip download --no-deps ... -d .whl`): they are
# installed from there with --no-index into a private folder. Budget: at most 6 minutes in all. Every stage
# is time-boxed by `timeout` to its own limit (wheels 20 s, build 50 s, environment 15 s, compile 20 s, tests
# 80 s, bf16 check 30 s, limits 55 s, launch checks 15 s, benchmark 65 s with --budget 60: 350 s) and to
# what is left of DG_CHECK_BUDGET (default 350 s) since the script started, so a hung or slow stage cannot
# take the run past it; a stage
# with no time left is reported as skipped. Every GPU test is sized to seconds and a few GB (the edge draws
# in launches of at most 2^22 logits: tests/test_sampler_edges.py, whose CPU test bounds what it allocates).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-$PWD/gpu_results}}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

BUDGET="${DG_CHECK_BUDGET:-350}"
START=$(date +%s)

cap() {  # cap N: N seconds, or what is left of the budget when that is less (at least 1)
    local left=$(( BUDGET - ($(date +%s) - START) ))
    [ "$left" -lt "$1" ] && { [ "$left" -lt 1 ] && echo 1 || echo "$left"; } || echo "$1"
}

. benchmarks/gpu_stages.sh  # stage (time-boxed, logged), set_up (wheels, editable install) and environment

set_up

stage environment 15 bash -c "$(declare -f environment); PY='$PY' environment" > "$RESULTS/environment.txt"
cat "$RESULTS/environment.txt"

# 3. kernel compile report for this GPU's architecture
ARCH=$(timeout "$(cap 15)" "$PY" -c "import cupy; d=cupy.cuda.Device(0); print('sm_' + d.compute_capability)" 2>/dev/null || echo sm_90)
stage compile 20 "$PY" -m diffusiongemma.fast.gpu.build --arch "$ARCH" > "$RESULTS/compile.txt" 2>&1

# 4. the GPU equivalence suite on the real device (-m gpu selects its "cuda" variants; the "cuda-sim" ones
#    and the host suites run in CI on any machine), and the launch checks, which are quick
stage tests 80 "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_gpu_equivalence.py \
    2>&1 | tee "$RESULTS/gpu_tests.log" | tail -25
# the GPU bfloat16 run against the reference's bfloat16 run on tiny models, the ratio of every call printed
# (check (b) of tests/test_gpu_bf16_model.py on this device; it says "not run" until fast.gpu.Model has a dtype)
stage bf16_check 30 "$PY" benchmarks/gpu_bf16_check.py --device cuda \
    2>&1 | tee -a "$RESULTS/gpu_tests.log" | tail -25
stage limits 55 "$PY" -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_gpu_limits.py tests/test_sampler_edges.py \
    2>&1 | tee -a "$RESULTS/gpu_tests.log" | tail -8
timeout "$(cap 15)" "$PY" - >> "$RESULTS/environment.txt" 2>&1 <<'PYEOF'
# the device's own limits next to the table cuda-sim enforces (fast/gpu/launch.py SHARED_OPT_IN_LIMITS)
import cupy
from diffusiongemma.fast.gpu import launch as gl
d = cupy.cuda.Device(0)
arch, attrs = "sm_" + d.compute_capability, d.attributes
print(f"limits: {arch} MaxSharedMemoryPerBlockOptin={attrs['MaxSharedMemoryPerBlockOptin']} "
      f"(table: {gl.SHARED_OPT_IN_LIMITS.get(arch)}) MaxSharedMemoryPerBlock={attrs['MaxSharedMemoryPerBlock']} "
      f"(default limit {gl.DEFAULT_SHARED_LIMIT}) MaxThreadsPerBlock={attrs['MaxThreadsPerBlock']}")
PYEOF
tail -1 "$RESULTS/environment.txt"
stage launch_tests 15 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_gpu_launch.py \
    2>&1 | tee -a "$RESULTS/gpu_tests.log" | tail -5

# 5. the benchmark: the shipped model end to end, the per-step breakdown and counts, ours and transformers in
#    fp32/bf16
stage bench 65 "$PY" benchmarks/bench_gpu.py --budget 60 --out "$RESULTS/bench_gpu.md" 2>&1 | tee "$RESULTS/bench.log" | tail -20

echo "total: $(( $(date +%s) - START )) s of a ${BUDGET} s budget" | tee -a "$SUMMARY"
