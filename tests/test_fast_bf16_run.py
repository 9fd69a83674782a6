"""The fast CPU path's bfloat16 run (``fast.Model(..., dtype="bfloat16")``) against the reference's
(``reference.Model(..., dtype="bfloat16")``, docs/SPEC.md §10.1 B1-B9).

Tiny models from ``diffusiongemma.tiny`` (every norm weight, scale and layer scalar redrawn). Three levels:

* each kernel's ``bf16`` flag against the reference's rounding points: bit for bit where the float32
  arithmetic before a rounding is the same on both sides. Where it is not, the one difference is named and
  bounded: the kernels' RMSNorm factor sums its squares in float64 (the reference in float32), their exp and
  GELU are their own single-precision forms, their products sum in their own order. Each makes a float32
  value that differs from the reference's by a few float32 ulps, far below a bfloat16 spacing; rounding to
  nearest is monotone, so the two rounded values are equal or adjacent bfloat16 numbers (``adjacent``),
  and the test also checks that adjacent ones are rare. The fused kernels are checked by composing the
  reference's rounding steps on the kernel's own norm (``K.rms_norm(..., bf16=True)``), so that every
  rounding point they fuse is compared bit for bit;
* whole calls (prompt encode, decoder step without and with self-conditioning, incremental encode), with
  the criterion max|fast bf16 - ref bf16| <= 1/8 max|ref bf16 - ref fp32|. A call above it must be a
  near-tied router choice flipped by one such adjacent rounding: replaying the reference's expert choices
  (``ReplayedRouting``) brings it within 1/8;
* ``generate``: the fast backend's self-conditioning chain (B8) gives the tokens of the reference's loop on
  the same bfloat16 model; the share of seeds whose tokens equal the bfloat16 reference's is printed (a
  free run parts at the first flipped rounding, benchmarks/RESULTS_bf16.md §2) and must be at least the
  float32 reference's share.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from diffusiongemma import fast
from diffusiongemma.fast import _kernels as K
from diffusiongemma.fast.experts import pack_panels
from diffusiongemma.fast.model import CpuOps
from diffusiongemma.reference import primitives as P
from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.generate import generate
from diffusiongemma.reference.layers import attend, lower_index_top_k
from diffusiongemma.reference.model import Model as Ref
from diffusiongemma.reference.support.errors import ConfigError
from diffusiongemma.tiny import make_config, random_tensors

BF = P.BFLOAT16
EPS = np.float32(1e-6)


def rb(x) -> np.ndarray:
    """The reference's rounding (``round_to``) of a float32 array."""
    return P.round_to(np.asarray(x, dtype=np.float32), BF)


def spacing(x) -> np.ndarray:
    """The bfloat16 spacing at |x|: 2**(e - 7) for 2**e <= |x| < 2**(e + 1) (the subnormal spacing near 0)."""
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -126)))
    return 2.0 ** (e - 7)


def assert_adjacent(mine, ref, rare: float = 0.02) -> None:
    """Equal or adjacent bfloat16 numbers everywhere, and unequal at most at a share ``rare``."""
    mine, ref = np.asarray(mine, np.float64), np.asarray(ref, np.float64)
    assert np.array_equal(np.isnan(mine), np.isnan(ref))
    d = np.abs(mine - ref)
    assert (d <= np.maximum(spacing(mine), spacing(ref))).all(), float((d / spacing(ref)).max())
    assert np.mean(d > 0) <= rare, np.mean(d > 0)


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def bf16_values(rng, shape, scale=1.0) -> np.ndarray:
    return rb(rng.standard_normal(shape) * scale)


# ------------------------------------------------------------------------------------------ the rounding
def test_round_bf16_is_round_to_bit_for_bit():
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2 ** 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF, 0x7F800000, 0xFF800000,  # NaN, inf
                        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # overflow to inf, or not
                        0x00000001, 0x00008000, 0x00018000, 0x807FFFFF, 0, 0x80000000,  # subnormals, zeros
                        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001], dtype=np.uint32)  # ties, near ties
    x = np.concatenate([patterns, special]).view(np.float32).reshape(-1, 4).copy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ml_dtypes warns on NaN casts
        expected = rb(x)
    y = x.copy()
    K.round_bf16(y)
    assert np.array_equal(bits(y), bits(expected))  # NaN included: the quiet NaN of its sign, as ml_dtypes
    out = np.empty(x.shape, np.uint16)
    K.bf16_bits_of(x, 0.0, out)
    assert np.array_equal(out, (bits(expected) >> 16).astype(np.uint16))


