"""The CPU fast path's denoising step: the fused decoder buffer and the fused sampling pass.

``CpuBackend`` implements ``reference.generate.DenoisingBackend``, so that the one generation loop
(``reference.generate.generate``) runs the fast path with the reference's arguments, results and
random-draw contract. What differs is only how a step is computed:

* with ``fast.Model``'s own decoder, one (B, C, V) float32 buffer serves the whole run: the decoder
  writes soft-capped logits into it, the fused sampling pass (``fast.sampling``) turns each row into its
  probabilities in place, and the next step's self-conditioning reads those probabilities from it (the
  reference recomputes the same softmax of the processed logits). With ``SeededDraws`` nothing else
  proportional to the vocabulary is allocated per step;
* rows that finished denoising are not decoded again (the reference runs them and discards the result):
  only their reported ``StepInfo.sampled`` differs, which for such a row repeats its last live draw;
* with ``SeededDraws`` the categorical draw uses the same generator call as the reference
  (``generator.random((B, C), float64)``) and the reference's inverse-CDF rule inside the fused pass;
  any other ``DrawSource`` is handed the (B, C, V) probabilities as in the reference;
* a replaced ``denoiser`` is called exactly as the reference calls it, on every row, with the processed
  logits as self-conditioning input; only the sampling is fused.

With the same seeded source, fast and reference produce the same tokens unless a decision of the
reference falls within float32 rounding of a tie (see ``fast.sampling``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from diffusiongemma.reference.draws import DrawSource, SeededDraws
from diffusiongemma.reference.generate import StepOutput, run_denoiser
from diffusiongemma.reference.observer import NULL_OBSERVER, Observer
from diffusiongemma.reference.sampling import entropy_bound_accept, renoise, scale_logits

from .sampling import FusedSampler

__all__ = ["CpuBackend"]


class CpuBackend:
    """One denoising step on the CPU fast path (``reference.generate.DenoisingBackend``).

    model: a ``fast.Model``. draws: the run's draw source. batch_size: B. denoiser: None (the model's fused
    decoder) or a replacement with ``model.denoise``'s signature. observer: receives each step's logits
    (and, through the model, nothing else: the fused decoder reports no layer internals).
    """

    def __init__(self, model: Any, draws: DrawSource, batch_size: int, denoiser: Any = None,
                 observer: Observer = NULL_OBSERVER):
        self.model, self.draws, self.observer = model, draws, observer
        self.B, self.C, self.V = int(batch_size), int(model.config.canvas_length), int(model.config.vocab_size)
        self.fused_decoder = denoiser is None
        self.denoise = denoiser
        self.seeded = type(draws) is SeededDraws  # exact type: a subclass may draw differently
        self.sampler = FusedSampler()
        # fused decoder: logits, then probabilities, then next step's SC input, all in one buffer
        self.buffer = np.empty((self.B, self.C, self.V), dtype=np.float32)
        self.cache: Any = None
        self.has_sc = False  # the buffer holds self-conditioning probabilities (fused decoder)
        self.sc_logits: np.ndarray | None = None  # replaced denoiser: next step's SC input (processed logits)
        self.sampled_prev: np.ndarray | None = None  # (B, C) last draws, reported for rows not decoded
        self.entropies = np.zeros((self.B, self.C), dtype=np.float32)
        self.draft: np.ndarray | None = None

    def context(self) -> Any:
        """The run keeps the BLAS library on one thread throughout (``fast.blas.CpuArrays.serial_blas``): the
        kernels' tiles are the products' parallelism, and changing the BLAS thread count per call would
        wake its thread pool every step."""
        scope = getattr(self.model.xp, "serial_blas", None)
        return scope() if scope is not None else contextlib.nullcontext()

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None) -> None:
        B, C, V = self.B, self.C, self.V
        self.cache, self.has_sc, self.sc_logits = cache, False, sc_logits
        self.sampled_prev = None
        self.draft = None
        if self.fused_decoder and sc_logits is not None:  # user SC logits (first canvas): their softmax
            self.model.ops.softmax(sc_logits.reshape(B * C, V), self.buffer.reshape(B * C, V))
            self.has_sc = True

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> StepOutput:
        B, C, V = self.B, self.C, self.V
        live = np.flatnonzero(~finished)  # rows to decode and sample this step
        if self.fused_decoder:
            self.model.decode_rows(canvas[live], live, self.cache, self.buffer if self.has_sc else None, self.buffer)
            logits = probs = self.buffer
            if self.observer.records:  # a copy of the live rows, only for an observer that keeps it
                self.observer.logits(logits[live], rows=live)
            rows = live  # finished rows were not decoded: only live rows are sampled
        else:
            logits = np.ascontiguousarray(run_denoiser(self.denoise, canvas, self.cache, self.sc_logits, (B, C, V)))
            self.observer.logits(logits)
            probs = self.buffer
            rows = np.arange(B, dtype=np.int64)  # a replaced denoiser ran on every row: sample them all
        uniforms = self.draws.generator.random(size=(B, C), dtype=np.float64) if self.seeded else None
        result = self.sampler(logits, rows, temp, uniforms, probs=probs)  # (c)-(f) fused
        draft = np.zeros((B, C), dtype=np.int64) if self.draft is None else self.draft.copy()
        draft[rows] = result.draft  # (e)
        entropies = self.entropies.copy()
        entropies[rows] = result.entropies
        previous = canvas if self.sampled_prev is None else self.sampled_prev
        if self.seeded:
            sampled = previous.copy()
            sampled[rows] = result.sampled  # (d)
        else:
            sampled = np.array(self.draws.categorical(probs), dtype=np.int64)  # (d) (B, C)
            skipped = np.ones(B, dtype=bool)
            skipped[rows] = False  # rows not decoded: their probabilities are stale, keep the last draw
            sampled[skipped] = previous[skipped]
        if not self.fused_decoder:
            processed = scale_logits(logits, temp)  # next step's SC input, as the reference
            if finished.any():
                processed[finished] = self.sc_logits[finished]
            self.sc_logits = processed
        self.has_sc = True
        self.draft, self.entropies, self.sampled_prev = draft, entropies, sampled
        return StepOutput(draft, sampled, entropies)

    def accept_and_renoise(self, entropies: np.ndarray, sampled: np.ndarray, noise: np.ndarray,
                           bound: float) -> tuple[np.ndarray, np.ndarray]:
        accepted = entropy_bound_accept(entropies, bound)  # (f)
        return accepted, renoise(sampled, accepted, noise)  # (g)
