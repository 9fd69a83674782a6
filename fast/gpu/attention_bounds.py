"""The interval a bfloat16 attention output may lie in for any float32 summation order: the bound
``dg_attention_bf16`` (fast/gpu/cuda/attention_bf16.cu) is held to on cuda-sim by tests/test_gpu_attention_bf16.py
(whose docstring derives it step by step) and that benchmarks/bench_attention_bf16.py counts on a GPU.
"""

from __future__ import annotations

import numpy as np

from diffusiongemma.reference.primitives import BFLOAT16, round_to

f32, f64 = np.float32, np.float64
U = 2.0 ** -23  # float32's relative rounding error bound


def bf16(x) -> np.ndarray:
    return round_to(np.asarray(x, f32), BFLOAT16)


def interval(q, keys, values, visible) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) (B, S, nh * d) float32: the bfloat16 outputs any correct summation order may give (the
    derivation: tests/test_gpu_attention_bf16.py). q (B, S, nh, d), keys and values (B, g, T, d) bfloat16
    values in float32, visible (B, S, T) bool."""
    B, S, nh, d = q.shape
    g, T = keys.shape[1], keys.shape[2]
    r = nh // g
    q64 = q.astype(f64).reshape(B, S, g, r, d).transpose(0, 2, 3, 1, 4)         # (B, g, r, S, d)
    k64 = keys.astype(f64)[:, :, None]                                          # (B, g, 1, T, d)
    dot = q64 @ k64.swapaxes(-1, -2)                                            # (B, g, r, S, T)
    e_s = (2 * (-(-d // 16) * 16) + 16) * U * (np.abs(q64) @ np.abs(k64).swapaxes(-1, -2))
    mask = np.broadcast_to(visible[:, None, None], dot.shape)
    s_lo = np.where(mask, bf16((dot - e_s).astype(f32)).astype(f64), -np.inf)
    s_hi = np.where(mask, bf16((dot + e_s).astype(f32)).astype(f64), -np.inf)
    top = np.max(s_hi, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    E_lo, E_hi = np.exp(s_lo - top), np.exp(s_hi - top)
    A_lo, A_hi = E_lo.sum(-1, keepdims=True), E_hi.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        P_lo = np.where(mask, E_lo / (E_lo + np.maximum(A_hi - E_hi, 0.0)), 0.0)
        P_hi = np.where(mask, E_hi / (E_hi + np.maximum(A_lo - E_lo, 0.0)), 0.0)
    delta = (2 * T + 256) * U
    p_lo = np.where(mask, bf16(np.maximum(P_lo * (1 - delta) - 2.0 ** -140, 0.0).astype(f32)), 0.0).astype(f64)
    p_hi = np.where(mask, bf16(np.minimum(P_hi * (1 + delta) + 2.0 ** -140, 1.0).astype(f32)), 0.0).astype(f64)
    v64 = values.astype(f64)[:, :, None]                                        # (B, g, 1, T, d)
    # sum_t min(p_lo v, p_hi v) = sum_t (p_lo v+ - p_hi v-) with v = v+ - v- (p_lo <= p_hi, both >= 0)
    vp, vn = np.maximum(v64, 0.0), np.maximum(-v64, 0.0)
    o_lo = p_lo @ vp - p_hi @ vn
    o_hi = p_hi @ vp - p_lo @ vn
    T_pad = -(-T // 32) * 32
    e_o = (2 * T_pad + 16) * U * (p_hi @ np.abs(v64))
    lo = bf16((o_lo - e_o).astype(f32))
    hi = bf16((o_hi + e_o).astype(f32))
    back = lambda x: x.transpose(0, 3, 1, 2, 4).reshape(B, S, nh * d)  # noqa: E731
    return back(lo), back(hi)
