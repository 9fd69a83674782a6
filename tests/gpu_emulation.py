"""A CPU stand-in for the GPU device of ``diffusiongemma.fast.gpu``: NumPy arrays and a NumPy version of
every CUDA kernel, reading its packed arguments exactly as the kernel does (flat C-contiguous memory,
sizes and strides from the scalar arguments).

It lets the tests run all of ``fast/gpu.py`` (weights upload, cache, encoder, decoder, the generation
loop, every launch's geometry and argument list) on a machine with no GPU. The emulations state what each
kernel must compute; the GPU tests (tests/test_gpu_equivalence.py) check the real kernels against the
reference model on a GPU. The emulated sampling pass uses the reference's own functions for the
distribution, the entropy and the draw, so the generation loop can be compared with the reference loop
bit for bit.
"""

from __future__ import annotations

import contextlib

import numpy as np

from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.reference import sampling as S
from diffusiongemma.reference.primitives import gelu_tanh


def _rms(x: np.ndarray, eps) -> np.ndarray:
    """(…, D) -> (…, 1) float32 factor (mean(x^2) + eps)^-1/2."""
    return np.power(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps), np.float32(-0.5))


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (…, S, heads, d) with cos, sin (S, d/2): rotate-half."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


# ------------------------------------------------------------------------------------------------ kernels
def dg_rms_norm(x, w_opt, post, out, rows, dim, eps):
    X = x.reshape(-1)[: rows * dim].reshape(rows, dim)
    v = X * _rms(X, eps)
    if w_opt is not None:
        v = v * w_opt
    out.reshape(-1)[: rows * dim] = (v * post).reshape(-1)


def dg_residual_norm(h, y, w, scalar, rows, dim, eps):
    Hh, Y = h.reshape(rows, dim), y.reshape(rows, dim)
    Hh[:] = (Hh + (Y * _rms(Y, eps)) * w) * scalar


def dg_ffn_tail(h, dense, moe, w_dense, w_moe, w_out, scalar, rows, dim, eps):
    Hh, D, M = h.reshape(rows, dim), dense.reshape(rows, dim), moe.reshape(rows, dim)
    D[:] = (D * _rms(D, eps)) * w_dense + (M * _rms(M, eps)) * w_moe
    Hh[:] = (Hh + (D * _rms(D, eps)) * w_out) * scalar


def dg_embed(ids, table, scale, add_opt, normalize, out, rows, dim, eps):
    assert ids.min() >= 0 and ids.max() < table.shape[0], "token id out of range reached the kernel"
    O = table.reshape(-1, dim)[ids[:rows]] * scale
    if add_opt is not None:
        O = O + add_opt.reshape(rows, dim)
    if normalize:
        O = O * _rms(O, eps)
    out.reshape(rows, dim)[:] = O


def dg_softcap(x, n, cap):
    flat = x.reshape(-1)
    flat[:n] = cap * np.tanh(flat[:n] / cap)


def dg_gated_gelu(gu, out, rows, inner):
    G = gu.reshape(rows, 2 * inner)
    out.reshape(rows, inner)[:] = gelu_tanh(G[:, :inner]) * G[:, inner:]


