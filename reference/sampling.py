"""The entropy-bound sampler of DiffusionGemma, one stage per function.

This module is the specification of what happens to the decoder's logits inside one denoising step,
and of how a finished canvas is committed. ``generate.py`` strings the stages together; nothing here
holds model state, and nothing here draws random numbers (the draws are inputs, see ``draws.py``).

One denoising step of one canvas (B rows, C positions, vocabulary V), cur_step n = N, N-1, ..., 1:

    z  (B, C, V) float32   soft-capped logits from the decoder (checked: support/logits.py)
    T_n = t_min + (t_max - t_min) * n / N   (float32; no schedule: z as is)  temperature
    ẑ = z / T_n   the "processed" logits                                       scale_logits
    p = softmax(ẑ),  H_j = entropy of position j (float32)                    softmax_and_entropy
    y_j ~ Categorical(p_j)   one draw per position (random draw 1 of 2)        categorical_from_uniform
    ā_j = argmax_v ẑ_j  (the "draft", first index on ties)                     argmax_tokens
    A = entropy-bound acceptance of H (a prefix of the ascending order)        entropy_bound_accept
    r ~ UniformInt[0, V) (B, C)   fresh noise (random draw 2 of 2)
    x' = where(A, y, r)                                                        renoise
    rows already finished keep (ā, x, ẑ, H) from the previous step             freeze_rows
    finished |= stable(ā) & mean_j(H_j) < γ                                    StableAndConfident
    next step: x <- x', self-conditioning logits <- ẑ

The freeze and stop stages exist only with adaptive stopping (both thresholds set); without it every
canvas runs all N steps. When every row is finished (or after N steps) the draft ā is committed, not the
sampled canvas, and ``finalize_canvas`` applies the EOS/pad rules. ``tokens_per_forward`` is the
throughput statistic that transformers reports.

Upstream: transformers 5.24.0, ``generation_diffusion_gemma.py`` (``LinearTemperatureScheduleLogitsProcessor``,
``EntropyBoundSampler``, ``StableAndConfidentStoppingCriteria``, ``DiffusionGemmaGenerationMixin._denoising_step``,
``_finalize_canvas``, ``_compute_tokens_per_forward``). With transformers' logits and the same random draws,
these functions reproduce its tokens exactly (tests/test_generate_parity.py).

Numerics, and where they can differ from torch in the last bit:

* Everything is float32 except two accumulations done in float64: the cumulative entropy of the
  acceptance rule (torch's CPU ``cumsum`` accumulates float32 in double, which we match bit for bit;
  torch on CUDA accumulates in float32) and the cumulative distribution of the categorical draw (our own
  inverse-CDF rule; torch's multinomial stream cannot be reproduced from NumPy, so for comparisons its
  draws are replayed).
* Entropies and their mean are float32 reductions whose summation order differs from torch's, so they
  agree with torch to about 1e-6 relative, not bit for bit. A decision can differ from torch only when
  a value lands within that distance of the entropy bound or the confidence threshold.
* Thresholds are compared in float32 (torch casts a Python-float threshold to the tensor's dtype):
  ``cum - H <= float32(bound)`` and ``mean(H) < float32(threshold)``.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from .support.errors import InputError, SamplingError

__all__ = [
    "temperature",
    "scale_logits",
    "softmax_and_entropy",
    "categorical_from_uniform",
    "argmax_tokens",
    "entropy_bound_accept",
    "renoise",
    "freeze_rows",
    "StableAndConfident",
    "finalize_canvas",
    "tokens_per_forward",
]

# Rows of the float64 cumulative distribution built at once by the categorical sampler. Only bounds
# memory (a full (256, 262144) float64 CDF would be 512 MiB); every row is independent, so the chunk size
# never changes a result.
_CDF_CHUNK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------------------------- temperature
def temperature(step: int, max_steps: int, t_min: float, t_max: float) -> np.float32:
    """Temperature of denoising step ``step`` under the linear schedule: a float32 scalar.

        T = t_min + (t_max - t_min) * (step / max_steps)

    ``step`` is transformers' ``cur_step``: it counts *down*, N at the first step of a canvas and 1 at the
    last, so the first step uses t_max and the last uses t_min + (t_max - t_min)/N (never t_min itself;
    trap T12). The schedule always uses N = ``max_steps``, even when the loop stops early.

    Rounding reproduces torch exactly: ``step / max_steps`` is a float32 division, ``t_max - t_min`` is
    formed in double and rounded to float32, and the product and sum are float32.

    Raises ``InputError`` when ``step`` is outside [1, max_steps].
    Upstream: ``LinearTemperatureScheduleLogitsProcessor``.
    """
    if not 1 <= step <= max_steps:
        raise InputError(f"denoising step {step!r} is outside [1, max_denoising_steps={max_steps}]")
    fraction = np.float32(step) / np.float32(max_steps)
    return np.float32(np.float32(t_min) + np.float32(t_max - t_min) * fraction)


def scale_logits(logits: np.ndarray, temp: np.float32 | None) -> np.ndarray:
    """Temperature-scaled ("processed") logits ``logits / temp``: (..., V) float32 -> new (..., V) float32.

    ``temp`` None means no schedule (transformers adds no temperature processor when t_min or t_max is
    unset) and returns a copy. A division, not a multiplication by 1/T, as upstream.
    """
    if temp is None:
        return np.array(logits, dtype=np.float32, copy=True)
    with np.errstate(over="ignore"):  # an overflow to inf is reported by check_logits, not as a warning
        return np.asarray(logits, dtype=np.float32) / np.float32(temp)


# ---------------------------------------------------------------------------------------------- distributions
def softmax_and_entropy(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities and entropy of each categorical distribution given by ``logits``.

    logits: (..., V) float32, finite or ``-inf`` (call ``check_logits`` first).
    Returns ``probs`` (..., V) float32 (``exp(z - max) / sum``; exactly 0 for ``-inf`` logits) and
    ``entropy`` (...) float32 in nats, ``H = -sum_v p_v * log p_v`` with ``log p = z - (max + log sum)``.
    As in torch's ``Categorical.entropy``, log-probabilities are clamped to the most negative float32
    before the product, so excluded ids contribute exactly 0 instead of ``0 * -inf = NaN``.
    Upstream: ``torch.softmax(..., dtype=float32)`` and ``torch.distributions.Categorical(logits=...).entropy()``.
    """
    z = np.asarray(logits, dtype=np.float32)
    top = z.max(axis=-1, keepdims=True)  # (..., 1)
    probs = np.exp(z - top)  # (..., V) unnormalised for now
    total = probs.sum(axis=-1, keepdims=True, dtype=np.float32)  # (..., 1), >= 1
    probs /= total
    p_log_p = z - (top + np.log(total))  # (..., V) log-probabilities (in place below: V-wide arrays are large)
    np.maximum(p_log_p, np.finfo(np.float32).min, out=p_log_p)
    p_log_p *= probs
    entropy = -np.sum(p_log_p, axis=-1, dtype=np.float32)
    return probs, entropy


