"""What a correct bfloat16 run looks like from the outside: the reference's bfloat16 run against itself with
its float32 sums taken in another order (the null distribution of ``crosscheck --dtype bfloat16``).

Two correct bfloat16 implementations make the same roundings but sum in their own order: BLAS against oneDNN,
NumPy's pairwise mean against torch's vectorised one. Where a float32 sum lands within a few float32 ulps of
a bfloat16 rounding point the two round to neighbouring bfloat16 values, and the following layers carry that
one-ulp flip on (a near-tied expert choice can amplify it). ``summation_order(kind)`` makes the reference do
exactly that and nothing else: inside it every float32 sum that precedes a bfloat16 rounding (the linear
maps, the attention scores and their product with V, the softmax denominators, the norms' mean squares, the
self-conditioning soft embedding, the experts' weighted sum) is taken in another order:

* ``reversed``: the summed axis reversed (BLAS and NumPy's pairwise sums then pair other terms);
* ``blocked``: the summed axis cut in blocks of 8 (or 3 when shorter), each block summed, then the partial
  sums added left to right (the order of a tiled kernel).

Nothing else changes: the roundings (``round_to``), the expert choice rule and every elementwise operation
are the reference's. ``deviation`` measures one tensor against another the way the verdict reads it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

KINDS = ("reversed", "blocked")
FLOAT32_NOISE = 2.0 ** -12  # a value "differs" when |d| > this x max(1, max|x|): 1/16 of a bfloat16 ulp at the
# tensor's scale, far above the float32 last bits (a soft-cap's tanh taken by another library)


def _block(n: int) -> int:
    return 8 if n > 16 else 3


def dot(a: np.ndarray, b: np.ndarray, kind: str) -> np.ndarray:
    """``a @ b`` (float32, contraction over a's last axis and b's second-to-last) with the sum in ``kind``'s
    order."""
    n = a.shape[-1]
    if n <= 1:
        return a @ b
    if kind == "reversed":
        return np.ascontiguousarray(a[..., ::-1]) @ np.ascontiguousarray(b[..., ::-1, :])
    step = _block(n)
    out = a[..., :step] @ b[..., :step, :]
    for s in range(step, n, step):
        out = out + a[..., s:s + step] @ b[..., s:s + step, :]
    return out


def total(x: np.ndarray, kind: str, axis: int = -1, keepdims: bool = True) -> np.ndarray:
    """``np.sum(x, axis)`` (float32) in ``kind``'s order."""
    x = np.moveaxis(x, axis, -1)
    n = x.shape[-1]
    if kind == "reversed":
        out = np.sum(x[..., ::-1], axis=-1)
    else:
        step = _block(n)
        out = np.sum(x[..., :step], axis=-1)
        for s in range(step, n, step):
            out = out + np.sum(x[..., s:s + step], axis=-1)
    out = out.astype(x.dtype, copy=False)
    return np.expand_dims(out, axis) if keepdims else out


@contextlib.contextmanager
def summation_order(kind: str) -> Iterator[None]:
    """Inside: the reference computes with ``kind``'s summation order (module notes). Not thread-safe (it
    swaps the reference's module functions for the duration)."""
    if kind not in KINDS:
        raise ValueError(f"unknown summation order {kind!r}; known: {', '.join(KINDS)}")
    from diffusiongemma.reference import layers, model, primitives
    from diffusiongemma.reference.primitives import FLOAT32, round_to

    def linear(x, weight, dtype=FLOAT32):
        return round_to(dot(np.asarray(x, dtype=np.float32), weight.T, kind), dtype)

    def rms_norm(x, weight, eps, dtype=FLOAT32):
        x = np.asarray(x, dtype=np.float32)
        mean_square = total(np.square(x), kind) / np.float32(x.shape[-1]) + np.float32(eps)
        normed = x * np.power(mean_square, np.float32(-0.5))
        return round_to(normed * weight if weight is not None else normed, dtype)

    def attend(q, keys, values, visible, dtype=FLOAT32):  # layers.attend with the three sums reordered
        B, S, n_h, d = q.shape
        g = keys.shape[1]
        q = q.reshape(B, S, g, n_h // g, d).transpose(0, 2, 3, 1, 4)
        scores = round_to(dot(q, keys[:, :, None].swapaxes(-1, -2), kind), dtype)
        scores = np.where(visible[:, None, None, :, :], scores, -np.inf)
        peak = np.max(scores, axis=-1, keepdims=True)
        probs = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))
        den = total(probs, kind)
        probs = round_to(probs / np.where(den > 0, den, 1.0), dtype)
        out = round_to(dot(probs.astype(np.float32), values[:, :, None], kind), dtype)
        return out.transpose(0, 3, 1, 2, 4).reshape(B, S, n_h * d)

    def experts(x, indices, weights, w, dtype=FLOAT32):  # the K weighted outputs summed in the other order
        gate_up, down = w["experts.gate_up_proj"], w["experts.down_proj"]
        inner = down.shape[2]
        K = indices.shape[1]
        parts = np.zeros((K,) + x.shape, dtype=np.float32)
        for e in np.unique(indices):
            token, slot = np.nonzero(indices == e)
            gu = linear(x[token], gate_up[e], dtype)
            y = linear(round_to(primitives.gelu_tanh(gu[:, :inner], dtype) * gu[:, inner:], dtype), down[e], dtype)
            parts[slot, token] = y * weights[token, slot][:, None]
        return round_to(total(np.moveaxis(parts, 0, -1), kind, keepdims=False), dtype)

    def self_conditioning_embedding(self, logits):
        dt = self.dtype
        logits = round_to(logits, dt)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / total(probs, kind)
        soft = round_to(dot(round_to(probs, dt), self.tensors["embed_tokens"], kind), dt)
        return round_to(soft * round_to(np.float32(self.config.embed_scale), dt), dt)

    swaps = [(primitives, "linear", linear), (layers, "linear", linear), (model, "linear", linear),
             (primitives, "rms_norm", rms_norm), (layers, "rms_norm", rms_norm), (model, "rms_norm", rms_norm),
             (layers, "attend", attend), (model, "attend", attend), (layers, "experts", experts),
             (model.Model, "self_conditioning_embedding", self_conditioning_embedding)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in swaps]
    try:
        for owner, name, value in swaps:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def deviation(mine: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(size, share) of ``theirs`` against ``mine`` (same shape): size = max |d| in bfloat16 ulps at the
    tensor's scale (|d| / (2**-8 x max(1, max|mine|))), share = the fraction of values with |d| beyond
    ``FLOAT32_NOISE`` at that scale (a value left unrounded shows here, not in the size)."""
    a, b = np.asarray(mine, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf"), 1.0
    if a.size == 0:
        return 0.0, 0.0
    scale = max(1.0, float(np.max(np.abs(a))))
    d = np.abs(a - b)
    d = np.where(np.isnan(d), np.inf, d)
    return float(np.max(d)) / (2.0 ** -8 * scale), float(np.mean(d > FLOAT32_NOISE * scale))


def run_variant(kind: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with the reference in ``kind``'s summation order."""
    with summation_order(kind):
        return fn(*args, **kwargs)
