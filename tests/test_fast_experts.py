"""The routed experts' own products (``fast.experts``, ``_kernels.panel_matmul`` / ``expert_ffn``).

What they must do:

* compute x W^T within the proven float32 bound of a K-term dot product, gamma_K * sum |x_k w_k| with
  gamma_K = K u / (1 - K u), u = 2^-24 (checked against float64), at the sizes where the tiles part:
  rows around the register tile (1, 2, 3, 7, 8, 9, 16, 17), columns around the 32-wide panel (1, 31, 32,
  33, 64, 65), K around the 256-long chunk of the kernel (0, 1, 255, 256, 257, 512), empty experts;
* give the same bits on every instruction set (AVX-512, AVX2 + FMA, portable C) and with 1 or 2 threads;
* on Q8_0 weights, give bit for bit the float32 panels' result on the dequantized weights, whose values
  are the gguf package's dequantization, bit for bit (so the only bound of the Q8_0 path against the
  reference on the same file is the float32 path's);
* refuse inconsistent shapes, offsets and scales with a message naming them, before touching memory.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings, strategies as st
from threadpoolctl import threadpool_limits

from diffusiongemma.fast import _kernels as K
from diffusiongemma.fast.experts import ExpertPanels, pack_panels, pack_q8_0_panels, unpack_panels
from diffusiongemma.reference.support.quantized import Q8_0Tensor

ISAS = K.PANEL_ISAS
U = 2.0 ** -24


def f32(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(autouse=True)
def best_isa():
    """Every test leaves the kernels on the best instruction set, as it found them."""
    yield
    K.set_panel_isa("avx512")


def check_within_dot_bound(got: np.ndarray, x: np.ndarray, w: np.ndarray, what: str) -> None:
    """|got - x W^T| <= gamma_K sum_k |x_k w_k| elementwise (float64 reference), with a max-diff report."""
    k = x.shape[1]
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    gamma = k * U / (1 - k * U)
    excess = np.abs(got - exact) - gamma * magnitude - 1e-300
    assert not np.any(excess > 0), (f"{what}: max |diff| {np.abs(got - exact).max():.3e}, worst excess over the "
                                    f"bound {excess.max():.3e} at {np.unravel_index(excess.argmax(), excess.shape)}")


def run_panels(x, w, isa, q8: Q8_0Tensor | None = None) -> np.ndarray:
    K.set_panel_isa(isa)
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    if q8 is None:
        K.panel_matmul(x, pack_panels(w), w.shape[0], out)
    else:
        qp, sp = pack_q8_0_panels(q8)
        K.panel_matmul(x, qp, w.shape[0], out, scales=sp)
    return out


def test_chunk_sizes_the_tests_aim_at():
    assert K.PANEL == 32 and K.PANEL_CHUNK == 256 and K.PANEL_CHUNK % 32 == 0


def test_the_best_instruction_set_is_in_use():
    """This machine's CPU is x86-64 with at least AVX2 (the README's targets); the kernels pick it."""
    assert K.panel_isa() in ("avx2", "avx512")
    assert K.set_panel_isa("portable") == "portable"
    assert K.panel_isa() == "portable"
    with pytest.raises(ValueError, match="'sse' is not one of"):
        K.set_panel_isa("sse")


def test_packing_round_trips_and_pads_with_zeros():
    w = f32(70, 5)
    panels = pack_panels(w)
    assert panels.shape == (3, 5, 32) and panels.flags.c_contiguous
    np.testing.assert_array_equal(panels[2, :, 6:], 0.0)  # columns 70..95 do not exist
    np.testing.assert_array_equal(panels[1, 3, :], w[32:64, 3])
    np.testing.assert_array_equal(unpack_panels(panels, 70), w)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.sampled_from([0, 1, 2, 3, 7, 8, 9, 16, 17]), n=st.sampled_from([1, 31, 32, 33, 64, 65]),
       k=st.sampled_from([0, 1, 5, 255, 256, 257, 512]), seed=st.integers(0, 2 ** 16))
def test_panel_products_are_within_the_dot_bound_and_the_same_on_every_instruction_set(m, n, k, seed):
    x, w = f32(m, k, seed=seed), f32(n, k, seed=seed + 1)
    outs = [run_panels(x, w, isa) for isa in ISAS]
    for isa, out in zip(ISAS[1:], outs[1:]):
        # bit-exact: every instruction set's panel kernel adds the products in the portable kernel's order, by design
        np.testing.assert_array_equal(out, outs[0], err_msg=f"{isa} differs from portable")
    check_within_dot_bound(outs[-1], x, w, f"panels m={m} n={n} k={k}")
    if k == 0:
        np.testing.assert_array_equal(outs[-1], 0.0)


def test_signed_zero_and_cancellation_are_the_same_on_every_instruction_set():
    """Rows aimed at where orders part: exact cancellation (x w sums to 0), products that round, -0.0."""
    k = K.PANEL_CHUNK + 32  # two chunks
    x = np.zeros((9, k), np.float32)
    x[0] = 1.0
    x[1, ::2], x[1, 1::2] = 1e8, -1e8  # partial sums huge, result tiny
    x[2] = -0.0
    x[3] = np.float32(1 + 2 ** -23)
    x[4:] = f32(5, k, seed=7)
    w = np.ones((33, k), np.float32)
    w[5] = -0.0
    w[6] = np.float32(1 - 2 ** -24)
    w[7, :] = np.arange(k, dtype=np.float32) * np.float32(1e-3)
    outs = [run_panels(x, w, isa) for isa in ISAS]
    for out in outs[1:]:
        # bit-exact: as above: the instruction sets share one summation order
        assert out.tobytes() == outs[0].tobytes()  # bit for bit, signs of zeros included
    check_within_dot_bound(outs[0], x, w, "edge rows")


def q8_0_of(w: np.ndarray) -> tuple[Q8_0Tensor, np.ndarray]:
    """llama.cpp's Q8_0 of w (the gguf package's quantizer), as a Q8_0Tensor and as the file's bytes."""
    blocks = gguf.quants.quantize(w, Q.Q8_0)
    return Q8_0Tensor.from_blocks(blocks, w.shape), blocks


