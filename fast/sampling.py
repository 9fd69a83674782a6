"""The fused sampling stage of one denoising step (fast path of ``reference.sampling``).

One pass of ``_kernels.sample_rows`` per row of logits replaces the reference's chain
``scale_logits -> check_logits -> softmax_and_entropy -> categorical_from_uniform -> argmax_tokens``:

    reference (each a full (B, C, V) array pass, most allocating)      fast (two reads of each row)
    ẑ = z / T                                                          \
    check: NaN / +inf / all -inf                                         |  pass 1: max, first argmax,
    p = exp(ẑ - max) / sum,  H = -sum p log p                            |  S, A (entropy), flags
    y = first v with cumsum_f64(p)[v] > u * sum(p)                       |  pass 2: p written out,
    ā = argmax ẑ                                                        /   cumulative sum, the draw

The acceptance (``entropy_bound_accept``), renoising and stopping rules act on (B, C) arrays and are
the reference's own functions.

Where the numbers can differ from the reference (all at float32 rounding level, see ``_kernels.pyx``):
exp is the kernels' own (within ~2 ulp), sums accumulate in float64 in a different order, so
probabilities differ by a few ulp and entropies by ~1e-7 relative. Hence a discrete decision can differ
from the reference only when the reference's own decision is that close to a tie: two logits equal in
float32 (argmax), ``u * total`` within ~1e-7 of a cumulative-sum boundary (draw), an entropy sum within
~1e-6 of the entropy bound or a mean entropy that close to the confidence threshold
(``tests/test_fast_sampling.py`` measures these margins and reports every such case).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from diffusiongemma.reference.sampling import entropy_bound_accept, renoise
from diffusiongemma.reference.support.logits import raise_for_logit_flags

from . import _kernels

__all__ = ["StepResult", "FusedSampler", "sampling_step"]


class StepResult(NamedTuple):
    """Per-position outcome of the fused pass for the processed rows, each (n, C)."""

    draft: np.ndarray  # int64 argmax of the processed logits (first index on ties)
    entropies: np.ndarray  # float32 entropy in nats of softmax(processed logits)
    sampled: np.ndarray | None  # int64 inverse-CDF draws, None when no uniforms were given


class FusedSampler:
    """Runs the fused pass over a (B, C, V) logits buffer, reusing its small work buffers.

    One instance per generation run (it is not thread-safe).
    """

    def __init__(self) -> None:
        self._scratch: np.ndarray | None = None

    def __call__(self, logits: np.ndarray, rows: np.ndarray, temperature: np.float32 | None,
                 uniforms: np.ndarray | None = None, probs: np.ndarray | None = None) -> StepResult:
        """Sample the canvas positions of batch rows ``rows``.

        logits: (B, C, V) float32 C-contiguous soft-capped logits (read).
        rows: (n,) int64 batch rows to process (the others are not touched).
        temperature: the step's float32 temperature, or None for no schedule.
        uniforms: (B, C) float64 in [0, 1) (all rows; only ``rows`` are used) or None (no draw).
        probs: (B, C, V) float32 C-contiguous destination of the probabilities softmax(logits / T);
            default ``logits`` itself (overwritten in place, row by row, after it has been read).
        Returns a ``StepResult`` with (n, C) arrays. Raises ``SamplingError`` with the reference's
        message (``sampling.check_logits``) when a processed row holds NaN or +inf or has no finite
        value; ``probs`` holds garbage then.
        """
        B, C, V = logits.shape
        if probs is None:
            probs = logits
        rows = np.asarray(rows, dtype=np.int64)
        flat_rows = (rows[:, None] * C + np.arange(C, dtype=np.int64)).reshape(-1)  # (n*C,)
        R = flat_rows.shape[0]
        threads = max(1, _kernels.max_threads())
        width = _kernels.sampling_scratch_width(V)
        if self._scratch is None or self._scratch.shape[0] < threads or self._scratch.shape[1] < width:
            self._scratch = np.empty((threads, width), dtype=np.float32)
        draft = np.empty(R, dtype=np.int64)
        entropies = np.empty(R, dtype=np.float32)
        sampled = np.empty(R, dtype=np.int64) if uniforms is not None else None
        flags = np.zeros(R, dtype=np.intc)
        u = None
        if uniforms is not None:
            u = np.ascontiguousarray(np.asarray(uniforms, dtype=np.float64)[rows].reshape(-1))
        T = 0.0 if temperature is None else float(temperature)
        _kernels.sample_rows(logits.reshape(B * C, V), probs.reshape(B * C, V), flat_rows, T, u, self._scratch,
                             draft, entropies, sampled if sampled is not None else np.empty(R, np.int64), flags)
        if flags.any():
            raise_for_logit_flags(flat_rows, flags, C, temperature)
        n = rows.shape[0]
        return StepResult(draft.reshape(n, C), entropies.reshape(n, C),
                          None if sampled is None else sampled.reshape(n, C))


def sampling_step(logits: np.ndarray, temperature: np.float32 | None, uniforms: np.ndarray, noise: np.ndarray,
                  entropy_bound: float, sampler: FusedSampler | None = None) -> tuple[np.ndarray, ...]:
    """One whole sampling stage on a (B, C, V) logits array, in place: the fast twin of the reference chain.

    logits: (B, C, V) float32 soft-capped logits; overwritten with the probabilities softmax(logits / T).
    uniforms: (B, C) float64 in [0, 1) (the categorical draws' uniforms); noise: (B, C) int64 renoise ids.
    Returns ``(draft, entropies, sampled, accepted, next_canvas)``, each (B, C). Equivalent to
    ``scale_logits``, ``softmax_and_entropy``, ``categorical_from_uniform``, ``argmax_tokens``,
    ``entropy_bound_accept`` and ``renoise`` of ``reference.sampling`` (used by the benchmark and tests).
    """
    sampler = sampler or FusedSampler()
    B = logits.shape[0]
    result = sampler(logits, np.arange(B, dtype=np.int64), temperature, uniforms)
    accepted = entropy_bound_accept(result.entropies, entropy_bound)
    return result.draft, result.entropies, result.sampled, accepted, renoise(result.sampled, accepted, noise)
