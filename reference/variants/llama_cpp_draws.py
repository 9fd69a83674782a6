"""llama.cpp's random stream for DiffusionGemma, as a draw source (batch 1).

``LlamaCppDraws(seed)`` answers the three requests of ``draws.DrawSource`` with the numbers llama.cpp's
entropy-bound denoiser (``examples/diffusion/diffusion.cpp``, ``diffusion_generate_entropy_bound``, PR #24423
head c3fb972) draws, built with GCC's libstdc++, so that

    generate(model, ids, semantics="llama.cpp", random=LlamaCppDraws(seed))

makes llama.cpp's draws from its seed alone. What llama.cpp does, per block (its CLI calls the function once
per canvas, and each call starts a fresh generator):

    rng = std::mt19937(seed)                              seeded afresh for every block
    vocab_dist = std::uniform_int_distribution<int32_t>(0, V - 1)
    uni01 = std::uniform_real_distribution<float>(0, 1)
    canvas[i] = vocab_dist(rng)            for i in 0..C-1       the random initial canvas
    for each executed denoising step:
        for pos in 0..C-1:  u[pos] = uni01(rng); renoise[pos] = vocab_dist(rng)     interleaved
        sampled[pos] = first v with cum_v >= u[pos] * Z, cum and Z float sums of exp(z*temp_inv - max),
                       else V - 1

The libstdc++ (GCC 12) pieces, as ``bits/uniform_int_dist.h`` and ``bits/random.tcc`` write them:

* ``uniform_int_distribution`` over a 32-bit engine: Lemire's nearly-divisionless method on the 64-bit
  product ``w * V``: with ``low`` its lower 32 bits, a word is redrawn while ``low < (2^32 - V) % V``
  (checked only when ``low < V``); the id is the upper 32 bits. A redraw consumes another engine word.
* ``uniform_real_distribution<float>``: ``generate_canonical<float, 24>`` takes one word ``w`` and returns
  ``float(w) / 2^32`` in float arithmetic (``float(w)`` rounds to nearest, so it can reach 1.0), and a result
  ``>= 1`` becomes ``nextafter(1, 0)``; then ``* (1 - 0) + 0``, which changes nothing.
* ``std::mt19937(s)``: the result type is ``uint_fast32_t`` (64 bits on x86-64 Linux), reduced modulo 2^32, so
  llama.cpp's ``int32_t`` seed -1 is 4294967295. Without ``-s`` the CLI's seed is ``LLAMA_DEFAULT_SEED``
  (0xFFFFFFFF) passed on unchanged: fixed, not random (``DEFAULT_SEED`` below).

The categorical draw receives the reference's probabilities ``probs`` (B, C, V), not llama.cpp's ``exp``
values: the rule here is the first v whose float32 running sum of ``probs`` reaches ``u`` (else V - 1), the
same comparison divided by Z. It can differ from llama.cpp's only when ``u * Z`` falls within rounding of a
cumulative boundary.

Requests must come in the order ``generate`` makes them: ``canvas_ids`` once per canvas (it reseeds), then
per step ``categorical`` (which also draws that step's renoise ids, interleaved) followed by ``renoise_ids``
(which returns them). Only batch 1 exists in llama.cpp's CLI; other batch sizes raise ``InputError``.

``MT19937`` is the engine itself (tempered 32-bit words, twisted 624 at a time with NumPy), and
``uniform_int`` / ``uniform_float`` the two distributions, for tests and for other callers.
"""

from __future__ import annotations

import numpy as np

from ..draws import DrawSource
from ..support.errors import InputError

__all__ = ["LlamaCppDraws", "MT19937", "uniform_int", "uniform_float", "DEFAULT_SEED"]

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: what llama-diffusion-cli uses without -s (fixed, not random)

_N, _M = 624, 397
_MATRIX_A = np.uint32(0x9908B0DF)
_UPPER, _LOWER = np.uint32(0x80000000), np.uint32(0x7FFFFFFF)
_TWO32 = np.float32(4294967296.0)
_BELOW_ONE = np.nextafter(np.float32(1.0), np.float32(0.0))


