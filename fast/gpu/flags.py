"""What the sampling kernels' flags mean on the host: the flat (row, position) indices a pass covers, and
the reference's error for the first flagged position (``reference.support.logits``).

Used by the per-step backend (``sampling.py``), the device loop of a canvas (``canvas.py``) and the
model's own passes (``model.py``), so that a NaN or +inf logit is reported the same way on every path.
"""

from __future__ import annotations

import numpy as np

from diffusiongemma.reference.support.errors import SamplingError
from diffusiongemma.reference.support.logits import (FLAG_NAN, FLAG_NO_FINITE, FLAG_POSINF, FLAG_RAW_NO_FINITE,
                                                     FLAG_RAW_POSINF, raise_for_logit_flags)

__all__ = ["flat_rows", "raise_for_flags"]


def flat_rows(batch_rows: np.ndarray, C: int) -> np.ndarray:
    """int32 indices of the (B*C, V) rows belonging to ``batch_rows`` (R,): b*C + c, shape (R*C,)."""
    return (np.asarray(batch_rows, dtype=np.int64)[:, None] * C + np.arange(C)).reshape(-1).astype(np.int32)


def raise_for_flags(flags: np.ndarray, flat_rows: np.ndarray, C: int, temp: np.float32 | None,
                    error: type = SamplingError, what: str = "denoiser logits") -> None:
    """Raise the reference's error for the first (row, position) the device's sampling kernel flagged.

    flags: (R*C,) int32 kernel flags; flat_rows: (R*C,) int32 their b*C + c indices. The device kernel sets
    bits 1/2/4 (NaN, +inf, all -inf) on the soft-capped, temperature-scaled values; without a temperature
    those are the raw logits, so +inf and all -inf become the raw-stage bits. (With a temperature, +inf
    before and after the division are not told apart; with a soft-cap the raw logits are never +inf.)
    Returns None when nothing is flagged."""
    flags = np.asarray(flags).astype(np.int64)
    if temp is None:
        flags = (flags & FLAG_NAN) | np.where(flags & FLAG_POSINF, FLAG_RAW_POSINF, 0) \
            | np.where(flags & FLAG_NO_FINITE, FLAG_RAW_NO_FINITE, 0)
    raise_for_logit_flags(flat_rows, flags, C, temp, error, what)
