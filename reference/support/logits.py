"""Logit checks: a denoising step refuses logits that cannot define a distribution (NaN, +inf, a position
whose every logit is -inf) with an error that names the stage, the row and the position.

The GPU's sampling kernel reports the same faults as bit flags; ``raise_for_logit_flags`` turns them into
the same message.
"""

from __future__ import annotations

import numpy as np

from .errors import SamplingError


# Flag bits a compiled sampling pass sets per (row, position), so that it can report what ``check_logits``
# reports without a second pass over the logits: NaN, +inf or all -inf after the division by T (1, 2, 4);
# +inf or all -inf in the logits before it (8, 16).
FLAG_NAN, FLAG_POSINF, FLAG_NO_FINITE, FLAG_RAW_POSINF, FLAG_RAW_NO_FINITE = 1, 2, 4, 8, 16


def check_logits(logits: np.ndarray, what: str = "logits", error: type = SamplingError) -> None:
    """Refuse logits that cannot define a distribution, so that NaN never becomes a token.

    logits: (B, C, V) float. Allowed: finite values and ``-inf`` (an excluded id). Raises
    ``SamplingError`` (``bad_logits_error``) naming the first offending (row, position) for NaN, ``+inf``, or
    a position whose logits are all ``-inf``. ``what`` names the array in the message; ``error`` is the
    class raised (``InputError`` for a caller's self-conditioning input).
    """
    z = np.asarray(logits)
    if np.isfinite(z).all():
        return
    for bad, reason in ((np.isnan(z).any(axis=-1), "NaN"),
                        (np.isposinf(z).any(axis=-1), "+inf"),
                        (np.isneginf(z).all(axis=-1), "no finite value (all -inf)")):
        if bad.any():
            raise bad_logits_error(what, tuple(int(i) for i in np.argwhere(bad)[0]), reason, error)


def bad_logits_error(what: str, where: tuple, reason: str, error: type = SamplingError) -> Exception:
    """The one error every backend raises for logits that cannot be sampled (the message names the stage,
    the (row, position) and the reason: "NaN", "+inf" or "no finite value (all -inf)")."""
    return error(f"{what} at (row, position) {where} hold {reason}; cannot sample a token")


def raise_for_logit_flags(flat_positions: np.ndarray, flags: np.ndarray, C: int, temp: np.float32 | None,
                          error: type = SamplingError, what: str = "denoiser logits") -> None:
    """Raise what ``check_logits`` raises, in its order, from the flags of a compiled sampling pass.

    flat_positions: (n,) int flat indices b*C + c of the flagged rows' positions; flags: (n,) int bits above.
    The reference checks the raw logits first (NaN, then +inf, then all -inf), then, with a temperature,
    the processed ones; within a check the first (row, position) is named. ``what`` names the raw array.
    Returns when nothing is flagged.
    """
    flags = np.asarray(flags)
    if not flags.any():
        return
    order = np.argsort(flat_positions, kind="stable")
    positions, flags = np.asarray(flat_positions)[order], flags[order]
    stages = [(what, ((FLAG_NAN, "NaN"), (FLAG_RAW_POSINF, "+inf"),
                                   (FLAG_RAW_NO_FINITE, "no finite value (all -inf)")))]
    if temp is not None:
        stages.append((f"logits divided by temperature {float(temp)!r}",
                       ((FLAG_NAN, "NaN"), (FLAG_POSINF, "+inf"), (FLAG_NO_FINITE, "no finite value (all -inf)"))))
    for what, checks in stages:
        for bit, reason in checks:
            hit = np.flatnonzero(flags & bit)
            if hit.size:
                flat = int(positions[hit[0]])
                raise bad_logits_error(what, (flat // C, flat % C), reason, error)
    raise bad_logits_error("logits", "flagged by the sampling kernel", "an unknown flag", error)