def test_q8_0_dequantizes_as_the_gguf_package_does():
    w = f32(3, 40, 96, seed=2)
    w[0, 0, :32] = 0.0  # a block of zeros: scale 0
    w[1, 2, 32:64] *= 1e-6  # a block with a subnormal float16 scale
    q8, blocks = q8_0_of(w)
    expected = gguf.quants.dequantize(blocks, Q.Q8_0).reshape(w.shape)
    assert q8.dequantize().tobytes() == expected.astype(np.float32).tobytes()
    assert q8.nbytes == blocks.nbytes and q8.shape == w.shape


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.sampled_from([1, 3, 8, 9, 17]), n=st.sampled_from([1, 32, 33, 65]),
       k=st.sampled_from([32, 96, 224, 256, 288, 544]), seed=st.integers(0, 2 ** 16))
def test_q8_0_panels_give_the_float32_panels_bits_on_the_dequantized_weights(m, n, k, seed):
    x = f32(m, k, seed=seed)
    q8, _ = q8_0_of(f32(n, k, seed=seed + 1))
    dense = q8.dequantize()
    for isa in ISAS:
        # bit-exact: Q8_0 panels are widened exactly to the float32 panels' values, then the same kernel sums them
        assert run_panels(x, dense, isa, q8).tobytes() == run_panels(x, dense, isa).tobytes(), isa


