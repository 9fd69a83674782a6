"""The GPU path's kernels against the reference: on the simulated device in every run, on a GPU where one is.

Every test takes the ``device`` fixture: "cuda-sim" always (the CUDA sources of fast/gpu/cuda executed on
the CPU by fast/gpu/sim, with the bounds, shared-memory race, divergence and schedule checks on: a check
failure is a test failure), and "cuda" as well when CuPy sees a GPU (marked ``gpu``: ``pytest -m gpu``
selects only those, as ``benchmarks/gpu_check.sh`` does). No test is skipped on a machine without a GPU;
the real-device variants are then simply not collected (a line says so).

* forward passes (encode, cache, denoise with and without self-conditioning, padding, ring wrap) on
  hypothesis-drawn tiny configs, one larger config (several attention tiles and vocabulary chunks) and
  the edge shapes: a canvas of 1, a vocabulary that is not a multiple of the block, a window longer than
  the cache, every token on one expert, experts no token chooses, head dim 512;
* the sampling and acceptance kernels against the reference functions on the same logits and uniforms;
* the MoE pipeline kernels on crafted routings (one expert takes every token, the others none);
* the generation loop bit for bit on identical logits; the model along a reference generation (teacher
  forced); ``generate`` itself with the same draws on a contractive model, where every decision must match
  unless it is a near tie (detected from the reference's logits and reported as a warning);
* logits against transformers on a tiny randomised model loaded with ``from_pretrained(device=...)``;
* every ``extern "C" __global__`` kernel of fast/gpu/cuda was launched by this module.
"""

from __future__ import annotations

import collections
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusiongemma.fast import gpu
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.device import make_device
from diffusiongemma.fast.gpu.sampling import _StepOutputs
from diffusiongemma.reference import sampling as S
from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.generate import generate as reference_generate
from diffusiongemma.reference.model import Model as ReferenceModel
from diffusiongemma.reference.primitives import gelu_tanh, softcap
from tests.gpu_kernel_helpers import float32_expert_launches
from diffusiongemma.tiny import make_config, random_tensors
from tests.test_gpu_host import Recorder, close, fake_logits

GPU_OK, GPU_REASON = gpu.gpu_available()
DEVICES = [pytest.param("cuda-sim", id="sim")]
if GPU_OK:
    DEVICES.append(pytest.param("cuda", id="gpu", marks=pytest.mark.gpu))
else:
    print(f"GPU equivalence tests run on cuda-sim only: {GPU_REASON}")

#: kernel launches of this module per device name (the coverage test at the end reads it)
LAUNCHED: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class Counting:
    """A device that counts its launches per kernel (everything else is the wrapped device's)."""

    def __init__(self, device, name: str):
        self._device, self._name = device, name

    def __getattr__(self, name):
        return getattr(self._device, name)

    def launch(self, launch):
        LAUNCHED[self._name][launch.kernel] += 1
        self._device.launch(launch)


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return Counting(make_device(request.param), request.param)


def pair(config, device, seed=0, gain=1.0, tensors=None):
    tensors = tensors or random_tensors(config, seed, final_norm_gain=gain)
    return ReferenceModel(config, tensors), gpu.Model(config, tensors, device=device)


def forward_round_trip(ref, fast, B, P, rng, mask=None, steps=1):
    """Encode, denoise (with and without self-conditioning), commit, repeat; caches compared at the end."""
    config = ref.config
    ids = rng.integers(3, config.vocab_size, size=(B, P))
    rc, fc = ref.new_cache(B), fast.new_cache(B)
    close(fast.encode(ids, fc, mask), ref.encode(ids, rc, mask), tol=5e-4)
    for _ in range(steps):
        canvas = rng.integers(0, config.vocab_size, size=(B, config.canvas_length))
        z = ref.denoise(canvas, rc)
        close(fast.denoise(canvas, fc), z)
        sc = z / np.float32(0.7)
        close(fast.denoise(canvas, fc, sc), ref.denoise(canvas, rc, sc))
        ref.encode(canvas, rc)
        fast.encode(canvas, fc)
    mine = fc.to_reference()
    for l in range(config.num_hidden_layers):
        close(mine.keys[l], rc.keys[l])
        close(mine.values[l], rc.values[l])
    np.testing.assert_array_equal(mine.is_real, rc.is_real)


