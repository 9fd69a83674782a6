"""Reference encode/denoise vs transformers (eager, fp32) on the same weights, one thread each.

Run: ``python benchmarks/bench_reference.py``. Prints machine facts and, per operation, both times and
their ratio (reference / transformers; the target is <= 2x). Threads are pinned to 1 on both sides
(threadpoolctl for NumPy's BLAS, torch.set_num_threads for torch).
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from common import SMALL, SMALL_PROMPT, best_of, machine_facts  # noqa: E402


def main() -> None:
    import torch

    from diffusiongemma.reference.model import Model
    from diffusiongemma.crosscheck.transformers_peer import hf_cache, hf_denoise, hf_encode
    from diffusiongemma.tiny import save_tiny, tiny_model

    torch.set_num_threads(1)
    print(machine_facts())
    print(f"threads: 1 (numpy BLAS via threadpoolctl, torch.set_num_threads(1)); config: {SMALL}, prompt {SMALL_PROMPT}")
    hf = tiny_model(SMALL)
    with tempfile.TemporaryDirectory() as tmp:
        ours = Model.from_pretrained(save_tiny(hf, os.path.join(tmp, "hf")))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, SMALL.vocab_size, size=(1, SMALL_PROMPT))
    canvas = rng.integers(0, SMALL.vocab_size, size=(1, SMALL.canvas_length))
    with threadpool_limits(limits=1):
        t_enc_ours = best_of(lambda: ours.encode(prompt, ours.new_cache(1)))
        t_enc_hf = best_of(lambda: hf_encode(hf, hf_cache(hf), prompt))
        cache, hc = ours.new_cache(1), hf_cache(hf)
        ours.encode(prompt, cache)
        hf_encode(hf, hc, prompt)
        sc = ours.denoise(canvas, cache) / np.float32(0.8)
        t_dec_ours = best_of(lambda: ours.denoise(canvas, cache, sc))
        t_dec_hf = best_of(lambda: hf_denoise(hf, hc, canvas, sc))
    print(f"{'operation':<34}{'reference':>12}{'transformers':>14}{'ratio':>8}")
    for name, a, b in [(f"encode (prefill {SMALL_PROMPT})", t_enc_ours, t_enc_hf),
                       (f"denoise (canvas {SMALL.canvas_length}, with SC)", t_dec_ours, t_dec_hf)]:
        print(f"{name:<34}{a * 1e3:>10.2f}ms{b * 1e3:>12.2f}ms{a / b:>7.2f}x")


if __name__ == "__main__":
    sys.exit(main())
