"""Whole bfloat16 calls of the GPU model against the reference's bfloat16 and float32 runs on the same inputs,
with per-layer teacher forcing: check (b) of tests/test_gpu_bf16_model.py (on cuda-sim) and of
benchmarks/gpu_bf16_check.py (on a GPU). ``whole_calls`` makes the calls, ``ratios`` measures them and
``within`` is the criterion; the test module's docstring says why.
"""

from __future__ import annotations

from unittest import mock

import numpy as np

from diffusiongemma.fast import gpu
from diffusiongemma.reference.model import Model as ReferenceModel
from diffusiongemma.reference.primitives import BFLOAT16, round_to
from diffusiongemma.reference.support.observer import Observer

CONFIGS = {  # name: make_config knobs
    "sliding+full": {},
    "sqrt(H) not bf16": {"hidden_size": 48},
    "full only, top-3 of 6": {"layer_types": "FF", "num_experts": 6, "top_k_experts": 3},
}


class Forcing(Observer):
    """Teacher forcing of the reference's decoder: after each layer, its output is replaced (in place) by the
    GPU's output of that layer, so that the next layer starts from the GPU's state; ``diffs`` keeps, per layer,
    the reference's own output on the GPU's input of that layer."""

    def __init__(self, gpu_layers: list):
        self.gpu_layers, self.outputs = gpu_layers, []

    def decoder_layer(self, layer, h, rows=None):
        self.outputs.append(h.copy())
        h[...] = self.gpu_layers[layer].reshape(h.shape)


def whole_calls(config, tensors, device, seed=0):
    """Per call: (name, gpu_bf16, ref_bf16, ref_fp32, forced) on the same inputs: a prompt encode (with
    padding), a denoise without and with self-conditioning, an incremental encode and a denoise over the longer
    cache. ``forced`` (denoise calls; None for encodes): per decoder layer and for the logits, (GPU output,
    reference bf16 output, reference fp32 output) with both references fed, layer by layer, the GPU's output of
    the layer before (``Forcing``), so that each layer's difference is its own, not one amplified from an
    earlier rare neighbour (a value one bfloat16 ulp apart where a norm's float32 sum, taken in another order,
    sits on a rounding boundary, or a router top-K tie it moves)."""
    fast = gpu.Model(config, tensors, device=device, dtype="bfloat16")
    refs = ReferenceModel(config, tensors, dtype="bfloat16"), ReferenceModel(config, tensors)
    layer_out = []
    run_layer = fast.block_ops.layer

    def recording(keys, l, w, h, N, S, scalar):
        bad = run_layer(keys, l, w, h, N, S, scalar)
        layer_out.append(device.to_host(h).copy())
        return bad

    fast.block_ops.layer = recording
    rng = np.random.default_rng(seed)
    B, C = 2, config.canvas_length
    prompt = rng.integers(3, config.vocab_size, (B, 11))
    mask = np.ones((B, 11), np.int64)
    mask[1, :3] = 0
    canvas, more = rng.integers(0, config.vocab_size, (B, C)), rng.integers(3, config.vocab_size, (B, 6))
    caches = [fast.new_cache(B)] + [r.new_cache(B) for r in refs]
    out = []

    def encode(name, ids, attention_mask=None):
        out.append((name, *[m.encode(ids, c, attention_mask) for m, c in zip((fast,) + refs, caches)], None))
        layer_out.clear()

    def denoise(name, sc=None):
        layer_out.clear()
        g = fast.denoise(canvas, caches[0], sc)
        plain = [r.denoise(canvas, c, sc) for r, c in zip(refs, caches[1:])]
        forcings = [Forcing(list(layer_out)) for _ in refs]
        forced_logits = [r.denoise(canvas, c, sc, observer=f) for r, c, f in zip(refs, caches[1:], forcings)]
        forced = [(gl_, b, f) for gl_, b, f in zip(layer_out, *(fc.outputs for fc in forcings))]
        forced.append((g, *forced_logits))
        out.append((name, g, *plain, forced))
        return plain[0]

    encode("encode", prompt, mask)
    sc = denoise("denoise") / np.float32(0.8)  # the bf16 reference's logits, temperature 0.8
    denoise(SC_OWN, sc)

    def numpy_softmax(buffer, rows, what):  # the reference's (Model.self_conditioning_embedding's first lines)
        logits = round_to(device.to_host(buffer), BFLOAT16)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        buffer[...] = device.to_device(probs / probs.sum(axis=-1, keepdims=True))

    with mock.patch.object(fast, "_softmax_in_place", numpy_softmax):
        denoise("denoise + self-conditioning", sc)
    encode("incremental encode", more)
    denoise("denoise after it")
    return out


def ratios(calls) -> dict:
    """Per call: (max |gpu - ref_bf16| / max |ref_bf16 - ref_fp32|, the largest such ratio of one layer or the
    logits under teacher forcing, or None for an encode); padded positions left out of the prompt encode."""
    out = {}
    for name, g, b, f, forced in calls:
        if name == "encode":
            g, b, f = g[:, 3:], b[:, 3:], f[:, 3:]  # row 1's first 3 are padding: unspecified values
        worst = None
        if forced is not None:
            worst = max(float(np.abs(x.reshape(y.shape) - y).max() / np.abs(y - z).max()) for x, y, z in forced)
        out[name] = (float(np.abs(g - b).max() / np.abs(b - f).max()), worst)
    return out


SC_OWN = "denoise + self-conditioning, the GPU's softmax"


def within(r: dict) -> bool:
    """(b)'s criterion: every call within 1/8 as it is; or, for a denoise, every layer and the logits within 1/4
    under teacher forcing (``whole_calls``): there one layer's bfloat16-vs-float32 difference is the scale, and
    a single value one bfloat16 ulp apart (a rare neighbour) is up to about a fifth of it. The self-conditioning
    call is made twice: with the GPU's softmax of the bfloat16 logits (the sampling kernel's float32 result,
    summed in float64, differs from NumPy's by a few float32 ulps, ``test_self_conditioning_probabilities``;
    where that moves a probability across a bfloat16 boundary the signal moves by a neighbour), and with the
    reference's probabilities substituted."""
    return all(plain <= 1 / 8 or (forced is not None and forced <= 1 / 4) for plain, forced in r.values())
