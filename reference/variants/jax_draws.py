"""JAX's random stream as a draw source: ``JaxDraws(seed)`` makes the draws Google's JAX DiffusionGemma makes.

The JAX sampler (google-deepmind/gemma, ``gemma/diffusion/_sampler.py``) draws from a tree of
threefry2x32 keys, never from a sequential generator. Its key tree for one prompt, in the order the
reference's three requests meet it (``split`` returns two keys, used left to right):

    root = jax.random.key(seed)                               threefry key (0, seed)
    for each canvas:                                          DiffusionSampler._sample_step
        root, canvas_key = split(root)
        initial, steps = split(canvas_key)                    sample_next_canvas
        canvas      randint(initial, (B, C), 0, V)            DiffusionProcess.get_initial_sample
        for each executed denoising step:                     the while loop's body_fn
            steps, step_key = split(steps)
            draw_key, noise_key = split(step_key)             SampleFromPredictions
            categorical  categorical(draw_key, z / T)         float32 logits (B, C, V): Gumbel-max
            renoise      randint(noise_key, (B, C), 0, V)

No ``fold_in`` is used anywhere on that path. A row that has stopped still takes part in every draw of
its batch (JAX draws for the whole batch and discards), exactly as the reference asks for (B, C) draws.

The functions below are ``jax.random``'s, in NumPy uint32 arithmetic, for the default configuration of
current JAX (threefry2x32, ``jax_threefry_partitionable=True``, 32-bit integers and floats):

* ``threefry2x32(key, x0, x1)``: the 20-round Threefry-2x32 block function (rotations 13 15 26 6 /
  17 29 16 24, key-schedule parity 0x1BD11BDA).
* ``random_bits(key, shape)``: the block function of ``key`` over the 64-bit row-major index of every
  element (high word, low word); the two output words XORed.
* ``split(key, n)``: the same counters over shape (n,), both output words kept: n new keys.
* ``randint(key, shape, lo, hi)``: two words per element from ``split(key)``'s two keys, combined modulo
  the span with JAX's ``(hi_bits % span) * (2^16 % span)^2 % span + lo_bits % span`` rule (wrapping
  uint32 arithmetic).
* ``uniform(key, shape, lo, hi)``: the top 23 bits as a float in [1, 2), minus 1, then ``u * (hi - lo) + lo``
  with one rounding (XLA's CPU backend fuses it into a multiply-add), clamped below at lo.
* ``gumbel(key, shape)``: ``-log(-log(u))`` with u uniform in [tiny, 1) (float32); ``categorical``:
  ``argmax(logits + gumbel)`` over the last axis, the first index on ties.

``log`` is XLA's CPU implementation (Cephes' polynomial with fused multiply-adds, ``_log``), not the
correctly rounded logarithm: about a quarter of the Gumbel values would differ in the last bit otherwise.

Upstream: ``jax._src.prng`` (threefry2x32, splitting, random bits) and ``jax._src.random`` (randint,
uniform, gumbel, categorical), jax 0.10.x; ``gemma/diffusion/_sampler.py`` at google-deepmind/gemma main
7691fd4e7f26c9ec5db38110dddb3addfab4d767.
"""

from __future__ import annotations

import math

import numpy as np

from ..draws import DrawSource
from ..support.errors import InputError

__all__ = ["JaxDraws", "prng_key", "threefry2x32", "random_bits", "split", "randint", "uniform", "gumbel",
           "categorical", "jax_temperature"]

_U32 = np.uint32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = _U32(0x1BD11BDA)
_CHUNK = 1 << 22  # elements hashed at once by ``categorical`` (bounds its temporary memory)