def dg_qkv_heads(proj, tokens, S_, n_heads, n_kv, d, has_v, q_norm, k_norm, cos_t, sin_t, q_out, k_out, v_out, eps):
    B = tokens // S_
    P = proj.reshape(tokens, -1)
    assert P.shape[1] == (n_heads + (2 if has_v else 1) * n_kv) * d
    q = P[:, : n_heads * d].reshape(B, S_, n_heads, d)
    k_raw = P[:, n_heads * d:(n_heads + n_kv) * d].reshape(B, S_, n_kv, d)
    v_raw = P[:, (n_heads + n_kv) * d:].reshape(B, S_, n_kv, d) if has_v else k_raw
    cos, sin = cos_t.reshape(S_, d // 2), sin_t.reshape(S_, d // 2)
    q_out.reshape(B, S_, n_heads, d)[:] = _rope(q * _rms(q, eps) * q_norm, cos, sin)
    k = _rope(k_raw * _rms(k_raw, eps) * k_norm, cos, sin)
    k_out.reshape(B, n_kv, S_, d)[:] = k.transpose(0, 2, 1, 3)
    v_out.reshape(B, n_kv, S_, d)[:] = (v_raw * _rms(v_raw, eps)).transpose(0, 2, 1, 3)


def dg_attention(q, q_pos, S_, n_heads, d, cache_k_opt, cache_v_opt, cache_rows_opt, n_cache, slots, slot_pos_opt,
                 cache_real_opt, real_stride, new_k_opt, new_v_opt, n_new, new_pos_opt, new_real_opt, n_kv, window,
                 causal, q_block, key_tile, out):
    r = n_heads // n_kv
    rows_cap = (gl.const("DG_ATT_THREADS") // 32) * gl.const("DG_ATT_ROWS_PER_WARP")
    assert 1 <= q_block * r <= rows_cap and 32 % key_tile == 0 and d % (32 // key_tile) == 0
    N = q.size // (S_ * n_heads * d)
    Q = q.reshape(N, S_, n_heads, d)
    O = out.reshape(N, S_, n_heads * d)
    qp = q_pos[:S_]
    for n in range(N):
        keys, values, pos, real = [], [], [], []
        if n_cache > 0:
            crow = int(cache_rows_opt[n]) if cache_rows_opt is not None else n
            CK = cache_k_opt.reshape(-1, n_kv, slots, d)
            CV = cache_v_opt.reshape(-1, n_kv, slots, d)
            p = slot_pos_opt[:n_cache]
            creal = cache_real_opt.reshape(-1, real_stride)[crow]
            keys.append(CK[crow, :, :n_cache])
            values.append(CV[crow, :, :n_cache])
            pos.append(p)
            real.append((p >= 0) & (creal[np.clip(p, 0, None)] != 0))
        if n_new > 0:
            keys.append(new_k_opt.reshape(N, n_kv, n_new, d)[n])
            values.append(new_v_opt.reshape(N, n_kv, n_new, d)[n])
            pos.append(new_pos_opt[:n_new])
            real.append(new_real_opt.reshape(N, n_new)[n] != 0)
        K, Vv = np.concatenate(keys, axis=1), np.concatenate(values, axis=1)  # (g, T, d)
        pos, real = np.concatenate(pos), np.concatenate(real)
        vis = real[None, :] & np.ones((S_, 1), dtype=bool)
        if causal:
            vis &= pos[None, :] <= qp[:, None]
        if window > 0:
            vis &= pos[None, :] > qp[:, None] - window
        for h in range(n_heads):
            j = h // r
            scores = Q[n, :, h] @ K[j].T  # (S, T)
            scores = np.where(vis, scores, -np.inf)
            peak = scores.max(axis=-1, keepdims=True)
            peak = np.where(np.isfinite(peak), peak, 0.0)
            e = np.exp(scores - peak)
            total = e.sum(axis=-1, keepdims=True)
            P = e / np.where(total > 0, total, 1.0)
            O[n, :, h * d:(h + 1) * d] = P.astype(np.float32) @ Vv[j]


def dg_router(probs, per_expert_scale, indices, weights, N, E, K):
    P = probs.reshape(N, E)
    z = P - P.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    top_p = np.take_along_axis(p, top, axis=-1)
    indices.reshape(N, K)[:] = top
    weights.reshape(N, K)[:] = top_p / top_p.sum(axis=-1, keepdims=True) * per_expert_scale[top]
    np.put_along_axis(p, top, -1.0, axis=-1)
    P[:] = p


def dg_group_experts(indices, N, K, E, offsets, row_token, choice_row, tile_expert, max_tiles):
    tm = gl.const("DG_GEMM_TM")
    flat = indices.reshape(-1)[: N * K]
    counts = np.bincount(flat, minlength=E)[:E]
    padded = -(-counts // tm) * tm
    offsets[0] = 0
    offsets[1:] = np.cumsum(padded)
    assert offsets[E] <= max_tiles * tm, "grouped rows overflow the buffers"
    row_token[:] = -1
    tile_expert[:] = -1
    cr = choice_row.reshape(-1)
    for e in range(E):
        chosen = np.flatnonzero(flat == e)
        rows = offsets[e] + np.arange(chosen.size)
        row_token[rows] = chosen // K
        cr[chosen] = rows
        tile_expert[offsets[e] // tm: offsets[e + 1] // tm] = e


def dg_gather_rows(src, row_token, dst, rows, dim):
    D = dst.reshape(rows, dim)
    t = row_token[:rows]
    D[:] = 0.0
    D[t >= 0] = src.reshape(-1, dim)[t[t >= 0]]


def dg_grouped_gemm_nt(x, w, tile_group, y, m_tiles, n_out, k_dim):
    tm = gl.const("DG_GEMM_TM")
    X, Y = x.reshape(m_tiles * tm, k_dim), y.reshape(m_tiles * tm, n_out)
    W = w.reshape(-1, n_out, k_dim)
    for m in range(m_tiles):
        g = tile_group[m]
        if g >= 0:
            Y[m * tm:(m + 1) * tm] = X[m * tm:(m + 1) * tm] @ W[g].T


def dg_combine_experts(expert_out, indices, choice_row, weights, out, N, K, dim):
    Y = expert_out.reshape(-1, dim)
    I, Rw, Wt = indices.reshape(N, K), choice_row.reshape(N, K), weights.reshape(N, K)
    O = out.reshape(N, dim)
    for t in range(N):
        acc = np.zeros(dim, dtype=np.float32)
        for k in np.argsort(I[t], kind="stable"):
            acc = acc + Y[Rw[t, k]] * Wt[t, k]
        O[t] = acc


def dg_sample_rows(logits, rows, n_rows, vocab, cap, temp, uniforms_opt, argmax, entropy, sampled, flags):
    Z = logits.reshape(-1, vocab)
    r = rows[:n_rows].astype(np.int64)
    x = Z[r]
    if cap > 0:
        x = cap * np.tanh(x / cap)
    if temp > 0:
        x = x / temp
    f = np.where(np.isnan(x).any(-1), 1, 0) | np.where(np.isposinf(x).any(-1), 2, 0)
    f = np.where((f == 0) & np.isneginf(x).all(-1), 4, f)
    flags[:n_rows] = f
    ok = f == 0
    if not ok.any():
        return
    probs, ent = S.softmax_and_entropy(x[ok])
    argmax[:n_rows][ok] = S.argmax_tokens(x[ok])
    entropy[:n_rows][ok] = ent
    Z[r[ok]] = probs
    if uniforms_opt is not None:
        sampled[:n_rows][ok] = S.categorical_from_uniform(probs, uniforms_opt[:n_rows][ok])


def dg_accept_renoise(entropy, sampled, noise, C, bound, accepted, next_canvas):
    nb = entropy.size // C
    A = S.entropy_bound_accept(entropy.reshape(nb, C), bound)
    accepted.reshape(nb, C)[:] = A
    next_canvas.reshape(nb, C)[:] = S.renoise(sampled.reshape(nb, C), A, noise.reshape(nb, C))


EMULATIONS = {name: fn for name, fn in globals().items() if name.startswith("dg_")}


# ------------------------------------------------------------------------------------------------ device
class EmulatedDevice:
    """The device protocol of ``fast.gpu`` on NumPy: every launch is checked and recorded, then emulated.

    ``launches``: the ``gpu_launch.Launch`` objects in order. ``allocations``: (shape, dtype) of every
    ``empty``/``zeros``. ``empty`` fills float arrays with NaN and integer arrays with -7777, so a kernel
    emulation or a host step that reads memory nobody wrote shows up as NaN or a bad index.
    """

    xp = np
    name = "emulated"

    def __init__(self):
        self.launches: list[gl.Launch] = []
        self.allocations: list[tuple[tuple, np.dtype]] = []

    def context(self):
        return contextlib.nullcontext()

    def launch(self, launch: gl.Launch) -> None:
        assert isinstance(launch, gl.Launch)
        sig = gl.signatures()[launch.kernel]
        assert len(sig) == len(launch.args)
        for p, a in zip(sig, launch.args):
            if p.kind == "scalar":
                assert type(a) is p.dtype.type, (launch.kernel, p.name, type(a))
        self.launches.append(launch)
        EMULATIONS[launch.kernel](*launch.args)

    def empty(self, shape, dtype):
        shape = tuple(int(s) for s in (shape if isinstance(shape, tuple) else (shape,)))
        self.allocations.append((shape, np.dtype(dtype)))
        fill = np.nan if np.dtype(dtype).kind == "f" else (-7777 if np.dtype(dtype).itemsize > 1 else 77)
        return np.full(shape, fill, dtype=dtype)

    def zeros(self, shape, dtype):
        shape = tuple(int(s) for s in (shape if isinstance(shape, tuple) else (shape,)))
        self.allocations.append((shape, np.dtype(dtype)))
        return np.zeros(shape, dtype=dtype)

    def to_device(self, array):
        return np.array(array, copy=True, order="C")

    def to_host(self, array):
        return np.array(array, copy=True)

    def synchronize(self) -> None:
        pass
