"""Each compiled kernel of ``diffusiongemma.fast._kernels`` against the reference function it replaces.

Tolerances. The kernels compute the reference's float32 formulas with sums in another order (float64
accumulators for norms and softmax denominators, eight float32 lanes for dot products) and with their own
exp / tanh (within ~2 ulp, ``test_exp_and_tanh_accuracy``). Elementwise results therefore agree to a few
ulp (rtol 1e-6), and reductions of n terms to about n * 2^-24 relative at worst; the bounds below are
stated per test. Edge shapes: widths that are not multiples of the eight-lane vector (1, 3, 13), a canvas
of one position, a window larger than the cache, an expert hit by every token and experts hit by none.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffusiongemma.fast import _kernels as K
from diffusiongemma.reference import layers as ref_layers
from diffusiongemma.reference.config import FULL, SLIDING, RopeParameters
from diffusiongemma.reference.masks import decoder_visibility, encoder_visibility
from diffusiongemma.reference.primitives import apply_rope, embed, gelu_tanh, rms_norm, rope_cos_sin, softcap
from tests.random_weights import make_config

EPS = 1e-6
rng = np.random.default_rng(1234)


def f32(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# ------------------------------------------------------------------------------------------ elementwise
def test_exp_and_tanh_accuracy():
    """The kernels' exp / tanh against float64 over their whole range, including special values."""
    x = np.concatenate([np.linspace(-110, 90, 200_001), np.linspace(-1, 1, 20_001),
                        [-np.inf, np.inf, 0.0, -0.0, 88.72, 88.73, -87.3, -103.9, -104.5]]).astype(np.float32)
    got = np.empty_like(x)
    K.vector_exp(x, got)
    exact = np.exp(x.astype(np.float64))
    finite = np.isfinite(exact) & (exact < np.finfo(np.float32).max) & (exact > np.finfo(np.float32).tiny)
    ulp = np.spacing(exact[finite].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got[finite] - exact[finite]) / ulp) <= 2.0
    assert np.all(got[x == -np.inf] == 0) and np.all(got[x == np.inf] == np.inf) and np.all(got[x == 0] == 1)
    assert np.all(got[x < -104] == 0) and np.all(got[x > 88.73] == np.inf)
    sub = (exact > 1e-45) & (exact < np.finfo(np.float32).tiny)  # subnormal results: absolute error
    assert np.max(np.abs(got[sub] - exact[sub])) <= 2e-45
    nan = np.array([np.nan], dtype=np.float32)
    K.vector_exp(nan, got[:1])
    assert np.isnan(got[0])

    t = np.concatenate([np.linspace(-12, 12, 200_001), [-np.inf, np.inf, 0.0, 0.625, -0.625]]).astype(np.float32)
    got = np.empty_like(t)
    K.vector_tanh(t, got)
    exact = np.tanh(t.astype(np.float64))
    assert np.max(np.abs(got - exact) / np.spacing(np.abs(exact).astype(np.float32) + np.float32(1e-30))) <= 3.0
    K.vector_tanh(nan, got[:1])
    assert np.isnan(got[0])


