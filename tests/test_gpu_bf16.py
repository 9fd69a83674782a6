"""The bfloat16 matrix product of the GPU path (``dg_gemm_bf16``, fast/gpu/cuda/gemm_bf16.cu and bf16.cuh) on
cuda-sim, against the reference's bfloat16 ``linear`` (reference/primitives.py; SPEC §10.1), and its compile
checks for sm_80 and sm_90.

The bound. Every product of two bfloat16 values is exact in float32 (8 + 8 significant bits), so the only
error of the float32 accumulator is that of adding K exact terms. Its order is not ours to fix: cuda-sim adds
them left to right in float32 with rounding to nearest (the emulation of ``mma`` in bf16.cuh), the tensor cores
add the 16 products of one ``mma`` and the accumulator with an internal alignment and truncation of their own,
and NumPy's BLAS (the reference's float32 ``x @ w.T``) blocks the sum as it likes. Any of these orders, with
each addition rounding to nearest or toward zero (a relative error of at most u = 2^-23 on a partial sum no
larger than S = sum_k |a_mk| |b_nk|), stays within

    |c[m, n] - exact[m, n]| <= (2K + 16) * 2^-23 * S[m, n]                       (``bound`` below)

of the exact sum (float64 here): K additions, one more per ``mma`` for its accumulator input (K/16 <= K), and
16 to spare for the tensor core's wider intermediate sums. The bfloat16 output must then be the
nearest-even rounding of the kernel's own float32 accumulator bit for bit, and lie between the reference's
roundings of its float32 result moved by twice that bound down and up (rounding is monotone), which is where
two correct float32 sums may round to neighbouring bfloat16 values.

The fragment layout the kernel loads is checked on cuda-sim against a second statement of it (CuTe's), with
the emulated ``mma`` on exact small-integer sums; each check is shown to fail on a mutated copy of the kernel.
"""

from __future__ import annotations

import os
import re

import ml_dtypes
import numpy as np
import pytest

from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.sim import KernelCheckError, KernelLibrary, SimDevice
from diffusiongemma.reference.primitives import BFLOAT16, linear, round_to
from tests.gpu_kernel_helpers import accumulation_bound, bf16_bits, mutated, nvrtc_or_skip, random_bf16

SOURCE = os.path.join(cb.CUDA_DIR, "gemm_bf16.cu")
# M, N, K: single elements, one mma tile, whole block tiles, shapes that are multiples of nothing, K = 1,
# K past one block step, K % 4 == 2 (element-wise loads), and zero-size operands
SHAPES = [(1, 1, 1), (16, 8, 16), (64, 64, 32), (70, 65, 33), (33, 70, 1), (130, 9, 100), (3, 131, 47),
          (17, 5, 200), (40, 72, 66), (0, 4, 5), (3, 0, 5), (4, 3, 0)]


def library(text: str | None = None) -> KernelLibrary:
    """The kernel's own source (with its headers) compiled for cuda-sim: ``text`` replaces it when given."""
    return KernelLibrary.from_source(text if text is not None else cb.assemble(SOURCE))


def run(a: np.ndarray, b: np.ndarray, lib: KernelLibrary | None = None, dev=None) -> tuple[np.ndarray, np.ndarray]:
    """(float32 accumulator, bfloat16 output widened to float32) of the kernel on ``dev`` (default: cuda-sim with
    ``lib``, every launch checked: bounds, races, divergence, and the same outputs in two thread orders). a, b:
    float32 holding bfloat16 values; the outputs start as NaN / 0xFFFF so that an element left unwritten shows."""
    dev = dev or SimDevice(library=lib or library())
    M, N = a.shape[0], b.shape[0]
    A, B = dev.to_device(bf16_bits(a)), dev.to_device(bf16_bits(b))
    c = dev.to_device(np.full((M, N), np.nan, np.float32))
    c16 = dev.to_device(np.full((M, N), 0xFFFF, np.uint16))
    dev.launch(gl.gemm_bf16(A, B, c, c16))
    return dev.to_host(c), dev.to_host(c16).view(BFLOAT16).astype(np.float32)


