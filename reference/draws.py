"""Where the randomness of generation comes from: one explicit, injectable draw source.

Generation makes exactly three kinds of random draws, always in this order (trap T14):

    for each canvas:
        canvas      (B, C) int64 ids in [0, V)   the initial canvas; drawn even when the caller supplies
                                                 ``decoder_input_ids`` (then it is discarded)
        for each executed denoising step:
            categorical (B, C) int64 ids         one draw per position from that position's distribution
            renoise     (B, C) int64 ids in [0, V)   fresh noise for the positions not accepted

Nothing else is random. A ``DrawSource`` answers those three requests; ``generate`` calls nothing else.

Sources:

* ``SeededDraws(seed)``: the default, reproducible and counter-based:
  ``numpy.random.Generator(numpy.random.Philox(seed))``, with each request mapped to exactly one
  generator call, in the order above:

      canvas       generator.integers(0, V, size=(B, C), dtype=numpy.int64)
      categorical  u = generator.random(size=(B, C), dtype=numpy.float64), then
                   sampling.categorical_from_uniform(probs, u)
      renoise      generator.integers(0, V, size=(B, C), dtype=numpy.int64)

  A fast path reproduces a reference run token for token by making the same calls on a generator built
  the same way (or by using this class) and the same inverse-CDF rule on its own probabilities.
* ``ReplayDraws(tape)``: feeds recorded outcomes back, e.g. the ``torch.randint`` / ``torch.multinomial``
  results of a transformers run, so that run is reproduced exactly (tests/test_generate_parity.py).
* ``RecordingDraws(source)``: passes another source through and keeps its tape, for replaying later.

A tape is a list of ``(kind, ids)`` pairs, kind one of ``"canvas"``, ``"categorical"``, ``"renoise"``, ids a
(B, C) int64 array, in the order the draws were made.

Upstream: ``EntropyBoundSampler.initialize_canvas`` / ``renoise_canvas`` (``torch.randint``) and
``torch.multinomial(probs.view(B*C, V), 1)`` in ``_denoising_step``; torch's global RNG is replaced by an
explicit source.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .errors import InputError
from .sampling import categorical_from_uniform

__all__ = ["DrawSource", "SeededDraws", "ReplayDraws", "RecordingDraws", "ReplayError", "DRAW_KINDS"]

DRAW_KINDS = ("canvas", "categorical", "renoise")


class ReplayError(InputError):
    """A recorded tape does not fit the run replaying it: exhausted, out of order, wrong shape or
    range, or a categorical outcome of zero probability."""


class DrawSource:
    """Interface of a draw source. Subclasses implement the three requests below.

    Every method returns a new (B, C) int64 array.
    """

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        """The initial canvas of a block: (B, C) ids, uniform over [0, V)."""
        raise NotImplementedError

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        """One id per position drawn from ``probs`` (B, C, V) float32 (each row sums to ~1). -> (B, C)."""
        raise NotImplementedError

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        """Fresh noise for one step: (B, C) ids, uniform over [0, V)."""
        raise NotImplementedError


class SeededDraws(DrawSource):
    """The default source: ``numpy.random.Generator(numpy.random.Philox(seed))``, one call per request.

    seed: anything ``numpy.random.Philox`` accepts (an int, a ``SeedSequence``). Two instances with the
    same seed produce the same draws for the same sequence of requests. See the module docstring for the
    exact calls.
    """

    def __init__(self, seed: int | np.random.SeedSequence = 0):
        self.seed = seed
        self.generator = np.random.Generator(np.random.Philox(seed))

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self.generator.integers(0, vocab_size, size=(batch_size, canvas_length), dtype=np.int64)

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        u = self.generator.random(size=np.shape(probs)[:-1], dtype=np.float64)  # (B, C) in [0, 1)
        return categorical_from_uniform(probs, u)

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self.generator.integers(0, vocab_size, size=(batch_size, canvas_length), dtype=np.int64)


class ReplayDraws(DrawSource):
    """Answer every request with the next recorded outcome, checking that it fits.

    tape: sequence of ``(kind, ids)`` (see the module docstring). Each request must find the next entry
    of the same kind with shape (B, C) and ids in [0, V); a categorical id must have nonzero probability
    under the ``probs`` it is asked for (a replayed run that has drifted from the recording would
    otherwise emit impossible tokens silently). Any mismatch, and running out, raise ``ReplayError``
    naming the entry. ``check_exhausted()`` confirms the whole tape was used.
    """

    def __init__(self, tape: Iterable[tuple[str, np.ndarray]]):
        self.tape: list[tuple[str, np.ndarray]] = []
        for i, entry in enumerate(tape):
            try:
                kind, ids = entry
            except (TypeError, ValueError):
                raise ReplayError(f"tape entry {i} is not a (kind, ids) pair") from None
            if kind not in DRAW_KINDS:
                raise ReplayError(f"tape entry {i} has kind {kind!r}; expected one of {DRAW_KINDS}")
            ids = np.asarray(ids)
            if not np.issubdtype(ids.dtype, np.integer):
                raise ReplayError(f"tape entry {i} ({kind}) holds {ids.dtype} values, not integer ids")
            self.tape.append((kind, ids.astype(np.int64)))
        self.position = 0  # index of the next entry to replay

    @property
    def remaining(self) -> int:
        """Entries not replayed yet."""
        return len(self.tape) - self.position

    def check_exhausted(self) -> None:
        """Raise ``ReplayError`` if part of the tape was never requested."""
        if self.remaining:
            kind = self.tape[self.position][0]
            raise ReplayError(f"{self.remaining} recorded draws were never used (next: entry {self.position}, "
                              f"{kind})")

    def _next(self, kind: str, shape: tuple[int, int], vocab_size: int) -> np.ndarray:
        if self.position >= len(self.tape):
            raise ReplayError(f"the recording ran out: a {kind} draw was requested after all "
                              f"{len(self.tape)} recorded draws were used")
        index = self.position
        recorded_kind, ids = self.tape[index]
        if recorded_kind != kind:
            raise ReplayError(f"a {kind} draw was requested but tape entry {index} is a {recorded_kind} draw")
        if ids.shape != shape:
            raise ReplayError(f"tape entry {index} ({kind}) has shape {ids.shape}, the run needs {shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ReplayError(f"tape entry {index} ({kind}) holds ids outside [0, {vocab_size})")
        self.position += 1
        return ids.copy()

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self._next("canvas", (batch_size, canvas_length), vocab_size)

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        probs = np.asarray(probs)
        index = self.position
        ids = self._next("categorical", probs.shape[:-1], probs.shape[-1])
        chosen = np.take_along_axis(probs, ids[..., None], axis=-1)[..., 0]  # (B, C)
        if not (chosen > 0).all():
            b, c = (int(i) for i in np.argwhere(~(chosen > 0))[0])
            raise ReplayError(f"tape entry {index} (categorical) replays id {int(ids[b, c])} at (row, position) "
                              f"({b}, {c}), which has probability {chosen[b, c]!r} in this run")
        return ids

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self._next("renoise", (batch_size, canvas_length), vocab_size)


class RecordingDraws(DrawSource):
    """Pass requests to ``source`` and keep what it returned in ``tape`` (feed it to ``ReplayDraws``)."""

    def __init__(self, source: DrawSource):
        self.source = source
        self.tape: list[tuple[str, np.ndarray]] = []

    def _keep(self, kind: str, ids: np.ndarray) -> np.ndarray:
        self.tape.append((kind, np.array(ids, dtype=np.int64, copy=True)))
        return ids

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self._keep("canvas", self.source.canvas_ids(batch_size, canvas_length, vocab_size))

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        return self._keep("categorical", self.source.categorical(probs))

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self._keep("renoise", self.source.renoise_ids(batch_size, canvas_length, vocab_size))


def as_draw_source(random: DrawSource | int | np.random.SeedSequence | None) -> DrawSource:
    """``generate``'s ``random`` argument as a source: None -> ``SeededDraws(0)``, an int or
    ``SeedSequence`` -> ``SeededDraws(seed)``, a ``DrawSource`` (or any object with its three methods) as
    is. Raises ``InputError`` otherwise."""
    if random is None:
        return SeededDraws(0)
    if isinstance(random, DrawSource) or all(callable(getattr(random, name, None))
                                             for name in ("canvas_ids", "categorical", "renoise_ids")):
        return random
    if isinstance(random, (int, np.integer, np.random.SeedSequence)) and not isinstance(random, bool):
        return SeededDraws(random)
    raise InputError(f"random must be a DrawSource, an integer seed or None, got {type(random).__name__}")
