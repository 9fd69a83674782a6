"""The GPU fast path's host side (``fast/gpu/model.py``, ``cache.py``, ``sampling.py``) on the simulated
device ("cuda-sim": the real CUDA kernels executed on the CPU by fast/gpu/sim, every check on): weight
upload and fusion, the device cache (rings, growth, padding, conversion), input errors, the launches of a
decoder pass, the self-conditioning buffer discipline (one (C x V) buffer per row), and the generation loop
(draw order, freezing of finished rows, EOS/pad, callbacks) against the reference loop bit for bit on
identical logits. The model's numbers against the reference are tests/test_gpu_equivalence.py.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from diffusiongemma.fast import gpu
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.replay import RecordingDraws
from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.support.errors import InputError, SamplingError
from diffusiongemma.reference.generate import generate as reference_generate
from diffusiongemma.reference.model import Model as ReferenceModel
from diffusiongemma.fast.gpu.sim import SimDevice
from diffusiongemma.tiny import make_config, random_tensors  # SPEC §14's tiny model and its perturbations

def pair(config: ModelConfig, seed: int = 0, final_norm_gain: float = 1.0):
    tensors = random_tensors(config, seed, final_norm_gain=final_norm_gain)
    return ReferenceModel(config, tensors), gpu.Model(config, tensors, device=SimDevice(record=True))


def close(a, b, tol=2e-4):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    scale = max(1.0, float(np.abs(b).max()) if b.size else 1.0)
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    assert diff <= tol * scale, f"max |diff| {diff:.3e} (scale {scale:.3e})"


# ------------------------------------------------------------------------------------------------ model
def test_self_conditioning_mask_and_device_output():
    config = make_config()
    ref, fast = pair(config, seed=1)
    ids = np.arange(3, 13).reshape(2, 5)
    rc, fc = ref.new_cache(2), fast.new_cache(2)
    ref.encode(ids, rc)
    fast.encode(ids, fc)
    canvas = np.arange(32).reshape(2, 16) % config.vocab_size
    sc = np.random.default_rng(0).standard_normal((2, 16, config.vocab_size)).astype(np.float32)
    m = np.array([True, False])
    out = fast.denoise(canvas, fc, sc, m, device_output=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    close(out, ref.denoise(canvas, rc, sc, m))


def test_cache_round_trip_and_copy():
    config = make_config()
    ref, fast = pair(config)
    ids = np.random.default_rng(3).integers(3, 120, size=(2, 11))
    rc = ref.new_cache(2)
    ref.encode(ids, rc)
    dev = fast.device
    back = gpu.GpuKVCache.from_reference(rc, dev).to_reference()
    for l in range(config.num_hidden_layers):
        np.testing.assert_array_equal(back.keys[l], rc.keys[l])
    fc = fast.new_cache(2)
    fast.encode(ids, fc)
    twin = fc.copy()
    fast.encode(ids[:, :3], fc)
    assert twin.length == 11 and fc.length == 14
    canvas = np.zeros((2, 16), dtype=np.int64)
    close(fast.denoise(canvas, gpu.GpuKVCache.from_reference(rc, dev)), ref.denoise(canvas, rc))


def test_bad_inputs_raise_clear_errors():
    config = make_config()
    _, fast = pair(config)
    cache = fast.new_cache(1)
    with pytest.raises(InputError, match="outside"):
        fast.encode(np.array([[5, 128]]), cache)
    with pytest.raises(InputError, match="batch size"):
        fast.encode(np.ones((2, 3), dtype=np.int64), cache)
    with pytest.raises(InputError, match="0 and 1"):
        fast.encode(np.ones((1, 3), dtype=np.int64), cache, np.array([[1, 2, 1]]))
    assert cache.length == 0
    fast.encode(np.ones((1, 3), dtype=np.int64), cache)
    with pytest.raises(InputError, match="canvas_length"):
        fast.denoise(np.zeros((1, 15), dtype=np.int64), cache)
    with pytest.raises(InputError, match="shape"):
        fast.denoise(np.zeros((1, 16), dtype=np.int64), cache, np.zeros((1, 16, 7), dtype=np.float32))
    bad = np.zeros((1, 16, config.vocab_size), dtype=np.float32)
    bad[0, 3, 5] = np.nan
    with pytest.raises(InputError, match=r"\(0, 3\).*NaN"):
        fast.denoise(np.zeros((1, 16), dtype=np.int64), cache, bad)
    with pytest.raises(InputError, match="GpuKVCache"):
        fast.denoise(np.zeros((1, 16), dtype=np.int64), ReferenceModel(config, random_tensors(config)).new_cache(1))
    with pytest.raises(InputError, match="cuda"):
        gpu.Model(config, random_tensors(config), device="gpu0")


def test_missing_cupy_is_a_clear_runtime_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(RuntimeError, match="CuPy"):
        gpu.CupyDevice("cuda")
    ok, reason = gpu.gpu_available()
    assert not ok and "CuPy" in reason
    config = make_config()
    with pytest.raises(RuntimeError, match="CuPy"):
        gpu.Model(config, random_tensors(config), device="cuda")


def test_launches_of_one_denoise_are_within_limits():
    """Every kernel the decoder uses is launched with a legal geometry and the attention plan fits."""
    config = make_config()
    _, fast = pair(config)
    cache = fast.new_cache(2)
    fast.encode(np.ones((2, 13), dtype=np.int64), cache)
    dev = fast.device
    dev.launches.clear()
    fast.denoise(np.zeros((2, 16), dtype=np.int64), cache, np.zeros((2, 16, 128), dtype=np.float32))
    used = {launch.kernel for launch in dev.launches}
    assert used >= {"dg_embed", "dg_rms_norm", "dg_qkv_heads", "dg_attention", "dg_residual_norm", "dg_gated_gelu",
                    "dg_router", "dg_group_experts", "dg_gather_rows", "dg_grouped_gemm_nt", "dg_combine_experts",
                    "dg_ffn_tail", "dg_softcap", "dg_sample_rows"}
    for launch in dev.launches:
        assert all(g >= 1 for g in launch.grid) and 1 <= np.prod(launch.block) <= 1024
        if launch.kernel == "dg_attention":
            assert launch.shared_mem <= 48 * 1024 and launch.grid[2] == 2


# ------------------------------------------------------------------------------------------------ loop
V, C = 128, 16


def fake_logits(canvas: np.ndarray, *_ignored) -> np.ndarray:
    """Deterministic soft-capped logits (B, C, V) that depend only on each row's canvas: peaked enough that
    acceptance, stopping and EOS (id 1) are all reached in a few steps."""
    canvas = np.asarray(canvas)
    B = canvas.shape[0]
    rng = np.random.default_rng(1234)
    base = rng.standard_normal((C, V)).astype(np.float32) * 3.0
    base[:, 1] -= 2.0
    row_bias = (canvas.sum(axis=1, keepdims=True) % 5).astype(np.float32)[:, :, None]  # (B, 1, 1)
    sharp = np.float32(1.0) + np.float32(0.5) * (canvas[:, :, None] % 3).astype(np.float32)
    z = base[None] * sharp + row_bias * 0.1 * np.arange(V, dtype=np.float32)[None, None, :] / V
    z = z.reshape(B, C, V)
    z[:, 9, 1] += np.float32(25.0) * (row_bias[:, 0, 0] >= 2)  # some canvases end with EOS at position 9
    return (np.float32(30.0) * np.tanh(z / np.float32(30.0))).astype(np.float32)


class Recorder:
    def __init__(self):
        self.steps, self.canvases = [], []

    def on_step(self, info):
        self.steps.append(info)

    def on_canvas(self, info):
        self.canvases.append(info)


@pytest.mark.slow
@pytest.mark.parametrize("B,max_new,stability,confidence,draws,reaches", [
    (1, 32, 1, 1.2, "seeded", ""),
    (2, 40, 1, 1.5, "seeded", "partial eos"),  # rows freeze at different steps, EOS in one row
    (3, 64, 2, 10.0, "seeded", "partial eos"),
    (3, 48, 0, 1.5, "recorded", "eos"),  # probabilities handed to the host draw source
    (2, 33, None, None, "seeded", "eos"),  # no adaptive stopping: always N steps
])
@pytest.mark.parametrize("options", [{}, {"sync_every": 1}, {"sync_every": 5}, {"device_loop": False}],
                         ids=["device-loop", "flag-every-step", "flag-every-5", "spec-loop"])
def test_loop_matches_reference_loop_on_identical_logits(B, max_new, stability, confidence, draws, reaches, options):
    """The GPU backend's canvas loop on the device (``fast/gpu/canvas.py``; the stop flag read every 4, 1 or 5
    steps) and through the spec's per-step loop: every step, the stop steps, the forward passes, and the
    draw source's position afterwards equal the reference's on the same logits and draws."""
    config = make_config()
    _, fast = pair(config)
    ref_model = ReferenceModel(config, random_tensors(config))
    prompt = np.random.default_rng(B).integers(3, 120, size=(B, 7))
    kwargs = dict(max_new_tokens=max_new, stability_threshold=stability, confidence_threshold=confidence,
                  eos_token_id=[1], pad_token_id=0, max_denoising_steps=12)
    source = (lambda: SeededDraws(5)) if draws == "seeded" else (lambda: RecordingDraws(SeededDraws(5)))
    rec_ref, rec_gpu = Recorder(), Recorder()
    ref_draws, gpu_draws = source(), source()
    expected = reference_generate(ref_model, prompt, random=ref_draws, denoiser=lambda c, cache, sc: fake_logits(c),
                                  callback=rec_ref, **kwargs)
    got = gpu.generate(fast, prompt, random=gpu_draws, callback=rec_gpu, **kwargs,
                   backend_options=dict(options, logits_hook=lambda c, rows: fake_logits(c)))
    # the stream continues where the reference's does (a canvas's draws are made ahead on the device loop)
    np.testing.assert_array_equal(gpu_draws.categorical_uniforms(1, 4), ref_draws.categorical_uniforms(1, 4))
    np.testing.assert_array_equal(got.sequences, expected.sequences)
    np.testing.assert_array_equal(got.tokens_per_forward, expected.tokens_per_forward)
    np.testing.assert_array_equal(got.forward_passes, expected.forward_passes)
    assert got.steps_per_canvas == expected.steps_per_canvas
    assert len(rec_gpu.steps) == len(rec_ref.steps)
    for a, b in zip(rec_gpu.steps, rec_ref.steps):
        np.testing.assert_array_equal(a.draft, b.draft)
        np.testing.assert_array_equal(a.canvas, b.canvas)
        np.testing.assert_array_equal(a.accepted, b.accepted)
        np.testing.assert_array_equal(a.finished, b.finished)
        np.testing.assert_array_equal(a.sampled, b.sampled)
        assert (a.step, a.step_index, a.canvas_index) == (b.step, b.step_index, b.canvas_index)
        # the kernel's entropy (float32 exp, float64 sums per thread) is not the reference's bit for bit
        np.testing.assert_allclose(a.entropies, b.entropies, rtol=1e-4, atol=1e-5)
        assert a.temperature == b.temperature
    # the cases must reach what they are meant to exercise
    if "partial" in reaches:
        assert any(s.finished.any() and not s.finished.all() for s in rec_ref.steps), "no row was frozen"
    if "eos" in reaches:
        assert (expected.sequences[:, 7:] == 1).any(), "no EOS reached: the case lost its point"
    if stability is None:
        assert set(expected.steps_per_canvas) == {12}
    else:
        assert any(s.finished.any() for s in rec_ref.steps), "no row ever finished denoising"


@pytest.mark.slow
def test_generate_on_the_simulated_device_keeps_one_vocab_buffer():
    config = make_config(vocab_size=211)  # a vocabulary size no other dimension shares
    ref, fast = pair(config, seed=2, final_norm_gain=25.0)
    prompt = np.random.default_rng(0).integers(3, 120, size=(2, 9))
    dev = fast.device
    dev.allocations.clear()
    kwargs = dict(max_new_tokens=32, max_denoising_steps=6, eos_token_id=[1], pad_token_id=0)
    got = gpu.generate(fast, prompt, random=3, **kwargs)
    vocab_sized = [shape for shape, _ in dev.allocations if shape and shape[-1] == 211 and np.prod(shape) >= C * 211]
    assert vocab_sized == [(2, C, 211)], f"(canvas x vocab) buffers allocated: {vocab_sized}"
    mine, theirs = Recorder(), Recorder()
    gpu.generate(fast, prompt, random=3, callback=mine, **kwargs)
    expected = reference_generate(ref, prompt, random=3, callback=theirs, **kwargs)
    assert got.sequences.shape == expected.sequences.shape
    assert isinstance(got.cache, gpu.GpuKVCache) and got.cache.length == expected.cache.length
    # Same weights, float32 noise only. Decisions are chaotic under that noise (trap T20), so only the
    # first step is compared exactly; the loop itself is compared bit for bit on identical logits above.
    first, ref_first = mine.steps[0], theirs.steps[0]
    np.testing.assert_array_equal(first.draft, ref_first.draft)
    np.testing.assert_array_equal(first.sampled, ref_first.sampled)
    np.testing.assert_allclose(first.entropies, ref_first.entropies, atol=1e-4)


def test_generate_takes_a_host_denoiser_like_the_reference_and_reports_nan():
    config = make_config()
    ref, fast = pair(config)
    prompt = np.ones((1, 3), dtype=np.int64)
    kwargs = dict(max_new_tokens=16, max_denoising_steps=4, random=2)
    got = gpu.generate(fast, prompt, denoiser=lambda c, cache, sc: fake_logits(c), **kwargs)
    expected = reference_generate(ref, prompt, denoiser=lambda c, cache, sc: fake_logits(c), **kwargs)
    np.testing.assert_array_equal(got.sequences, expected.sequences)
    with pytest.raises(InputError, match="denoiser returned"):
        gpu.generate(fast, prompt, denoiser=lambda *a: None, **kwargs)

    def nan_logits(c, rows):
        z = fake_logits(c)
        z[0, 4, 7] = np.nan
        return z

    with pytest.raises(SamplingError, match=r"\(0, 4\).*NaN"):
        gpu._generate(fast, np.ones((1, 3), dtype=np.int64), None, None, random=0, cache=None, decoder_input_ids=None,
                      self_conditioning_logits=None, callback=None, overrides={"max_new_tokens": 16},
                      logits_hook=nan_logits)


def test_a_nan_at_a_later_step_is_named_by_the_device_loop():
    """NaN logits of one row at the third step of a canvas: the stop flag read after the stretch names that
    (row, position), as the per-step loop would (the flags of every step stay on the device, per row)."""
    config = make_config()
    _, fast = pair(config)
    calls = []

    def late_nan(c, rows):
        calls.append(rows)
        z = fake_logits(c)
        if len(calls) == 3:
            z[1, 3, 5] = np.nan
        return z

    with pytest.raises(SamplingError, match=r"\(1, 3\).*NaN"):
        gpu._generate(fast, np.ones((2, 3), dtype=np.int64), None, None, random=0, cache=None,
                      decoder_input_ids=None, self_conditioning_logits=None, callback=None,
                      overrides={"max_new_tokens": 16, "max_denoising_steps": 6}, logits_hook=late_nan)
    assert len(calls) == 4  # the stretch of 4 steps ran before the flag was read


@pytest.mark.slow
def test_shipped_model_on_the_gpu_sim_backend_gives_the_reference_tokens():
    """What ``diffusiongemma generate --backend gpu-sim`` runs (checkpoint.load_model / generate_function)
    gives the reference's tokens on the shipped model: one canvas, three denoising steps, seed 1."""
    from diffusiongemma.checkpoint import default_model_dir, generate_function, load_model

    path = default_model_dir()
    prompt = np.array([[2, 310, 47, 1022, 9]])
    kwargs = dict(max_new_tokens=32, max_denoising_steps=3, random=1)
    model = load_model(path, "gpu-sim")
    assert isinstance(model.device, SimDevice) and model.device.checks
    got = generate_function("gpu-sim")(model, prompt, **kwargs)
    expected = generate_function("reference")(load_model(path, "reference"), prompt, **kwargs)
    np.testing.assert_array_equal(got.sequences, expected.sequences)
    assert got.steps_per_canvas == expected.steps_per_canvas


