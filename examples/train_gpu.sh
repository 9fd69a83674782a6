#!/usr/bin/env bash
# Train the next tiny-kjv on one GPU and evaluate it beside the shipped model: one command, ~8 minutes of a
# lent GPU machine in all (its start and the copy back included), the pipeline itself MINUTES (default 6).
#
# On the machine that lends the GPU (no network there), from the repository root:
#     bash examples/train_gpu.sh [OUT_DIR]          # OUT_DIR defaults to $OUT, else ./gpu_train
# Before, on a machine with network (once):
#     python examples/prepare_data.py               # examples/data/ (gitignored): carry it along
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 -d .whl transformers==5.24.0     # if the GPU image has an older one
# and copy examples/data (and .whl), both gitignored, to the GPU machine with the working tree.
#
# OUT_DIR receives at most seven files (examples/pipeline.py): model.tar or model.tar.part00.. (the new
# checkpoint; `cat model.tar* | tar -x` gives tiny-kjv-new/), train_log.txt, evaluation.md,
# evaluation.json, pipeline.log, summary.json. Environment: MINUTES (budget of the pipeline, default 6),
# PRESET (model size, default cpu-max), TRAIN_ARGS / EVAL_ARGS (more flags for train_tiny.py /
# evaluate_tiny.py), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-$PWD/gpu_train}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false

# wheels carried in .whl/ (e.g. transformers 5.24.0 where the image has an older one), into a private folder
if ls .whl/*.whl >/dev/null 2>&1; then
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/dg_site .whl/*.whl && export PYTHONPATH="/tmp/dg_site:${PYTHONPATH:-}"
fi
# the training and evaluation need only the pure-Python parts of the package: no build
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
"$PY" -c "import torch, transformers; from transformers import DiffusionGemmaForBlockDiffusion; \
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| transformers', transformers.__version__)" \
    || { echo "transformers has no DiffusionGemmaForBlockDiffusion: carry the 5.24.0 wheel in .whl/"; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

# the shipped model's measures were taken on the CPU (examples/eval_tiny-kjv.json): the GPU evaluates the new one only
BASE=(--baseline diffusiongemma/assets/tiny-kjv)
[ -f examples/eval_tiny-kjv.json ] && BASE=(--baseline-json examples/eval_tiny-kjv.json)
exec "$PY" examples/pipeline.py --minutes "${MINUTES:-6}" --out "$OUT_DIR" --work /tmp/dg_work \
    --preset "${PRESET:-cpu-max}" --device auto "${BASE[@]}" --train-args "${TRAIN_ARGS:-}" \
    --eval-args "${EVAL_ARGS:-}"
