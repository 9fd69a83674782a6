"""One denoising step on one screen: SPEC §8.2 step 3 (b-j) as a plain function, in the SPEC's order.

This is the reading path of the sampler. ``generate.py`` runs the same arithmetic through its backends,
stage objects, observer and callbacks (so that fast paths and other implementations' choices plug in);
here there is none of that: one model, the transformers semantics, the reference's own functions
(``sampling.py``). ``tests/test_step_listing.py`` holds this function to ``generate`` step for step:
the same draft, proposals, entropies, accepted set, next canvas, next self-conditioning input and
stopping decision, for the same model and draws.

    state = start_canvas(canvas)                       # SPEC §8.2 step 2
    for n in range(N, 0, -1):                          # cur_step counts down (trap T12)
        state, seen = denoising_step(model, cache, state, n, config, draws, stopper)
        if state.finished.all():
            break
    commit state.draft                                 # step 4 (trap T16)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .sampling import (StableAndConfident, argmax_tokens, entropy_bound_accept, freeze_rows, renoise,
                       scale_logits, softmax_and_entropy, temperature)
from .support.logits import check_logits

__all__ = ["CanvasState", "StepView", "start_canvas", "denoising_step"]


class CanvasState(NamedTuple):
    """What one step hands the next, for a batch of B rows and a canvas of C positions."""

    canvas: np.ndarray  # (B, C) int64 x: the noisy canvas the decoder reads
    sc_logits: "np.ndarray | None"  # (B, C, V) float32 S: self-conditioning input, None at a canvas's start
    draft: np.ndarray  # (B, C) int64 ā: the last argmax draft (the initial canvas before step 1)
    entropies: np.ndarray  # (B, C) float32 H of the last step (zeros before step 1)
    finished: np.ndarray  # (B,) bool: rows that stopped denoising (frozen)


class StepView(NamedTuple):
    """Every intermediate of one step, for reading and for tests (rows that had finished: their new values
    before freezing)."""

    logits: np.ndarray  # (B, C, V) float32 z, soft-capped (b)
    temperature: "np.float32 | None"  # τ_n (c)
    processed: np.ndarray  # (B, C, V) float32 ẑ = z / τ_n (c)
    probs: np.ndarray  # (B, C, V) float32 p = softmax(ẑ) (d)
    sampled: np.ndarray  # (B, C) int64 y ~ p (d)
    draft: np.ndarray  # (B, C) int64 ā = argmax ẑ (e)
    entropies: np.ndarray  # (B, C) float32 H(p) in nats (f)
    accepted: np.ndarray  # (B, C) bool A: the entropy-bound prefix (f), False for frozen rows
    noise: np.ndarray  # (B, C) int64 r (g)


def start_canvas(canvas: np.ndarray, sc_logits: np.ndarray | None = None) -> CanvasState:
    """The state before step 1 (SPEC §8.2 step 2): ``canvas`` (B, C) int64, no row finished."""
    canvas = np.asarray(canvas, dtype=np.int64)
    B, C = canvas.shape
    return CanvasState(canvas, sc_logits, canvas, np.zeros((B, C), np.float32), np.zeros(B, dtype=bool))


def denoising_step(model: Any, cache: Any, state: CanvasState, n: int, config: Any, draws: Any,
                   stopper: StableAndConfident | None = None) -> tuple[CanvasState, StepView]:
    """One denoising step at cur_step ``n`` (N..1) of transformers 5.24.0's loop (SPEC §8.2 b-j).

    model: ``denoise(canvas, cache, sc_logits)`` -> (B, C, V) float32 soft-capped logits (``Model``); cache:
    the encoded context (read only); config: a ``GenerationConfig``; draws: the run's ``DrawSource`` (this
    step makes its categorical draw, then its renoise draw, SPEC §8.3); stopper: the run's
    ``StableAndConfident`` (reset at each canvas's start), or None when adaptive stopping is off.
    Returns (the next state, every intermediate). Raises ``SamplingError`` for NaN / +inf logits.
    """
    x, S, old_draft, old_H, finished = state
    B, C = x.shape
    V = int(model.config.vocab_size)
    z = model.denoise(x, cache, S)  # (b) decoder pass, SPEC §7: z = 30·tanh(logits/30)
    check_logits(z, "denoiser logits")
    tau = (temperature(n, config.max_denoising_steps, config.t_min, config.t_max)  # (c) τ_n, float32
           if config.uses_temperature else None)
    z_hat = scale_logits(z, tau)  # (c) ẑ = z / τ_n
    p, H = softmax_and_entropy(z_hat)  # (d, f) p = softmax(ẑ), H = -Σ p log p
    draft = argmax_tokens(z_hat)  # (e) ā, first index on ties
    y = draws.categorical(p)  # (d) one proposal per position
    r = draws.renoise_ids(B, C, V)  # (g) fresh uniform ids
    A = entropy_bound_accept(H, config.entropy_bound)  # (f) lowest-entropy prefix under β
    x_next = renoise(y, A, r)  # (g) x' = where(A, y, r)

    # (h) rows that had finished keep everything; their proposals are discarded
    draft = freeze_rows(finished, draft, old_draft)
    x_next = freeze_rows(finished, x_next, x)
    H_kept = freeze_rows(finished, H, old_H)
    S_next = z_hat if S is None or not finished.any() else freeze_rows(finished, z_hat, S)
    accepted = A & ~finished[:, None]

    # (i) stable (the draft repeats) and confident (mean H < γ)
    if stopper is not None:
        finished = finished | stopper(draft, H_kept, x)

    # (j) the next step reads the processed logits ẑ as its self-conditioning input (SPEC §7.1)
    view = StepView(z, tau, z_hat, p, freeze_rows(state.finished, y, x), draft, H_kept, accepted, r)
    return CanvasState(x_next, S_next, draft, H_kept, finished), view