# ------------------------------------------------------------------------------------------------ forward
@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_forward_matches_reference(device, data):
    layers = data.draw(st.sampled_from(["SSFSF", "F", "SF"]))  # S: sliding, F: full attention
    heads, kv = data.draw(st.sampled_from([(4, 2), (4, 1), (4, 4), (2, 1)]))
    window = data.draw(st.integers(2, 12))
    B, P = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 24))
    config = make_config(layer_types=layers, num_attention_heads=heads, sliding_kv_heads=kv, full_kv_heads=1,
                         sliding_window=window)
    ref, fast = pair(config, device, seed=data.draw(st.integers(0, 3)))
    rng = np.random.default_rng(P * 7 + B)
    mask = np.ones((B, P), dtype=np.int64)
    if B > 1 and P > 3:
        mask[1, : data.draw(st.integers(1, P - 1))] = 0
    forward_round_trip(ref, fast, B, P, rng, mask, steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["canvas of 1", "vocab 1037", "window longer than the cache", "head dim 512",
                                  "every token on both experts", "experts no token chooses"])
def test_edge_shapes_match_reference(device, case):
    """Shapes at the kernels' edges: one canvas position (one query row per block, one-key tiles of the
    self-attention); a vocabulary of 1037 (not a multiple of the 256 sampling threads, one full 1024-entry
    chunk and a partial one); a sliding window of 30 over a cache of at most 13 positions; full-attention
    heads of 512 dims (the kernels' maximum: 16 accumulators per lane, a key tile under the shared-memory
    budget, dynamic shared memory above 48 KiB); two experts with top-2 routing (every token on both
    experts); 16 experts with top-2 for a single prompt token (14 experts with empty groups)."""
    kwargs, B, P = {}, 2, 9
    if case == "canvas of 1":
        kwargs = dict(canvas_length=1)
    elif case == "vocab 1037":
        kwargs = dict(vocab_size=1037)
    elif case == "window longer than the cache":
        kwargs, P = dict(sliding_window=30), 13
    elif case == "head dim 512":
        kwargs = dict(layer_types="SF", full_head_dim=512)
    elif case == "every token on both experts":
        kwargs = dict(num_experts=2, top_k_experts=2)
    else:
        kwargs, B, P = dict(num_experts=16, top_k_experts=2), 1, 1
    config = make_config(**kwargs)
    ref, fast = pair(config, device, seed=1)
    forward_round_trip(ref, fast, B, P, np.random.default_rng(3), steps=1)


@pytest.mark.slow
def test_larger_config_matches_reference(device):
    """Several attention key tiles and query blocks, head dims 128/256, vocabulary of several chunks."""
    config = make_config(layer_types="SF", vocab_size=3000, hidden_size=128, num_attention_heads=8, sliding_kv_heads=4,
                         full_kv_heads=2, sliding_head_dim=128, full_head_dim=256, num_experts=8, top_k_experts=2,
                         sliding_window=40, canvas_length=32)
    ref, fast = pair(config, device, seed=5)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 3000, size=(1, 70))
    rc, fc = ref.new_cache(1), fast.new_cache(1)
    close(fast.encode(ids, fc), ref.encode(ids, rc), tol=5e-4)
    canvas = rng.integers(0, 3000, size=(1, 32))
    z = ref.denoise(canvas, rc)
    close(fast.denoise(canvas, fc), z)
    close(fast.denoise(canvas, fc, z / np.float32(0.8)), ref.denoise(canvas, rc, z / np.float32(0.8)))


