# Sourced by benchmarks/gpu_check.sh and benchmarks/gpu_full.sh (not run by itself): the time-boxed stage
# runner, the two set-up stages and the machine's description both scripts share. The caller sets RESULTS, SUMMARY, PY, BUDGET (seconds)
# and START (the script's start, `date +%s`) first.

stage() {  # stage NAME LIMIT COMMAND...: run under `timeout` (its limit, at most what is left), log the status
    local name=$1 limit=$2; shift 2
    local t0; t0=$(date +%s)
    local left=$(( BUDGET - (t0 - START) ))
    if [ "$left" -lt 5 ]; then
        echo "$name: skipped, the ${BUDGET} s budget is spent" | tee -a "$SUMMARY"
        return 124
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "$name: exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$SUMMARY"
    return $rc
}

set_up() {  # wheels carried in .whl/ (optional) into a private site folder, then the project itself, editable,
            # without network or build isolation (builds the CPU extension; cuda-sim is not needed on a GPU).
            # DG_SKIP_BUILD=1 skips the install when the project is already installed.
    if ls .whl/*.whl >/dev/null 2>&1; then
        stage wheels 20 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/dg_site .whl/*.whl && export PYTHONPATH="/tmp/dg_site:${PYTHONPATH:-}"
    fi
    export DIFFUSIONGEMMA_NO_CUDA_SIM="${DIFFUSIONGEMMA_NO_CUDA_SIM:-1}"
    [ "${DG_SKIP_BUILD:-0}" = 1 ] || stage build 50 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        > "$RESULTS/build.log" 2>&1 || { tail -30 "$RESULTS/build.log"; echo "build failed: see build.log"; }
}

environment() {  # the machine, the versions and the commit (both scripts run it as their `environment` stage)
    nvidia-smi 2>&1
    "$PY" --version
    "$PY" -c "import numpy, cupy, torch, transformers; print('numpy', numpy.__version__, '| cupy', cupy.__version__, '| torch', torch.__version__, torch.version.cuda, '| transformers', transformers.__version__)" 2>&1
    "$PY" -c "from diffusiongemma.fast import gpu; print(gpu.gpu_available())" 2>&1
    git log -1 --format='commit %h %cI' 2>&1 || echo "commit ${DG_COMMIT:-unknown}"
}
