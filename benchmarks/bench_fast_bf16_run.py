"""The CPU fast path's bfloat16 run against its float32 run on the shipped model: weights held and CPU time.

    python benchmarks/bench_fast_bf16_run.py [--repeats 5] [--threads 1] [--tokens 64]

Loads ``diffusiongemma/assets/tiny-kjv`` (a float32 checkpoint) twice, ``fast.Model.from_pretrained(path)``
and ``fast.Model.from_pretrained(path, dtype="bfloat16")`` (weights rounded to bfloat16, the matrices and
experts held bfloat16), and prints the bytes of weights each holds (``Model.weight_nbytes``), then the CPU
time (``time.process_time``, all threads) and wall time of one ``generate`` (fixed seed, a fixed number of
new tokens, adaptive stopping as the model's generation config sets it) and of one prompt encode + denoise
step, the two dtypes in alternation, each the median of ``--repeats`` runs after a warm-up. The tokens of the
two runs are printed as equal or not (they need not be: the bfloat16 run is another function). The machine
line (CPU, cores, load, commit) comes first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_facts  # noqa: E402

from diffusiongemma import fast  # noqa: E402
from diffusiongemma.checkpoint import default_model_dir  # noqa: E402
from diffusiongemma.reference.draws import SeededDraws  # noqa: E402
from diffusiongemma.reference.generate import generate  # noqa: E402


def timed(fn) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one ``fn()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of the kernels")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per generate")
    args = parser.parse_args()
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads)
    except ImportError:  # pragma: no cover
        pass
    path = default_model_dir()
    print(machine_facts() + f"; kernel threads {args.threads}")
    models = {dtype: fast.Model.from_pretrained(path, dtype=dtype) for dtype in ("float32", "bfloat16")}
    config = models["float32"].config
    print(f"model: {path} (V={config.vocab_size}, H={config.hidden_size}, layers={config.num_hidden_layers}, "
          f"experts={config.num_experts}, canvas={config.canvas_length})")
    for dtype, model in models.items():
        print(f"  {dtype:8s} weights held: {model.weight_nbytes / 2 ** 20:.2f} MiB")
    print(f"  ratio bfloat16 / float32 weights: {models['bfloat16'].weight_nbytes / models['float32'].weight_nbytes:.3f}")

    prompt = np.random.default_rng(0).integers(3, config.vocab_size, (1, 48))
    canvas = np.random.default_rng(1).integers(3, config.vocab_size, (1, config.canvas_length))
    tokens = {}

    def run_generate(dtype):
        tokens[dtype] = generate(models[dtype], prompt, random=SeededDraws(0), max_new_tokens=args.tokens).sequences

    def run_forward(dtype):
        model = models[dtype]
        cache = model.new_cache(1)
        model.encode(prompt, cache)
        model.denoise(canvas, cache)

    for label, fn in (("generate", run_generate), ("encode + denoise", run_forward)):
        samples = {dtype: [] for dtype in models}
        for dtype in models:  # warm-up
            fn(dtype)
        for _ in range(args.repeats):
            for dtype in models:  # alternation: a change of the machine's load hits both alike
                samples[dtype].append(timed(lambda: fn(dtype)))
        med = {dtype: (statistics.median(c for c, _ in s), statistics.median(w for _, w in s))
               for dtype, s in samples.items()}
        for dtype, (cpu, wall) in med.items():
            print(f"  {label:17s} {dtype:8s} CPU {cpu * 1e3:8.1f} ms  wall {wall * 1e3:8.1f} ms")
        print(f"  {label:17s} ratio bfloat16 / float32: CPU {med['bfloat16'][0] / med['float32'][0]:.2f}, "
              f"wall {med['bfloat16'][1] / med['float32'][1]:.2f}; load avg {os.getloadavg()[0]:.2f}")
    print(f"  generated tokens equal: {np.array_equal(tokens['float32'], tokens['bfloat16'])}")


if __name__ == "__main__":
    main()