# ------------------------------------------------------------------------------------------------ kernels
def test_sampling_kernel_matches_reference(device):
    rng = np.random.default_rng(7)
    R, V = 6, 2500  # three vocabulary chunks, the last one partial
    raw = (rng.standard_normal((R, V)) * 6).astype(np.float32)
    raw[3, 100:] = -np.inf  # a row with excluded ids
    raw[4, 7] = raw[4].max() + 1.0  # a clear argmax early in the row
    temp, cap = np.float32(0.7), 30.0
    processed = S.scale_logits(softcap(raw, cap), temp)
    probs, ent = S.softmax_and_entropy(processed)
    u = rng.random(R)
    u[5] = 0.999999  # a draw at the end of the distribution
    expected = S.categorical_from_uniform(probs, u)
    buf = device.to_device(raw)
    out = _StepOutputs(device, R)
    device.launch(gl.sample_rows(buf, device.to_device(np.arange(R, dtype=np.int32)), cap, float(temp),
                                 device.to_device(u), out.argmax, out.entropy, out.sampled, out.flags))
    assert (device.to_host(out.flags) == 0).all()
    np.testing.assert_array_equal(device.to_host(out.argmax), S.argmax_tokens(processed))
    np.testing.assert_allclose(device.to_host(out.entropy), ent, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(device.to_host(buf), probs, rtol=2e-5, atol=1e-9)
    got = device.to_host(out.sampled)
    for i in np.flatnonzero(got != expected):  # only a draw within rounding of a CDF boundary may differ
        cdf = np.cumsum(probs[i], dtype=np.float64)
        target = u[i] * cdf[-1]
        assert min(abs(cdf[expected[i]] - target), abs(cdf[got[i]] - target)) < 1e-5, (i, got[i], expected[i])
    # non-finite rows are flagged, not sampled
    bad = raw[:3].copy()
    bad[0, 5], bad[1, 9], bad[2, :] = np.nan, np.inf, -np.inf
    out = _StepOutputs(device, 3)
    device.launch(gl.sample_rows(device.to_device(bad), device.to_device(np.arange(3, dtype=np.int32)), 0.0, 0.0,
                                 None, out.argmax, out.entropy, out.sampled, out.flags))
    np.testing.assert_array_equal(device.to_host(out.flags), [1, 2, 4])


def test_accept_renoise_kernel_is_exact(device):
    rng = np.random.default_rng(3)
    B, C = 4, 40
    H = (rng.random((B, C)) * 0.05).astype(np.float32)
    H[1, ::3] = H[1, 0]  # ties
    H[2] = 0.0
    sampled, noise = rng.integers(0, 1000, (B, C)), rng.integers(0, 1000, (B, C))
    for bound in (0.0, 0.1, 1.0, 100.0):
        acc, nxt = device.empty((B, C), np.uint8), device.empty((B, C), np.int64)
        device.launch(gl.accept_renoise(device.to_device(H), device.to_device(sampled), device.to_device(noise), bound,
                                        acc, nxt))
        expected = S.entropy_bound_accept(H, bound)
        np.testing.assert_array_equal(device.to_host(acc).astype(bool), expected)
        np.testing.assert_array_equal(device.to_host(nxt), S.renoise(sampled, expected, noise))


@pytest.mark.parametrize("routing", ["all on expert 0 and 1", "all on expert 3 only", "spread"])
def test_moe_pipeline_on_crafted_routings(device, routing):
    """Router, grouping, gather, grouped GEMMs and combination against NumPy, for routings where one expert
    takes every token and the others none (empty groups, padding tiles, tiles skipped by the GEMM)."""
    rng = np.random.default_rng(11)
    N, E, H, I = 21, 6, 40, 24
    K = 1 if routing == "all on expert 3 only" else 2
    logits = rng.standard_normal((N, E)).astype(np.float32)
    if routing == "all on expert 0 and 1":
        logits[:, 0] += 20.0
        logits[:, 1] += 10.0
    elif routing == "all on expert 3 only":
        logits[:, 3] += 20.0
    scale = (0.5 + rng.random(E)).astype(np.float32)
    x = rng.standard_normal((N, H)).astype(np.float32)
    w_gu = (0.2 * rng.standard_normal((E, 2 * I, H))).astype(np.float32)
    w_down = (0.2 * rng.standard_normal((E, H, I))).astype(np.float32)
    # expected, in NumPy
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :K]
    top_p = np.take_along_axis(p, top, -1)
    weights = top_p / top_p.sum(-1, keepdims=True) * scale[top]
    expected = np.zeros((N, H), np.float32)
    for t in range(N):
        for k in np.argsort(top[t], kind="stable"):
            e = top[t, k]
            gu = w_gu[e] @ x[t]
            expected[t] += (w_down[e] @ (gelu_tanh(gu[:I]) * gu[I:])).astype(np.float32) * np.float32(weights[t, k])
    # the device pipeline (the order fast/gpu/model.py launches it in)
    d = device
    probs = d.to_device(logits)
    indices, wts = d.empty((N, K), np.int64), d.empty((N, K), np.float32)
    d.launch(gl.router(probs, d.to_device(scale), indices, wts))
    np.testing.assert_array_equal(d.to_host(indices), top)
    np.testing.assert_allclose(d.to_host(wts), weights, rtol=1e-5)
    out, offsets = float32_expert_launches(d, d.to_device(x), indices, wts, d.to_device(w_gu), d.to_device(w_down), E)
    counts = np.diff(d.to_host(offsets))
    hit = np.bincount(top.reshape(-1), minlength=E)
    tm = gl.const("DG_GEMM_TM")
    np.testing.assert_array_equal(counts, -(-hit // tm) * tm)
    if routing != "spread":
        assert (hit == N).sum() == K and (hit == 0).sum() == E - K  # experts taking all tokens / none
    close(d.to_host(out), expected, tol=2e-5)


# ------------------------------------------------------------------------------------------------ generation
@pytest.mark.slow
@pytest.mark.parametrize("B,max_new,stability,confidence", [(2, 40, 1, 1.5), (3, 33, None, None)])
def test_loop_matches_reference_loop_on_identical_logits(device, B, max_new, stability, confidence):
    config = make_config()
    ref_model, fast = pair(config, device)
    prompt = np.random.default_rng(B).integers(3, 120, size=(B, 7))
    kwargs = dict(max_new_tokens=max_new, stability_threshold=stability, confidence_threshold=confidence,
                  eos_token_id=[1], pad_token_id=0, max_denoising_steps=8)
    rec_ref, rec_gpu = Recorder(), Recorder()
    ref_draws, gpu_draws = SeededDraws(5), SeededDraws(5)
    expected = reference_generate(ref_model, prompt, random=ref_draws, denoiser=lambda c, cache, sc: fake_logits(c),
                                  callback=rec_ref, **kwargs)
    got = gpu._generate(fast, prompt, None, None, random=gpu_draws, cache=None, decoder_input_ids=None,
                        self_conditioning_logits=None, callback=rec_gpu, overrides=kwargs,
                        logits_hook=lambda c, rows: fake_logits(c))  # the canvas loop on the device
    np.testing.assert_array_equal(got.sequences, expected.sequences)
    np.testing.assert_array_equal(got.tokens_per_forward, expected.tokens_per_forward)
    assert got.steps_per_canvas == expected.steps_per_canvas
    assert [s.finished.tolist() for s in rec_gpu.steps] == [s.finished.tolist() for s in rec_ref.steps]
    # after early stops, the draw stream is where the reference's is
    np.testing.assert_array_equal(gpu_draws.renoise_ids(1, 8, 100), ref_draws.renoise_ids(1, 8, 100))


def test_the_captured_decoder_pass_replays_what_was_issued(device):
    """Each canvas's whole denoising step (decoder pass, sampling, acceptance, stop state) captured once and
    replayed (``graph.py``: a CUDA graph on a GPU, the recorded plan on cuda-sim) gives the run that the same
    steps issued launch by launch give."""
    config = make_config()
    _, fast = pair(config, device, seed=1)
    prompt = np.random.default_rng(3).integers(3, 120, size=(2, 7))
    kwargs = dict(max_new_tokens=32, max_denoising_steps=5, stability_threshold=0, confidence_threshold=4.4,
                  eos_token_id=[1], pad_token_id=0, random=4)
    graphed = gpu.generate(fast, prompt, backend_options={"graphs": True}, **kwargs)
    issued = gpu.generate(fast, prompt, backend_options={"graphs": False}, **kwargs)
    np.testing.assert_array_equal(graphed.sequences, issued.sequences)
    np.testing.assert_array_equal(graphed.forward_passes, issued.forward_passes)
    assert graphed.steps_per_canvas == issued.steps_per_canvas


@pytest.mark.slow
@pytest.mark.parametrize("seed,B", [(0, 1), (2, 3)])
def test_generation_trajectory_matches_reference(device, seed, B):
    """Teacher-forced parity along a real generation (SPEC §14 check 3 applied to our own reference): every
    decoder call of a reference run (its canvas, its self-conditioning logits, the cache of that canvas) is
    replayed through the GPU model, whose logits must match (trap T20: free-running token equality needs a
    contractive model, see the next test)."""
    config = make_config()
    ref, fast = pair(config, device, seed=seed)
    prompt = np.random.default_rng(seed).integers(3, 120, size=(B, 13))
    calls = []

    def recording_denoiser(canvas, cache, sc):
        logits = ref.denoise(canvas, cache, sc)
        calls.append((cache.length, np.array(canvas), None if sc is None else np.array(sc), logits))
        return logits

    result = reference_generate(ref, prompt, random=seed, denoiser=recording_denoiser, max_new_tokens=32,
                                max_denoising_steps=4, eos_token_id=[1], pad_token_id=0)
    cache = fast.new_cache(B)
    fast.encode(prompt, cache)
    C = config.canvas_length
    for length, canvas, sc, logits in calls:
        if length > cache.length:  # the reference committed a canvas: encode the same tokens
            start = cache.length
            fast.encode(result.sequences[:, start:start + C], cache)
        assert cache.length == length
        close(fast.denoise(canvas, cache, sc), logits)


def _near_tie(ref_logits: np.ndarray, temperature, b: int, c: int, tokens: tuple[int, int], cap: float) -> bool:
    """Whether two draws of position (b, c) can differ by float32 rounding alone: the reference's probability
    mass strictly between the two ids (the CDF runs over ids) is below 1e-5, so a boundary between them lies
    within rounding of the target whatever the uniform was."""
    z = softcap(ref_logits[b, c][None], cap)
    if temperature is not None:
        z = S.scale_logits(z, np.float32(temperature))
    probs, _ = S.softmax_and_entropy(z)
    lo, hi = sorted(tokens)
    return float(probs[0, lo + 1:hi].astype(np.float64).sum()) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_generate_matches_reference_with_the_same_draws(device, seed):
    """Free-running ``generate`` with the same seed on a contractive model (self-conditioning gain 1e-3,
    tests/random_weights.py): every draft, draw, acceptance and the final tokens match the reference's,
    unless a draw is a near tie (``_near_tie``), which is then reported as a warning and ends the
    comparison (the two runs have parted legitimately). Any other difference fails."""
    from tests.random_weights import random_tensors as contractive_tensors

    config = make_config()
    tensors = contractive_tensors(config, seed, final_norm_gain=8.0, self_conditioning_gain=1e-3)
    ref, fast = pair(config, device, tensors=tensors)
    prompt = np.random.default_rng(seed).integers(3, 120, size=(2, 9))
    logits_seen = []

    def recording(canvas, cache, sc):
        z = ref.denoise(canvas, cache, sc)
        logits_seen.append(z)
        return z

    kwargs = dict(max_new_tokens=32, max_denoising_steps=6, eos_token_id=[1], pad_token_id=0)
    mine, theirs = Recorder(), Recorder()
    got = gpu.generate(fast, prompt, random=seed, callback=mine, **kwargs)
    expected = reference_generate(ref, prompt, random=seed, denoiser=recording, callback=theirs, **kwargs)
    assert len(logits_seen) == len(theirs.steps)
    ties = []
    for k, (a, b) in enumerate(zip(mine.steps, theirs.steps)):
        differing = np.argwhere(a.sampled != b.sampled)
        for row, pos in differing:
            tokens = (int(a.sampled[row, pos]), int(b.sampled[row, pos]))
            assert _near_tie(logits_seen[k], b.temperature, row, pos, tokens, config.final_logit_softcapping), \
                f"step {k}: draw at ({row}, {pos}) differs {tokens} and is not a near tie"
            ties.append((k, int(row), int(pos), tokens))
        if ties:
            break
        np.testing.assert_array_equal(a.draft, b.draft, err_msg=f"step {k}")
        np.testing.assert_array_equal(a.accepted, b.accepted, err_msg=f"step {k}")
        np.testing.assert_array_equal(a.canvas, b.canvas, err_msg=f"step {k}")
        np.testing.assert_allclose(a.entropies, b.entropies, rtol=1e-3, atol=2e-4)
    if ties:
        warnings.warn(f"generate parity seed {seed}: near tie(s) {ties}; the runs part there")
        return
    assert len(mine.steps) == len(theirs.steps)
    np.testing.assert_array_equal(got.sequences, expected.sequences)
    assert got.steps_per_canvas == expected.steps_per_canvas


# ------------------------------------------------------------------------------------------------ transformers
@pytest.mark.slow
def test_logits_match_transformers(device, tmp_path):
    from tests.hf_oracle import hf_cache, hf_denoise, hf_encode
    from tests.hf_tiny import save_tiny, tiny_model

    hf = tiny_model()
    fast = gpu.Model.from_pretrained(save_tiny(hf, tmp_path / "hf"), device=device)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 120, size=(1, 13))
    cache, hc = fast.new_cache(1), hf_cache(hf)
    close(fast.encode(ids, cache), hf_encode(hf, hc, ids), tol=5e-4)
    canvas = rng.integers(0, 128, size=(1, 16))
    z = hf_denoise(hf, hc, canvas)
    close(fast.denoise(canvas, cache), z, tol=5e-5)
    close(fast.denoise(canvas, cache, z / np.float32(0.7)), hf_denoise(hf, hc, canvas, z / np.float32(0.7)), tol=5e-5)


# ------------------------------------------------------------------------------------------------ bfloat16
def test_bf16_gemm_within_its_accumulation_bound(device):
    """``dg_gemm_bf16`` on this device (the tensor cores' ``mma`` on a GPU, its emulation on cuda-sim) against the
    exact product and the reference's bfloat16 ``linear``, within the bound tests/test_gpu_bf16.py states."""
    from tests.test_gpu_bf16 import check, random_bf16, run

    rng = np.random.default_rng(5)
    for M, N, K in ((70, 65, 33), (1, 9, 1), (130, 64, 200)):
        a, b = random_bf16(rng, (M, K)), random_bf16(rng, (N, K), 0.05)
        check(a, b, *run(a, b, dev=device))


def test_bf16_attention_within_its_bound(device):
    """``dg_attention_bf16`` on this device (tensor cores on a GPU, the emulated ``mma`` on cuda-sim): an encoder
    chunk over a sliding layer's ring cache with padding, and a decoder canvas over a cache, against the
    reference's bfloat16 ``attend`` within the bound tests/test_gpu_attention_bf16.py states."""
    from tests.test_gpu_attention_bf16 import Case, check, run

    rng = np.random.default_rng(9)
    for kw in (dict(N=2, S=70, nh=4, g=2, d=64, past=40, ring=15, window=16, pad=[0, 5], scale=2.0),
               dict(N=2, S=24, nh=8, g=2, d=256, past=50, decoder=True, rows=[1, 0], pad=[3, 0], scale=2.0)):
        case = Case(rng, **kw)
        check(case, run(case, dev=device), agree=0.8)  # tensor cores and CUDA expf: other neighbours


def test_bf16_model_is_the_reference_bf16_run(device):
    """``gpu.Model(..., dtype="bfloat16")`` on this device, every bfloat16 kernel in place: check (b) of
    tests/test_gpu_bf16_model.py (whole calls against the bfloat16 reference, that file's ``within``) on one tiny
    config."""
    from diffusiongemma.tiny import make_config
    from diffusiongemma.tiny import random_tensors as tiny_tensors
    from tests.test_gpu_bf16_model import ratios, whole_calls, within

    config = make_config()
    r = ratios(whole_calls(config, tiny_tensors(config, seed=3), device))
    assert within(r), r


def test_round_bf16_is_the_reference_rounding(device):
    """``dg_round_bf16`` on this device: every element of a float32 array rounded to bfloat16 in place (ties to
    even, overflow to infinity, NaN kept), bit for bit the reference's ``round_to(x, BFLOAT16)``."""
    from tests.test_gpu_bf16 import round_edge_values, same_as_reference

    rng = np.random.default_rng(11)
    x = np.concatenate([round_edge_values(), (rng.standard_normal(5000) * 1e3).astype(np.float32)])
    buf = device.to_device(x)
    device.launch(gl.round_bf16(buf))
    assert same_as_reference(x, device.to_host(buf)).all()


# ------------------------------------------------------------------------------------------------ coverage
@pytest.mark.slow
@pytest.mark.last_in_module
def test_every_kernel_was_launched(device):
    """Runs last in this module: every ``extern "C" __global__`` kernel of fast/gpu/cuda/*.cu (listed from
    the sources themselves) was launched on this device by the tests above (run the whole module)."""
    declared = set()
    for path in sorted(__import__("glob").glob(f"{gl.CUDA_DIR}/*.cu")):
        with open(path, encoding="utf-8") as f:
            declared |= set(re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                                       r"(\w+)\s*\(", f.read()))
    assert declared == set(gl.signatures()), "the kernel list and the launcher's parsed signatures disagree"
    missing = sorted(declared - set(LAUNCHED[device._name]))
    assert not missing, f"kernels never launched on {device._name} by this module: {missing}"