def prng_key(seed: int) -> np.ndarray:
    """``jax.random.key(seed)`` (equally ``PRNGKey``) for threefry: the key words (0, seed), (2,) uint32.

    seed: an int in [-2^31, 2^31) (JAX's 32-bit default), read modulo 2^32 as JAX does for negatives.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InputError(f"a JAX seed must be an integer, got {type(seed).__name__}")
    if not -2**31 <= int(seed) < 2**31:
        raise InputError(f"a JAX seed must fit in 32 signed bits (jax_enable_x64 off), got {int(seed)}")
    return np.array([0, int(seed) % 2**32], dtype=_U32)


def _check_key(key) -> np.ndarray:
    key = np.asarray(key)
    if key.shape != (2,) or not np.issubdtype(key.dtype, np.integer):
        raise InputError(f"a threefry key is two uint32 words, got an array of shape {key.shape} ({key.dtype})")
    return key.astype(_U32)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << _U32(r)) | (x >> _U32(32 - r))


def threefry2x32(key, x0: np.ndarray, x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 (20 rounds) of the counter words (x0, x1) under ``key``: two uint32 arrays."""
    k0, k1 = (_U32(w) for w in _check_key(key))
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    with np.errstate(over="ignore"):
        x0 = np.asarray(x0, dtype=_U32) + ks[0]
        x1 = np.asarray(x1, dtype=_U32) + ks[1]
        for group in range(5):
            for r in _ROTATIONS[group % 2]:
                x0 = x0 + x1
                x1 = _rotl(x1, r) ^ x0
            x0 = x0 + ks[(group + 1) % 3]
            x1 = x1 + ks[(group + 2) % 3] + _U32(group + 1)
    return x0, x1