@pytest.mark.parametrize("D", [1, 3, 13, 64])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(D, weighted):
    x, w = f32(7, D, scale=3.0), (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    out = np.empty_like(x)
    K.rms_norm(x, w if weighted else None, EPS, out)
    np.testing.assert_allclose(out, rms_norm(x, w if weighted else None, EPS), rtol=2e-6, atol=1e-7)
    K.rms_norm(x, w if weighted else None, EPS, x)  # in place
    np.testing.assert_array_equal(x, out)


@pytest.mark.parametrize("D", [5, 64])
def test_residual_and_feed_forward_tails(D):
    h, y, w = f32(6, D), f32(6, D, scale=5.0), (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    scalar = np.float32(0.7)
    expect = (h + rms_norm(y, w, EPS)) * scalar
    got = h.copy()
    K.residual_norm_add(got, y, w, EPS, scalar)
    np.testing.assert_allclose(got, expect, rtol=2e-6, atol=1e-6)
    dense, moe = f32(6, D), f32(6, D, scale=0.1)
    w1, w2 = (1 + 0.3 * rng.standard_normal((2, D))).astype(np.float32)
    expect = (h + rms_norm(rms_norm(dense, w1, EPS) + rms_norm(moe, w2, EPS), w, EPS)) * scalar
    got = h.copy()
    K.feed_forward_residual(got, dense.copy(), moe, w1, w2, w, EPS, scalar)
    np.testing.assert_allclose(got, expect, rtol=5e-6, atol=2e-6)


@pytest.mark.parametrize("I", [1, 3, 17, 96])
def test_gelu_gate(I):
    gate_up = f32(9, 2 * I, scale=4.0)
    out = np.empty((9, I), dtype=np.float32)
    K.gelu_gate(gate_up, out)
    expect = gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]
    # 0.5 x (1 + tanh(y)): an ulp of tanh near -1 (2^-24) moves the result by |x * up| * 2^-24, in
    # both implementations, so the bound is relative to |gate * up| rather than to the result
    bound = 2e-6 * np.abs(expect) + 2.0 ** -22 * np.abs(gate_up[:, :I] * gate_up[:, I:])
    assert np.all(np.abs(out - expect) <= bound)
    with pytest.raises(ValueError, match="gate_up has shape"):
        K.gelu_gate(gate_up[:, :-1].copy(), out)


@pytest.mark.parametrize("V", [1, 7, 129])
def test_softcap_and_softmax(V):
    z = f32(4, V, scale=40.0)
    got = z.copy()
    K.softcap(got, np.float32(30.0))
    np.testing.assert_allclose(got, softcap(z, 30.0), rtol=4e-7, atol=4e-6)  # 30 * (a few ulp of tanh)
    p = np.empty_like(z)
    K.softmax(z, p)
    shifted = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(p, shifted / shifted.sum(-1, keepdims=True), rtol=2e-6, atol=1e-30)
    if V > 1:
        z[0, 0] = -np.inf  # an excluded id gets probability exactly 0
        K.softmax(z, p)
        assert p[0, 0] == 0.0 and np.isclose(p[0].sum(), 1.0)


@pytest.mark.parametrize("normalize", [False, True])
def test_embed(normalize):
    V, H = 11, 13
    table, ids, add = f32(V, H), rng.integers(0, V, size=20), f32(20, H)
    scale = np.float32(np.sqrt(H))
    out = np.empty((20, H), dtype=np.float32)
    K.embed(ids, table, scale, add if normalize else None, normalize, EPS, out)
    expect = embed(ids, table, float(scale))
    if normalize:
        expect = rms_norm(expect + add, None, EPS)
    np.testing.assert_allclose(out, expect, rtol=2e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("kind,d,g", [(SLIDING, 6, 2), (FULL, 8, 1), (FULL, 16, 4)])
def test_heads_match_project_qkv(kind, d, g):
    """q/k/v split, q/k norms, RoPE, value norm (full layers: of the raw keys, trap T3)."""
    n_h, H, N, S = 4, 10, 2, 5
    config = make_config(hidden_size=H, num_attention_heads=n_h, layer_types="F" if kind == FULL else "SF",
                         full_head_dim=d, full_kv_heads=g, sliding_head_dim=d, sliding_kv_heads=g)
    layer = 0
    w = {"q_proj": f32(n_h * d, H), "k_proj": f32(g * d, H), "q_norm": f32(d) + 1, "k_norm": f32(d) + 1}
    if kind == SLIDING:
        w["v_proj"] = f32(g * d, H)
    x = f32(N, S, H)
    positions = np.broadcast_to(np.arange(20, 20 + S), (N, S))
    rope = RopeParameters("default", 1e4) if kind == SLIDING else RopeParameters("proportional", 1e6, 0.5)
    from diffusiongemma.reference.primitives import rope_inverse_frequencies
    omega = rope_inverse_frequencies(rope, d)
    cos, sin = rope_cos_sin(positions, omega)
    q_ref, k_ref, v_ref = ref_layers.project_qkv(x, w, config, layer, cos, sin)
    weights = [w["q_proj"], w["k_proj"]] + ([w["v_proj"]] if kind == SLIDING else [])
    proj = (x.reshape(N * S, H) @ np.concatenate(weights).T).reshape(N, S, -1)
    q, k, v = np.empty((N, S, n_h, d), np.float32), np.empty((N, g, S, d), np.float32), np.empty((N, g, S, d), np.float32)
    K.heads(np.ascontiguousarray(proj), n_h, g, d, kind == SLIDING, w["q_norm"], w["k_norm"], EPS,
            np.ascontiguousarray(cos[0, :, : d // 2]), np.ascontiguousarray(sin[0, :, : d // 2]), q, k, v)
    for got, expect in ((q, q_ref), (k, k_ref), (v, v_ref)):
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=2e-6)


def _reference_attention(q, keys, values, visible):
    return ref_layers.attend(q, keys, values, visible)


def _fast_attention(*args):
    from types import SimpleNamespace

    from diffusiongemma.fast.attention import attend
    from diffusiongemma.fast.model import Workspace

    attend(SimpleNamespace(xp=np, ops=K, workspace=Workspace()), *args)


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("S", [1, 3, 11])
@pytest.mark.parametrize("budget", [None, 40])
def test_attention_decoder(r, S, budget, monkeypatch):
    """Canvas queries over [retained cache (ring order) ++ canvas], bidirectional, GQA without repeats;
    ``budget`` forces the query chunking."""
    from diffusiongemma.fast import attention

    if budget:
        monkeypatch.setattr(attention, "SCORE_BUDGET", budget)
    B, g, d, slots, L = 2, 2, 5, 6, 9
    n_h = g * r
    q = f32(B, S, n_h, d, scale=0.7)
    cache_k, cache_v = f32(B, g, slots, d, scale=0.7), f32(B, g, slots, d)
    slot_pos = (np.arange(L - slots, L) % slots)  # slot of each position
    positions = np.empty(slots, dtype=np.int64)
    positions[slot_pos] = np.arange(L - slots, L)  # ring: slot -> position
    real = (rng.random((B, L)) > 0.3).astype(np.uint8)
    new_k, new_v = f32(B, g, S, d, scale=0.7), f32(B, g, S, d)
    out = np.empty((B, S, n_h * d), dtype=np.float32)
    qpos = np.arange(L, L + S, dtype=np.int64)
    _fast_attention(q, qpos, cache_k, cache_v, np.arange(B, dtype=np.int64), slots, positions, real, new_k, new_v,
                    qpos, np.ones((B, S), np.uint8), 0, False, out)
    order = np.argsort(positions)
    keys = np.concatenate([cache_k[:, :, order], new_k], axis=2)
    values = np.concatenate([cache_v[:, :, order], new_v], axis=2)
    visible = decoder_visibility(real[:, positions[order]].astype(bool), S)
    np.testing.assert_allclose(out, _reference_attention(q, keys, values, visible), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [0, 3, 40])
@pytest.mark.parametrize("budget", [None, 30])
def test_attention_encoder_causal_window_and_padding(window, budget, monkeypatch):
    """Causal encoder attention with a window (also one larger than the cache), padding keys hidden,
    and a padded query with no visible key (zero output, as the reference); ``budget`` forces chunks
    that drop keys outside the window."""
    from diffusiongemma.fast import attention

    if budget:
        monkeypatch.setattr(attention, "SCORE_BUDGET", budget)
    B, g, r, d, L, n = 2, 1, 3, 4, 4, 9
    n_h = g * r
    q = f32(B, n, n_h, d)
    cache_k, cache_v = f32(B, g, L, d), f32(B, g, L, d)
    new_k, new_v = f32(B, g, n, d), f32(B, g, n, d)
    real = np.ones((B, L + n), dtype=np.uint8)
    real[1, :L + 2] = 0  # row 1: everything up to position L+1 is padding
    qpos = np.arange(L, L + n, dtype=np.int64)
    out = np.empty((B, n, n_h * d), dtype=np.float32)
    _fast_attention(q, qpos, cache_k, cache_v, np.arange(B, dtype=np.int64), L, np.arange(L, dtype=np.int64), real,
                    new_k, new_v, qpos, np.ascontiguousarray(real[:, L:]), window, True, out)
    keys, values = np.concatenate([cache_k, new_k], 2), np.concatenate([cache_v, new_v], 2)
    visible = encoder_visibility(qpos, np.arange(L + n), real.astype(bool), window or None)
    expect = _reference_attention(q, keys, values, visible)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=2e-6)
    assert not out[1, :2].any()  # queries at L, L+1 of row 1 see no real key
    # a full layer encoding straight into its cache: every key in cache slots, none "new"
    slots_k, slots_v = np.concatenate([cache_k, new_k], 2), np.concatenate([cache_v, new_v], 2)
    none = np.zeros((B, g, 0, d), np.float32)
    _fast_attention(q, qpos, slots_k, slots_v, np.arange(B, dtype=np.int64), L + n, np.arange(L + n, dtype=np.int64),
                    real, none, none, qpos[:0], real[:, :0].copy(), 0, True, out)
    visible = encoder_visibility(qpos, np.arange(L + n), real.astype(bool), None)
    np.testing.assert_allclose(out, _reference_attention(q, keys, values, visible), rtol=1e-5, atol=2e-6)


# ------------------------------------------------------------------------------------------ experts
def _expert_weights(E, H, I):
    return {"router.proj": f32(E, H), "router.scale": f32(H) + 1, "router.per_expert_scale": f32(E) + 1,
            "experts.gate_up_proj": f32(E, 2 * I, H, scale=0.3), "experts.down_proj": f32(E, H, I, scale=0.3)}


def _fast_experts(x, indices, weights, w):
    M, H = x.shape
    Kk = indices.shape[1]
    E = w["experts.gate_up_proj"].shape[0]
    offsets, order, position = np.empty(E + 1, np.int64), np.empty(M * Kk, np.int64), np.empty((M, Kk), np.int64)
    K.group_by_expert(indices, offsets, order, position)
    grouped = np.empty((M * Kk, H), np.float32)
    K.gather_rows(x, order, grouped)
    I2 = w["experts.gate_up_proj"].shape[1]
    gu, act, y = np.empty((M * Kk, I2), np.float32), np.empty((M * Kk, I2 // 2), np.float32), np.empty((M * Kk, H), np.float32)
    for e in range(E):
        a, b = offsets[e], offsets[e + 1]
        gu[a:b] = grouped[a:b] @ w["experts.gate_up_proj"][e].T
    K.gelu_gate(gu, act)
    for e in range(E):
        a, b = offsets[e], offsets[e + 1]
        y[a:b] = act[a:b] @ w["experts.down_proj"][e].T
    out = np.empty((M, H), np.float32)
    K.combine_experts(y, indices, position, weights, out)
    return out, offsets


def test_route_matches_reference_including_ties():
    E, Kk, H = 6, 3, 8
    config = make_config(hidden_size=H, num_experts=E, top_k_experts=Kk)
    w = _expert_weights(E, H, 4)
    h = f32(10, H)
    idx_ref, wts_ref = ref_layers.route(h, w, config)
    z = rms_norm(h, None, EPS) * w["router.scale"] * np.float32(H ** -0.5)
    logits = z @ w["router.proj"].T
    idx, wts = np.empty((10, Kk), np.int64), np.empty((10, Kk), np.float32)
    K.route(np.ascontiguousarray(logits), w["router.per_expert_scale"], idx, wts)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_allclose(wts, wts_ref, rtol=2e-6)
    tied = np.zeros((2, E), np.float32)  # all tied: the lower expert index first (trap T25; torch leaves it undefined)
    K.route(tied, w["router.per_expert_scale"], idx[:2], wts[:2])
    np.testing.assert_array_equal(idx[:2], [[0, 1, 2], [0, 1, 2]])


@pytest.mark.parametrize("case", ["random", "one_expert_for_all", "some_unused", "top1_of_1"])
def test_expert_dispatch_matches_reference(case):
    E, H, I, M = (1, 6, 3, 5) if case == "top1_of_1" else (5, 6, 3, 9)
    Kk = 1 if case == "top1_of_1" else 2
    w = _expert_weights(E, H, I)
    x = f32(M, H)
    if case == "random":
        indices = np.stack([rng.choice(E, Kk, replace=False) for _ in range(M)])
    elif case == "one_expert_for_all":  # expert 3 is every token's second choice
        indices = np.stack([[int(rng.choice([0, 1, 2, 4])), 3] for _ in range(M)])
    elif case == "some_unused":  # experts 1 and 4 are hit by no token
        indices = np.stack([rng.choice([0, 2, 3], Kk, replace=False) for _ in range(M)])
    else:
        indices = np.zeros((M, 1), np.int64)
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    weights = rng.uniform(0.1, 2.0, indices.shape).astype(np.float32)
    got, offsets = _fast_experts(x, indices, weights, w)
    np.testing.assert_allclose(got, ref_layers.experts(x, indices, weights, w), rtol=1e-5, atol=1e-6)
    counts = np.diff(offsets)
    np.testing.assert_array_equal(counts, np.bincount(indices.ravel(), minlength=E))


def test_parallel_and_serial_paths_agree():
    """With two OpenMP threads and every kernel forced parallel (threshold 0), results are bit-identical
    to the serial path: work is split by rows and no reduction crosses rows."""
    from threadpoolctl import threadpool_limits

    x, w = f32(64, 33), f32(33) + 1
    z = f32(40, 300, scale=5.0)
    S = 9
    qpos = np.arange(S, dtype=np.int64)
    outs = []
    for threshold in (1e30, 0.0):
        previous = K.set_parallel_threshold(threshold)
        try:
            with threadpool_limits(limits=2, user_api="openmp"):
                a = np.empty_like(x)
                K.rms_norm(x, w, EPS, a)
                p = np.empty_like(z)
                K.softmax(z, p)
                c = z.copy()
                K.softcap(c, np.float32(30))
                att = (z[:36, :S] * 3).copy()  # 4 heads x 9 queries
                K.masked_softmax(att, qpos, qpos, np.ones(S, np.uint8), 4, True)
                probs, draft, H, sampled, flags = (np.empty_like(z), np.empty(40, np.int64), np.empty(40, np.float32),
                                                   np.empty(40, np.int64), np.zeros(40, np.intc))
                K.sample_rows(z, probs, np.arange(40, dtype=np.int64), 0.7, np.linspace(0, 0.99, 40),
                              np.empty((2, K.sampling_scratch_width(300)), np.float32), draft, H, sampled, flags)
                outs.append((a, p, c, att, probs, draft, H, sampled))
        finally:
            K.set_parallel_threshold(previous)
    for serial, parallel in zip(*outs):
        np.testing.assert_array_equal(serial, parallel)