def _seed_value(seed) -> int:
    """A seed as std::mt19937 sees it: any integer reduced modulo 2^32 (llama.cpp's int32 -1 -> 2^32 - 1)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InputError(f"a llama.cpp seed must be an integer, got {type(seed).__name__}")
    seed = int(seed)
    if not -2**31 <= seed < 2**32:
        raise InputError(f"a llama.cpp seed is a 32-bit integer (int32 or uint32), got {seed}")
    return seed & 0xFFFFFFFF


class MT19937:
    """std::mt19937: the 32-bit Mersenne Twister. ``words(n)`` consumes and returns the next n tempered outputs
    (uint32); ``peek(n)`` returns them without consuming; ``skip(n)`` consumes n."""

    def __init__(self, seed: int):
        state = [_seed_value(seed)]
        for i in range(1, _N):  # x[i] = 1812433253 * (x[i-1] ^ (x[i-1] >> 30)) + i  (mod 2^32)
            prev = state[-1]
            state.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
        self._state = np.array(state, dtype=np.uint32)
        self._buffer = np.empty(0, dtype=np.uint32)  # tempered outputs made but not consumed, in order

    def _twist(self) -> np.ndarray:
        """Renew the 624-word state; return its tempered outputs."""
        x = self._state
        # x[k] = x[k + M] ^ twist(x[k], x[k + 1]) for k = 0..N-1 in order. Indices k + M wrap onto words renewed
        # earlier in the same pass, so the pass runs in slices of N - M = 227 whose right-hand sides are final
        # (x[k + 1] is read before its slice writes it: old for every k < N - 1, the renewed x[0] for N - 1).
        for start in range(0, _N, _N - _M):
            k = np.arange(start, min(start + _N - _M, _N))
            y = (x[k] & _UPPER) | (x[(k + 1) % _N] & _LOWER)
            x[k] = x[(k + _M) % _N] ^ (y >> np.uint32(1)) ^ np.where(y & np.uint32(1), _MATRIX_A, np.uint32(0))
        y = x.copy()
        y ^= y >> np.uint32(11)
        y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
        y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
        y ^= y >> np.uint32(18)
        return y

    def peek(self, n: int) -> np.ndarray:
        """The next ``n`` outputs (uint32), not consumed."""
        n = int(n)
        if self._buffer.size < n:
            extra = [self._twist() for _ in range(-(-(n - self._buffer.size) // _N))]
            self._buffer = np.concatenate([self._buffer] + extra)
        return self._buffer[:n].copy()

    def skip(self, n: int) -> None:
        """Consume ``n`` outputs."""
        self.peek(n)
        self._buffer = self._buffer[int(n):]

    def words(self, n: int) -> np.ndarray:
        """Consume and return the next ``n`` outputs (uint32)."""
        out = self.peek(n)
        self.skip(n)
        return out

    def __call__(self) -> int:
        return int(self.words(1)[0])


def _check_range(n: int) -> int:
    n = int(n)
    if not 1 <= n <= 2**32 - 1:
        raise InputError(f"uniform_int needs 1 <= V <= 2^32 - 1 ids, got {n}")
    return n


def _lemire(words: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, redraw) of Lemire's method on words (uint32) for range n: ids = upper 32 bits of w * n; a word
    whose lower 32 bits fall below (2^32 - n) % n must be redrawn."""
    product = words.astype(np.uint64) * np.uint64(n)
    low = product & np.uint64(0xFFFFFFFF)
    return (product >> np.uint64(32)).astype(np.int64), low < np.uint64((2**32 - n) % n)


def _one_int(engine: MT19937, n: int) -> int:
    """One ``uniform_int_distribution(0, n - 1)`` draw, word by word (redrawing as libstdc++ does)."""
    threshold = (2**32 - n) % n
    while True:
        product = engine() * n
        if (product & 0xFFFFFFFF) >= threshold:
            return product >> 32


def uniform_int(engine: MT19937, n: int, count: int) -> np.ndarray:
    """``count`` draws of libstdc++'s ``uniform_int_distribution(0, n - 1)`` from ``engine`` (int64)."""
    n = _check_range(n)
    out = np.empty(int(count), dtype=np.int64)
    filled = 0
    while filled < out.size:
        ids, redraw = _lemire(engine.peek(out.size - filled), n)
        first = int(np.argmax(redraw)) if redraw.any() else ids.size
        out[filled:filled + first] = ids[:first]
        engine.skip(first)
        filled += first
        if filled < out.size:  # a redraw: this draw reads further words; the next draws start after them
            out[filled] = _one_int(engine, n)
            filled += 1
    return out


