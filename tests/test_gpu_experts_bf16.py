"""The routed experts of the GPU path in bfloat16 on cuda-sim (fast/gpu/cuda/mlp.cu ``dg_gated_gelu`` and
moe.cu ``dg_combine_experts`` with their bf16 flags, moe_bf16.cu ``dg_grouped_gemm_bf16``, fast/gpu/experts.py
``expert_mix``), against the reference's bfloat16 experts (reference/primitives.py ``gated_mlp``,
reference/layers.py ``experts`` with dtype bfloat16; SPEC §10.1 B6), and their NVRTC builds for sm_80 / sm_90.

The bounds, one per rounding point of the reference:

* Projections (``check_linear``): products of bfloat16 values are exact in float32, so a float32 accumulator of
  K terms added in any order lies within (2K + 16) 2^-23 sum |a||b| of the exact sum (tests/test_gpu_bf16.py
  derives it); the bfloat16 output is the kernel's own accumulator rounded, bit for bit, and lies between the
  reference's roundings of its float32 sum moved down and up by twice that bound (rounding is monotone): either
  neighbour where two correct sums straddle a rounding point.
* Gated GELU: computed in float32 and rounded, then its product with the (bfloat16) up value rounded. The
  kernel's tanhf (glibc's on cuda-sim, CUDA's on a GPU) and NumPy's tanh may differ by a few ulps; we allow 4,
  i.e. 4 * 2^-24 = 2^-22 near |tanh| = 1, which the GELU 0.5 x (1 + tanh(...)) carries as an absolute
  |x| 2^-23 (large against the GELU itself in its negative tail, where 1 + tanh cancels: there one ulp of tanh
  halves or doubles the GELU), plus a relative 2^-21 for its own roundings. So the kernel's float32 GELU lies
  within spread = |gelu| 2^-21 + |x| 2^-23 of the reference's, its rounding between the roundings of the
  reference's GELU moved by that spread, and the rounded product (monotone in the GELU) between the two products.
* Combination: float32 products and sums in the reference's order (ascending expert index), so exact.
* ``expert_mix`` end to end: the steps above carried on intervals (``expert_mix_bounds``; the derivation is in
  ``test_expert_mix_matches_the_bf16_reference``).

Where order or tanh differences may move a value, the tests also bound how many outputs differ from the
reference's at all (they are rare), and each check is shown to fail on a mutated kernel.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.sim import KernelCheckError, KernelLibrary, SimDevice
from diffusiongemma.reference.primitives import BFLOAT16, gelu_tanh, linear, round_to
from tests.gpu_kernel_helpers import (accumulation_bound, bf16_bits, float32_expert_launches, mutated,
                                      nvrtc_or_skip, random_bf16)

MLP_SOURCE = os.path.join(cb.CUDA_DIR, "mlp.cu")


# ------------------------------------------------------------------------------------------------ gated GELU
def run_gated_gelu(gu: np.ndarray, bf16: bool, lib: KernelLibrary | None = None) -> np.ndarray:
    dev = SimDevice(library=lib or KernelLibrary.from_source(cb.assemble(MLP_SOURCE)))
    out = dev.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
    dev.launch(gl.gated_gelu(dev.to_device(gu), out, bf16=bf16))
    return dev.to_host(out)


def check_gated_gelu_bf16(gu: np.ndarray, got: np.ndarray) -> None:
    """Raise AssertionError unless ``got`` is the reference's bfloat16 gated GELU of ``gu`` (either rounded GELU
    where the float32 GELUs may round differently, module docstring)."""
    inner = gu.shape[1] // 2
    gate, up = gu[:, :inner], gu[:, inner:]
    want = round_to(gelu_tanh(gate, BFLOAT16) * up, BFLOAT16)       # the reference's two roundings
    g32 = gelu_tanh(gate).astype(np.float64)
    spread = np.abs(g32) * 2.0 ** -21 + np.abs(gate) * 2.0 ** -23
    g_lo = round_to((g32 - spread).astype(np.float32), BFLOAT16)
    g_hi = round_to((g32 + spread).astype(np.float32), BFLOAT16)
    alt_lo, alt_hi = round_to(g_lo * up, BFLOAT16), round_to(g_hi * up, BFLOAT16)
    same = got.view(np.uint32) == want.view(np.uint32)
    ok = same | ((np.minimum(alt_lo, alt_hi) <= got) & (got <= np.maximum(alt_lo, alt_hi)))
    assert ok.all(), (f"{np.count_nonzero(~ok)} of {got.size} outputs are not the bfloat16 gated GELU, first "
                      f"gate {gate[~ok][:3]!r} up {up[~ok][:3]!r}: {got[~ok][:3]!r}, want {want[~ok][:3]!r}")
    # the tolerance is for midpoints and the cancelling tail only (about 0.5 % of normal gates of scale 2)
    assert np.count_nonzero(~same) <= max(1, got.size // 50)


@pytest.mark.parametrize("rows,inner", [(1, 1), (7, 13), (33, 64), (5, 704)])
def test_gated_gelu_bf16_rounds_the_gelu_and_the_product(rows, inner):
    rng = np.random.default_rng(rows * 1000 + inner)
    gu = random_bf16(rng, (rows, 2 * inner), 2.0)
    gu[0, 0] = 0.0                                  # gelu(0) = 0 exactly
    got = run_gated_gelu(gu, bf16=True)
    check_gated_gelu_bf16(gu, got)
    assert not np.any(got.view(np.uint32) & 0xFFFF)  # bfloat16 values


def test_gated_gelu_float32_mode_is_the_unrounded_expression_bit_for_bit():
    """bf16=False computes exactly ``dg_gelu(gate) * up`` (the float32 kernel as it was): compared with a probe
    kernel of that expression alone."""
    probe = cb.assemble(os.path.join(cb.CUDA_DIR, "common.cuh")) + r"""
