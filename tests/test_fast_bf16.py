"""bfloat16 weights kept bfloat16 on the CPU fast path (``keep_bf16``).

A bfloat16 value is the top half of a float32's bits, so widening is exact and a bfloat16 matrix stands
for one float32 matrix. The fast path keeps such matrices bfloat16 in memory and widens them piece by
piece where it multiplies: a 256-long chunk of k of a 32-column panel for the routed experts
(``fast/panel_gemm.h``), a BLAS tile's rows for the attention, dense-MLP and self-conditioning products
(``_kernels.gemm_bf16``). What it must do, checked here:

* every product gives, bit for bit, what the float32 path gives on the widened weights: the panel kernel
  on every instruction set and at the sizes where tiles and chunks part, the experts' loop at 1 or 2
  threads, the tiled BLAS products at the tile edges, NumPy's product when no BLAS is installed;
* a whole model built from bfloat16 tensors gives the float32 model's logits (prompt encode, denoise
  without and with self-conditioning, incremental encode, second denoise) and generated tokens, bit for
  bit, while holding its large matrices at 2 bytes a weight;
* ``from_pretrained`` keeps the bfloat16 of a converted directory (``dtype`` bfloat16), of a transformers
  directory of bfloat16 safetensors and of a GGUF file's BF16 tensors by default, and widens with ``keep_bf16=False``, with the same bits either way;
* mixed or wrong kinds are refused with a message naming them.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from diffusiongemma import fast
from diffusiongemma.fast import _kernels as K
from diffusiongemma.fast.blas import CpuArrays
from diffusiongemma.fast.experts import ExpertPanels, pack_panels, unpack_panels
from diffusiongemma.fast.weights import MATRICES_KEPT_BF16
from diffusiongemma.reference.support.quantized import BFLOAT16, is_bfloat16, widen
from tests.random_weights import make_config, random_tensors
from tests.test_fast_experts import run_experts

ISAS = K.PANEL_ISAS


def bf16(*shape, seed=0, scale=1.0) -> np.ndarray:
    """Random bfloat16 values (float32 draws rounded to nearest even)."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32).astype(BFLOAT16)


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(autouse=True)
def best_isa():
    yield
    K.set_panel_isa("avx512")


def panel_product(x, w, isa) -> np.ndarray:
    K.set_panel_isa(isa)
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    K.panel_matmul(x, pack_panels(w), w.shape[0], out)
    return out


# ------------------------------------------------------------------------------------------ kernels
def test_packing_keeps_bfloat16_and_round_trips():
    w = bf16(70, 300)
    panels = pack_panels(w)
    assert panels.dtype == BFLOAT16 and panels.shape == (3, 300, 32) and panels.nbytes == 3 * 300 * 32 * 2
    assert unpack_panels(panels, 70).tobytes() == w.tobytes()
    assert not np.any(widen(panels[2, :, 70 - 64:]))  # padding columns are zeros


