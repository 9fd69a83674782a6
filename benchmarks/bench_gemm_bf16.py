"""The bfloat16 matrix product of the GPU path (``dg_gemm_bf16``, tensor cores) at the 26B model's layer shapes.

Run on a GPU machine: ``python benchmarks/bench_gemm_bf16.py [--budget S] [--out FILE]``. For each shape (M
tokens x N outputs x K inputs: the fused projections of one sliding layer and the LM head, for a 1,024-token
prompt and a 256-token canvas) it times, with CUDA events, the median of ``--repeats`` calls of

* ours: ``dg_gemm_bf16`` with a bfloat16 output (what a bf16 layer would keep);
* torch bf16: ``x @ w.T`` on bfloat16 CUDA tensors (cuBLAS, float32 accumulation), where torch sees the GPU;
* CuPy float32: ``x @ w.T`` in float32 (cuBLAS; what the GPU path runs today, TF32 off as CuPy's default),

and prints ms, TFLOP/s (2 M N K per call) and the ratios. It also checks 64 rows of ours against the exact
product (float64 on the host): "bound used" is max |error| / ((2K + 16) 2^-23 sum|a||b|), the bound that
tests/test_gpu_bf16.py states (at most 1 where the tensor cores stay within it).

``--sim`` runs the same code on cuda-sim with small shapes (correctness only: the times are the CPU
executor's). Without a GPU and without ``--sim`` it prints "no GPU: <reason>" and exits 1.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import device_ms, kernel_bench_args, kernel_bench_device, machine_facts, print_table  # noqa: E402
from diffusiongemma.fast.gpu import launch as gl  # noqa: E402
from diffusiongemma.reference.primitives import BFLOAT16  # noqa: E402

# hidden 2816; a sliding layer's fused q/k/v: (16 + 2 * 8) heads of 256; the dense MLP's gate/up 2 x 2112 and
# its down projection; the LM head over the 262,144-token vocabulary (SPEC §1, §5.2)
SHAPES = [("qkv, prompt 1024", 1024, 8192, 2816), ("gate/up, prompt 1024", 1024, 4224, 2816),
          ("down, prompt 1024", 1024, 2816, 2112), ("qkv, canvas 256", 256, 8192, 2816),
          ("LM head, canvas 256", 256, 262144, 2816)]
SIM_SHAPES = [("small", 70, 65, 33), ("tiles", 128, 128, 64)]


def bound_used(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> float:
    a64, b64 = a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
    err = np.abs(c.astype(np.float64) - a64 @ b64.T)
    bound = (2 * a.shape[1] + 16) * 2.0 ** -23 * (np.abs(a64) @ np.abs(b64).T)
    return float(np.max(err / np.maximum(bound, np.finfo(np.float64).tiny)))


def main(argv=None) -> int:
    args = kernel_bench_args(argv, __doc__, 20, "shapes")
    opened = kernel_bench_device(args.sim)
    if opened is None:
        return 1
    device, torch = opened
    lines = [f"# dg_gemm_bf16 on {getattr(device, 'arch', 'cuda-sim')}", "", machine_facts(), "",
             "| shape | M x N x K | ours bf16 ms | TFLOP/s | torch bf16 ms | CuPy fp32 ms | ours / torch | "
             "ours / fp32 | bound used |", "|---|---|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    began = time.perf_counter()
    for name, M, N, K in (SIM_SHAPES if args.sim else SHAPES):
        if time.perf_counter() - began > args.budget:
            lines.append(f"| {name} | skipped: budget of {args.budget:.0f} s spent | | | | | | | |")
            continue
        a = (rng.standard_normal((M, K), np.float32)).astype(BFLOAT16)
        b = (rng.standard_normal((N, K), np.float32) * 0.05).astype(BFLOAT16)
        A, B = device.to_device(a.view(np.uint16)), device.to_device(b.view(np.uint16))
        C16 = device.empty((M, N), np.uint16)
        launch = gl.gemm_bf16(A, B, None, C16)
        ours = device_ms(device, lambda: device.launch(launch), 3 if args.sim else args.repeats)
        rows = min(M, 64)
        C = device.empty((rows, N), np.float32)
        device.launch(gl.gemm_bf16(A[:rows], B, C, None))
        used = bound_used(a[:rows], b, device.to_host(C))
        flops = 2.0 * M * N * K
        t_torch = t_fp32 = float("nan")
        if torch is not None:
            x = torch.from_numpy(a.view(np.uint16).view(np.int16)).cuda().view(torch.bfloat16)
            w = torch.from_numpy(b.view(np.uint16).view(np.int16)).cuda().view(torch.bfloat16)
            t_torch = device_ms(device, lambda: x @ w.T, args.repeats)
            del x, w
        if not args.sim:
            xp = device.xp
            x32, w32 = xp.asarray(a.astype(np.float32)), xp.asarray(b.astype(np.float32))
            t_fp32 = device_ms(device, lambda: x32 @ w32.T, args.repeats)
            del x32, w32
        lines.append(f"| {name} | {M} x {N} x {K} | {ours:.3f} | {flops / ours / 1e9:.1f} | {t_torch:.3f} | "
                     f"{t_fp32:.3f} | {ours / t_torch:.2f} | {ours / t_fp32:.2f} | {used:.3f} |")
    print_table(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