def _counters(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """The (high, low) words of the 64-bit element indices start..stop-1."""
    index = np.arange(start, stop, dtype=np.uint64)
    return (index >> np.uint64(32)).astype(_U32), (index & np.uint64(0xFFFFFFFF)).astype(_U32)


def _shape(shape) -> tuple[int, ...]:
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise InputError(f"a draw shape cannot have negative sizes, got {shape}")
    return shape


def random_bits(key, shape) -> np.ndarray:
    """``jax.random.bits(key, shape, uint32)``: one uint32 word per element."""
    shape = _shape(shape)
    hi, lo = threefry2x32(key, *_counters(0, math.prod(shape)))
    return (hi ^ lo).reshape(shape)


def split(key, num: int = 2) -> np.ndarray:
    """``jax.random.split(key, num)``: (num, 2) uint32, one new key per row."""
    hi, lo = threefry2x32(key, *_counters(0, int(num)))
    return np.stack([hi, lo], axis=-1)


def randint(key, shape, minval: int, maxval: int) -> np.ndarray:
    """``jax.random.randint(key, shape, minval, maxval)`` (int32 bounds, minval <= maxval): int64 ids."""
    shape = _shape(shape)
    lo, hi = int(minval), int(maxval)
    if not -2**31 <= lo <= hi <= 2**31 - 1:
        raise InputError(f"randint bounds must satisfy -2^31 <= minval <= maxval < 2^31, got [{lo}, {hi})")
    k1, k2 = split(key)
    higher, lower = random_bits(k1, shape), random_bits(k2, shape)
    span = _U32(max(hi - lo, 1))  # maxval <= minval returns minval
    with np.errstate(over="ignore"):
        multiplier = _U32(2**16) % span
        multiplier = (multiplier * multiplier) % span
        offset = ((higher % span) * multiplier + lower % span) % span
    return lo + offset.astype(np.int64)


def uniform(key, shape, minval: float = 0.0, maxval: float = 1.0) -> np.ndarray:
    """``jax.random.uniform(key, shape, float32, minval, maxval)``: float32 in [minval, maxval)."""
    shape = _shape(shape)
    return _uniform_from_bits(random_bits(key, shape), np.float32(minval), np.float32(maxval))


def _fma(a, b, c) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (a fused multiply-add), elementwise over broadcast arrays.

    The product of two float32 values is exact in float64; the sum is rounded to float64 with round-to-odd
    (nearest, then the odd neighbour when inexact), which makes the final rounding to float32 correct.
    """
    a, b, c = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    product = a * b
    total = product + c
    back = total - product
    error = (product - (total - back)) + (c - back)  # TwoSum: total + error == product + c exactly
    even = (total.view(np.uint64) & np.uint64(1)) == 0
    odd = np.where((error != 0) & even, np.nextafter(total, np.where(error > 0, np.inf, -np.inf)), total)
    return odd.astype(np.float32)


def _uniform_from_bits(bits: np.ndarray, lo: np.float32, hi: np.float32) -> np.ndarray:
    floats = ((bits >> _U32(9)) | _U32(0x3F800000)).view(np.float32) - np.float32(1.0)  # [0, 1)
    return np.maximum(lo, _fma(floats, np.float32(hi - lo), lo))


# XLA's CPU ``log`` for float32: Cephes' logf polynomial in Eigen's evaluation order, which LLVM compiles
# with fused multiply-adds (read from the machine code XLA emits; see ``_log``).
_SQRT_HALF = np.float32(0.707106781186547524)
_LOG_P = tuple(np.float32(c) for c in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                                       1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                                       3.3333331174e-1))
_LOG_Q1, _LOG_Q2 = np.float32(-2.12194440e-4), np.float32(0.693359375)


def _log(x: np.ndarray) -> np.ndarray:
    """float32 natural log of positive finite ``x`` exactly as XLA's CPU backend computes it.

    x = m * 2^e with m in [0.5, 1); m < sqrt(1/2) moves to 2m, e - 1; with t = m - 1, a degree-8
    polynomial P(t) evaluated as three quadratics joined by t^3, and
    log x = fma(e, q2, (fma(t^2, -1/2, t) + fma(P, t^3, e * q1))).
    Not correctly rounded (about a quarter of the values differ from the nearest float32 by one unit).
    """
    f, p = np.float32, _LOG_P
    x = np.maximum(np.asarray(x, dtype=f), np.finfo(f).tiny)
    bits = x.view(_U32)
    e = ((bits >> _U32(23)).astype(np.int32) - 127).astype(f) + f(1.0)
    m = ((bits & _U32(0x807FFFFF)) | _U32(0x3F000000)).view(f)  # mantissa in [0.5, 1)
    below = m < _SQRT_HALF
    t = (m - f(1.0)) + np.where(below, m, f(0.0))
    e = e - np.where(below, f(1.0), f(0.0))
    t2 = t * t
    t3 = t2 * t
    y = _fma(_fma(p[0], t, p[1]), t, p[2])
    y1 = _fma(_fma(p[3], t, p[4]), t, p[5])
    y2 = _fma(_fma(p[6], t, p[7]), t, p[8])
    y = _fma(_fma(y, t3, y1), t3, y2)
    y = _fma(y, t3, e * _LOG_Q1)
    return _fma(e, _LOG_Q2, _fma(t2, f(-0.5), t) + y)


def _gumbel_from_bits(bits: np.ndarray) -> np.ndarray:
    u = _uniform_from_bits(bits, np.finfo(np.float32).tiny, np.float32(1.0))
    return -_log(-_log(u))


def gumbel(key, shape) -> np.ndarray:
    """``jax.random.gumbel(key, shape, float32)``: ``-log(-log(u))``, u uniform in [tiny, 1)."""
    return _gumbel_from_bits(random_bits(key, shape))


def categorical(key, logits: np.ndarray) -> np.ndarray:
    """``jax.random.categorical(key, logits, axis=-1)``: argmax(logits + Gumbel noise of logits' shape).

    logits: (..., V) float32 (may hold -inf). Returns (...) int64. The noise is hashed in chunks so
    that memory stays bounded for a large vocabulary; the values are those of one whole-array draw.
    """
    logits = np.asarray(logits, dtype=np.float32)
    V = logits.shape[-1]
    if V == 0:
        raise InputError("categorical needs at least one category (the last axis of logits is empty)")
    rows = logits.reshape(-1, V)
    out = np.empty(rows.shape[0], dtype=np.int64)
    per_chunk = max(1, _CHUNK // V)
    for a in range(0, rows.shape[0], per_chunk):
        b = min(rows.shape[0], a + per_chunk)
        hi, lo = threefry2x32(key, *_counters(a * V, b * V))
        noise = _gumbel_from_bits(hi ^ lo).reshape(b - a, V)
        out[a:b] = np.argmax(noise + rows[a:b], axis=-1)
    return out.reshape(logits.shape[:-1])


def jax_temperature(step_index: int, max_steps: int, t_min: float, t_max: float) -> tuple[np.float32, np.float32]:
    """(T, factor) of JAX's ``AnnealingTemperatureShaper`` (exponent 1) at step ``step_index`` (0 = the first,
    noisiest step) of ``max_steps``, as the compiled sampler computes them; the logits are multiplied by
    ``factor``, they are not divided by T. In the reference's counting (n = N..1) the step index is N - n.

    XLA's simplifier rewrites each division by a broadcast value into a multiplication by its reciprocal and
    its CPU backend fuses multiply-adds, so, in float32:

        p      = 1 - i * (1 / N)                       noise proportion (rounded reciprocal of N)
        T      = fma(1 - (1 - p), t_max - t_min, t_min)   t_max - t_min: a double rounded once
        factor = 1 / T                                  the shaped logits are z * factor

    (read from the sampler's output bit for bit for all 2016 (i, N) with N < 64; tests/golden/jax/).
    """
    if not 0 <= step_index < max_steps:
        raise InputError(f"step index {step_index!r} is outside [0, max_denoising_steps={max_steps})")
    f = np.float32
    p = f(1.0) - f(step_index) * (f(1.0) / f(max_steps))
    T = _fma(f(1.0) - (f(1.0) - p), f(t_max - t_min), f(t_min))[()]
    return f(T), f(f(1.0) / T)


class JaxDraws(DrawSource):
    """The draws of JAX's DiffusionGemma sampler for ``jax.random.key(seed)`` (see the module docstring).

    ``categorical(probs, logits=None)``: JAX draws from the temperature-scaled float32 logits; pass them
    as ``logits`` to get its choice bit for bit. Without them the draw uses ``log(probs)``, the same
    distribution, which can differ from JAX's choice on near ties.
    The three requests must come in the loop's order (canvas, then categorical and renoise per step);
    anything else raises ``InputError``.
    """

    takes_logits = True  # the categorical stage passes the processed logits (stages.CategoricalDraw)

    def __init__(self, seed: int = 0, *, key=None):
        self.seed = seed
        self.key = prng_key(seed) if key is None else _check_key(key)
        self._steps_key: np.ndarray | None = None  # the denoising loop's carried key (current canvas)
        self._noise_key: np.ndarray | None = None  # this step's renoise key, set by ``categorical``

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        self.key, canvas_key = split(self.key)
        initial, self._steps_key = split(canvas_key)
        self._noise_key = None
        return randint(initial, (batch_size, canvas_length), 0, vocab_size)

    def categorical(self, probs: np.ndarray, logits: np.ndarray | None = None) -> np.ndarray:
        if self._steps_key is None:
            raise InputError("JaxDraws: a categorical draw was requested before any canvas was drawn")
        if self._noise_key is not None:
            raise InputError("JaxDraws: two categorical draws in one step (the renoise draw was skipped)")
        self._steps_key, step_key = split(self._steps_key)
        draw_key, self._noise_key = split(step_key)
        if logits is None:
            with np.errstate(divide="ignore"):
                logits = np.log(np.asarray(probs, dtype=np.float32))
        return categorical(draw_key, logits)

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        if self._noise_key is None:
            raise InputError("JaxDraws: a renoise draw was requested before this step's categorical draw")
        key, self._noise_key = self._noise_key, None
        return randint(key, (batch_size, canvas_length), 0, vocab_size)