@pytest.mark.parametrize("m", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 255), (32, 256), (33, 257), (65, 512), (64, 544), (5, 0)])
def test_bf16_panels_give_the_float32_panels_bits_on_the_widened_weights(m, n, k):
    """Chunks of 256 values of k (one, one and a bit, two), panels whole and partial, every row-tile size."""
    x, w = f32(m, k, seed=m + n), bf16(n, k, seed=k + 1)
    wide = w.astype(np.float32)
    for isa in ISAS:
        got = panel_product(x, w, isa)
        assert got.tobytes() == panel_product(x, wide, isa).tobytes(), isa
    np.testing.assert_allclose(got, x.astype(np.float64) @ wide.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_bf16_experts_give_the_widened_experts_bits_at_one_or_two_threads_in_half_the_bytes():
    E, I, H, R = 5, 64, 288, 120  # H = 288: the gate/up products run a chunk of 256 and one of 32
    x, gate_up, down = f32(R, H, seed=3), bf16(E, 2 * I, H, seed=4, scale=0.1), bf16(E, H, I, seed=5, scale=0.1)
    kept, widened = ExpertPanels.from_weights(gate_up, down), ExpertPanels.from_weights(widen(gate_up), widen(down))
    assert (kept.kind, widened.kind) == ("bfloat16", "float32")
    assert ExpertPanels.from_weights(gate_up, down, keep_bf16=False).kind == "float32"
    assert kept.nbytes * 2 == widened.nbytes
    offsets = np.array([0, 30, 30, 75, 100, R], np.int64)  # expert 1 gets no rows
    expected = run_experts(widened, x, offsets)
    previous = K.set_parallel_threshold(0.0)
    try:
        for threads in (1, 2):
            with threadpool_limits(limits=threads):
                assert run_experts(kept, x, offsets).tobytes() == expected.tobytes(), threads
    finally:
        K.set_parallel_threshold(previous)


def test_a_bf16_tensor_beside_a_float32_one_is_widened():
    gate_up, down = bf16(2, 64, 32), f32(2, 32, 32)
    panels = ExpertPanels.from_weights(gate_up, down)
    assert panels.kind == "float32"
    np.testing.assert_array_equal(unpack_panels(panels.gate_up, 64), widen(gate_up))


@pytest.mark.skipif(not K.has_gemm(), reason="tiled products need NumPy's OpenBLAS and OpenMP (fast.blas)")
@pytest.mark.parametrize("m", [1, 16, 256, 257, 300])  # 2 * GEMM_TILE_ROWS = 256: one row tile, then 128-row tiles
@pytest.mark.parametrize("n", [7, 256, 257, 600])  # GEMM_TILE_COLS = 256
def test_tiled_bf16_products_give_the_float32_tiles_bits(m, n):
    k = 96
    x, w = f32(m, k, seed=m), bf16(n, k, seed=n)
    got, expected = np.full((m, n), np.nan, np.float32), np.full((m, n), np.nan, np.float32)
    previous = K.set_parallel_threshold(0.0)
    try:
        K.gemm_bf16(x, w, got)
        K.gemm(x, w.astype(np.float32), True, expected)
    finally:
        K.set_parallel_threshold(previous)
    # bit-exact: both products take the same path (CpuArrays.matmul on the same shapes), so they sum in the same order
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("tiled", [True, False])
def test_the_model_array_module_takes_bf16_weights_as_their_widened_values(tiled):
    """``CpuArrays.matmul(x, W.T)`` with W bfloat16: the tiled product, or NumPy's on W widened (no BLAS)."""
    if tiled and not K.has_gemm():
        pytest.skip("tiled products need NumPy's OpenBLAS and OpenMP")
    xp = CpuArrays(tiled)
    x, w = f32(20, 64), bf16(300, 64, seed=1)
    got, expected = np.empty((20, 300), np.float32), np.empty((20, 300), np.float32)
    xp.matmul(x, w.T, out=got)
    xp.matmul(x, w.astype(np.float32).T, out=expected)
    assert got.tobytes() == expected.tobytes()
    untransposed = xp.matmul(f32(3, 300), w)  # (3, 300) @ (300, 64): widened whole
    # bit-exact: the widened matrix goes to the same BLAS call as np.matmul's (same shapes and layout, same order)
    assert untransposed.tobytes() == np.matmul(f32(3, 300), w.astype(np.float32)).tobytes()


def test_wrong_kinds_are_refused():
    x = f32(4, 64)
    w = bf16(2, 32, 64)
    bufs = np.empty((4, 64), np.float32), np.empty((4, 32), np.float32), np.empty((4, 64), np.float32)
    offsets = np.array([0, 2, 4], np.int64)
    with pytest.raises(ValueError, match="both be bfloat16"):
        K.expert_ffn(x, offsets, pack_panels(bf16(2, 64, 64)), pack_panels(f32(2, 64, 32)), 32, *bufs)
    with pytest.raises(ValueError, match="take no scales"):
        K.panel_matmul(x, pack_panels(w[0]), 32, np.empty((4, 32), np.float32),
                       scales=np.zeros((1, 2, 32), np.float32))
    with pytest.raises(ValueError, match="w must be bfloat16, got float32"):
        K.gemm_bf16(x, f32(32, 64), np.empty((4, 32), np.float32))
    if K.has_gemm():
        with pytest.raises(ValueError, match="do not match"):
            K.gemm_bf16(x, w[0], np.empty((4, 31), np.float32))
    assert K.bf16_bits(f32(2)) is None and K.bf16_bits(w).dtype == np.uint16


# ------------------------------------------------------------------------------------------ whole model
def rounded_tensors(config, seed: int = 0) -> tuple[dict, dict]:
    """(bfloat16 tensors, the same values in float32) of a random tiny model."""
    kept = {name: value.astype(BFLOAT16) for name, value in random_tensors(config, seed).items()}
    return kept, {name: value.astype(np.float32) for name, value in kept.items()}


def model_outputs(model, prompt: np.ndarray) -> list[np.ndarray]:
    """Prompt encode (its cache), denoise without and with self-conditioning, incremental encode of the
    canvas, and a second canvas's denoise."""
    config = model.config
    rng = np.random.default_rng(9)
    cache = model.new_cache(prompt.shape[0])
    model.encode(prompt, cache)
    keys = [np.array(k) for k in cache.keys]
    canvas = rng.integers(0, config.vocab_size, size=(prompt.shape[0], config.canvas_length))
    first = model.denoise(canvas, cache)
    second = model.denoise(canvas, cache, (first / np.float32(0.7)).astype(np.float32))
    model.encode(canvas, cache)
    third = model.denoise(rng.integers(0, config.vocab_size, size=canvas.shape), cache)
    return keys + [first, second, third] + [np.array(k) for k in cache.keys]


def test_a_bf16_model_gives_the_float32_models_logits_and_tokens_bit_for_bit():
    config = make_config()
    kept, wide = rounded_tensors(config, seed=1)
    small, large = fast.Model(config, kept), fast.Model(config, wide)
    for w in small.layers:
        assert w.experts.kind == "bfloat16"
        assert all(getattr(w, name).dtype == BFLOAT16 for name in MATRICES_KEPT_BF16 if hasattr(w, name))
    assert small.sc_gate_up.dtype == BFLOAT16 and small.embed_tokens.dtype == np.float32
    assert {w.experts.kind for w in large.layers} == {"float32"}
    assert small.weight_nbytes < 0.75 * large.weight_nbytes
    prompt = np.random.default_rng(5).integers(3, config.vocab_size, size=(2, 21))  # longer than the window
    for a, b in zip(model_outputs(small, prompt), model_outputs(large, prompt)):
        assert a.tobytes() == b.tobytes()
    runs = [fast.generate(m, prompt, random=3, max_new_tokens=32, max_denoising_steps=8) for m in (small, large)]
    np.testing.assert_array_equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].sequences.shape[1] > prompt.shape[1]