def reference_experts(x, offsets, gate_up, down):
    """The per-expert loop of reference.layers.experts (before the weighted sum), in float64."""
    I = down.shape[2]  # noqa: E741
    y = np.zeros((x.shape[0], down.shape[1]))
    for e in range(gate_up.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        g = x[a:b].astype(np.float64) @ gate_up[e].T.astype(np.float64)
        gelu = 0.5 * g[:, :I] * (1 + np.tanh(0.7978845608028654 * (g[:, :I] + 0.044715 * g[:, :I] ** 3)))
        y[a:b] = (gelu * g[:, I:]) @ down[e].T.astype(np.float64)
    return y


def run_experts(panels: ExpertPanels, x, offsets):
    R, I, H = x.shape[0], panels.moe_intermediate_size, panels.hidden_size
    gu, act, y = (np.full((R, 2 * I), np.nan, np.float32), np.full((R, I), np.nan, np.float32),
                  np.full((R, H), np.nan, np.float32))
    panels(x, offsets, gu, act, y)
    return y


@pytest.mark.parametrize("kind", ["float32", "q8_0"])
def test_experts_match_the_per_expert_loop_with_the_same_bits_at_one_or_two_threads(kind):
    E, I, H, R = 5, 64, 96, 120
    x, gate_up, down = f32(R, H, seed=3), f32(E, 2 * I, H, seed=4, scale=0.1), f32(E, H, I, seed=5, scale=0.1)
    if kind == "q8_0":
        gate_up, down = q8_0_of(gate_up)[0], q8_0_of(down)[0]
    panels = ExpertPanels.from_weights(gate_up, down)
    assert panels.kind == kind
    offsets = np.array([0, 30, 30, 75, 100, R], np.int64)  # expert 1 gets no rows
    results = []
    previous = K.set_parallel_threshold(0.0)
    try:
        for threads in (1, 2):
            with threadpool_limits(limits=threads):
                results.append(run_experts(panels, x, offsets))
    finally:
        K.set_parallel_threshold(previous)
    # bit-exact: threads split the experts' rows, never one dot product, so each output sums in one order
    assert results[0].tobytes() == results[1].tobytes()
    dense = lambda t: t.dequantize() if isinstance(t, Q8_0Tensor) else t  # noqa: E731
    expected = reference_experts(x, offsets, dense(gate_up), dense(down))
    np.testing.assert_allclose(results[0], expected, rtol=2e-4, atol=2e-5)
    if kind == "q8_0":  # the same bits as float32 panels of the dequantized weights
        widened = ExpertPanels.from_weights(gate_up.dequantize(), down.dequantize())
        # bit-exact: the same kernel on exactly the same (widened) values
        assert run_experts(widened, x, offsets).tobytes() == results[0].tobytes()
        assert panels.nbytes * 3.5 < widened.nbytes


def test_a_q8_0_tensor_beside_a_float32_one_is_widened():
    """A layer's experts share one kind: a file with Q8_0 gate/up and F16 down (llama.cpp writes F16 where a
    row is no whole number of Q8_0 blocks) runs on float32 panels, with the dequantized values."""
    E, I, H = 2, 48, 64  # I = 48: the down projection's rows are 1.5 blocks
    gate_up, down = q8_0_of(f32(E, 2 * I, H))[0], f32(E, H, I)
    panels = ExpertPanels.from_weights(gate_up, down)
    assert panels.kind == "float32"
    np.testing.assert_array_equal(unpack_panels(panels.gate_up, 2 * I), gate_up.dequantize())


def test_bad_shapes_offsets_and_scales_are_refused():
    E, I, H, R = 3, 32, 64, 10
    x = f32(R, H)
    panels = ExpertPanels.from_weights(f32(E, 2 * I, H), f32(E, H, I))
    bufs = np.empty((R, 2 * I), np.float32), np.empty((R, I), np.float32), np.empty((R, H), np.float32)
    for offsets, message in (([0, 6, 4, R], "decrease at expert 1"), ([0, 4, 6, R + 1], "end at most"),
                             ([1, 4, 6, R], "start at 0"), ([0, 4, R], "3 offsets \\(expected 4\\)")):
        with pytest.raises(ValueError, match=message):
            panels(x, np.array(offsets, np.int64), *bufs)
    with pytest.raises(ValueError, match="buffers"):
        panels(x, np.array([0, 4, 6, R], np.int64), bufs[0][:5], bufs[1], bufs[2])
    with pytest.raises(ValueError, match="do not hold a"):
        K.expert_ffn(x, np.array([0, 4, 6, R], np.int64), panels.gate_up, panels.gate_up, I, *bufs)
    q8 = ExpertPanels.from_weights(q8_0_of(f32(E, 2 * I, H))[0], q8_0_of(f32(E, H, I))[0])
    with pytest.raises(ValueError, match="both scales"):
        K.expert_ffn(x, np.array([0, 4, 6, R], np.int64), q8.gate_up, q8.down, I, *bufs, q8.gate_up_scales, None)
    with pytest.raises(ValueError, match="scales"):
        K.expert_ffn(x, np.array([0, 4, 6, R], np.int64), q8.gate_up, q8.down, I, *bufs, q8.down_scales,
                     q8.down_scales)
    with pytest.raises(ValueError, match="expected \\(2, 5\\)"):
        K.panel_matmul(f32(2, 8), pack_panels(f32(5, 8)), 5, np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        K.panel_matmul(f32(2, 8), pack_panels(f32(5, 8)).astype(np.int8), 5, np.empty((2, 5), np.float32),
                       scales=np.zeros((1, 0, 32), np.float32))
    with pytest.raises(Exception, match="int8 and scales float16"):
        Q8_0Tensor(values=np.zeros((2, 32), np.int16), scales=np.zeros((2, 1), np.float16))
    with pytest.raises(Exception, match="multiple of 32"):
        Q8_0Tensor(values=np.zeros((2, 48), np.int8), scales=np.zeros((2, 1), np.float16))


def test_a_model_leaves_the_callers_tensors_alone_unless_told_to_release_them():
    """``fast.Model(config, tensors)`` repacks without touching the caller's dict; ``from_pretrained``'s own
    dict is emptied of each layer's experts as they are packed (so a load never holds both copies)."""
    from diffusiongemma import fast
    from diffusiongemma.tiny import make_config, random_tensors

    config = make_config()
    tensors = random_tensors(config, seed=0)
    names = set(tensors)
    fast.Model(config, tensors)
    assert set(tensors) == names
    released = dict(tensors)
    fast.Model(config, released, release_tensors=True)
    assert not any(".experts." in name for name in released) and set(released) < names


def test_a_q8_0_tensor_with_a_non_finite_scale_is_refused_by_the_finiteness_rule():
    """Kept quantized, a Q8_0 matrix is checked through its scales (its int8 values are always finite)."""
    from diffusiongemma.reference.support.checkpoint_io import check_finite
    from diffusiongemma.reference.support.errors import CheckpointError

    scales = np.ones((2, 2), np.float16)
    check_finite(Q8_0Tensor(values=np.ones((2, 64), np.int8), scales=scales), "ok")
    scales[1, 0] = np.inf
    with pytest.raises(CheckpointError, match=r"'layers.0.experts.down_proj' holds 1 NaN or infinite"):
        check_finite(Q8_0Tensor(values=np.ones((2, 64), np.int8), scales=scales), "layers.0.experts.down_proj")