def check(a: np.ndarray, b: np.ndarray, c: np.ndarray, c16: np.ndarray) -> None:
    """Raise AssertionError unless the outputs are the product within the stated bound (see the docstring)."""
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    e = accumulation_bound(a, b)                        # the bound of the module docstring
    err = np.abs(c.astype(np.float64) - exact)
    assert np.all(err <= e), (f"float32 accumulator off by {err.max():.3g} "
                              f"(bound {e.flat[np.argmax(err - e)]:.3g} there)")
    mine = round_to(c, BFLOAT16)
    assert np.array_equal(c16.view(np.uint32), mine.view(np.uint32)), \
        f"bfloat16 output is not its accumulator rounded: {np.count_nonzero(c16 != mine)} of {c.size} elements differ"
    ref32 = a @ b.T                                       # the reference's float32 sum, before its rounding
    ref = linear(a, b, dtype=BFLOAT16)
    assert np.array_equal(ref, round_to(ref32, BFLOAT16))
    lo = round_to((ref32 - 2 * e).astype(np.float32), BFLOAT16)
    hi = round_to((ref32 + 2 * e).astype(np.float32), BFLOAT16)
    outside = ~((lo <= c16) & (c16 <= hi))
    assert not outside.any(), f"{np.count_nonzero(outside)} bfloat16 outputs are not a rounding of the reference's sum"


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matches_the_bf16_reference(M, N, K):
    rng = np.random.default_rng(1000 * M + 10 * N + K)
    a, b = random_bf16(rng, (M, K)), random_bf16(rng, (N, K), 0.05)
    c, c16 = run(a, b)
    check(a, b, c, c16)
    if M and N:
        assert np.isfinite(c).all()
        # the sums are not exact in float32 for K > 1 (so the bound, not equality, is what is tested), and the
        # bfloat16 output rounds them: it agrees with the reference's bfloat16 result almost everywhere
        ref = linear(a, b, dtype=BFLOAT16)
        assert np.count_nonzero(c16 != ref) <= max(1, c.size // 50)


def test_cancellation_and_wide_exponents_stay_within_the_bound():
    """Terms of magnitudes 2^-40 .. 2^40 that cancel: where the order of the additions matters most."""
    rng = np.random.default_rng(7)
    M, N, K = 20, 24, 96
    a = round_to((rng.standard_normal((M, K)) * 2.0 ** rng.integers(-40, 40, (M, K))).astype(np.float32), BFLOAT16)
    b = random_bf16(rng, (N, K))
    b[:, K // 2:] = -b[:, :K // 2]
    a[:, K // 2:] = a[:, :K // 2]                         # every row sums to exactly zero
    c, c16 = run(a, b)
    check(a, b, c, c16)


BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


@pytest.mark.parametrize("a_row,b_row", [
    ([1.0, 2.0 ** -8], [1.0, 1.0]),                        # a tie: to the even 1.0
    ([1.0 + 2.0 ** -7, 2.0 ** -8], [1.0, 1.0]),            # a tie: to the even 1 + 2^-6
    ([1.0, 2.0 ** -8 + 2.0 ** -15], [1.0, 1.0]),           # just above a tie: up
    ([-1.0, -2.0 ** -8], [1.0, 1.0]),                      # a negative tie: to the even -1.0
    ([3.0 * 2.0 ** -70], [2.0 ** -64]),                    # 3 * 2^-134, a tie between bfloat16 subnormals
    ([BF16_MAX, 2.0 ** 119], [1.0, 1.0]),                  # a tie above the largest finite value: inf
    ([BF16_MAX, 2.0 ** 118], [1.0, 1.0]),                  # below the tie: the largest finite value
])
def test_output_rounding_ties_to_even_subnormals_and_overflow(a_row, b_row):
    """A float32 accumulator that bfloat16 terms make exactly, rounded as ml_dtypes (and torch) round: ties to
    even, among subnormals too, and a tie above the largest finite value to inf."""
    a, b = np.array([a_row], np.float32), np.array([b_row], np.float32)
    assert np.array_equal(round_to(a, BFLOAT16), a) and np.array_equal(round_to(b, BFLOAT16), b)
    exact = float((a.astype(np.float64) @ b.astype(np.float64).T)[0, 0])
    assert np.float32(exact) == exact and round_to(np.float32(exact), BFLOAT16) != exact   # exact, not bfloat16
    c, c16 = run(a, b)
    assert c[0, 0] == np.float32(exact)
    assert c16[0, 0].view(np.uint32) == round_to(np.float32(exact), BFLOAT16).view(np.uint32)


def test_nan_and_inf_propagate():
    a = np.ones((3, 4), np.float32)
    b = np.ones((5, 4), np.float32)
    a[0, 1], a[1, 2] = np.nan, np.inf
    c, c16 = run(a, b)
    assert np.isnan(c[0]).all() and np.isnan(c16[0]).all()
    assert np.isposinf(c[1]).all() and np.isposinf(c16[1]).all()
    assert (c[2] == 4).all() and (c16[2] == 4).all()


# ------------------------------------------------------------------------------------------------ the mma fragments
PROBE = r"""
// One warp: d = c + A @ B with the fragments of every lane given and returned as they are.
extern "C" __global__ void probe_mma(const int* a_frag, const int* b_frag, const float* c_frag, float* d_frag) {
    const int lane = threadIdx.x;
    unsigned a[4], b[2];
    float d[4];
    for (int i = 0; i < 4; ++i) a[i] = (unsigned)a_frag[lane * 4 + i];
    for (int i = 0; i < 2; ++i) b[i] = (unsigned)b_frag[lane * 2 + i];
    for (int i = 0; i < 4; ++i) d[i] = c_frag[lane * 4 + i];
    dg_mma_bf16_16816(d, a, b);
    for (int i = 0; i < 4; ++i) d_frag[lane * 4 + i] = d[i];
}
"""


def test_mma_emulation_follows_the_fragment_layout_of_cute():
    """The emulated ``mma.m16n8k16`` against the fragment layout as CUTLASS's CuTe writes it (a second
    statement of the PTX table, mma_traits_sm80: (thread, value) -> coordinate; thread = t0 + 4 t1): A
    (16 x 16) at 32 t0 + t1 + 16 v0 + 8 v1 + 128 v2, B (K 16 x N 8) at 16 t0 + t1 + 8 v0 + 64 v1, C and D
    (16 x 8) at 32 t0 + t1 + 16 v0 + 8 v1, column-major offsets; values 2r and 2r + 1 share register r, the
    first in the low half. Small integers make every sum exact, so D must equal C + A @ B exactly."""
    lib = KernelLibrary.from_source(cb.assemble(os.path.join(cb.CUDA_DIR, "bf16.cuh")) + PROBE)
    rng = np.random.default_rng(11)
    A = rng.integers(-8, 9, (16, 16)).astype(np.float32)
    B = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    C = rng.integers(-100, 101, (16, 8)).astype(np.float32)
    a_bits, b_bits = bf16_bits(A).astype(np.uint32), bf16_bits(B).astype(np.uint32)
    a_frag, b_frag = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32)
    c_frag = np.zeros((32, 4), np.float32)
    for lane in range(32):
        t0, t1 = lane % 4, lane // 4
        for v in range(8):
            v0, v1, v2 = v & 1, (v >> 1) & 1, v >> 2
            idx = 32 * t0 + t1 + 16 * v0 + 8 * v1 + 128 * v2
            a_frag[lane, v // 2] |= a_bits[idx % 16, idx // 16] << (16 * (v % 2))
        for v in range(4):
            v0, v1 = v & 1, v >> 1
            idx = 16 * t0 + t1 + 8 * v0 + 64 * v1
            b_frag[lane, v // 2] |= b_bits[idx // 8, idx % 8] << (16 * (v % 2))
            idx = 32 * t0 + t1 + 16 * v0 + 8 * v1
            c_frag[lane, v] = C[idx % 16, idx // 16]
    dev = SimDevice(library=lib)
    d_frag = dev.to_device(np.full((32, 4), np.nan, np.float32))
    dev.launch(gl.Launch("probe_mma", (1, 1, 1), (32, 1, 1), (dev.to_device(a_frag.view(np.int32)),
                                                              dev.to_device(b_frag.view(np.int32)),
                                                              dev.to_device(c_frag), d_frag)))
    D = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        t0, t1 = lane % 4, lane // 4
        for v in range(4):
            idx = 32 * t0 + t1 + 16 * (v & 1) + 8 * (v >> 1)
            D[idx % 16, idx // 16] = d_frag[lane, v]
    np.testing.assert_array_equal(D, C + A @ B)


# ------------------------------------------------------------------------------------------------ the tests can fail
MUTATIONS = {
    # output rounding: ties away from zero instead of to even
    "ties away": ("(u + 0x7fffu + ((u >> 16) & 1u)) >> 16", "(u + 0x8000u) >> 16"),
    # output rounding: truncation
    "truncation": ("(u + 0x7fffu + ((u >> 16) & 1u)) >> 16", "u >> 16"),
    # the A fragment's second and third registers swapped (rows g+8 and columns 8.. exchanged)
    "fragment layout": ("af[mi][1] = bottom[0];\n                af[mi][2] = top[4];",
                        "af[mi][2] = bottom[0];\n                af[mi][1] = top[4];"),
    # the wide loads' two pairs swapped (bf16.cuh dg_bf16_stage_wide: A and B)
    "pair order": ("dst[r][2 * q] = (unsigned)v;", "dst[r][2 * q] = (unsigned)(v >> 32);"),
    # the element-wise loads of B drop the last element of an even K (K % 4 == 2; bf16.cuh dg_bf16_stage)
    "even K": ("in && gk + 1 < K ? row[gk + 1] : (unsigned short)0);",
              "in && gk + 2 < K ? row[gk + 1] : (unsigned short)0);"),
    # a row past M read (the bounds check of cuda-sim, not the numbers, reports it)
    "row bound": ("const bool in = m0 + r < M;", "const bool in = m0 + r <= M;"),
    # the last partial step of K dropped
    "K tail": ("k0 < K; k0 += DG_BF16_TK", "k0 + DG_BF16_TK <= K; k0 += DG_BF16_TK"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_checks_catch_a_broken_kernel(name):
    old, new = MUTATIONS[name]
    broken = library(mutated(cb.assemble(SOURCE), old, new, name))
    rng = np.random.default_rng(3)
    for K in (33, 34, 64):                                # the element-wise and the 8-byte loads
        a, b = random_bf16(rng, (70, K)), random_bf16(rng, (65, K), 0.05)
        a[0, :2] = [1.0, 2.0 ** -8]                       # one accumulator exactly on a rounding tie
        b[0, :2] = [1.0, 1.0]
        b[0, 2:] = 0.0
        try:
            check(a, b, *run(a, b, broken))
        except (AssertionError, KernelCheckError):
            return
    pytest.fail(f"mutation {name!r} passed every check")


# ------------------------------------------------------------------------------------------------ launch, compile
def test_sim_poisons_new_bf16_buffers_with_nan():
    """cuda-sim's ``empty`` of uint16 (bfloat16 bits) holds NaN, as its float32 ``empty`` does, so that an output
    element a kernel forgets to write shows as NaN."""
    out = SimDevice(library=library()).empty((2, 3), np.uint16)
    assert np.isnan(out.view(BFLOAT16).astype(np.float32)).all()


def test_launch_builder_checks_its_operands():
    u16 = np.zeros((4, 8), np.uint16)
    c = np.zeros((4, 3), np.float32)
    launch = gl.gemm_bf16(u16, np.zeros((3, 8), np.uint16), c)
    assert launch.grid == (1, 1, 1) and launch.block == (gl.const("DG_BF16_THREADS"), 1, 1)
    assert launch.args[3] is None
    launch = gl.gemm_bf16(np.zeros((130, 8), np.uint16), np.zeros((65, 8), np.uint16), None,
                          np.zeros((130, 65), np.uint16))
    assert launch.grid == (2, 3, 1)
    with pytest.raises(gl.LaunchError, match="a must be uint16, got float32"):
        gl.gemm_bf16(u16.astype(np.float32), np.zeros((3, 8), np.uint16), c)
    with pytest.raises(gl.LaunchError, match=r"b has shape \(3, 7\), expected \(3, 8\)"):
        gl.gemm_bf16(u16, np.zeros((3, 7), np.uint16), c)
    with pytest.raises(gl.LaunchError, match="no output"):
        gl.gemm_bf16(u16, np.zeros((3, 8), np.uint16))
    with pytest.raises(gl.LaunchError, match=r"c has shape \(4, 4\), expected \(4, 3\)"):
        gl.gemm_bf16(u16, np.zeros((3, 8), np.uint16), np.zeros((4, 4), np.float32))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_to_tensor_core_mma_without_spills_and_fits_its_launches(arch):
    nvrtc_or_skip()
    text = cb.assemble(SOURCE)
    ptx = cb.nvrtc_ptx(text, arch)
    # 2 x 4 tiles per warp, two k steps of 16 per block step: 16 mma instructions, no fallback on the CUDA cores
    assert len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32\b", ptx)) == 16, ptx[-2000:]
    assert "shfl.sync" not in ptx
    report = cb.compile_source(text, arch, compiler="nvrtc", name="gemm_bf16.cu").kernels["dg_gemm_bf16"]
    assert report.registers > 0 and not report.spills and report.stack_frame == 0   # accumulators stay in registers
    assert report.registers * gl.const("DG_BF16_THREADS") <= 65536
    assert library().static_shared["dg_gemm_bf16"] == report.shared_memory   # cuda-sim's layout is ptxas's
    launch = gl.gemm_bf16(np.zeros((1000, 640), np.uint16), np.zeros((2048, 640), np.uint16),
                          np.zeros((1000, 2048), np.float32))
    assert gl.check_resources(launch, report.shared_memory, 1024, gl.SHARED_OPT_IN_LIMITS[arch], arch) == 0


# ------------------------------------------------------------------------------------------------ dg_round_bf16
ROUND_SOURCE = os.path.join(cb.CUDA_DIR, "round_bf16.cu")


def round_edge_values() -> np.ndarray:
    """float32 values at every kind of bfloat16 rounding case: exact ties to an even and to an odd neighbour
    (both signs), one ulp either side of a tie, the largest finite values (the tie above the largest bfloat16
    overflows to infinity), subnormals and their ties, signed zeros, infinities and NaNs with payloads."""
    bits = []
    for hi in (0x3F80, 0x3F81, 0x4049, 0x0001, 0x0002, 0x7F7E, 0x7F7F, 0x0080, 0x007F):
        for lo in (0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0001, 0x4000):
            for sign in (0, 0x80000000):
                bits.append(sign | (hi << 16) | lo)
    bits += [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345,
             0x7FBFFFFF, 0x7FFFFFFF]
    return np.array(bits, np.uint32).view(np.float32)


def run_round(x: np.ndarray, lib: KernelLibrary | None = None) -> np.ndarray:
    dev = SimDevice(library=lib or KernelLibrary.from_source(cb.assemble(ROUND_SOURCE)))
    buf = dev.to_device(np.ascontiguousarray(x, np.float32))
    dev.launch(gl.round_bf16(buf))
    return dev.to_host(buf)


def same_as_reference(x: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per element: the kernel's float32 result is the reference's ``round_to(x, BFLOAT16)`` bit for bit,
    except that any two NaNs of the same sign count as equal (the payload is not part of the contract)."""
    with np.errstate(invalid="ignore"):  # NumPy warns when ml_dtypes casts a NaN; the value is still a NaN
        want = round_to(x, BFLOAT16)
    both_nan = np.isnan(want) & np.isnan(got) & (np.signbit(want) == np.signbit(got))
    return (want.view(np.uint32) == got.view(np.uint32)) | both_nan


def test_round_bf16_matches_the_reference_rounding_bit_for_bit():
    rng = np.random.default_rng(7)
    edges = round_edge_values()
    randoms = (rng.standard_normal(3000) * np.exp(rng.uniform(-80, 80, 3000))).astype(np.float32)
    noise_bits = rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([edges, randoms, noise_bits])
    got = run_round(x)
    ok = same_as_reference(x, got)
    assert ok.all(), f"{np.count_nonzero(~ok)} values differ, first at {x[~ok][:4]!r} -> {got[~ok][:4]!r}"
    # the results are bfloat16 values (low 16 bits zero) where finite, NaN stays NaN, and ties went to even
    finite = np.isfinite(got)
    assert not np.any(got[finite].view(np.uint32) & 0xFFFF)
    assert np.array_equal(np.isnan(got), np.isnan(x))
    tie_to_even = np.array([0x3F808000], np.uint32).view(np.float32)  # 1 + 2^-8: between 1 and 1 + 2^-7
    assert run_round(tie_to_even)[0] == np.float32(1.0)
    assert np.isinf(run_round(np.array([3.4e38], np.float32))[0])      # past the largest bfloat16's tie


@pytest.mark.parametrize("shape", [(0,), (1,), (257,), (3, 5, 7), (4096 + 3,)])
def test_round_bf16_covers_every_element_of_any_shape(shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    got = run_round(x)
    assert got.shape == x.shape and same_as_reference(x, got).all()


@pytest.mark.parametrize("name, old, new", [
    ("truncation instead of rounding", "(u + 0x7fffu + ((u >> 16) & 1u)) >> 16", "u >> 16"),
    ("ties away from zero", "(u + 0x7fffu + ((u >> 16) & 1u)) >> 16", "(u + 0x8000u) >> 16"),
    ("NaN rounded like a number", "if ((u & 0x7fffffffu) > 0x7f800000u)", "if (false)"),
])
def test_round_bf16_check_catches_a_broken_rounding(name, old, new):
    text = cb.assemble(ROUND_SOURCE)
    assert old in text, f"{old!r} is no longer in bf16.cuh: update this test with the helper"
    x = round_edge_values()
    got = run_round(x, KernelLibrary.from_source(text.replace(old, new, 1)))
    assert not same_as_reference(x, got).all(), name


def test_round_bf16_launch_builder_checks_its_operand():
    launch = gl.round_bf16(np.zeros((3, 4), np.float32))
    assert launch.kernel == "dg_round_bf16" and launch.block == (256, 1, 1)
    with pytest.raises(gl.LaunchError, match="dg_round_bf16"):
        gl.round_bf16(np.zeros(4, np.float64))
    with pytest.raises(gl.LaunchError, match="dg_round_bf16"):
        gl.round_bf16(np.zeros((4, 4), np.float32)[:, ::2])