def categorical_from_uniform(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF categorical draw: the first id whose cumulative probability exceeds ``u * total``.

    probs: (R..., V) float32, non-negative weights (rows need not sum to 1).
    u: float64 uniforms in [0, 1), shape ``R...`` (one draw per row) or ``R... + (S,)`` (S draws per row).
    Returns int64 ids with the shape of ``u``.

    Rule, per row: ``cdf`` = left-to-right cumulative sum of the float32 weights accumulated in float64,
    ``total = cdf[V-1]``, and the draw is the smallest v with ``cdf[v] > u * total``. Hence an id of zero
    probability (e.g. from a ``-inf`` logit) is never chosen, and P(v) = p_v / total up to float64
    rounding. If rounding leaves ``u * total >= total`` (never in practice) the draw is the last id of
    nonzero probability. The search is a vectorised bisection, ceil(log2(V + 1)) passes.

    Raises ``SamplingError`` for NaN or negative weights, or a row whose weights sum to 0 or overflow;
    ``InputError`` for mismatched shapes or ``u`` outside [0, 1).
    Upstream: none (torch.multinomial's stream cannot be reproduced); this is the project's own rule, and
    the fast paths reproduce it.
    """
    p = np.asarray(probs, dtype=np.float32)
    u = np.asarray(u, dtype=np.float64)
    rows = p.shape[:-1]
    if u.shape != rows and u.shape[:-1] != rows:
        raise InputError(f"uniforms have shape {u.shape}; expected {rows} or {rows} + (samples,) for "
                         f"probabilities of shape {p.shape}")
    if u.size and not ((u >= 0.0) & (u < 1.0)).all():
        raise InputError(f"uniforms must lie in [0, 1); got values in [{u.min()}, {u.max()}]")
    if np.isnan(p).any():
        raise SamplingError("probabilities contain NaN; cannot sample a token")
    if (p < 0).any():
        raise SamplingError("probabilities contain negative values; cannot sample a token")
    V = p.shape[-1]
    flat_p = p.reshape(-1, V)  # (R, V)
    flat_u = u.reshape(flat_p.shape[0], -1)  # (R, S)
    out = np.empty(flat_u.shape, dtype=np.int64)
    chunk = max(1, _CDF_CHUNK_ELEMENTS // max(V, 1))
    for start in range(0, flat_p.shape[0], chunk):  # memory bound only; rows are independent
        rows_p = flat_p[start:start + chunk]
        cdf = np.cumsum(rows_p, axis=-1, dtype=np.float64)  # (r, V), non-decreasing
        total = cdf[:, -1]  # (r,)
        if not (np.isfinite(total) & (total > 0)).all():
            bad = start + int(np.argmax(~(np.isfinite(total) & (total > 0))))
            raise SamplingError(f"probability row {bad} sums to {float(total[bad - start])!r}; cannot sample a token")
        target = flat_u[start:start + chunk] * total[:, None]  # (r, S)
        ids = _count_at_most(cdf, target)  # first index with cdf > target, or V
        overflow = ids >= V
        if overflow.any():  # u * total rounded up to total: take the last id of nonzero probability
            last_nonzero = V - 1 - np.argmax(rows_p[:, ::-1] > 0, axis=-1)  # (r,)
            ids = np.where(overflow, last_nonzero[:, None], ids)
        out[start:start + chunk] = ids
    return out.reshape(u.shape)


def _count_at_most(cdf: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row, the number of entries of the non-decreasing ``cdf`` (r, V) that are <= ``target`` (r, S).

    Equals ``searchsorted(cdf_row, target, side="right")``; computed by a bisection over all rows at once.
    """
    V = cdf.shape[-1]
    lo = np.zeros(target.shape, dtype=np.int64)  # invariant: cdf[lo - 1] <= target
    hi = np.full(target.shape, V, dtype=np.int64)  # invariant: cdf[hi] > target (or hi == V)
    for _ in range(int(V).bit_length()):
        mid = (lo + hi) // 2
        probe = np.take_along_axis(cdf, np.minimum(mid, V - 1), axis=-1)  # (r, S)
        right = (probe <= target) & (lo < hi)
        left = (probe > target) & (lo < hi)
        lo = np.where(right, mid + 1, lo)
        hi = np.where(left, mid, hi)
    return lo


def argmax_tokens(logits: np.ndarray) -> np.ndarray:
    """The draft: ``argmax_v logits`` per position, first index on ties. (..., V) -> (...) int64.

    Upstream: ``torch.argmax(processed_logits, dim=-1)`` (also first index on ties). Dividing by T > 0
    cannot change the maximum except in rounding ties, so this is the argmax of the raw logits too.
    """
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


# ---------------------------------------------------------------------------------------------- acceptance
def entropy_bound_accept(entropies: np.ndarray, bound: float) -> np.ndarray:
    """Which positions keep their sampled token: the entropy-bound rule. (B, C) float32 -> (B, C) bool.

    Per row, sort the C entropies ascending, H_(1) <= ... <= H_(C), and accept the k-th of them iff

        S_k - H_(k) <= bound,      S_k = H_(1) + ... + H_(k)

    i.e. iff the entropies strictly before it in the order sum to at most ``bound``. Because S_k - H_(k)
    grows with k, the accepted set is a prefix of the ascending order, and it always contains the
    lowest-entropy position (its left-hand side is 0). S_k is accumulated in float64 and rounded to
    float32 after each term, and the subtraction and the comparison with float32(bound) are float32:
    this is what torch's CPU ``cumsum`` and ``<=`` do, bit for bit.

    Ties: equal entropies are ordered by position (a stable sort). torch.sort on CPU is stable only for
    rows of at most 16 entries (the tiny test model's canvas); for longer rows its tie order is
    unspecified. The accepted *set* can differ only when a run of exactly equal entropies straddles the
    bound, which needs bit-identical logit rows.

    Upstream: ``EntropyBoundSampler.accept_canvas`` (after arXiv 2505.24857: the left-hand side bounds the
    mutual information among the accepted tokens).
    """
    H = np.asarray(entropies, dtype=np.float32)
    order = np.argsort(H, axis=-1, kind="stable")  # (B, C) positions in ascending entropy
    sorted_H = np.take_along_axis(H, order, axis=-1)
    cumulative = np.cumsum(sorted_H, axis=-1, dtype=np.float64).astype(np.float32)
    accept_sorted = (cumulative - sorted_H) <= np.float32(bound)
    accepted = np.zeros(H.shape, dtype=bool)
    np.put_along_axis(accepted, order, accept_sorted, axis=-1)
    return accepted


def renoise(sampled: np.ndarray, accepted: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """The next canvas: the sampled token where accepted, fresh noise everywhere else.

    sampled, noise: (B, C) int64; accepted: (B, C) bool. Returns a new (B, C) int64. The previous canvas
    never survives a step: a position that is not accepted gets a new uniform token (``noise`` is a full
    (B, C) draw made every step, trap T13), and a position accepted now may change at the next step.
    Upstream: ``EntropyBoundSampler.renoise_canvas`` after ``accept_canvas`` (the two ``where``s collapse
    into one).
    """
    return np.where(accepted, sampled, noise).astype(np.int64)


def freeze_rows(finished: np.ndarray, new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Rows whose denoising has finished keep their previous value: ``where(finished, old, new)``.

    finished: (B,) bool; new, old: (B, ...) of one shape. Returns a new array like ``new``. Applied to the
    draft, the next canvas, the processed logits and the entropies, so that a finished row's canvas and
    self-conditioning input stop changing while other rows keep denoising (the batch still runs the
    decoder on it). Upstream: the ``finished_denoising`` ``where``s in ``_denoising_step``.
    """
    mask = np.asarray(finished, dtype=bool).reshape((-1,) + (1,) * (np.ndim(new) - 1))
    return np.where(mask, old, new)


# ---------------------------------------------------------------------------------------------- stopping
class StableAndConfident:
    """The adaptive stopping rule of a canvas: stop a row once its draft is stable *and* confident.

    stability_threshold s (int >= 0), confidence_threshold γ (float > 0).

    * stable: s = 0 means always stable. Otherwise the rule keeps the drafts of the last s steps, filled
      with -1 at the start of every canvas (``reset``), and a row is stable iff its new draft equals each
      of them. So a draft must repeat over s + 1 consecutive steps, and nothing is stable before step
      s + 1 (s = 1: "same draft as the previous step").
    * confident: the mean over positions of the entropies of the processed logits is < γ (strict).

    ``__call__(draft, entropies)`` -> (B,) bool; the caller ORs it into the finished flags. Frozen rows are
    passed with their frozen draft and entropies (their answer no longer matters: they stay finished).
    Upstream: ``StableAndConfidentStoppingCriteria`` (the mean is a float32 reduction, see the module notes).
    """

    def __init__(self, stability_threshold: int, confidence_threshold: float, comparison: Any = np.less):
        self.stability_threshold = int(stability_threshold)
        self.confidence_threshold = np.float32(confidence_threshold)
        self.comparison = comparison  # (mean entropy (B,), γ) -> (B,) bool: the spec's strict mean < γ
        self.history: np.ndarray | None = None  # (s, B, C) int64: the last s drafts, oldest first

    def reset(self) -> None:
        """Forget the drafts (start of a canvas)."""
        self.history = None

    def __call__(self, draft: np.ndarray, entropies: np.ndarray, input_canvas: np.ndarray | None = None) -> np.ndarray:
        """draft: (B, C) int64, entropies: (B, C) float32 -> (B,) bool (stable and confident).
        ``input_canvas``, the canvas the step read, is not used by this rule (other stopping rules compare
        the draft with it)."""
        draft = np.asarray(draft, dtype=np.int64)
        s = self.stability_threshold
        if s == 0:
            stable = np.ones(draft.shape[0], dtype=bool)
        else:
            if self.history is None:
                self.history = np.full((s,) + draft.shape, -1, dtype=np.int64)
            stable = (self.history == draft[None]).all(axis=(0, 2))  # (B,)
            self.history = np.concatenate([self.history[1:], draft[None]], axis=0)
        mean_entropy = np.mean(np.asarray(entropies, dtype=np.float32), axis=-1, dtype=np.float32)  # (B,)
        return stable & self.comparison(mean_entropy, self.confidence_threshold)


# ---------------------------------------------------------------------------------------------- committing
def finalize_canvas(canvas: np.ndarray, finished_before: np.ndarray, eos_token_ids: Iterable[int],
                    pad_token_id: int | None, forced: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Apply the end-of-sequence rules to a just-committed canvas.

    canvas: (B, C) int64, the committed draft. finished_before: (B,) bool, rows finished in an earlier
    canvas. eos_token_ids: the EOS ids (empty: no EOS rule). pad_token_id: None disables every rewrite.
    forced: (B,) bool or None, rows finished by another criterion (the max-length rule).
    Returns ``(tokens, finished)``: the canvas to append, (B, C) int64 (a new array), and the updated
    (B,) finished flags.

    * A row finishes in this canvas if an EOS id appears anywhere in the canvas (the whole canvas is
      scanned) or ``forced`` says so.
    * If a pad id is set and any row is finished: rows finished before this canvas become all pad, and in
      every row each token after the first EOS becomes pad (the first EOS stays; later EOS ids are padded
      too). Rows without EOS are untouched.

    Upstream: ``EosTokenCriteria(new_token_length=C)`` OR ``MaxLengthCriteria``, then ``_finalize_canvas``.
    """
    tokens = np.array(canvas, dtype=np.int64, copy=True)
    finished_before = np.asarray(finished_before, dtype=bool)
    eos = np.asarray(tuple(eos_token_ids), dtype=np.int64)
    hit_eos = np.isin(tokens, eos).any(axis=-1) if eos.size else np.zeros(tokens.shape[0], dtype=bool)
    finished_now = hit_eos if forced is None else hit_eos | np.asarray(forced, dtype=bool)
    finished = finished_before | finished_now
    if pad_token_id is not None and finished.any():
        tokens[finished_before] = pad_token_id
        if eos.size and finished_now.any():
            is_eos = np.isin(tokens, eos)  # (B, C), seen after the previous-row rewrite, as upstream
            seen = np.cumsum(is_eos, axis=-1)
            after_first_eos = (seen > 0) & ~((seen == 1) & is_eos)
            tokens[after_first_eos] = pad_token_id
    return tokens, finished


def tokens_per_forward(new_tokens: np.ndarray, forward_passes: np.ndarray, pad_token_id: int | None) -> np.ndarray:
    """Generated tokens per decoder pass, per row: (B, k*C) int64, (B,) int -> (B,) float32.

    Tokens equal to the pad id are not counted (a real token with that id is excluded too; trap T24);
    without a pad id every generated position counts. ``forward_passes`` counts, per row, the decoder
    passes made while that row was neither finished denoising nor a finished sequence.
    The float32 arithmetic is upstream's, bit for bit: with a pad id, ``count_tensor / passes_tensor``
    (float32 true division); without one the count is a Python int, and ``int / tensor`` is torch's
    ``__rtruediv__``, i.e. ``passes.reciprocal() * count``: a float32 reciprocal, then a float32 product,
    which differs from the quotient in the last bit for some counts (17 / 3, 48 / 7, ...).
    Upstream: ``_compute_tokens_per_forward``.
    """
    new_tokens = np.asarray(new_tokens)
    passes = np.asarray(forward_passes).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):  # a row with no pass: inf / nan, as torch
        if pad_token_id is None:
            return (np.float32(1.0) / passes) * np.float32(new_tokens.shape[1])
        valid = (new_tokens != pad_token_id).sum(axis=-1)
        return valid.astype(np.float32) / passes