def test_pairwise_mean_is_numpys_float32_mean_bit_for_bit():
    """The stopping rule's mean entropy on the device (``canvas.pairwise_mean``) is NumPy's float32 mean, bit
    for bit, for canvas lengths across the pairwise block sizes and values of any scale."""
    from diffusiongemma.fast.gpu.canvas import pairwise_mean

    rng = np.random.default_rng(0)
    for C in list(range(1, 40)) + [63, 64, 65, 127, 128, 129, 200, 256, 257, 300, 512]:
        H = (rng.random((4, C)) * rng.choice([1e-6, 1e-2, 1.0, 7.0, 1e4], (4, C))).astype(np.float32)
        mine = pairwise_mean(np, H)
        assert mine.dtype == np.float32
        # bit-exact: pairwise_mean adds in NumPy's own pairwise order (no BLAS on either side), which is what it checks
        np.testing.assert_array_equal(mine.view(np.int32), np.mean(H, axis=-1, dtype=np.float32).view(np.int32),
                                      err_msg=f"C={C}")


def test_the_step_kernels_stopping_rule_decides_on_numpys_float32_mean():
    """``dg_step_update`` (the captured step's stopping rule) decides "mean entropy < γ" on NumPy's float32 mean
    bit for bit: with γ equal to a row's mean the row does not stop, with γ one float32 above it the row stops
    (at the step index read on the device), for canvas lengths across the pairwise block sizes."""
    from diffusiongemma.fast.gpu import launch as gl

    dev = SimDevice(checks=False)
    rng = np.random.default_rng(1)
    B, N, step = 3, 4, 2
    for C in (5, 8, 64, 129, 300):
        H = (rng.random((B, C)) * rng.choice([1e-3, 1.0, 7.0], (B, C))).astype(np.float32)
        means = np.mean(H, axis=-1, dtype=np.float32)
        for b in range(B):
            for gamma, stops in ((means[b], False), (np.nextafter(means[b], np.float32(np.inf)), True)):
                finished, finish_step = dev.zeros((B,), np.uint8), dev.to_device(np.full(B, N, dtype=np.int32))
                dev.launch(gl.step_update(
                    dev.zeros((B * C,), np.int64), dev.to_device(H.reshape(-1)), dev.zeros((B * C,), np.int64),
                    dev.zeros((N, B, C), np.int64), dev.to_device(np.array([step], dtype=np.int32)), 0.5, True, 0,
                    float(gamma), dev.zeros((B, C), np.int64), dev.zeros((B, C), np.int64),
                    dev.zeros((B, C), np.float32), finished, finish_step, dev.zeros((1, B, C), np.int64)))
                assert bool(finished[b]) == stops, (C, b, gamma, means[b])
                assert finish_step[b] == (step if stops else N), (C, b)