def test_bf16_storage_is_the_float32_run_not_upstreams_bfloat16_run():
    """What the bfloat16-kept path computes: the float32 run on the stored weights (within float32 noise of the
    float32 reference on them), not the bfloat16 run of the reference (``Model(dtype="bfloat16")``, SPEC
    §10.1), which rounds activations too and lands orders of magnitude further away."""
    from diffusiongemma.reference.model import Model as RefModel

    config = make_config()
    kept, wide = rounded_tensors(config, seed=0)
    prompt = np.random.default_rng(5).integers(3, config.vocab_size, size=(2, 21))
    canvas = np.random.default_rng(6).integers(0, config.vocab_size, size=(2, config.canvas_length))
    logits = []
    for model in (fast.Model(config, kept), RefModel(config, wide), RefModel(config, wide, dtype="bfloat16")):
        cache = model.new_cache(2)
        model.encode(prompt, cache)
        logits.append(np.asarray(model.denoise(canvas, cache), np.float32))
    ours, float32_run, bfloat16_run = logits
    to_float32_run = float(np.abs(ours - float32_run).max())
    assert to_float32_run <= 1e-4 * (1 + float(np.abs(float32_run).max()))
    assert to_float32_run * 1000 < float(np.abs(bfloat16_run - float32_run).max())


