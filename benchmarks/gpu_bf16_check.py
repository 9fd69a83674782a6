"""The GPU bfloat16 run against the reference's bfloat16 run, call by call, on the real device (issue #30).

``python benchmarks/gpu_bf16_check.py [--device cuda|cuda-sim]`` (``benchmarks/gpu_check.sh`` runs it on the
GPU). It runs check (b) of ``tests/test_gpu_bf16_model.py``, which CI holds on cuda-sim only, on the device
given: for each tiny model of ``CONFIGS`` (random weights, seed 3), the same calls on
``fast.gpu.Model(..., dtype="bfloat16")``, ``reference.Model(..., dtype="bfloat16")`` and the float32
reference (a prompt encode with left padding, denoise calls without and with self-conditioning, an
incremental encode and a denoise over the longer cache: ``whole_calls``), and prints per call

    ratio = max |gpu_bf16 - ref_bf16| / max |ref_bf16 - ref_fp32|

(padded positions left out) and, for a denoise, the largest such ratio of one layer or the logits with the
references teacher-forced by the GPU's layer outputs. Two runs that round at the same points part only
where a float32 sum taken in another order lands next to a rounding boundary, so the ratio is near 0; a
missing or misplaced rounding moves the run by about bfloat16's own rounding, as far as the float32 run, so
the ratio nears 1. A call passes when its ratio is at most 1/8, or, for a denoise, when every forced ratio is
at most 1/4 (``within``, whose docstring says why). On a GPU this is the real device's kernels:
tensor cores, fused multiply-adds, CUDA's own exp and tanh.

The calls and the criterion (``CONFIGS``, ``whole_calls``, ``ratios``, ``within``) live in
``diffusiongemma.fast.gpu.bf16_whole_calls``, which the test imports too, so that the GPU and cuda-sim check
the same thing. Exit status: 0 when every call passes, 1 when one does not, 2 when the check cannot run (no
GPU, or no ``dtype`` in ``fast.gpu.Model``), each with a one-line reason.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help='"cuda" (default), "cuda:N" or "cuda-sim"')
    parser.add_argument("--config", action="append", dest="configs",
                        help="a name of the test file's CONFIGS (repeatable; default: all)")
    args = parser.parse_args(argv)
    from diffusiongemma.fast import gpu
    from diffusiongemma.tiny import make_config, random_tensors

    if "dtype" not in inspect.signature(gpu.Model.__init__).parameters:
        print("bf16 check: not run: diffusiongemma.fast.gpu.Model has no dtype argument yet (issue #30)")
        return 2
    if args.device == "cuda-sim":
        from diffusiongemma.fast.gpu.sim import SimDevice

        device = SimDevice(checks=False)
    else:
        ok, reason = gpu.gpu_available()
        if not ok:
            print(f"bf16 check: no GPU: {reason}")
            return 2
        device = gpu.CupyDevice(args.device)
    from diffusiongemma.fast.gpu.bf16_whole_calls import CONFIGS as configs, ratios, whole_calls, within

    names = args.configs or list(configs)
    unknown = [n for n in names if n not in configs]
    if unknown:
        print(f"bf16 check: error: unknown --config {unknown}; the checks have {sorted(configs)}")
        return 2
    print(f"bf16 check on {args.device}: per call max |gpu_bf16 - ref_bf16| / max |ref_bf16 - ref_fp32| "
          f"(<= 1/8), for a denoise also the worst layer under teacher forcing (<= 1/4)", flush=True)
    failed = 0
    for name in names:
        start = time.perf_counter()
        config = make_config(**configs[name])
        for call, (plain, forced) in ratios(whole_calls(config, random_tensors(config, seed=3), device)).items():
            ok = within({call: (plain, forced)})
            failed += not ok
            extra = "" if forced is None else f" (forced {forced:.4f})"
            print(f"  {name}: {call}: {plain:.4f}{extra} {'ok' if ok else 'FAILED'}", flush=True)
        print(f"  {name}: {time.perf_counter() - start:.1f} s", flush=True)
    print(f"bf16 check: {'every call passes' if not failed else f'{failed} call(s) FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