def test_prefetched_draws_leave_the_stream_where_the_executed_steps_do():
    """A canvas's draws made ahead (``canvas.prefetch_draws``) are the spec loop's, step by step, and putting
    the generator back after s steps leaves it where s steps of the spec's loop leave it."""
    from diffusiongemma.fast.gpu.canvas import prefetch_draws, restore_draws

    B, C, V, N = 2, 5, 1000, 6
    for s in range(N + 1):
        ahead = SeededDraws(3)
        uniforms, noise, states = prefetch_draws(ahead, N, B, C, V)
        restore_draws(ahead, states, s)
        spec = SeededDraws(3)
        for i in range(s):
            np.testing.assert_array_equal(uniforms[i], spec.categorical_uniforms(B, C))
            np.testing.assert_array_equal(noise[i], spec.renoise_ids(B, C, V))
        np.testing.assert_array_equal(ahead.canvas_ids(B, C, V), spec.canvas_ids(B, C, V))
        np.testing.assert_array_equal(ahead.categorical_uniforms(B, C), spec.categorical_uniforms(B, C))


# The seed of the draws in the test below, picked by its margin (tests/decision_margins.py): every draw,
# argmax, acceptance and stop of the run stays as it is under any change of the raw logits up to LOGIT_NOISE
# (about 20 float32 ulps of its largest logit, |z| < 4), which is far more than the few ulps that summing
# the decoder's products in another order moves them. Seeds 0-11 have margins 0.05-2.3 at this noise.
REPLAY_SEED, LOGIT_NOISE = 8, 1e-5