def test_bf16_bits_of_processed_logits():
    rng = np.random.default_rng(1)
    z = (rng.standard_normal((6, 300)) * 20).astype(np.float32)
    out = np.empty(z.shape, np.uint16)
    K.bf16_bits_of(z, np.float32(0.8), out)
    assert np.array_equal(out, (bits(rb(z / np.float32(0.8))) >> 16).astype(np.uint16))


# ------------------------------------------------------------------------------------------ kernel flags
def test_rms_norm_flag():
    rng = np.random.default_rng(2)
    x, w = bf16_values(rng, (64, 96), 3.0), bf16_values(rng, (96,)) + 1
    out, plain = np.empty_like(x), np.empty_like(x)
    K.rms_norm(x, w, EPS, out, True)
    K.rms_norm(x, w, EPS, plain)
    assert np.array_equal(bits(out), bits(rb(plain)))  # the flag rounds the float32 kernel's output, no more
    assert_adjacent(out, P.rms_norm(x, w, EPS, BF))  # float64 against float32 sum of squares
    K.rms_norm(x, None, EPS, out, True)
    assert_adjacent(out, P.rms_norm(x, None, EPS, BF))


def test_heads_flag_rope_and_norms():
    rng = np.random.default_rng(3)
    N, S, n_h, g, d = 2, 5, 4, 2, 16
    proj = bf16_values(rng, (N, S, (n_h + 2 * g) * d), 2.0)
    qn, kn = bf16_values(rng, (d,)) + 1, bf16_values(rng, (d,)) + 1
    omega = P.rope_inverse_frequencies(make_config().rope_parameters["sliding_attention"], d)
    positions = np.arange(40, 40 + S)
    cos_full, sin_full = P.rope_cos_sin(positions[None], omega, BF)  # (1, S, d): the reference's tables
    cos, sin = np.ascontiguousarray(cos_full[0, :, :d // 2]), np.ascontiguousarray(sin_full[0, :, :d // 2])
    q, k, v = (np.empty((N, S, n_h, d), np.float32), np.empty((N, g, S, d), np.float32),
               np.empty((N, g, S, d), np.float32))
    K.heads(proj, n_h, g, d, True, qn, kn, EPS, cos, sin, q, k, v, True)

    def normed(block, weight):  # the kernel's own norm (bounded by test_rms_norm_flag), rounded
        flat = np.ascontiguousarray(block.reshape(-1, d))
        out = np.empty_like(flat)
        K.rms_norm(flat, weight, EPS, out, True)
        return out.reshape(block.shape)

    cs = (np.broadcast_to(cos_full, (N, S, d)), np.broadcast_to(sin_full, (N, S, d)))
    q_ref = P.apply_rope(normed(proj[..., :n_h * d].reshape(N, S, n_h, d), qn), *cs, BF)
    k_raw = proj[..., n_h * d:(n_h + g) * d].reshape(N, S, g, d)
    k_ref = P.apply_rope(normed(k_raw, kn), *cs, BF).transpose(0, 2, 1, 3)
    v_ref = normed(proj[..., (n_h + g) * d:].reshape(N, S, g, d), None).transpose(0, 2, 1, 3)
    for mine, ref in ((q, q_ref), (k, k_ref), (v, v_ref)):
        assert np.array_equal(bits(mine), bits(ref))


def test_gelu_gate_flag():
    rng = np.random.default_rng(4)
    gu = bf16_values(rng, (64, 2 * 80), 3.0)
    out = np.empty((64, 80), np.float32)
    K.gelu_gate(gu, out, True)
    g, u = gu[:, :80], gu[:, 80:]
    ref = rb(P.gelu_tanh(g, BF) * u)
    # the kernel's GELU x / (1 + exp(-2y)) and the reference's 0.5 x (1 + tanh y) differ by a few float32
    # ulps, plus the reference's own cancellation where tanh y is near -1 (at most |x| 2^-23 absolute):
    # the rounded GELUs are within one spacing plus that, the product within |u| times it plus one spacing
    gelu_bound = spacing(P.gelu_tanh(g, BF)) + np.abs(g) * 2.0 ** -22
    assert (np.abs(out - ref) <= np.abs(u) * gelu_bound + spacing(ref)).all()
    body = g > -3  # outside the reference's cancellation tail the two GELUs round alike: bit for bit
    assert np.array_equal(bits(out[body]), bits(ref[body])) and body.mean() > 0.8
    plain_gelu = np.empty_like(out)
    K.gelu_gate(np.concatenate([g, np.ones_like(u)], axis=1), plain_gelu, True)  # bf16(bf16(gelu) * 1)
    assert np.array_equal(bits(out), bits(rb(plain_gelu * u)))  # the product's rounding, bit for bit


def test_masked_softmax_flag_against_attend():
    rng = np.random.default_rng(5)
    S, T, d = 6, 40, 16
    q, keys = np.zeros((1, S, 1, T), np.float32), np.zeros((1, 1, T, T), np.float32)  # head dim T (values = I)
    q[..., :d] = rng.integers(-16, 17, (1, S, 1, d)) / 32  # exact float32 scores of up to 14 bits:
    keys[..., :d] = rng.integers(-16, 17, (1, 1, T, d)) / 32  # their bfloat16 rounding is exercised
    scores = (q[0, :, 0] @ keys[0, 0].T).astype(np.float32)  # (S, T), exact
    assert not np.array_equal(rb(scores), scores)
    key_pos = np.arange(T, dtype=np.int64)
    q_pos = np.arange(T - S, T, dtype=np.int64)
    real = np.ones(T, np.uint8)
    mine = scores.copy()
    K.masked_softmax(mine, q_pos, key_pos, real, 8, True, True)
    visible = ((key_pos[None] <= q_pos[:, None]) & (key_pos[None] > q_pos[:, None] - 8))[None]
    eye = np.eye(T, dtype=np.float32)[None, None]  # values = identity: attend returns its rounded weights
    ref = attend(q, keys, eye, visible, BF)[0]  # (S, T)
    assert_adjacent(mine, ref, rare=0.05)  # the kernel's exp and float64 sum against NumPy's float32
    assert set(np.unique(mine[~visible[0]])) == {0.0}


def _norm_bf16(x, w):
    out = np.empty_like(x)
    K.rms_norm(np.ascontiguousarray(x), w, EPS, out, True)
    return out


def test_residual_kernels_flags():
    rng = np.random.default_rng(6)
    M, H = 12, 64
    h, y, dense, moe = (bf16_values(rng, (M, H), s) for s in (4.0, 1.0, 2.0, 3.0))
    w, w1, w2, wo = (bf16_values(rng, (H,)) + 1 for _ in range(4))
    scalar = np.float32(rb(np.float32(0.7734)))
    mine = h.copy()
    K.residual_norm_add(mine, y, w, EPS, np.float32(1.0), True)
    assert np.array_equal(bits(mine), bits(rb(h + _norm_bf16(y, w))))  # Model._block_tail's first sum
    mine, d2 = h.copy(), dense.copy()
    assert K.feed_forward_residual(mine, d2, moe, w1, w2, wo, EPS, scalar, True) == 0
    branch = _norm_bf16(rb(_norm_bf16(dense, w1) + _norm_bf16(moe, w2)), wo)  # layers.feed_forward's end
    assert np.array_equal(bits(mine), bits(rb(rb(h + branch) * scalar)))  # and _block_tail's


def test_embed_flag():
    rng = np.random.default_rng(7)
    V, H = 50, 48  # sqrt(48) = 6.928 is no bfloat16 number: the scale rounds to 6.9375 (B1)
    table = bf16_values(rng, (V, H))
    ids = rng.integers(0, V, 20).astype(np.int64)
    scale = np.float32(np.sqrt(np.float32(H)))
    out = np.empty((20, H), np.float32)
    K.embed(ids, table, rb(scale), None, False, EPS, out, True)
    # bit-exact: a lookup and an elementwise scale on both sides: no sum
    assert np.array_equal(bits(out), bits(P.embed(ids, table, scale, BF)))
    signal = bf16_values(rng, (20, H))
    K.embed(ids, table, rb(scale), signal, True, EPS, out, True)
    summed = rb(P.embed(ids, table, scale, BF) + signal)  # Model.canvas_input's sum, then its norm
    # bit-exact: the embedding's norm is the same rms_norm kernel as _norm_bf16's (one sum order)
    assert np.array_equal(bits(out), bits(_norm_bf16(summed, None)))


def test_expert_kernels_flags():
    rng = np.random.default_rng(8)
    E, I, H, R = 3, 32, 64, 14
    gate_up, down = bf16_values(rng, (E, 2 * I, H), 0.1), bf16_values(rng, (E, H, I), 0.1)
    x = bf16_values(rng, (R, H))
    offsets = np.array([0, 5, 5, R], np.int64)  # expert 1 gets no rows
    gp, dp = pack_panels(gate_up.astype(BF)), pack_panels(down.astype(BF))  # bfloat16 panels, as loaded
    gu_buf, act, y = np.empty((R, 2 * I), np.float32), np.empty((R, I), np.float32), np.empty((R, H), np.float32)
    K.expert_ffn(x, offsets, gp, dp, I, gu_buf, act, y, None, None, True)
    for e in range(E):
        rows = slice(offsets[e], offsets[e + 1])
        if offsets[e] == offsets[e + 1]:
            continue
        first = np.empty((offsets[e + 1] - offsets[e], 2 * I), np.float32)
        K.panel_matmul(x[rows], gp[e], 2 * I, first)
        # the kernel's float32 product (a fused multiply-add chain in k order) against the reference's BLAS
        # product: rounded, equal or adjacent (test_fast_experts bounds the float32 sums' difference)
        assert_adjacent(rb(first), P.linear(x[rows], gate_up[e], BF), rare=0.05)
        a = np.empty((first.shape[0], I), np.float32)
        K.gelu_gate(rb(first), a, True)
        second = np.empty((first.shape[0], H), np.float32)
        K.panel_matmul(a, dp[e], H, second)
        assert np.array_equal(bits(y[rows]), bits(rb(second)))  # B3's four roundings inside the experts
    # the weighted sum: float32 products and sums in ascending expert order, rounded once (B6)
    indices = np.array([[0, 2]] * 5 + [[2, 0]] * 2, np.int64)
    weights = rng.random((7, 2)).astype(np.float32)
    position = np.array([[i, 5 + i] for i in range(5)] + [[10, 5], [11, 6]], np.int64)
    mine = np.empty((7, H), np.float32)
    K.combine_experts(y, indices, position, weights, mine, True)
    ref = np.zeros((7, H), np.float32)
    for t in range(7):
        for k in np.argsort(indices[t]):
            ref[t] += y[position[t, k]] * weights[t, k]
    assert np.array_equal(bits(mine), bits(rb(ref)))


def test_router_input_three_roundings():
    """``CpuOps.router_input`` of a bfloat16 model: ``layers.route``'s z (the weightless norm, its product with
    ``scale`` and with the float32 H**-0.5, each rounded), on the kernel's own norm, bit for bit. H = 48: for
    H = 64 the factor 1/8 is a power of two, and rounding before or after it would be the same."""
    config = make_config(hidden_size=48)
    model = fast.Model(config, random_tensors(config, 6), dtype="bfloat16")
    rng = np.random.default_rng(6)
    h = bf16_values(rng, (10, config.hidden_size), 5.0)
    scale = model.layers[0].router_scale
    z = np.empty_like(h)
    model.block_ops.router_input(h, scale, z)
    expected = rb(rb(_norm_bf16(h, None) * scale) * np.float32(config.hidden_size ** -0.5))
    # bit-exact: the router input's norm is the same rms_norm kernel as _norm_bf16's; the scalings are elementwise
    assert np.array_equal(bits(z), bits(expected))


def test_softcap_flag_rounds_first():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((4, 200)) * 40).astype(np.float32)
    mine, ref = x.copy(), rb(x)
    K.softcap(mine, np.float32(30.0), True)
    K.softcap(ref, np.float32(30.0))
    assert np.array_equal(bits(mine), bits(ref))


# ------------------------------------------------------------------------------------------ whole calls
CONFIGS = {
    "sliding+full (SPEC §14)": (dict(), dict()),
    "sqrt(H) not bf16, top-3 of 6": (dict(hidden_size=48, num_experts=6, top_k_experts=3), dict()),
    "peaked logits, window 4": (dict(layer_types="SFSF", sliding_window=4), dict(final_norm_gain=6.0)),
}


class ReplayedRouting(CpuOps):
    """``fast.block``'s CPU operations whose router takes the reference's expert choices (``tape``), call by
    call; it records where the fast router's own choice differed and by how much."""

    __slots__ = ("tape", "calls", "flips")

    def route(self, logits, per_expert_scale, indices, weights):
        super().route(logits, per_expert_scale, indices, weights)  # logits now hold the probabilities
        top = self.tape[self.calls]
        self.calls += 1
        for row in np.flatnonzero((np.sort(top, 1) != np.sort(indices, 1)).any(1)):
            p = logits[row]
            mine, theirs = set(indices[row]) - set(top[row]), set(top[row]) - set(indices[row])
            self.flips.append(max(abs(float(p[a] - p[b])) / float(p.max()) for a in mine for b in theirs))
        indices[...] = top
        chosen = np.take_along_axis(logits, top, axis=1)
        weights[...] = chosen / chosen.sum(axis=1, keepdims=True) * per_expert_scale[top]


def recording(model: Ref) -> list:
    """Make ``model``'s router record its expert choices (lower-index ties, the fast kernel's rule)."""
    tape = []

    def top_k(probs, k):
        top = lower_index_top_k(probs, k)
        tape.append(top.copy())
        return top

    model.router_top_k = top_k
    return tape


def whole_calls(config_kw: dict, tensor_kw: dict, seed: int, replay: bool) -> list:
    """[(call, fast bf16, ref bf16, ref fp32, flips)] for prompt encode, decoder step, self-conditioned step
    and incremental encode (B = 2 rows), each call on each model's own cache. ``replay``: every fast call
    takes the bfloat16 reference's expert choices (``flips``: the relative probability gaps where its own
    choice differed)."""
    config = make_config(**config_kw)
    tensors = random_tensors(config, seed, **tensor_kw)
    ref16, ref32 = Ref(config, tensors, dtype="bfloat16"), Ref(config, tensors)
    mine = fast.Model(config, dict(tensors), dtype="bfloat16")
    tape = recording(ref16)
    ops = None
    if replay:
        ops = mine.block_ops = ReplayedRouting(mine)
        ops.tape, ops.calls, ops.flips = tape, 0, []
    rng = np.random.default_rng(seed)
    B, V, C = 2, config.vocab_size, config.canvas_length
    prompt = rng.integers(3, V, (B, config.sliding_window + 5))
    canvas = rng.integers(0, V, (B, C))
    c16, c32, cf = ref16.new_cache(B), ref32.new_cache(B), mine.new_cache(B)
    rows = []

    def call(name, method, *args):
        r16 = getattr(ref16, method)(*args[:1], c16, *args[1:])  # the reference first: its choices are taped
        flips_before = len(ops.flips) if ops else 0
        out = getattr(mine, method)(*args[:1], cf, *args[1:])
        rows.append((name, out, r16, getattr(ref32, method)(*args[:1], c32, *args[1:]),
                     ops.flips[flips_before:] if ops else []))
        return r16

    call("prompt encode", "encode", prompt)
    sc = (call("decoder step", "denoise", canvas) / np.float32(0.8)).astype(np.float32)  # processed logits
    call("self-conditioned step", "denoise", canvas, sc)
    call("incremental encode", "encode", np.argmax(sc, axis=-1))
    return rows


def ratio(row) -> float:
    _, mine, r16, r32, _ = row
    return float(np.abs(mine - r16).max()) / float(np.abs(r16 - r32).max())


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_whole_calls_within_an_eighth_of_the_bf16_error(name, seed, capsys):
    config_kw, tensor_kw = CONFIGS[name]
    own = whole_calls(config_kw, tensor_kw, seed, replay=False)
    replayed = None
    lines = []
    for i, row in enumerate(own):
        note = ""
        if ratio(row) > 1 / 8:  # must be a flipped near-tie of the router (module notes)
            replayed = replayed or whole_calls(config_kw, tensor_kw, seed, replay=True)
            flips = [f for r in replayed[:i + 1] for f in r[4]]
            note = f" -> {ratio(replayed[i]):.3f} on the reference's expert choices (router gaps {flips})"
            assert flips and max(flips) < 2 ** -5, flips  # near ties: a few bfloat16 ulps of probability
            assert ratio(replayed[i]) <= 1 / 8
        lines.append(f"{name}, seed {seed}, {row[0]}: ratio {ratio(row):.2e}{note}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_replayed_routing_takes_the_reference_choices():
    """The replay the test above falls back on: every router call of the fast model takes the taped choice
    (the float32 kernel's weights recomputed for it), and the calls stay within 1/8."""
    rows = whole_calls(*CONFIGS["sliding+full (SPEC §14)"], 0, replay=True)
    assert all(ratio(row) <= 1 / 8 for row in rows)


# ------------------------------------------------------------------------------------------ generate
def test_generate_self_conditions_like_the_reference_loop(capsys):
    """The fast backend's B8 chain (bfloat16 bits of the processed logits, softmaxed next step) gives the
    tokens of the reference's own loop on the same fast bfloat16 model; the share of seeds on which the
    tokens are the bfloat16 reference's is printed, and is at least the float32 reference's."""
    config = make_config()
    same_loop, fast_ref, fp32_ref = [], [], []
    for seed in range(6):
        tensors = random_tensors(config, seed, self_conditioning_gain=1e-3)  # contractive (test_fast_generate)
        mine = fast.Model(config, dict(tensors), dtype="bfloat16")
        prompt = np.random.default_rng(seed).integers(3, config.vocab_size, (1, 9))
        run = lambda model, **kw: generate(model, prompt, random=SeededDraws(seed), max_new_tokens=32,  # noqa: E731
                                           **kw).sequences
        ours = run(mine)
        same_loop.append(np.array_equal(ours, run(mine, denoiser=mine.denoise)))  # the reference's step
        r16 = run(Ref(config, tensors, dtype="bfloat16"))
        fast_ref.append(np.array_equal(ours, r16))
        fp32_ref.append(np.array_equal(run(Ref(config, tensors)), r16))
    with capsys.disabled():
        print(f"\ngenerate, 6 seeds: fast bf16 == reference loop on it {sum(same_loop)}/6; tokens of the bf16 "
              f"reference: fast bf16 {sum(fast_ref)}/6, float32 reference {sum(fp32_ref)}/6")
    assert all(same_loop)
    assert sum(fast_ref) >= sum(fp32_ref)


def test_generate_rows_finishing_apart_and_given_self_conditioning():
    """Two rows, the first canvas's self-conditioning logits given, rows that finish at different steps (the
    fast backend then decodes a subset of rows, whose SC inputs stay frozen; the confidence bound is placed
    midway between two observed mean entropies, so no decision is a near tie): the reference's loop on the
    same fast bfloat16 model gives the same tokens, steps and forward passes."""
    config = make_config()
    tensors = random_tensors(config, 2, self_conditioning_gain=1e-3, final_norm_gain=20.0)  # peaked
    mine = fast.Model(config, dict(tensors), dtype="bfloat16")
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, config.vocab_size, (2, 9))
    sc = (rng.standard_normal((2, config.canvas_length, config.vocab_size)) * 4).astype(np.float32)
    entropies = []

    class Seen:
        def on_step(self, info):
            entropies.append(float(np.asarray(info.entropies)[0].mean()))

        def on_canvas(self, info):
            pass

    settings = dict(random=SeededDraws(5), max_denoising_steps=10, stability_threshold=0, self_conditioning_logits=sc)
    generate(mine, prompt, max_new_tokens=16, confidence_threshold=1e-30, callback=Seen(), **settings)
    values = np.unique(entropies)
    gamma = float((values[len(values) // 2] + values[len(values) // 2 + 1]) / 2)  # row 0 stops mid-way
    runs = [generate(mine, prompt, max_new_tokens=32, confidence_threshold=gamma,
                     **dict(settings, random=SeededDraws(5)), **kw) for kw in ({}, {"denoiser": mine.denoise})]
    assert np.array_equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].steps_per_canvas == runs[1].steps_per_canvas
    assert np.array_equal(runs[0].forward_passes, runs[1].forward_passes)
    assert len(set(runs[0].forward_passes.tolist())) > 1, "rows should stop at different steps"


def test_decoding_a_subset_of_rows_is_the_whole_batch_rows():
    """``decode_rows`` on rows 0 and 2 of 3 (the generate backend once a row has finished: one soft-embedding
    product per row, the probabilities rounded row by row) gives those rows of ``denoise``'s logits bit for
    bit (the same products row by row: BLAS sums each output in the same order)."""
    config = make_config()
    model = fast.Model(config, random_tensors(config, 4), dtype="bfloat16")
    rng = np.random.default_rng(4)
    B, C, V = 3, config.canvas_length, config.vocab_size
    canvas = rng.integers(0, V, (B, C))
    cache = model.new_cache(B)
    model.encode(rng.integers(3, V, (B, 11)), cache)
    sc = (rng.standard_normal((B, C, V)) * 4).astype(np.float32)
    whole = model.denoise(canvas, cache, sc)
    probs = rb(sc)  # B8: the logits cast to bfloat16, softmaxed in float32 (the backend's buffer)
    for b in range(B):
        K.softmax(probs[b], probs[b])
    logits = np.zeros((B, C, V), np.float32)
    rows = np.array([0, 2])
    model.decode_rows(canvas[rows], rows, cache, probs, logits)
    # bit-exact: the rows' products pass sgemm the same K and weights (only M differs), and OpenBLAS's kernels add
    # a row's K products in one order whatever M (same bits under its Haswell, Sandybridge, Zen, SkylakeX and
    # Prescott kernels at 1 and 2 threads)
    assert np.array_equal(bits(logits[rows]), bits(whole[rows])) and not logits[1].any()


def test_soft_embedding_of_a_bfloat16_table_in_blocks(monkeypatch):
    """The bfloat16 run holds the embedding bfloat16; its soft-embedding product runs in blocks of vocabulary
    rows (here 48 of V = 128: two whole blocks and a partial one). Two float32 summations of the same V
    products each lie within gamma_V sum|p||E| of the exact sum (Higham, ch. 3), so they differ by at most
    twice that; and the model holds the table as bfloat16."""
    from diffusiongemma.fast import model as fast_model

    config = make_config()
    model = fast.Model(config, random_tensors(config, 5), dtype="bfloat16")
    table = model.embed_tokens
    assert table.dtype == BF
    monkeypatch.setattr(fast_model, "SOFT_EMBEDDING_BLOCK", 48)
    rng = np.random.default_rng(5)
    probs = rng.random((20, config.vocab_size)).astype(np.float32)
    out = np.empty((20, config.hidden_size), np.float32)
    model.block_ops._soft_embedding(probs, table, out)
    wide = table.astype(np.float32)
    V = config.vocab_size
    gamma = V * 2.0 ** -24 / (1 - V * 2.0 ** -24)
    assert (np.abs(out - probs @ wide) <= 2 * gamma * (np.abs(probs) @ np.abs(wide))).all()
    assert not np.array_equal(out, np.zeros_like(out))


# ------------------------------------------------------------------------------------------ float32, loading
def test_float32_stays_the_default_and_unchanged():
    config = make_config()
    tensors = random_tensors(config, 3)
    default, explicit, b16 = (fast.Model(config, dict(tensors)), fast.Model(config, dict(tensors), dtype="float32"),
                              fast.Model(config, dict(tensors), dtype="bfloat16"))
    assert default.dtype == P.FLOAT32 and not default.block_ops.bf16 and b16.block_ops.bf16
    ids = np.random.default_rng(3).integers(3, config.vocab_size, (1, 11))
    outs = []
    for model in (default, explicit, b16):
        cache = model.new_cache(1)
        model.encode(ids, cache)
        outs.append(model.denoise(ids[:, :config.canvas_length].repeat(2, 1)[:, :config.canvas_length], cache))
    assert np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[0], outs[2])
    ref = Ref(config, tensors)
    cache = ref.new_cache(1)
    ref.encode(ids, cache)
    assert np.abs(outs[0] - ref.denoise(ids[:, :config.canvas_length].repeat(2, 1)[:, :config.canvas_length],
                                        cache)).max() < 1e-4
    assert b16.weight_nbytes < 0.6 * default.weight_nbytes  # matrices and experts held as bfloat16


def test_bad_dtype_is_refused(tmp_path):
    config = make_config()
    with pytest.raises(ConfigError, match="float16"):
        fast.Model(config, random_tensors(config, 0), dtype="float16")
    with pytest.raises(ConfigError, match="float16"):  # before anything is read: the folder does not exist
        fast.Model.from_pretrained(tmp_path / "missing", dtype="float16")
