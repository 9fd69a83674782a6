"""The bfloat16 attention of the GPU path (``dg_attention_bf16``, tensor cores) at the 26B model's attention shapes.

Run on a GPU machine: ``python benchmarks/bench_attention_bf16.py [--budget S] [--out FILE]``. For each case
(one sliding layer: 16 query heads over 8 KV heads of 256, window 1,024; one full layer: 16 over 2 KV heads of
512; an encoder prefill of 1k or 8k tokens, causal, and a 256-token decoder canvas over a 1,024-token cache) it
times, with CUDA events, the median of ``--repeats`` calls of

* ours bf16: ``dg_attention_bf16`` (launch plan of ``launch.attention_bf16_plan``);
* ours fp32: ``dg_attention``, the float32 kernel the GPU path runs today;
* torch bf16: ``scaled_dot_product_attention`` on bfloat16 CUDA tensors with ``scale=1.0``, the same visibility as
  a boolean mask (``is_causal`` for a full layer's prefill), grouped heads repeated, where torch sees the GPU;

and prints ms, the effective TFLOP/s (4 d per visible (query head, key) pair: the two products once, though
ours computes the scores twice) and the ratios. It also checks the first 32 queries of ours against
``reference.layers.attend(..., dtype=BFLOAT16)`` on the host: "outside bound" counts the outputs outside the
interval tests/test_gpu_attention_bf16.py derives (0 where the tensor cores and CUDA's expf stay within it).

``--sim`` runs small cases on cuda-sim (correctness only: the times are the CPU executor's). Without a GPU and
without ``--sim`` it prints "no GPU: <reason>" and exits 1.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import device_ms, kernel_bench_args, kernel_bench_device, machine_facts, print_table  # noqa: E402
from diffusiongemma.fast.gpu import launch as gl  # noqa: E402
from diffusiongemma.reference.layers import attend  # noqa: E402
from diffusiongemma.reference.masks import decoder_visibility, encoder_visibility  # noqa: E402
from diffusiongemma.reference.primitives import BFLOAT16, round_to  # noqa: E402

# (name, S queries, cache length, query heads, KV heads, head dim, window (0: full layer), decoder)
CASES = [("sliding prefill 1k", 1024, 0, 16, 8, 256, 1024, False), ("full prefill 1k", 1024, 0, 16, 2, 512, 0, False),
         ("sliding prefill 8k", 8192, 0, 16, 8, 256, 1024, False), ("full prefill 8k", 8192, 0, 16, 2, 512, 0, False),
         ("sliding canvas 256", 256, 1023, 16, 8, 256, 0, True), ("full canvas 256", 256, 1024, 16, 2, 512, 0, True)]
SIM_CASES = [("sliding prefill 40", 40, 0, 4, 2, 64, 16, False), ("full canvas 24", 24, 30, 4, 1, 128, 0, True)]



def inputs(rng, S: int, past: int, nh: int, g: int, d: int, window: int, decoder: bool) -> dict:
    """One call's operands as the model passes them (host arrays, bf16-valued float32): a cache of ``past``
    positions (slot t holds position t) and the call's own S keys at positions past .. past + S - 1."""
    bf = lambda x: round_to(x.astype(np.float32), BFLOAT16)  # noqa: E731
    sd = 2.0 * d ** -0.25
    a = dict(q=bf(rng.standard_normal((1, S, nh, d), np.float32) * sd), q_pos=past + np.arange(S, dtype=np.int64),
             new_k=bf(rng.standard_normal((1, g, S, d), np.float32) * sd),
             new_v=bf(rng.standard_normal((1, g, S, d), np.float32)), new_real=np.ones((1, S), np.uint8),
             window=0 if decoder else window, causal=not decoder, n_cache=past)
    a["new_pos"] = a["q_pos"]
    if past:
        a.update(cache_k=bf(rng.standard_normal((1, g, past, d), np.float32) * sd),
                 cache_v=bf(rng.standard_normal((1, g, past, d), np.float32)),
                 slot_pos=np.arange(past, dtype=np.int64), cache_real=np.ones((1, past + S), np.uint8))
    else:
        a.update(cache_k=None, cache_v=None, slot_pos=None, cache_real=None)
    return a


def visibility(a: dict, S: int, past: int) -> np.ndarray:
    """(1, S or 1, past + S) bool: the reference model's rule (reference/masks.py)."""
    if not a["causal"]:
        return decoder_visibility(np.ones((1, past), bool), S)
    return encoder_visibility(a["q_pos"], np.concatenate([np.arange(past), a["q_pos"]]), np.ones((1, past + S), bool),
                              a["window"] or None)