@pytest.mark.parametrize("sync_every", [1, 4])
def test_the_replayed_decoder_pass_gives_the_same_run(sync_every):
    """Each canvas's decoder pass captured once and replayed (``graph.py``, the recorded plan cuda-sim runs
    where a GPU launches a CUDA graph) against the same pass issued launch by launch and against the spec's
    per-step loop: the same tokens, stop steps, forward passes and draw position, also when rows stop at
    different steps (the live rows change and the pass is captured again)."""
    from tests.decision_margins import StepsKept, UniformsKept, assert_clear_of_ties, margins

    config = make_config()
    ref, fast = pair(config, seed=1)
    prompt = np.random.default_rng(3).integers(3, 120, size=(3, 7))
    # mean entropies fall from ~4.5 over the steps: rows cross 4.4 at different steps
    kwargs = dict(max_new_tokens=32, max_denoising_steps=8, stability_threshold=0, confidence_threshold=4.4,
                  eos_token_id=[1], pad_token_id=0)
    kept, steps = UniformsKept(REPLAY_SEED), StepsKept()
    reference_generate(ref, prompt, random=kept, callback=steps, **kwargs)
    assert_clear_of_ties(margins(steps.steps, kept.kept, LOGIT_NOISE, 0.1, 4.4), LOGIT_NOISE)
    runs = []
    for options in ({"graphs": True}, {"graphs": False}, {"device_loop": False}):
        draws, rec = SeededDraws(REPLAY_SEED), Recorder()
        result = gpu.generate(fast, prompt, random=draws, callback=rec,
                              backend_options=dict(options, sync_every=sync_every), **kwargs)
        runs.append((result, draws.categorical_uniforms(1, 3), rec))
    (a, ua, ra), *others = runs
    for n, (b, ub, rb) in enumerate(others):
        np.testing.assert_array_equal(a.sequences, b.sequences)
        np.testing.assert_array_equal(a.forward_passes, b.forward_passes)
        assert a.steps_per_canvas == b.steps_per_canvas
        np.testing.assert_array_equal(ua, ub)
        assert len(ra.steps) == len(rb.steps)
        for x, y in zip(ra.steps, rb.steps):
            np.testing.assert_array_equal(x.draft, y.draft)
            if n == 0:
                # bit-exact: the replayed plan re-issues the recorded launches on the same buffers and rows, so
                # every product has the same shape and sums in the same order as the pass issued directly
                np.testing.assert_array_equal(x.entropies, y.entropies)
            else:
                # the spec's loop multiplies only the live rows, the device loop all of them: once a row has
                # stopped, BLAS may block a product of another height differently (a few float32 ulps)
                np.testing.assert_allclose(x.entropies, y.entropies, rtol=0,
                                           atol=32 * np.finfo(np.float32).eps * float(np.abs(y.entropies).max()))
    assert any(s.finished.any() and not s.finished.all() for s in ra.steps), "no row stopped before the others"


def test_a_captured_pass_refuses_host_copies():
    from diffusiongemma.fast.gpu import graph

    device = SimDevice(checks=False)
    x = device.zeros((4,), np.float32)
    with pytest.raises(graph.CaptureError, match="copy to the host"):
        graph.capture(device, lambda rec: rec.to_host(x))
    with pytest.raises(graph.CaptureError, match="copy to the device"):
        graph.capture(device, lambda rec: rec.to_device(np.ones(3)))
    plan = graph.capture(device, lambda rec: rec.xp.add(x, np.float32(1), out=x))
    graph.replay(device, plan)
    np.testing.assert_array_equal(x, 2.0)  # once while recording, once replayed
