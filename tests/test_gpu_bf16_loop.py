"""A bfloat16 GPU model's ``generate`` on the device loop (``fast/gpu/canvas.py``, graphs replayed), on cuda-sim.

The next step's self-conditioning input of a bfloat16 run is B8's (docs/SPEC.md §10.1): the processed logits
(soft-cap, then division by the temperature, float32) rounded to bfloat16, then a float32 softmax. The device
loop's sampling kernel writes it with its bf16 flag (``launch.sample_step(..., bf16_sc=...)``), in the same pass
that writes the float32 probabilities of the draw. Checked:

(a) the flag's output against B8 computed on the host with NumPy from the same logits: the processed logits
    rounded to bfloat16 are the host's wherever the kernel's float32 processed logit and NumPy's cannot lie
    on two sides of a bfloat16 rounding boundary (the kernel's tanh is not NumPy's: a row where some logit
    lies within 4 float32 ulps of a boundary is "not clear"); in clear rows the probabilities then differ
    only by the softmax's float32 arithmetic: one exp each (an ulp or two apart), the sum (NumPy's pairwise
    float32 sum, relative error below (log2 V + 1) 2^-24, against the kernel's float64 sum rounded once) and
    the division, so |p - p_host| <= (log2 V + 8) 2^-24 p_host (+ 2^-126 for values below float32's normal
    range). Rows not clear: the probabilities' bfloat16 roundings equal or neighbours. The flag's output is
    also bit for bit what the per-step loop computes with its own launches (``GpuBackend._bf16_self_
    conditioning``: dg_softcap, a float32 division, dg_round_bf16, dg_sample_rows), and the float32 outputs
    of the pass (probabilities, argmax, entropy, draw, flags) are those of the same launch without the flag.
(b) the device loop of a real bfloat16 model feeds each step the B8 of the previous step's logits (as (a));
(c) its tokens, forward passes and steps are those of the model's own per-step loop, same draws, on
    several seeds (rows stopping at different steps included; once with a caller's self-conditioning logits);
(d) a kernel whose flag does not round fails (a).
The copies and launches of a bfloat16 canvas: tests/test_gpu_counts.py.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from diffusiongemma.fast import gpu
from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.sampling import GpuBackend
from diffusiongemma.fast.gpu.sim import KernelLibrary, SimDevice
from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.primitives import BFLOAT16, round_to, softcap
from diffusiongemma.tiny import make_config, random_tensors

SLACK = 4  # float32 ulps between the kernel's processed logit and NumPy's that a "clear" row tolerates


def bf(x) -> np.ndarray:
    return round_to(np.asarray(x, np.float32), BFLOAT16)


def host_b8(raw: np.ndarray, cap: float, temp: float) -> tuple[np.ndarray, np.ndarray]:
    """B8 with NumPy: (probabilities (..., V) float32, clear (...) bool: no processed logit of the row within
    SLACK float32 ulps of a bfloat16 rounding boundary)."""
    x = softcap(np.asarray(raw, np.float32), cap) if cap else np.asarray(raw, np.float32)
    if temp > 0:
        x = x / np.float32(temp)
    xb = bf(x)
    with np.errstate(invalid="ignore", over="ignore"):
        step = np.float32(SLACK) * np.spacing(np.abs(x))
        wide = [bf(x - step), bf(x + step)]
        clear = ((wide[0] == xb) | np.isnan(xb)) & ((wide[1] == xb) | np.isnan(xb))
    p = np.exp(xb - xb.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p, clear.all(axis=-1)


def check_b8(got: np.ndarray, raw: np.ndarray, cap: float, temp: float, what: str) -> float:
    """Assert ``got`` (..., V) is B8 of ``raw`` (module docstring (a)); returns the share of clear rows."""
    want, clear = host_b8(raw, cap, temp)
    V = want.shape[-1]
    tol = (np.log2(V) + 8) * 2.0 ** -24
    err = np.abs(got - want) - tol * want - 2.0 ** -126
    bad = (err > 0).any(axis=-1) & clear
    assert not bad.any(), f"{what}: {np.count_nonzero(bad)} clear rows are not B8's (max relative error " \
                          f"{(np.abs(got - want) / np.maximum(want, 2.0 ** -126))[clear].max():.3g}, bound {tol:.3g})"
    gb = bf(got).astype(BFLOAT16).view(np.uint16).astype(np.int32)
    wb = bf(want).astype(BFLOAT16).view(np.uint16).astype(np.int32)
    assert (np.abs(gb - wb) <= 1).all(), f"{what}: a probability is more than one bfloat16 ulp from B8's"
    return float(clear.mean())


@pytest.fixture(scope="module")
def dev() -> SimDevice:
    return SimDevice()


# ------------------------------------------------------------------------------------------------ (a) the kernel
def flag_case(dev, rng) -> list:
    """One sampling pass with the bf16 flag on 4 of 6 rows (V = 1100: two chunks), at three steps (two
    temperatures, none), against the host's B8 and the per-step loop's launches; a NaN row and a row whose
    only large logit rounds to +inf in bfloat16 (flag 2, nothing written)."""
    B, C, V, N = 2, 3, 1100, 3
    raw = (rng.standard_normal((B * C, V)) * 8).astype(np.float32)
    raw[1, 7] = -np.inf  # a masked entry: probability 0 on both sides
    rows = np.array([0, 1, 3, 5], dtype=np.int32)
    cap, temps = 30.0, np.array([0.7, 0.33, 0.0], dtype=np.float32)
    shares = []
    for s in range(N):
        outs, uniforms = {}, rng.random((N, B * C))
        for flag in (True, False):
            logits = dev.to_device(raw)
            o = [dev.empty((B * C,), np.int64), dev.empty((B * C,), np.float32), dev.zeros((B * C,), np.int64),
                 dev.zeros((N, B * C), np.int32)]
            sc = dev.to_device(np.full((B * C, V), -7.0, np.float32))  # rows not sampled keep this
            dev.launch(gl.sample_step(logits, dev.to_device(rows), cap, dev.to_device(temps),
                                      dev.to_device(np.array([s], np.int32)), dev.to_device(uniforms),
                                      *o, sc if flag else None))
            outs[flag] = [dev.to_host(a) for a in (logits, *o, sc)]
        on, off = outs[True], outs[False]
        for a, b in zip(on[:5], off[:5]):  # the float32 run's outputs: unchanged by the flag
            # bit-exact: the flag adds a rounding after the float32 outputs are written; their kernels are the same launches
            assert a.tobytes() == b.tobytes(), "the bf16 flag changed the pass's float32 outputs"
        got = on[5]
        assert (got[np.setdiff1d(np.arange(B * C), rows)] == -7.0).all(), "a row not sampled was written"
        shares.append(check_b8(got[rows], raw[rows], cap, float(temps[s]), f"step {s}"))
        # the per-step loop's own launches on a copy of the raw logits (GpuBackend._bf16_self_conditioning)
        per_step = dev.to_device(raw.reshape(B, C, V))
        backend = GpuBackend.__new__(GpuBackend)
        backend.dev = dev
        backend.model = mock.Mock(_softmax_in_place=lambda buf, live, what: gpu.Model._softmax_in_place(
            mock.Mock(device=dev, bf16=True), buf, live, what))
        GpuBackend._bf16_self_conditioning(backend, per_step, np.arange(B), cap, temps[s] if temps[s] > 0 else None)
        want = dev.to_host(per_step).reshape(B * C, V)
        # bit-exact: the per-step loop launches the same softmax and rounding kernels on the same logits (no BLAS)
        assert got[rows].tobytes() == want[rows].tobytes(), f"step {s}: not the per-step loop's bits"
    assert np.mean(shares) >= 0.5, shares  # the tight bound is what is checked, in most rows
    # flags: NaN (1) from the float32 run; a finite logit that rounds to +inf in bfloat16 (2) from the flag
    z = np.zeros((2, 4), np.float32)
    z[0, 1] = np.nan
    z[1, 2] = np.array([0x7F7F8000], np.uint32).view(np.float32)[0]  # 3.3961e38: a tie, rounds to +inf
    logits, sc = dev.to_device(z), dev.to_device(np.full((2, 4), -7.0, np.float32))
    flags = dev.zeros((1, 2), np.int32)
    dev.launch(gl.sample_step(logits, dev.to_device(np.arange(2, dtype=np.int32)), 0.0, dev.zeros((1,), np.float32),
                              dev.zeros((1,), np.int32), dev.zeros((1, 2), np.float64), dev.empty((2,), np.int64),
                              dev.empty((2,), np.float32), dev.zeros((2,), np.int64), flags, sc))
    assert dev.to_host(flags).tolist() == [[1, 2]]
    assert (dev.to_host(sc) == -7.0).all(), "a flagged row was written"


def test_the_bf16_flag_writes_b8s_probabilities(dev):
    flag_case(dev, np.random.default_rng(0))


def test_a_flag_that_does_not_round_is_caught():
    text = cb.assemble_all()
    for old, new in (("dg_stats_add(sb, dg_bf16_round(x), v)", "dg_stats_add(sb, x, v)"),
                     ("expf(dg_bf16_round(x) - mb)", "expf(x - mb)")):
        assert text.count(old) == 1, f"mutation no longer applies: {old!r}"
        text = text.replace(old, new)
    broken = SimDevice(library=KernelLibrary.from_source(text), checks=False)
    with pytest.raises(AssertionError, match="not B8's|more than one bfloat16 ulp"):
        flag_case(broken, np.random.default_rng(0))


# ------------------------------------------------------------------------------------------------ (b), (c) the loop
@pytest.fixture(scope="module")
def small():
    """A small bfloat16 model (two layers, canvas 8) on cuda-sim without the executor's checks (speed), and the
    settings of a run whose rows stop at different steps."""
    config = make_config(layer_types="SF", canvas_length=8)
    model = gpu.Model(config, random_tensors(config, seed=5, final_norm_gain=4.0), device=SimDevice(checks=False),
                      dtype="bfloat16")
    kwargs = dict(max_new_tokens=16, max_denoising_steps=5, eos_token_id=[1], pad_token_id=0,
                  stability_threshold=0, confidence_threshold=0.8)
    return model, kwargs


def test_the_device_loop_feeds_each_step_b8_of_the_last(small):
    model, kwargs = small
    dev = model.device
    calls, temps = [], []
    own_decoder, own_sample = model._decoder_logits, gl.sample_step

    def decoder(canvas, cache, rows, buffer, has_sc, sc_mask=None, sc_probs=None):
        read = None
        if has_sc:
            read = ("own" if sc_probs is not None and sc_probs is backend_of[0]._sc_buffer else "other",
                    dev.to_host(buffer if sc_probs is None else sc_probs)[rows])
        own_decoder(canvas, cache, rows, buffer, has_sc, sc_mask, sc_probs=sc_probs)
        calls.append((np.array(rows), read, dev.to_host(buffer).copy()))

    def sample_step(logits, rows, cap, temps_dev, step, *rest):
        temps.append((cap, float(dev.to_host(temps_dev)[int(dev.to_host(step)[0])])))
        return own_sample(logits, rows, cap, temps_dev, step, *rest)

    backend_of = []
    own_backend = model.denoising_backend

    def backend(*args, **kw):
        backend_of.append(own_backend(*args, **kw))
        return backend_of[-1]

    prompt = np.random.default_rng(0).integers(3, 120, size=(2, 5))
    with mock.patch.object(model, "_decoder_logits", decoder), mock.patch.object(gl, "sample_step", sample_step), \
            mock.patch.object(model, "denoising_backend", backend), \
            mock.patch.object(GpuBackend, "step", side_effect=AssertionError("the per-step loop ran")):
        gpu.generate(model, prompt, random=0, backend_options={"graphs": False}, **kwargs)
    assert len(calls) == len(temps)
    pairs = 0
    for (rows, _, raw), (cap, temp), (next_rows, read, _) in zip(calls, temps, calls[1:]):
        if read is None:  # a new canvas: no self-conditioning
            continue
        assert read[0] == "own", "the decoder did not read the bfloat16 self-conditioning buffer"
        assert np.isin(next_rows, rows).all()
        check_b8(read[1], raw[next_rows], cap, temp, f"step after {pairs}")
        pairs += 1
    assert pairs >= 4, pairs


def test_bf16_generate_on_the_device_loop_is_the_per_step_loops(small):
    model, kwargs = small
    ran = []
    from diffusiongemma.fast.gpu import canvas as canvas_loop

    own = canvas_loop.run_canvas

    def counted(*args, **kw):
        ran.append(1)
        return own(*args, **kw)

    stopped_apart = False
    for seed in (0, 1, 2, 3):
        prompt = np.random.default_rng(seed).integers(3, 120, size=(2, 5))
        run = dict(kwargs, random=seed)
        if seed == 3:  # a caller's self-conditioning logits for the first canvas (its first step reads them)
            run["self_conditioning_logits"] = (np.random.default_rng(seed).standard_normal((2, 8, 128)) * 3).astype(
                np.float32)
        with mock.patch.object(canvas_loop, "run_canvas", counted):
            loop = gpu.generate(model, prompt, **run)
        per_step = gpu.generate(model, prompt, backend_options={"device_loop": False}, **run)
        np.testing.assert_array_equal(loop.sequences, per_step.sequences)
        np.testing.assert_array_equal(loop.forward_passes, per_step.forward_passes)
        assert loop.steps_per_canvas == per_step.steps_per_canvas
        stopped_apart |= loop.forward_passes[0] != loop.forward_passes[1]
    assert len(ran) == 8, "a canvas did not run on the device loop"
    assert stopped_apart, "no run had rows stopping at different steps"