def outside_bound(a: dict, out: np.ndarray, S: int, past: int, rows: int = 32) -> int:
    """Outputs of the first ``rows`` queries outside tests/test_gpu_attention_bf16.py's interval."""
    from diffusiongemma.fast.gpu.attention_bounds import interval

    keys = np.concatenate([a["cache_k"], a["new_k"]], 2) if past else a["new_k"]
    values = np.concatenate([a["cache_v"], a["new_v"]], 2) if past else a["new_v"]
    vis = visibility(a, S, past)[:, :rows] if a["causal"] else visibility(a, S, past)
    q = a["q"][:, :rows]
    lo, hi = interval(q, keys, values, vis)
    ref = attend(q, keys, values, vis, dtype=BFLOAT16)
    assert np.all((lo <= ref) & (ref <= hi))
    got = out[:, :rows]
    return int(np.count_nonzero(~((lo <= got) & (got <= hi))))


def main(argv=None) -> int:
    args = kernel_bench_args(argv, __doc__, 10, "cases")
    opened = kernel_bench_device(args.sim)
    if opened is None:
        return 1
    device, torch = opened
    lines = [f"# dg_attention_bf16 on {getattr(device, 'arch', 'cuda-sim')}", "", machine_facts(), "",
             "| case | S x T, heads / KV heads x d | rows per block, shared KiB | ours bf16 ms | TFLOP/s | "
             "ours fp32 ms | torch bf16 ms | ours bf16 / fp32 | ours bf16 / torch | outside bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    began = time.perf_counter()
    for name, S, past, nh, g, d, window, decoder in (SIM_CASES if args.sim else CASES):
        if time.perf_counter() - began > args.budget:
            lines.append(f"| {name} | skipped: budget of {args.budget:.0f} s spent | | | | | | | | |")
            continue
        a = inputs(rng, S, past, nh, g, d, window, decoder)
        dev = {k: (device.to_device(v) if isinstance(v, np.ndarray) else v) for k, v in a.items()}
        out16, out32 = device.empty((1, S, nh * d), np.float32), device.empty((1, S, nh * d), np.float32)
        call = dict(q=dev["q"], q_pos=dev["q_pos"], cache_k=dev["cache_k"], cache_v=dev["cache_v"], cache_rows=None,
                    n_cache=past, slot_pos=dev["slot_pos"], cache_real=dev["cache_real"], new_k=dev["new_k"],
                    new_v=dev["new_v"], new_pos=dev["new_pos"], new_real=dev["new_real"], window=a["window"],
                    causal=a["causal"])
        l16, l32 = gl.attention_bf16(**call, out=out16), gl.attention(**call, out=out32)
        row_tiles, smem = gl.attention_bf16_plan(S, nh // g, d)
        reps = 1 if args.sim else args.repeats
        t16 = device_ms(device, lambda: device.launch(l16), reps)
        t32 = device_ms(device, lambda: device.launch(l32), reps)
        pairs = float(np.count_nonzero(visibility(a, S, past))) * (S if not a["causal"] else 1) * nh
        flops = 4.0 * d * pairs
        t_torch = float("nan")
        if torch is not None:
            tq = torch.from_numpy(a["q"]).cuda().to(torch.bfloat16).transpose(1, 2)          # (1, nh, S, d)
            keys = np.concatenate([a["cache_k"], a["new_k"]], 2) if past else a["new_k"]
            values = np.concatenate([a["cache_v"], a["new_v"]], 2) if past else a["new_v"]
            tk = torch.from_numpy(keys).cuda().to(torch.bfloat16).repeat_interleave(nh // g, dim=1)
            tv = torch.from_numpy(values).cuda().to(torch.bfloat16).repeat_interleave(nh // g, dim=1)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            if a["causal"] and not a["window"] and not past:
                t_torch = device_ms(device, lambda: sdpa(tq, tk, tv, is_causal=True, scale=1.0), args.repeats)
            else:
                mask = torch.from_numpy(np.ascontiguousarray(visibility(a, S, past))).cuda()
                t_torch = device_ms(device, lambda: sdpa(tq, tk, tv, attn_mask=mask, scale=1.0), args.repeats)
            del tq, tk, tv
        bad = outside_bound(a, device.to_host(out16), S, past)
        lines.append(f"| {name} | {S} x {past + S}, {nh} / {g} x {d} | {16 * row_tiles}, {smem / 1024:.1f} | "
                     f"{t16:.3f} | {flops / t16 / 1e9:.1f} | {t32:.3f} | {t_torch:.3f} | {t16 / t32:.2f} | "
                     f"{t16 / t_torch:.2f} | {bad} |")
    print_table(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
