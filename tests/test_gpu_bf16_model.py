"""The GPU model's bfloat16 run (``fast.gpu.Model(..., dtype="bfloat16")``) on cuda-sim, against the reference's
bfloat16 run (``reference.Model(..., dtype="bfloat16")``, docs/SPEC.md §10.1 B1-B9).

Tiny models from ``diffusiongemma.tiny`` (every norm weight, scale and layer scalar redrawn; nothing tuned).

(a) Each kernel's ``bf16`` mode against the reference's own function on the same inputs. On "exact" inputs,
    values k/8 with |k| <= 64, every float32 sum a kernel takes (the norms' mean of squares, the products'
    accumulators) is exact whatever its order, so the kernel must equal the reference bit for bit. On random
    bfloat16 inputs the norms' sums round, in another order than NumPy's: the kernels' float32 factor may
    then differ from the reference's by an ulp or two (relative 2^-22), which moves a result across a
    bfloat16 rounding boundary only when it lies within that distance of one. So: at least 99% of the values
    equal the reference's, and every other one is one bfloat16 ulp away (the neighbour a correct float32
    result could round to). The matrix product on random inputs: within the accumulation bound of
    tests/test_gpu_bf16.py.
(b) Whole calls (prompt encode, denoise without and with self-conditioning, incremental encode, denoise over
    the longer cache): max |gpu_bf16 - ref_bf16| <= max |ref_bf16 - ref_fp32| / 8 on the same inputs. Two
    runs that round at the same points part only by the rare neighbour above, so the ratio is about 0;
    a missing or misplaced rounding moves the run by the size of bfloat16's rounding, like the fp32 run.
(c) The float32 model: no bfloat16 kernel or flag in any of its launches, and still the float32 reference.
(d) ``generate`` on the bfloat16 GPU model against the bfloat16 reference, same seeds: the share of seeds
    whose tokens agree (printed; see the test).
(e) Each check fails on a kernel with one rounding broken on purpose.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest

from diffusiongemma.fast import gpu
from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.bf16_whole_calls import CONFIGS, ratios, whole_calls, within  # (b), shared
from diffusiongemma.fast.gpu.sim import KernelLibrary, SimDevice
from diffusiongemma.fast.gpu.weights_bf16 import bits_to_float32, float32_to_bits
from diffusiongemma.reference import layers
from diffusiongemma.reference.generate import generate as reference_generate
from diffusiongemma.reference.model import Model as ReferenceModel
from diffusiongemma.reference.primitives import (BFLOAT16, embed, linear, rms_norm, rope_cos_sin,
                                                 rope_inverse_frequencies, round_to)
from diffusiongemma.tiny import make_config, random_tensors

EPS = 1e-6
ULP_SHARE = 0.99  # share of values that must equal the reference's on random inputs (see the docstring)


def bf(x) -> np.ndarray:
    """float32 holding bfloat16 values (the reference's ``round_to``)."""
    return round_to(np.asarray(x, np.float32), BFLOAT16)


def exact(rng, shape) -> np.ndarray:
    """k/8, |k| <= 64: bfloat16 values whose squares and products sum exactly in float32, in any order."""
    return (rng.integers(-64, 65, shape) / 8).astype(np.float32)


def gauss(rng, shape, scale=1.0) -> np.ndarray:
    return bf(rng.standard_normal(shape) * scale)


def gains(rng, n) -> np.ndarray:
    """A norm weight as ``diffusiongemma.tiny`` draws it: 1 + 0.3 N(0, 1), in bfloat16."""
    return bf(1.0 + 0.3 * rng.standard_normal(n))


def compare(got: np.ndarray, want: np.ndarray, exact_inputs: bool, what: str) -> None:
    """Bit for bit on exact inputs; else at least ULP_SHARE equal and the rest one bfloat16 ulp away."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    same = got.view(np.uint32) == want.view(np.uint32)
    if exact_inputs:
        assert same.all(), f"{what}: {np.count_nonzero(~same)} of {same.size} values differ (max " \
                           f"{np.abs(got - want).max():.3g})"
        return
    gb = got.astype(BFLOAT16).view(np.uint16).astype(np.int32)
    wb = want.astype(BFLOAT16).view(np.uint16).astype(np.int32)
    neighbour = (np.abs(gb - wb) == 1) & (np.sign(got) == np.sign(want))
    assert (same | neighbour).all(), f"{what}: a value is more than one bfloat16 ulp from the reference's " \
                                     f"(max {np.abs(got - want).max():.3g})"
    assert same.mean() >= ULP_SHARE, f"{what}: only {same.mean():.4f} of the values equal the reference's"


@pytest.fixture(scope="module")
def dev() -> SimDevice:
    return SimDevice()


def run(dev, launch_of, *arrays):
    """Upload ``arrays``, launch ``launch_of(*device arrays)``, return them all on the host."""
    on = [dev.to_device(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a for a in arrays]
    dev.launch(launch_of(*on))
    return [dev.to_host(a) if isinstance(a, np.ndarray) else a for a in on]


# ------------------------------------------------------------------------------------------------ (a) one kernel
def case_rms_norm(dev, rng, ex):
    make = exact if ex else gauss
    x, w = make(rng, (7, 48)), gains(rng, 48)
    got = run(dev, lambda x_, w_, o_: gl.rms_norm(x_, w_, o_, EPS, bf16=1), x, w, np.zeros_like(x))[2]
    weightless = run(dev, lambda x_, o_: gl.rms_norm(x_, None, o_, EPS, bf16=1), x, np.zeros_like(x))[1]
    return [(got, rms_norm(x, w, EPS, BFLOAT16), "rms_norm"),
            (weightless, rms_norm(x, None, EPS, BFLOAT16), "weightless rms_norm")]


def case_router_input(dev, rng, ex):
    """B6: ``layers.route``'s input to its projection, captured from the reference's own ``route``."""
    config = make_config(hidden_size=48)
    H = config.hidden_size
    h = (exact if ex else gauss)(rng, (6, H))
    w = {"router.scale": gains(rng, H), "router.proj": gauss(rng, (config.num_experts, H), 0.1),
         "router.per_expert_scale": gains(rng, config.num_experts)}
    seen = []

    def spy(x, weight, dtype):
        seen.append(x)
        return linear(x, weight, dtype)

    with mock.patch.object(layers, "linear", spy):
        layers.route(h, w, config, dtype=BFLOAT16)
    factor = float(np.float32(H ** -0.5))
    got = run(dev, lambda h_, s_, o_: gl.rms_norm(h_, s_, o_, config.rms_norm_eps, post=factor, bf16=2),
              h, w["router.scale"], np.zeros_like(h))[2]
    return [(got, seen[0], "router input")]


def case_residual(dev, rng, ex):
    make = exact if ex else gauss
    h, y, w = make(rng, (5, 64)), make(rng, (5, 64)), gains(rng, 64)
    got = run(dev, lambda h_, y_, w_: gl.residual_norm(h_, y_, w_, 1.0, EPS, bf16=True), h, y, w)[0]
    return [(got, bf(h + rms_norm(y, w, EPS, BFLOAT16)), "residual_norm")]  # Model._block_tail's first line


def case_ffn_tail(dev, rng, ex):
    make = exact if ex else gauss
    h, dense, moe = make(rng, (5, 64)), make(rng, (5, 64)), make(rng, (5, 64))
    w1, w2, wo = gains(rng, 64), gains(rng, 64), gains(rng, 64)
    scalar = np.float32(bf(0.5 + rng.random()))
    got = run(dev, lambda *a: gl.ffn_tail(*a, scalar, EPS, bf16=True), h, dense, moe, w1, w2, wo)[0]
    # layers.feed_forward after its two branches, then Model._block_tail's last two lines
    ff = rms_norm(bf(rms_norm(dense, w1, EPS, BFLOAT16) + rms_norm(moe, w2, EPS, BFLOAT16)), wo, EPS, BFLOAT16)
    return [(got, bf(bf(h + ff) * scalar), "ffn_tail")]


def case_embed(dev, rng, ex):
    """B1 with H = 48: sqrt(48) = 6.928 is rounded to 6.9375 first; the canvas input's sum and norm (B8)."""
    V, H = 40, 48
    table = (exact if ex else gauss)(rng, (V, H))
    ids = rng.integers(0, V, 9).astype(np.int64)
    signal = (exact if ex else gauss)(rng, (9, H))
    scale = float(np.float32(np.sqrt(H)))
    bits = float32_to_bits(table)
    out = []
    for normed, add in ((False, None), (True, None), (True, signal)):
        got = run(dev, lambda i_, t_, a_, o_: gl.embed(i_, t_, scale, a_, normed, o_, EPS, bf16=True),
                  ids, bits, add, np.zeros((9, H), np.float32))[3]
        e = embed(ids, table, scale, BFLOAT16)
        want = e if not normed else rms_norm(e if add is None else bf(e + add), None, EPS, BFLOAT16)
        out.append((got, want, f"embed normed={normed} signal={add is not None}"))
    return out


def case_heads(dev, rng, ex):
    """B4: ``layers.project_qkv`` itself, its projections replaced by the same fused projection the kernel reads."""
    config = make_config()
    B, S = 2, 5
    out = []
    for l in (0, 2):  # a sliding layer (own v_proj) and a full one (v = raw k)
        d, g, n_h = config.layer_head_dim[l], config.layer_num_key_value_heads[l], config.num_attention_heads
        sliding = config.is_sliding(l)
        width = (n_h + (2 if sliding else 1) * g) * d
        proj = (exact if ex else gauss)(rng, (B * S, width))
        parts = {"q": proj[:, :n_h * d], "k": proj[:, n_h * d:(n_h + g) * d], "v": proj[:, (n_h + g) * d:]}
        w = {"q_proj": "q", "k_proj": "k", "q_norm": gains(rng, d), "k_norm": gains(rng, d)}
        if sliding:
            w["v_proj"] = "v"
        positions = np.broadcast_to(np.arange(3, 3 + S), (B, S))
        omega = rope_inverse_frequencies(config.rope_parameters[config.layer_types[l]], d)
        cos, sin = rope_cos_sin(positions, omega, BFLOAT16)
        with mock.patch.object(layers, "linear", lambda x, name, dtype: parts[name].reshape(B, S, -1)):
            q, k, v = layers.project_qkv(np.zeros((B, S, 1), np.float32), w, config, l, cos, sin, BFLOAT16)
        got = run(dev, lambda p_, qn, kn, c_, s_, qo, ko, vo: gl.qkv_heads(p_, B, S, n_h, g, d, sliding, qn, kn, c_,
                                                                          s_, qo, ko, vo, EPS, bf16=True),
                  proj, w["q_norm"], w["k_norm"], np.ascontiguousarray(cos[0, :, :d // 2]),
                  np.ascontiguousarray(sin[0, :, :d // 2]), np.zeros((B, S, n_h, d), np.float32),
                  np.zeros((B, g, S, d), np.float32), np.zeros((B, g, S, d), np.float32))
        out += [(got[5], q, f"q layer {l}"), (got[6], k, f"k layer {l}"), (got[7], v, f"v layer {l}")]
    return out


def case_gemm(dev, rng, ex):
    """The projections (float32 activations in, bf16-valued float32 out) and B8's ``probs @ E`` ("nn": the
    (V, H) table as stored, float32 probabilities rounded as they are loaded)."""
    make = exact if ex else gauss
    a, wt = make(rng, (19, 70)), make(rng, (33, 70))
    got = run(dev, lambda w_, a_, c_: gl.gemm_bf16(None, w_, c_, a_f32=a_, round_c=True), float32_to_bits(wt), a,
              np.zeros((19, 33), np.float32))[2]
    logits = rng.standard_normal((16, 90)).astype(np.float32) * 3
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)
    if ex:  # probabilities k/64 plus float32 dust below half a bfloat16 ulp: the load must round it away
        probs = (np.round(probs * 64) / 64 * (1 + 2.0 ** -12)).astype(np.float32)
    table = make(rng, (90, 24))
    soft = run(dev, lambda t_, p_, c_: gl.gemm_bf16(None, t_, c_, a_f32=p_, b_kn=True, round_c=True),
               float32_to_bits(table), probs, np.zeros((16, 24), np.float32))[2]
    return [(got, linear(a, wt, BFLOAT16), "gemm nt"),
            (soft, bf(bf(probs) @ table), "gemm nn (probs @ E)")]  # reference Model.self_conditioning_embedding


CASES = {"rms_norm": case_rms_norm, "router_input": case_router_input, "residual": case_residual,
         "ffn_tail": case_ffn_tail, "embed": case_embed, "heads": case_heads}


@pytest.mark.parametrize("ex", [True, False], ids=["exact", "random"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_bf16_kernel_is_the_reference_function(dev, name, ex):
    rng = np.random.default_rng(sorted(CASES).index(name) + 10 * ex)
    for got, want, what in CASES[name](dev, rng, ex):
        compare(got, want, ex, what)


def test_bf16_products_round_where_linear_does(dev):
    """Exact inputs: bit for bit. Random ones: the float32 accumulator within tests/test_gpu_bf16.py's bound
    and ``round_c`` its nearest-even rounding bit for bit."""
    from tests.test_gpu_bf16 import check

    for got, want, what in case_gemm(dev, np.random.default_rng(1), True):
        compare(got, want, True, what)
    rng = np.random.default_rng(2)
    for M, N, K, kn in ((19, 33, 70, False), (16, 24, 90, True), (70, 65, 200, False), (3, 130, 33, True)):
        a = rng.standard_normal((M, K)).astype(np.float32)  # float32, not bf16-valued: rounded on load
        b = gauss(rng, (K, N) if kn else (N, K), 0.1)
        b_nk = b.T if kn else b
        c, c16, cr = run(dev, lambda b_, a_, c_, c16_, cr_: (
            dev.launch(gl.gemm_bf16(None, b_, c_, c16_, a_f32=a_, b_kn=kn)),
            gl.gemm_bf16(None, b_, cr_, a_f32=a_, b_kn=kn, round_c=True))[1],
            float32_to_bits(b), a, np.zeros((M, N), np.float32), np.zeros((M, N), np.uint16),
            np.zeros((M, N), np.float32))[2:]
        check(bf(a), np.ascontiguousarray(b_nk), c, c16.view(BFLOAT16).astype(np.float32))
        assert (cr.view(np.uint32) == bf(c).view(np.uint32)).all()


# ------------------------------------------------------------------------------------------------ (b) whole calls
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_whole_calls_are_the_reference_bf16_run(dev, name):
    config = make_config(**CONFIGS[name])
    r = ratios(whole_calls(config, random_tensors(config, seed=3), dev))
    print(f"{name}: " + "; ".join(f"{k} {p:.4f}" + ("" if q is None else f" (forced {q:.4f})")
                                  for k, (p, q) in r.items()))
    assert within(r), r


# ------------------------------------------------------------------------------------------------ (c) float32
class Launches:
    """A device that keeps every launch (everything else is the wrapped device's)."""

    def __init__(self, device):
        self._device, self.launches = device, []

    def __getattr__(self, name):
        return getattr(self._device, name)

    def launch(self, launch):
        self.launches.append(launch)
        self._device.launch(launch)


def test_the_float32_model_is_untouched_by_the_bf16_run(dev):
    """Every launch of the float32 model passes bf16 = 0 and none is a bfloat16 kernel; its weights are
    float32; it still computes the float32 reference's run; the bfloat16 model holds half the bytes."""
    config = make_config()
    tensors = random_tensors(config, seed=4)
    rec = Launches(dev)
    fast = gpu.Model(config, tensors, device=rec)
    ref = ReferenceModel(config, tensors)
    rng = np.random.default_rng(4)
    ids, canvas = rng.integers(3, 128, (2, 9)), rng.integers(0, 128, (2, config.canvas_length))
    fc, rc = fast.new_cache(2), ref.new_cache(2)
    np.testing.assert_allclose(fast.encode(ids, fc), ref.encode(ids, rc), rtol=1e-4, atol=5e-4)
    z = ref.denoise(canvas, rc)
    np.testing.assert_allclose(fast.denoise(canvas, fc), z, rtol=1e-4, atol=5e-4)
    np.testing.assert_allclose(fast.denoise(canvas, fc, z), ref.denoise(canvas, rc, z), rtol=1e-4, atol=5e-4)
    sigs = gl.signatures()
    assert rec.launches
    for launch in rec.launches:
        assert launch.kernel not in ("dg_gemm_bf16", "dg_round_bf16", "dg_attention_bf16"), launch.kernel
        for p, value in zip(sigs[launch.kernel], launch.args):
            if p.name == "bf16":
                assert value == 0, launch.kernel
    assert fast.embed_tokens.dtype == np.float32 and fast.layers[0].qkv.dtype == np.float32
    half = gpu.Model(config, tensors, device=dev, dtype="bfloat16")
    assert half.embed_tokens.dtype == np.uint16 and half.layers[0].expert_down.dtype == np.uint16
    print(f"weights on the device: bfloat16 {half.weight_bytes:,} bytes, float32 {fast.weight_bytes:,} bytes "
          f"({half.weight_bytes / fast.weight_bytes:.3f})")
    assert half.weight_bytes < 0.52 * fast.weight_bytes


def test_the_bf16_weights_read_back_are_the_reference_bf16_weights(dev):
    """The diagnosis of non-finite logits re-runs the reference on the host copy of the model's weights
    (``diagnosis.host_tensors``): for a bfloat16 model that copy is the reference bfloat16 model's tensors
    exactly (the bits widened), and its re-run is a bfloat16 one."""
    from diffusiongemma.fast.gpu.diagnosis import host_tensors

    config = make_config()
    tensors = random_tensors(config, seed=8)
    fast = gpu.Model(config, tensors, device=dev, dtype="bfloat16")
    ref = ReferenceModel(config, tensors, dtype="bfloat16")
    back = host_tensors(fast)
    assert set(back) == set(ref.tensors)
    for name, value in ref.tensors.items():
        assert np.array_equal(back[name], value), name
    assert np.array_equal(bits_to_float32(float32_to_bits(value)), value)


def test_dtype_is_checked_before_anything_is_read(tmp_path):
    from diffusiongemma.reference.support.errors import ConfigError

    with pytest.raises(ConfigError, match="float16"):
        gpu.Model.from_pretrained(tmp_path / "missing", device=SimDevice(), dtype="float16")


# ------------------------------------------------------------------------------------------------ (d) generate
def test_generate_follows_the_reference_bf16_run(dev):
    """Free runs with the same seeds. Asserted: a canvas's first step (no self-conditioning yet) gives the
    bfloat16 reference's tokens on every seed; the per-step loop's self-conditioning input after a step is B8's
    (the device loop's, written by the sampling kernel's bf16 flag: tests/test_gpu_bf16_loop.py), the
    float32 softmax of the step's processed logits (soft-cap, then temperature) rounded to bfloat16, computed
    from the GPU's own logits: the bfloat16 roundings of the probabilities equal or neighbours (the soft-cap's
    tanh is the sampling kernel's, not NumPy's, so a processed logit on a rounding boundary may round to the
    other side; the float32 softmax: ``test_self_conditioning_probabilities``). Printed:
    how many tokens of a whole run differ from the reference's (measured, seeds 0-2: 0, 21 and 15 of 32; where
    the runs part, the logits and the self-conditioning probabilities of the step before agree, and a rare
    neighbour in the self-conditioned pass is amplified by this tiny model)."""
    from diffusiongemma.fast.gpu.sampling import GpuBackend
    from diffusiongemma.reference.primitives import softcap

    config = make_config()
    tensors = random_tensors(config, seed=5, final_norm_gain=8.0, self_conditioning_gain=1e-3)
    fast = gpu.Model(config, tensors, device=dev, dtype="bfloat16")
    ref = ReferenceModel(config, tensors, dtype="bfloat16")
    kwargs = dict(max_new_tokens=16, max_denoising_steps=4, eos_token_id=[1], pad_token_id=0)
    one = dict(kwargs, max_new_tokens=config.canvas_length, max_denoising_steps=1)
    for seed in (0, 1):
        prompt = np.random.default_rng(seed).integers(3, 120, size=(2, 7))
        np.testing.assert_array_equal(gpu.generate(fast, prompt, random=seed, **one).sequences,
                                      reference_generate(ref, prompt, random=seed, **one).sequences)
    seen = []
    own = GpuBackend._bf16_self_conditioning

    def recording(backend, raw, live, cap, temp):
        logits = dev.to_host(raw).copy()
        own(backend, raw, live, cap, temp)
        seen.append((logits, cap, temp, dev.to_host(raw).copy()))

    with mock.patch.object(GpuBackend, "_bf16_self_conditioning", recording):
        got = gpu.generate(fast, prompt, random=seed, backend_options={"device_loop": False}, **kwargs).sequences
    assert seen
    for logits, cap, temp, probs in seen:
        processed = round_to(softcap(logits, cap) / np.float32(temp), BFLOAT16)
        want = np.exp(processed - processed.max(axis=-1, keepdims=True))
        want /= want.sum(axis=-1, keepdims=True)
        compare(bf(probs), bf(want), False, "the loop's self-conditioning probabilities")
    want = reference_generate(ref, prompt, random=seed, **kwargs).sequences
    print(f"generate, seed {seed}: {np.count_nonzero(got != want)} of {got.size - prompt.size} tokens differ from the "
          "bfloat16 reference's")


# ------------------------------------------------------------------------------------------------ (e) mutations
MUTATIONS = {  # name: (file, text, replacement, the check that must fail)
    "embed scale not rounded (53.066)": ("norms.cu", "bf16 ? dg_bf16_round(scale) : scale", "scale", "embed"),
    "router norm not rounded": ("norms.cu", "if (bf16 == 2) v = dg_bf16_round(v);", "", "router_input"),
    "attention's norm not rounded before the sum": ("norms.cu", "hr[i] + dg_bf16_round((yr[i] * f) * w[i])",
                                                     "hr[i] + (yr[i] * f) * w[i]", "residual"),
    "branch sum not rounded": ("norms.cu", "dr[i] = dg_bf16_round(dg_bf16_round((dr[i] * fa)",
                               "dr[i] = (dg_bf16_round((dr[i] * fa)", "ffn_tail"),
    "rope products not rounded": ("rope.cu", "dg_bf16_round(dg_bf16_round(a * c[j]) - dg_bf16_round(bb * sn[j]))",
                                  "dg_bf16_round(a * c[j] - bb * sn[j])", "heads"),
    "q/k norm not rounded": ("rope.cu", "vec[i] = bf16 ? dg_bf16_round(v) : v;", "vec[i] = v;", "heads"),
    "norm output not rounded": ("norms.cu", "if (bf16) v = dg_bf16_round(v);\n        v = v * post;\n"
                                "        orow[i] = bf16 ? dg_bf16_round(v) : v;", "orow[i] = v * post;", "rms_norm"),
    "router's scale product not rounded": ("norms.cu",
                                           "if (w_opt) v = v * w_opt[i];\n        if (bf16) v = dg_bf16_round(v);",
                                           "if (w_opt) v = v * w_opt[i];", "router_input"),
    "products not rounded": ("gemm_bf16.cu", "round_c ? dg_bf16_to_float(dg_float_to_bf16(v)) : v", "v", "gemm"),
    "probabilities truncated on load": ("gemm_bf16.cu", "a_f32_opt ? dg_float_to_bf16(a_f32_opt[at])",
                                        "a_f32_opt ? (unsigned short)(__float_as_uint(a_f32_opt[at]) >> 16)", "gemm"),
}


def mutated_library(file: str, old: str, new: str) -> KernelLibrary:
    text = cb.assemble_all()
    assert text.count(old) == 1, f"mutation no longer applies: {old!r}"
    return KernelLibrary.from_source(text.replace(old, new))


def fails(check) -> bool:
    try:
        check()
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_kernel_checks_catch_a_broken_rounding(name):
    file, old, new, case = MUTATIONS[name]
    broken = SimDevice(library=mutated_library(file, old, new))
    cases = dict(CASES, gemm=case_gemm)

    def check():
        for ex in (True, False):
            rng = np.random.default_rng(sorted(cases).index(case) + 10 * ex)
            for got, want, what in cases[case](broken, rng, ex):
                compare(got, want, ex, what)

    assert fails(check), f"{name}: the {case} check passed on the broken kernel"


def test_the_whole_call_check_catches_a_broken_rounding():
    """The scale of the embedding left unrounded (53.066 instead of 53.0; here sqrt(48)) lifts the ratio of (b)
    far above 1/8, as does an attention whose weights are not rounded."""
    config = make_config(hidden_size=48)
    tensors = random_tensors(config, seed=3)
    file, old, new, _ = MUTATIONS["embed scale not rounded (53.066)"]
    r = ratios(whole_calls(config, tensors, SimDevice(library=mutated_library(file, old, new))))
    print("unrounded embedding scale:", {k: round(v[0], 3) for k, v in r.items()})
    assert not within(r)