def test_steady_state_denoising_with_bf16_weights_allocates_nothing_large():
    """The widened tiles live in a per-thread buffer of ``fast.blas`` that only grows: after a warm-up step a
    decoder pass allocates (every NumPy buffer, traced by tracemalloc) far less than one widened tile."""
    import tracemalloc

    config = make_config(vocab_size=4096, canvas_length=8, hidden_size=64, sliding_window=64)
    kept, _ = rounded_tensors(config)
    model = fast.Model(config, kept)
    assert model.layers[0].qkv.dtype == BFLOAT16
    B, C, V = 2, config.canvas_length, config.vocab_size
    cache = model.new_cache(B)
    model.encode(np.random.default_rng(0).integers(0, V, (B, 300)), cache)
    buffer = np.empty((B, C, V), np.float32)
    rows, canvas = np.arange(B), np.random.default_rng(1).integers(0, V, (B, C))
    model.decode_rows(canvas, rows, cache, None, buffer)
    model.decode_rows(canvas, rows, cache, buffer, buffer)  # warm-up
    tracemalloc.start()
    try:
        model.decode_rows(canvas, rows, cache, buffer, buffer)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one_tile = K.GEMM_TILE_COLS * config.hidden_size * 4
    assert peak < one_tile / 4, (peak, one_tile)


def test_keep_bf16_false_widens_at_load():
    config = make_config()
    kept, _ = rounded_tensors(config)
    model = fast.Model(config, kept, keep_bf16=False)
    assert {w.experts.kind for w in model.layers} == {"float32"}
    assert model.layers[0].qkv.dtype == np.float32 and model.sc_down.dtype == np.float32


def write_converted(path, config, tensors, dtype: str) -> None:
    """A converted checkpoint directory holding ``tensors`` as they are (float32 or bfloat16)."""
    from safetensors.numpy import save_file

    save_file(tensors, str(path / "weights-00001.safetensors"))
    (path / "diffusiongemma.json").write_text(json.dumps({
        "format": "diffusiongemma", "format_version": 1, "dtype": dtype, "model_config": config.to_dict(),
        "weight_map": {name: "weights-00001.safetensors" for name in tensors}}))


def test_from_pretrained_keeps_a_bf16_directory_bf16_by_default(tmp_path):
    config = make_config()
    kept, _ = rounded_tensors(config, seed=2)
    write_converted(tmp_path, config, kept, "bfloat16")
    small, large = fast.Model.from_pretrained(tmp_path), fast.Model.from_pretrained(tmp_path, keep_bf16=False)
    assert {w.experts.kind for w in small.layers} == {"bfloat16"} and small.layers[1].o_proj.dtype == BFLOAT16
    assert {w.experts.kind for w in large.layers} == {"float32"} and large.layers[1].o_proj.dtype == np.float32
    prompt = np.random.default_rng(6).integers(3, config.vocab_size, size=(1, 9))
    for a, b in zip(model_outputs(small, prompt), model_outputs(large, prompt)):
        assert a.tobytes() == b.tobytes()
    # the reference, and every other reader, still gets float32
    from diffusiongemma.reference.support.checkpoint_io import load_checkpoint

    assert {v.dtype for v in load_checkpoint(tmp_path)[1].values()} == {np.dtype(np.float32)}
    assert {v.dtype for v in load_checkpoint(tmp_path, keep_bf16=True)[1].values()} == {BFLOAT16}


def test_a_float32_directory_stays_float32(tmp_path):
    config = make_config()
    _, wide = rounded_tensors(config)
    write_converted(tmp_path, config, wide, "float32")
    model = fast.Model.from_pretrained(tmp_path)
    assert {w.experts.kind for w in model.layers} == {"float32"} and model.layers[0].qkv.dtype == np.float32


