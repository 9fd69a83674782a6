"""The routed experts of the GPU path in bfloat16 on cuda-sim (fast/gpu/cuda/mlp.cu ``dg_gated_gelu`` with its
bf16 flag; fast/gpu/experts.py), against the reference's bfloat16 experts (reference/primitives.py ``gated_mlp``,
reference/layers.py ``experts`` with dtype bfloat16; SPEC §10.1 B6).

The gated GELU. The GELU is computed in float32 and rounded to bfloat16, then its product with the (bfloat16) up
value is rounded. The kernel's tanhf (glibc's on cuda-sim, CUDA's on a GPU) and NumPy's tanh may differ by a
few ulps (we allow 4: 4 * 2^-24 absolute near |tanh| = 1, where its ulp is 2^-24), and the float32 GELU
0.5 x (1 + tanh(...)) carries that as an absolute error of 0.5 |x| * 2^-22 (large relative to the GELU itself in
its negative tail, where 1 + tanh cancels: a one-ulp tanh there halves or doubles the GELU), plus a relative 2^-21
for its own roundings. So a kernel's float32 GELU lies within spread = |gelu| 2^-21 + |x| 2^-23 of the
reference's, and its bfloat16 rounding between the roundings of the reference's float32 GELU moved down and up by
that spread (rounding is monotone); the product with the up value rounded is monotone in the GELU, so the output
lies between the roundings of those two GELUs times the up value. Almost every output is the reference's bit for
bit (the test bounds how many are not).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.sim import KernelLibrary, SimDevice
from diffusiongemma.reference.primitives import BFLOAT16, gelu_tanh, round_to

MLP_SOURCE = os.path.join(cb.CUDA_DIR, "mlp.cu")


def random_bf16(rng: np.random.Generator, shape: tuple, scale: float = 1.0) -> np.ndarray:
    return round_to((rng.standard_normal(shape) * scale).astype(np.float32), BFLOAT16)


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
    old, new = GELU_MUTATIONS[name]
    text = cb.assemble(MLP_SOURCE)
    assert text.count(old) == 1, f"mutation {name!r} no longer applies: update it with the kernel"
    rng = np.random.default_rng(9)
    gu = random_bf16(rng, (16, 2 * 40), 2.0)
    got = run_gated_gelu(gu, True, KernelLibrary.from_source(text.replace(old, new)))
    with pytest.raises(AssertionError):
        check_gated_gelu_bf16(gu, got)


def test_gated_gelu_launch_passes_the_flag():
    z = np.zeros
    assert gl.gated_gelu(z((3, 8), np.float32), z((3, 4), np.float32)).args[-1] == 0
    assert gl.gated_gelu(z((3, 8), np.float32), z((3, 4), np.float32), bf16=True).args[-1] == 1