def uniform_float(words: np.ndarray) -> np.ndarray:
    """libstdc++'s ``uniform_real_distribution<float>(0, 1)`` of one word each: float(w) / 2^32, below 1."""
    u = np.asarray(words, dtype=np.uint32).astype(np.float32) / _TWO32
    return np.where(u >= np.float32(1.0), _BELOW_ONE, u).astype(np.float32)


def step_draws(engine: MT19937, n: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """One denoising step's draws: for each of ``count`` positions in order, ``u`` (uniform_float) then a
    renoise id (uniform_int over n). Returns (u float32 (count,), renoise int64 (count,))."""
    n = _check_range(n)
    u = np.empty(int(count), dtype=np.float32)
    ids = np.empty(int(count), dtype=np.int64)
    done = 0
    while done < u.size:
        words = engine.peek(2 * (u.size - done))
        got, redraw = _lemire(words[1::2], n)
        first = int(np.argmax(redraw)) if redraw.any() else got.size
        u[done:done + first] = uniform_float(words[0:2 * first:2])
        ids[done:done + first] = got[:first]
        engine.skip(2 * first)
        done += first
        if done < u.size:  # position `done` redraws its renoise id: take it word by word
            u[done] = uniform_float(engine.words(1))[0]
            ids[done] = _one_int(engine, n)
            done += 1
    return u, ids


def first_reaching(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """llama.cpp's inverse-CDF pick on probabilities: per row, the first v whose float32 running sum of
    ``probs`` reaches ``u`` (``cum >= u``), else the last id V - 1. probs (R, V), u (R,) -> (R,) int64."""
    cum = np.cumsum(np.asarray(probs, dtype=np.float32), axis=-1, dtype=np.float32)
    hit = cum >= np.asarray(u, dtype=np.float32)[:, None]
    return np.where(hit.any(axis=-1), np.argmax(hit, axis=-1), cum.shape[-1] - 1).astype(np.int64)


class LlamaCppDraws(DrawSource):
    """llama.cpp's draws for batch 1 from ``seed`` (default: the CLI's fixed seed without ``-s``).

    seed: an int32 or uint32 integer (as ``-s`` takes it; reduced modulo 2^32 like std::mt19937). Each
    ``canvas_ids`` starts a new ``std::mt19937(seed)``, so every block's initial canvas is the same. After a
    run, ``u`` holds the last step's uniforms (float32 (C,)).
    """

    def __init__(self, seed: int = DEFAULT_SEED):
        self.seed = _seed_value(seed)
        self.engine: MT19937 | None = None
        self.u: np.ndarray | None = None
        self._renoise: np.ndarray | None = None  # the step's renoise ids, drawn with its uniforms

    @staticmethod
    def _batch_one(batch_size: int) -> None:
        if batch_size != 1:
            raise InputError(f"LlamaCppDraws reproduces llama.cpp's single-sequence CLI: batch size must be 1, "
                             f"got {batch_size}")

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        self._batch_one(batch_size)
        self.engine = MT19937(self.seed)  # llama.cpp reseeds at the start of every block
        self._renoise = None
        return uniform_int(self.engine, vocab_size, canvas_length)[None, :]

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        probs = np.asarray(probs)
        if probs.ndim != 3:
            raise InputError(f"categorical needs probabilities of shape (B, C, V), got {probs.shape}")
        self._batch_one(probs.shape[0])
        if self.engine is None:
            raise InputError("LlamaCppDraws: a categorical draw was requested before the block's canvas_ids "
                             "(llama.cpp seeds its generator when a block starts)")
        _, C, V = probs.shape
        self.u, self._renoise = step_draws(self.engine, V, C)
        return first_reaching(probs[0], self.u)[None, :]

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        self._batch_one(batch_size)
        if self._renoise is None or self._renoise.shape != (canvas_length,):
            raise InputError("LlamaCppDraws: renoise ids are drawn together with the step's categorical draw "
                             "(llama.cpp interleaves them per position); request categorical first")
        ids, self._renoise = self._renoise, None
        if ids.size and ids.max() >= vocab_size:
            raise InputError(f"LlamaCppDraws: the step's renoise ids were drawn for another vocabulary size "
                             f"than {vocab_size}")
        return ids[None, :]