extern "C" __global__ void probe_gated_gelu(const float* gu, float* out, int rows, int inner) {
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < (long long)rows * inner;
         k += (long long)gridDim.x * blockDim.x) {
        const long long r = k / inner, i = k - r * inner;
        out[k] = dg_gelu(gu[r * 2 * inner + i]) * gu[r * 2 * inner + inner + i];
    }
}
"""
    rng = np.random.default_rng(5)
    gu = (rng.standard_normal((9, 2 * 37)) * 3).astype(np.float32)   # float32 values, not bfloat16 ones
    got = run_gated_gelu(gu, bf16=False)
    dev = SimDevice(library=KernelLibrary.from_source(probe))
    want = dev.empty((9, 37), np.float32)
    dev.launch(gl.Launch("probe_gated_gelu", (2, 1, 1), (64, 1, 1), (dev.to_device(gu), want, np.int32(9),
                                                                      np.int32(37))))
    assert np.array_equal(got.view(np.uint32), dev.to_host(want).view(np.uint32))
    assert np.any(got.view(np.uint32) & 0xFFFF)     # not rounded
    np.testing.assert_allclose(got, gelu_tanh(gu[:, :37]) * gu[:, 37:], rtol=1e-5, atol=1e-6)


GELU_MUTATIONS = {
    "GELU not rounded": ("const float gelu = dg_bf16_to_float(dg_float_to_bf16(dg_gelu(g[i])));",
                         "const float gelu = dg_gelu(g[i]);"),
    "product not rounded": ("out[k] = dg_bf16_to_float(dg_float_to_bf16(gelu * g[inner + i]));",
                            "out[k] = gelu * g[inner + i];"),
    "gate and up swapped": ("dg_float_to_bf16(dg_gelu(g[i])", "dg_float_to_bf16(dg_gelu(g[inner + i])"),
}


@pytest.mark.parametrize("name", sorted(GELU_MUTATIONS))
def test_gated_gelu_check_catches_a_broken_kernel(name):
    broken = KernelLibrary.from_source(mutated(cb.assemble(MLP_SOURCE), *GELU_MUTATIONS[name], name))
    rng = np.random.default_rng(9)
    gu = random_bf16(rng, (16, 2 * 40), 2.0)
    got = run_gated_gelu(gu, True, broken)
    with pytest.raises(AssertionError):
        check_gated_gelu_bf16(gu, got)


def test_gated_gelu_launch_passes_the_flag():
    z = np.zeros
    assert gl.gated_gelu(z((3, 8), np.float32), z((3, 4), np.float32)).args[-1] == 0
    assert gl.gated_gelu(z((3, 8), np.float32), z((3, 4), np.float32), bf16=True).args[-1] == 1


# ------------------------------------------------------------------------------------------------ grouped GEMM
MOE_SOURCE = os.path.join(cb.CUDA_DIR, "moe_bf16.cu")


def check_linear(a: np.ndarray, b: np.ndarray, acc: np.ndarray, y: np.ndarray) -> None:
    """Raise AssertionError unless ``acc`` is a float32 sum of a @ b.T within the accumulation bound, ``y`` is
    its bfloat16 rounding bit for bit, and y lies between the reference's roundings of its own float32 sum moved
    down and up by twice the bound (two correct sums may round to neighbouring bfloat16 values)."""
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    e = accumulation_bound(a, b)
    err = np.abs(acc.astype(np.float64) - exact)
    assert np.all(err <= e), f"float32 accumulator off by {err.max():.3g} (bound {e.flat[np.argmax(err - e)]:.3g})"
    assert np.array_equal(y.view(np.uint32), round_to(acc, BFLOAT16).view(np.uint32)), \
        "bfloat16 output is not its accumulator rounded"
    ref32 = a @ b.T
    lo = round_to((ref32 - 2 * e).astype(np.float32), BFLOAT16)
    hi = round_to((ref32 + 2 * e).astype(np.float32), BFLOAT16)
    outside = ~((lo <= y) & (y <= hi))
    assert not outside.any(), f"{np.count_nonzero(outside)} bfloat16 outputs are not a rounding of the reference's sum"


def moe_library(text: str | None = None) -> KernelLibrary:
    return KernelLibrary.from_source(text if text is not None else cb.assemble(MOE_SOURCE))


def run_grouped(x: np.ndarray, w: np.ndarray, tile_group: np.ndarray, lib: KernelLibrary | None = None):
    """(y, accumulator) of dg_grouped_gemm_bf16 on cuda-sim (every launch checked); both start as 7.0 so that
    rows the kernel must leave alone (tiles of no group) and rows it forgets show."""
    dev = SimDevice(library=lib or moe_library())
    rows, n_out = x.shape[0], w.shape[1]
    y = dev.to_device(np.full((rows, n_out), 7.0, np.float32))
    acc = dev.to_device(np.full((rows, n_out), 7.0, np.float32))
    dev.launch(gl.grouped_gemm_bf16(dev.to_device(x), dev.to_device(bf16_bits(w)),
                                    dev.to_device(tile_group.astype(np.int32)), y, acc))
    return dev.to_host(y), dev.to_host(acc)


def check_grouped(x, w, tile_group, y, acc) -> None:
    tm = gl.const("DG_GEMM_TM")
    for m, g in enumerate(tile_group):
        rows = slice(m * tm, (m + 1) * tm)
        if g < 0:
            assert (y[rows] == 7.0).all() and (acc[rows] == 7.0).all(), f"tile {m} of no expert was written"
        else:
            check_linear(x[rows], w[g], acc[rows], y[rows])


# tile groups: skipped tiles (-1) between and after, groups used twice, a group used by no tile
GROUPED_SHAPES = [  # (tile_group, n_out, k_dim)
    ([0], 1, 1), ([2, -1, 0, 2, 1, -1], 130, 33), ([1, 1, 0, -1], 128, 64), ([0, 2], 5, 34),
    ([3, 0, -1], 200, 47), ([1], 72, 16), ([0, 0], 9, 0),
]


@pytest.mark.parametrize("tile_group,n_out,k_dim", GROUPED_SHAPES)
def test_grouped_gemm_matches_the_bf16_reference(tile_group, n_out, k_dim):
    rng = np.random.default_rng(n_out * 100 + k_dim)
    tile_group = np.array(tile_group)
    tm = gl.const("DG_GEMM_TM")
    G = max(int(tile_group.max()) + 2, 1)           # one group no tile names
    x = random_bf16(rng, (len(tile_group) * tm, k_dim))
    x[-3:] = 0.0                                    # padding rows, as dg_gather_rows leaves them
    w = random_bf16(rng, (G, n_out, k_dim), 0.05)
    y, acc = run_grouped(x, w, tile_group)
    check_grouped(x, w, tile_group, y, acc)
    used = np.repeat(tile_group >= 0, tm)
    assert not np.any(y[used].view(np.uint32) & 0xFFFF)
    if k_dim:
        ref = np.concatenate([linear(x[m * tm:(m + 1) * tm], w[g], BFLOAT16)
                              for m, g in enumerate(tile_group) if g >= 0])
        assert np.count_nonzero(y[used] != ref) <= max(1, ref.size // 50)   # the bound is for rare neighbours


def test_grouped_gemm_rounds_ties_to_even_and_takes_non_bf16_inputs_rounded():
    """An accumulator exactly on a rounding tie goes to the even neighbour; an activation that is not a
    bfloat16 value is rounded to nearest on staging (the kernel's documented conversion)."""
    x = np.zeros((16, 2), np.float32)
    x[0] = [1.0, 2.0 ** -8]                          # 1 + 2^-8: a tie between 1 and 1 + 2^-7
    x[1] = [1.0 + 2.0 ** -7, 2.0 ** -8]              # a tie to the even 1 + 2^-6
    x[2] = [1.0 + 2.0 ** -8 + 2.0 ** -20, 0.0]       # not a bfloat16 value: above the midpoint, up to 1 + 2^-7
    w = np.ones((1, 1, 2), np.float32)
    y, acc = run_grouped(x, w, np.array([0]))
    assert y[0, 0] == 1.0 and y[1, 0] == 1.0 + 2.0 ** -6
    assert acc[2, 0] == 1.0 + 2.0 ** -7 == round_to(x[2:3, :1], BFLOAT16)[0, 0]


GEMM_MUTATIONS = {
    # the A fragment's second and third registers swapped (rows g+8 and columns 8.. exchanged)
    "fragment layout": ("af[1] = xs[g + 8][ks + t];\n            af[2] = xs[g][ks + t + 4];",
                        "af[2] = xs[g + 8][ks + t];\n            af[1] = xs[g][ks + t + 4];"),
    # the wide weight loads' two pairs swapped (bf16.cuh dg_bf16_stage_wide, shared with dg_gemm_bf16)
    "pair order": ("dst[r][2 * q] = (unsigned)v;", "dst[r][2 * q] = (unsigned)(v >> 32);"),
    # the wide activation loads' two values swapped
    "activation pair": ("xs[r][p] = dg_bf16_pair(dg_float_to_bf16(__uint_as_float((unsigned)v)),",
                        "xs[r][p] = dg_bf16_pair(dg_float_to_bf16(__uint_as_float((unsigned)(v >> 32))),"),
    # the element-wise weight loads drop the last element of an even k_dim (bf16.cuh dg_bf16_stage)
    "even K": ("in && gk + 1 < K ? row[gk + 1] : (unsigned short)0);",
               "in && gk + 2 < K ? row[gk + 1] : (unsigned short)0);"),
    # a weight row past n_out read (cuda-sim's bounds check reports it; bf16.cuh dg_bf16_stage)
    "column bound": ("const bool in = r0 + r < n_rows;", "const bool in = r0 + r <= n_rows;"),
    # the last partial step of k_dim dropped
    "K tail": ("k0 < k_dim; k0 += DG_MOE_BF16_TK", "k0 + DG_MOE_BF16_TK <= k_dim; k0 += DG_MOE_BF16_TK"),
    # tiles of no expert computed with expert 0
    "skipped tiles": ("if (grp < 0) return;", "if (grp < -1) return;"),
    # another expert's matrix
    "expert offset": ("w + (long long)grp * n_out * k_dim", "w + (long long)(grp > 0 ? grp - 1 : 0) * n_out * k_dim"),
    # the output truncated instead of rounded
    "output rounding": ("y[at] = dg_bf16_to_float(dg_float_to_bf16(acc[ni][i]));",
                        "y[at] = __uint_as_float(__float_as_uint(acc[ni][i]) & 0xffff0000u);"),
}


@pytest.mark.parametrize("name", sorted(GEMM_MUTATIONS))
def test_grouped_gemm_checks_catch_a_broken_kernel(name):
    broken = moe_library(mutated(cb.assemble(MOE_SOURCE), *GEMM_MUTATIONS[name], name))
    rng = np.random.default_rng(4)
    tile_group = np.array([2, -1, 0, 1])
    for k_dim in (34, 64, 33):                       # the element-wise and the 8-byte loads
        x = random_bf16(rng, (len(tile_group) * 16, k_dim))
        w = random_bf16(rng, (3, 130, k_dim), 0.05)
        try:
            check_grouped(x, w, tile_group, *run_grouped(x, w, tile_group, broken))
        except (AssertionError, KernelCheckError):
            return
    pytest.fail(f"mutation {name!r} passed every check")


def test_grouped_gemm_launch_builder_checks_its_operands():
    z, i32, u16 = np.zeros, np.int32, np.uint16
    launch = gl.grouped_gemm_bf16(z((32, 8), np.float32), z((3, 130, 8), u16), z(2, i32), z((32, 130), np.float32))
    assert launch.grid == (2, 2, 1) and launch.block == (gl.const("DG_MOE_BF16_THREADS"), 1, 1)
    assert launch.args[4] is None
    with pytest.raises(gl.LaunchError, match="w must be uint16, got float32"):
        gl.grouped_gemm_bf16(z((32, 8), np.float32), z((3, 130, 8), np.float32), z(2, i32), z((32, 130), np.float32))
    with pytest.raises(gl.LaunchError, match=r"x has shape \(16, 8\), expected \(32, 8\)"):
        gl.grouped_gemm_bf16(z((16, 8), np.float32), z((3, 130, 8), u16), z(2, i32), z((32, 130), np.float32))
    with pytest.raises(gl.LaunchError, match="no group"):
        gl.grouped_gemm_bf16(z((32, 8), np.float32), z((0, 130, 8), u16), z(2, i32), z((32, 130), np.float32))
    with pytest.raises(gl.LaunchError, match=r"y_acc has shape"):
        gl.grouped_gemm_bf16(z((32, 8), np.float32), z((3, 130, 8), u16), z(2, i32), z((32, 130), np.float32),
                             z((32, 129), np.float32))


# ------------------------------------------------------------------------------------------------ combination
def reference_combine(yo: np.ndarray, indices: np.ndarray, choice_row: np.ndarray, weights: np.ndarray,
                      bf16: bool) -> np.ndarray:
    """The reference's combination (layers.experts): a loop over experts in ascending order adding each chosen
    output times its weight with numpy.add.at into float32 zeros, rounded once in bfloat16."""
    out = np.zeros((indices.shape[0], yo.shape[1]), np.float32)
    for e in np.unique(indices):
        token, slot = np.nonzero(indices == e)
        np.add.at(out, token, yo[choice_row[token, slot]] * weights[token, slot][:, None])
    return round_to(out, BFLOAT16) if bf16 else out


def run_combine(yo, indices, choice_row, weights, bf16: bool, lib: KernelLibrary | None = None) -> np.ndarray:
    dev = SimDevice(library=lib or KernelLibrary.from_source(cb.assemble(os.path.join(cb.CUDA_DIR, "moe.cu"))))
    out = dev.empty((indices.shape[0], yo.shape[1]), np.float32)
    dev.launch(gl.combine_experts(dev.to_device(yo), dev.to_device(indices), dev.to_device(choice_row),
                                  dev.to_device(weights), out, bf16=bf16))
    return dev.to_host(out)


def combine_case(seed: int = 2, N: int = 9, K: int = 4, E: int = 6, H: int = 37):
    """Expert outputs of bfloat16 values in rows of their own, each token's K distinct experts in a shuffled
    order, positive float32 weights with ties (equal weights of two choices of a token)."""
    rng = np.random.default_rng(seed)
    indices = np.stack([rng.permutation(E)[:K] for _ in range(N)]).astype(np.int64)
    choice_row = rng.permutation(N * K).reshape(N, K).astype(np.int32)
    yo = random_bf16(rng, (N * K, H), 3.0)
    weights = rng.random((N, K)).astype(np.float32)
    weights[:, 1] = weights[:, 0]
    return yo, indices, choice_row, weights


@pytest.mark.parametrize("bf16", [False, True])
def test_combination_is_the_reference_bit_for_bit(bf16):
    """The sums are float32 in the reference's order (ascending expert index, each product rounded), so the
    combination is exact, not bounded: the same float32 sum, rounded once in bfloat16."""
    yo, indices, choice_row, weights = combine_case()
    got = run_combine(yo, indices, choice_row, weights, bf16)
    want = reference_combine(yo, indices, choice_row, weights, bf16)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert bf16 == (not np.any(got.view(np.uint32) & 0xFFFF))


COMBINE_NOT_ROUNDED = ("o[i] = bf16 ? dg_bf16_to_float(dg_float_to_bf16(s)) : s;", "o[i] = s;")


@pytest.mark.parametrize("name,old,new", [
    ("not rounded", *COMBINE_NOT_ROUNDED),
    ("each product rounded", "s = __fadd_rn(s, __fmul_rn(expert_out[row * dim + i], weights[(long long)t * K + k]));",
     "s = __fadd_rn(s, dg_bf16_to_float(dg_float_to_bf16(__fmul_rn(expert_out[row * dim + i], "
     "weights[(long long)t * K + k]))));"),
    ("choice order", "const int k = order[a];", "const int k = K - 1 - a;"),
])
def test_combination_check_catches_a_broken_kernel(name, old, new):
    broken = KernelLibrary.from_source(mutated(cb.assemble(os.path.join(cb.CUDA_DIR, "moe.cu")), old, new, name))
    yo, indices, choice_row, weights = combine_case()
    same = [np.array_equal(run_combine(yo, indices, choice_row, weights, bf16, broken),
                           reference_combine(yo, indices, choice_row, weights, bf16)) for bf16 in (False, True)]
    assert not all(same), name


# ------------------------------------------------------------------------------------------------ expert_mix
GELU_ARGMIN = np.float32(-0.7517916)  # where the tanh GELU takes its minimum (about -0.17)


def _round(v: np.ndarray) -> np.ndarray:
    return round_to(np.asarray(v, np.float64).astype(np.float32), BFLOAT16)


def _gelu_range(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of any float32 GELU (the kernel's or NumPy's) of a value in [lo, hi], before rounding: the GELU at
    both ends and at its minimum where [lo, hi] holds it (it falls, then rises), widened by the spread of the
    gated GELU's bound (module docstring) at both ends."""
    g_lo, g_hi = gelu_tanh(lo).astype(np.float64), gelu_tanh(hi).astype(np.float64)
    low, high = np.minimum(g_lo, g_hi), np.maximum(g_lo, g_hi)
    low = np.where((lo <= GELU_ARGMIN) & (GELU_ARGMIN <= hi), np.minimum(low, float(gelu_tanh(GELU_ARGMIN))), low)
    x_abs = np.maximum(np.abs(lo), np.abs(hi)).astype(np.float64)
    spread = 2 * (np.maximum(np.abs(low), np.abs(high)) * 2.0 ** -21 + x_abs * 2.0 ** -23)
    return low - spread, high + spread


def expert_mix_bounds(x, indices, weights, gate_up, down) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper bounds (N, H) of any correct bfloat16 ``expert_mix`` (see ``test_expert_mix_matches_the_
    bf16_reference``): the reference's computation carried out on intervals. x, gate_up, down: float32 holding
    bfloat16 values."""
    N, H = x.shape
    I_e = down.shape[2]
    lo_out, hi_out = np.zeros((N, H), np.float32), np.zeros((N, H), np.float32)
    for e in np.unique(indices):
        token, slot = np.nonzero(indices == e)
        xe = x[token]
        # the gate/up projection: the reference's float32 sum moved by twice the accumulation bound, rounded
        s1, e1 = xe @ gate_up[e].T, accumulation_bound(xe, gate_up[e])
        gu_lo, gu_hi = _round(s1 - 2 * e1), _round(s1 + 2 * e1)
        # the GELU of the gate, rounded; its product with the up value (corners of the two intervals), rounded
        g_lo, g_hi = _gelu_range(gu_lo[:, :I_e], gu_hi[:, :I_e])
        g_lo, g_hi = _round(g_lo), _round(g_hi)
        u_lo, u_hi = gu_lo[:, I_e:], gu_hi[:, I_e:]
        corners = np.stack([g_lo * u_lo, g_lo * u_hi, g_hi * u_lo, g_hi * u_hi])
        a_lo, a_hi = round_to(corners.min(0), BFLOAT16), round_to(corners.max(0), BFLOAT16)
        # the down projection of an interval vector: centre and radius, plus the accumulation bound
        mid, rad = (a_lo.astype(np.float64) + a_hi) / 2, (a_hi.astype(np.float64) - a_lo) / 2
        W = down[e].astype(np.float64)
        reach = rad @ np.abs(W).T + accumulation_bound(np.maximum(np.abs(a_lo), np.abs(a_hi)), down[e])
        y_lo, y_hi = _round(mid @ W.T - reach), _round(mid @ W.T + reach)
        # the combination: float32 products and sums in the reference's order, both monotone in each operand
        wk = weights[token, slot][:, None]
        p1, p2 = y_lo * wk, y_hi * wk
        np.add.at(lo_out, token, np.minimum(p1, p2))
        np.add.at(hi_out, token, np.maximum(p1, p2))
    return round_to(lo_out, BFLOAT16), round_to(hi_out, BFLOAT16)


def expert_case(seed: int, N: int, K: int, E: int, H: int, I_e: int, routing: str = "spread"):
    """bfloat16-valued inputs: x, expert matrices, the routing (indices (N, K) of distinct experts per token,
    positive float32 weights renormalised as the router's, with ties), per the ``routing`` edge."""
    rng = np.random.default_rng(seed)
    x = random_bf16(rng, (N, H))
    gate_up = random_bf16(rng, (E, 2 * I_e, H), 1.5 / np.sqrt(H))
    down = random_bf16(rng, (E, H, I_e), 1.0 / np.sqrt(I_e))
    if routing == "spread":               # random distinct experts; some experts chosen by no token when E >> K
        indices = np.stack([rng.permutation(E)[:K] for _ in range(N)])
    elif routing == "one expert takes all":
        indices = np.stack([np.concatenate([[E - 1], rng.permutation(E - 1)[:K - 1]]) for _ in range(N)])
    elif routing == "the same K for all":     # K experts take every token, the others none
        indices = np.tile(rng.permutation(E)[:K], (N, 1))
    else:
        raise ValueError(routing)
    weights = rng.random((N, K)).astype(np.float32) + np.float32(0.1)
    weights[::2, -1] = weights[::2, 0]    # ties in weights
    weights = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
    return x, indices.astype(np.int64), weights, gate_up, down


def run_expert_mix(x, indices, weights, gate_up, down, E: int, bf16: bool, dev=None) -> np.ndarray:
    from diffusiongemma.fast.gpu.experts import expert_mix

    dev = dev or SimDevice()
    to = (lambda a: dev.to_device(bf16_bits(a))) if bf16 else (lambda a: dev.to_device(a))
    out = expert_mix(dev, dev.to_device(x), dev.to_device(indices), dev.to_device(weights), to(gate_up), to(down),
                     E, bf16)
    return dev.to_host(out)


EXPERT_CASES = [  # (N, K, E, H, I_e, routing): tokens not a multiple of the 16-row tile, inner sizes not of 16
    (13, 2, 8, 40, 24, "spread"),              # experts chosen by no token
    (21, 3, 5, 33, 18, "one expert takes all"),
    (17, 4, 4, 48, 20, "spread"),              # K = E: every token takes every expert
    (5, 2, 7, 130, 12, "the same K for all"),  # five experts chosen by none; H past one column block
    (1, 1, 3, 16, 16, "spread"),
]


@pytest.mark.parametrize("N,K,E,H,I_e,routing", EXPERT_CASES)
def test_expert_mix_matches_the_bf16_reference(N, K, E, H, I_e, routing):
    """``expert_mix(..., bf16=True)`` against ``reference.layers.experts(..., dtype=BFLOAT16)``.

    The bound. Each of the reference's rounding points may see another float32 value on the device: the
    projections' sums differ within twice the accumulation bound (``check_linear``), the GELU within its spread
    (module docstring). Every step after is monotone in each operand (rounding, the float32 products with the up
    value and with the routing weight, the float32 sums of the combination in the reference's order) or, for the
    GELU, falls then rises around its minimum, so the set of outputs a correct kernel may give is contained in the
    interval the reference's own operations give on the ends of its operands' intervals (``expert_mix_bounds``; the
    down projection of an interval vector by its centre and radius). The output must lie in that interval, and so
    must the reference's (which checks the bound); outside the rare elements where two float32 values straddle a
    rounding point they are the same bfloat16 value, so the output equals the reference almost everywhere."""
    from diffusiongemma.reference.layers import experts

    x, indices, weights, gate_up, down = expert_case(N * 7 + E, N, K, E, H, I_e, routing)
    check_expert_mix(x, indices, weights, gate_up, down, run_expert_mix(x, indices, weights, gate_up, down, E, True))


def check_expert_mix(x, indices, weights, gate_up, down, got) -> None:
    """Raise AssertionError unless ``got`` is a bfloat16 expert_mix of these operands (see the test above)."""
    from diffusiongemma.reference.layers import experts

    ref = experts(x, indices, weights, {"experts.gate_up_proj": gate_up, "experts.down_proj": down}, BFLOAT16)
    lo, hi = expert_mix_bounds(x, indices, weights, gate_up, down)
    assert np.all((lo <= ref) & (ref <= hi)), "the bound does not hold for the reference itself"
    assert not np.any(got.view(np.uint32) & 0xFFFF), "expert_mix's output is not bfloat16 values"
    outside = ~((lo <= got) & (got <= hi))
    assert not outside.any(), f"{np.count_nonzero(outside)} of {got.size} outputs outside the bound"
    differ = np.count_nonzero(got != ref)
    assert differ <= max(1, got.size // 20), f"{differ} of {got.size} outputs differ from the reference's"


EXPERT_MIX_MUTATIONS = {  # the kernels' own mutations above, each once in the assembled sources of them all
    "combination not rounded": COMBINE_NOT_ROUNDED,
    "GELU not rounded": GELU_MUTATIONS["GELU not rounded"],
    "projection truncated": GEMM_MUTATIONS["output rounding"],
    "another expert": GEMM_MUTATIONS["expert offset"],
}


@pytest.mark.parametrize("name", sorted(EXPERT_MIX_MUTATIONS))
def test_expert_mix_check_catches_a_broken_kernel(name):
    dev = SimDevice(library=KernelLibrary.from_source(mutated(cb.assemble_all(), *EXPERT_MIX_MUTATIONS[name], name)))
    x, indices, weights, gate_up, down = expert_case(5, 21, 3, 5, 40, 24, "one expert takes all")
    x *= 8.0                                        # activations large enough for the GELU's rounding to show
    with pytest.raises(AssertionError):
        check_expert_mix(x, indices, weights, gate_up, down,
                         run_expert_mix(x, indices, weights, gate_up, down, 5, True, dev))


def test_expert_mix_float32_mode_is_the_sequence_it_replaces():
    """bf16=False issues exactly the launches ``GpuOps.expert_mix`` (fast/gpu/model.py) issued, with the same
    arguments, and gives the same outputs bit for bit as that sequence issued by hand here."""
    N, K, E, H, I_e = 19, 3, 6, 40, 24
    x, indices, weights, gate_up, down = expert_case(3, N, K, E, H, I_e)
    dev = SimDevice(record=True)
    got = run_expert_mix(x, indices, weights, gate_up, down, E, False, dev)
    kernels = [launch.kernel for launch in dev.launches]
    assert kernels == ["dg_group_experts", "dg_gather_rows", "dg_grouped_gemm_nt", "dg_gated_gelu",
                       "dg_grouped_gemm_nt", "dg_combine_experts"]
    assert dev.launches[3].args[-1] == 0 and dev.launches[5].args[-1] == 0      # the float32 modes
    d = SimDevice()
    out, _ = float32_expert_launches(d, *(d.to_device(a) for a in (x, indices, weights, gate_up, down)), E)
    assert np.array_equal(got.view(np.uint32), d.to_host(out).view(np.uint32))
    from diffusiongemma.reference.layers import experts

    ref = experts(x, indices, weights, {"experts.gate_up_proj": gate_up, "experts.down_proj": down})
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_expert_mix_refuses_matrices_of_the_other_run():
    from diffusiongemma.fast.gpu.experts import expert_mix

    dev = SimDevice()
    x, indices, weights = dev.zeros((3, 16), np.float32), dev.zeros((3, 2), np.int64), dev.zeros((3, 2), np.float32)
    gu32, down32 = dev.zeros((4, 16, 16), np.float32), dev.zeros((4, 16, 8), np.float32)
    with pytest.raises(gl.LaunchError, match="gate_up is float32, expected uint16 in the bfloat16 run"):
        expert_mix(dev, x, indices, weights, gu32, down32, 4, True)
    with pytest.raises(gl.LaunchError, match="down is uint16, expected float32 in the float32 run"):
        expert_mix(dev, x, indices, weights, gu32, down32.astype(np.uint16), 4, False)
    with pytest.raises(gl.LaunchError, match=r"do not match \(5, 2 \* I_e, 16\)"):
        expert_mix(dev, x, indices, weights, gu32, down32, 5, False)


# ------------------------------------------------------------------------------------------------ the router
ROUTER_TIE = "if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }"


def router_indices(logits: np.ndarray, K: int, text: str | None = None) -> np.ndarray:
    dev = SimDevice(library=KernelLibrary.from_source(text or cb.assemble(os.path.join(cb.CUDA_DIR, "moe.cu"))))
    N, E = logits.shape
    indices, weights = dev.empty((N, K), np.int64), dev.empty((N, K), np.float32)
    dev.launch(gl.router(dev.to_device(logits), dev.to_device(np.ones(E, np.float32)), indices, weights))
    return dev.to_host(indices)


def tied_logits() -> np.ndarray:
    logits = np.random.default_rng(8).integers(0, 3, (12, 40)).astype(np.float32)   # ties everywhere, at the K-th too
    logits[0] = 1.0                                                                  # every expert tied
    return logits


@pytest.mark.parametrize("mutated", [False, True])
def test_router_breaks_ties_to_the_lower_expert_index_as_the_reference(mutated):
    """``dg_router`` (float32 in both runs, SPEC B6) picks among exactly equal probabilities as the reference's
    default ``lower_index_top_k`` does: largest first, equal values by lower expert index (equal logits give
    equal float32 probabilities in any summation order). Mutated: ties to the higher index, which the check
    must see."""
    from diffusiongemma.reference.layers import lower_index_top_k

    text = cb.assemble(os.path.join(cb.CUDA_DIR, "moe.cu"))
    assert text.count(ROUTER_TIE) == 1
    if mutated:
        text = text.replace(ROUTER_TIE, ROUTER_TIE.replace("oa < arg", "oa > arg"))
    logits = tied_logits()
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    same = np.array_equal(router_indices(logits, 8, text), lower_index_top_k(p, 8))
    assert same != mutated


# ------------------------------------------------------------------------------------------------ compile
def compile_problems(text: str, arch: str) -> list[str]:
    """What is wrong with the NVRTC build of ``text`` (moe_bf16.cu assembled) for ``arch``: [] when it runs its
    4 mma tiles per warp and two k steps of 16 per block step as 8 tensor-core mma instructions (no fallback on
    the CUDA cores), keeps its accumulators in registers (no spill, no stack frame), fits a block's registers,
    and its static shared memory is cuda-sim's layout."""
    import re

    problems = []
    ptx = cb.nvrtc_ptx(text, arch)
    mma = len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b", ptx))
    if mma != 8 or "shfl.sync" in ptx:
        problems.append(f"{mma} mma instructions, shuffles: {'shfl.sync' in ptx}")
    report = cb.compile_source(text, arch, compiler="nvrtc", name="moe_bf16.cu").kernels["dg_grouped_gemm_bf16"]
    if not (report.registers > 0 and not report.spills and report.stack_frame == 0):
        problems.append(f"registers {report.registers}, spills {report.spills}, stack frame {report.stack_frame}")
    if report.registers * gl.const("DG_MOE_BF16_THREADS") > 65536:
        problems.append(f"{report.registers} registers per thread")
    if moe_library(text).static_shared["dg_grouped_gemm_bf16"] != report.shared_memory:
        problems.append("cuda-sim's static shared memory differs from ptxas's")
    return problems


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_grouped_gemm_compiles_to_tensor_core_mma_without_spills(arch):
    nvrtc_or_skip()
    assert compile_problems(cb.assemble(MOE_SOURCE), arch) == []
    report = cb.compile_source(cb.assemble(MOE_SOURCE), arch, compiler="nvrtc",
                               name="moe_bf16.cu").kernels["dg_grouped_gemm_bf16"]
    # the released model's shapes: 128 experts, top-8, H 2816, I_e 704 (512 tokens)
    tiles, rows = gl.moe_rows(512, 8, 128)
    for n_out, k_dim in ((2 * 704, 2816), (2816, 704)):
        launch = gl.grouped_gemm_bf16(np.zeros((rows, k_dim), np.float32), np.zeros((128, n_out, k_dim), np.uint16),
                                      np.zeros(tiles, np.int32), np.zeros((rows, n_out), np.float32))
        assert gl.check_resources(launch, report.shared_memory, 1024, gl.SHARED_OPT_IN_LIMITS[arch], arch) == 0


@pytest.mark.parametrize("name,old,new", [
    ("no tensor cores", "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800", "#if 0"),
    ("accumulators indexed at run time", "#pragma unroll\n            for (int ni = 0; ni < 4; ++ni) dg_mma_bf16_16816",
     "#pragma unroll 1\n            for (int ni = 0; ni < 4; ++ni) dg_mma_bf16_16816"),
])
def test_compile_check_catches_a_broken_build(name, old, new):
    nvrtc_or_skip()
    assert compile_problems(mutated(cb.assemble(MOE_SOURCE), old, new, name), "sm_80"), name