def test_a_gguf_files_bf16_tensors_stay_bf16(tmp_path):
    from gguf import GGMLQuantizationType as Q

    from tests.test_gguf import SPEC, tiny_model, write_gguf

    path = write_gguf(tmp_path / "bf16.gguf", tiny_model(SPEC, seed=3), Q.BF16)
    small, large = fast.Model.from_pretrained(path), fast.Model.from_pretrained(path, keep_bf16=False)
    assert {w.experts.kind for w in small.layers} == {"bfloat16"} and small.layers[0].mlp_down.dtype == BFLOAT16
    assert {w.experts.kind for w in large.layers} == {"float32"}
    prompt = np.random.default_rng(7).integers(5, SPEC.vocab_size, size=(2, 12))
    for a, b in zip(model_outputs(small, prompt), model_outputs(large, prompt)):
        assert a.tobytes() == b.tobytes()


def test_a_bf16_transformers_directory_stays_bf16(tmp_path):
    """The released checkpoint's own format: a transformers directory of bfloat16 safetensors."""
    import torch

    from tests.hf_tiny import tiny_model

    tiny_model(seed=0).to(torch.bfloat16).save_pretrained(tmp_path)
    small, large = fast.Model.from_pretrained(tmp_path), fast.Model.from_pretrained(tmp_path, keep_bf16=False)
    assert {w.experts.kind for w in small.layers} == {"bfloat16"} and small.layers[0].qkv.dtype == BFLOAT16
    assert {w.experts.kind for w in large.layers} == {"float32"} and large.layers[0].qkv.dtype == np.float32
    prompt = np.random.default_rng(8).integers(5, small.config.vocab_size, size=(1, 10))
    for a, b in zip(model_outputs(small, prompt), model_outputs(large, prompt)):
        assert a.tobytes() == b.tobytes()


def test_a_non_finite_bf16_weight_is_refused_at_load():
    from diffusiongemma.reference.support.errors import CheckpointError

    config = make_config()
    kept, _ = rounded_tensors(config)
    kept["layers.1.o_proj"] = kept["layers.1.o_proj"].copy()
    kept["layers.1.o_proj"][2, 3] = np.nan
    assert is_bfloat16(kept["layers.1.o_proj"])
    with pytest.raises(CheckpointError, match=r"'layers.1.o_proj' holds 1 NaN or infinite value\(s\) \(1 NaN, 0 inf, "
                                              r"in bfloat16"):
        fast.Model(config, kept)


def test_an_overflow_with_bf16_weights_is_diagnosed_as_with_float32_ones():
    """A post-FFN norm of 3e38 (a bfloat16 number) overflows float32 activations in layer 1: the bfloat16
    model's error names the same place and cause as the float32 model's on the widened weights."""
    from diffusiongemma.reference.support.errors import NonFiniteError

    config = make_config()
    kept, wide = rounded_tensors(config, seed=4)
    for tensors in (kept, wide):
        tensors["layers.1.post_feedforward_layernorm"] = np.full_like(tensors["layers.1.post_feedforward_layernorm"],
                                                                      3e38)
    messages = []
    with np.errstate(all="ignore"):
        for tensors in (kept, wide):
            model = fast.Model(config, tensors)
            with pytest.raises(NonFiniteError) as caught:
                fast.generate(model, np.array([[2, 100, 120]]), max_new_tokens=16)
            messages.append(str(caught.value))
    assert fast.Model(config, kept).layers[1].mlp_down.dtype == BFLOAT16
    assert messages[0] == messages[1] and "layer 1 is not finite" in messages[0], messages


def test_ml_dtypes_rounds_as_the_tests_assume():
    """float32 -> bfloat16 rounds to nearest even and widening back is exact (the premise of every test here)."""
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -7], np.float32)
    np.testing.assert_array_equal(x.astype(ml_dtypes.bfloat16).astype(np.float32), [1, 1 + 2 ** -6, 1 + 2 ** -7])
