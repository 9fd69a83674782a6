"""Recording and replaying draws: a run's random outcomes kept as a tape, and fed back so that another
implementation's run (a transformers trace, a peer's recorded stream) is reproduced exactly.

A tape is a list of ``(kind, ids)`` pairs, kind one of ``"canvas"``, ``"categorical"``, ``"renoise"``, ids a
(B, C) int64 array, in the order the draws were made (``draws.py`` gives the order).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ..draws import DRAW_KINDS, DrawSource
from .errors import InputError

__all__ = ["ReplayDraws", "RecordingDraws", "ReplayError"]


class ReplayError(InputError):
    """A recorded tape does not fit the run replaying it: exhausted, out of order, wrong shape or
    range, or a categorical outcome of zero probability."""


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
