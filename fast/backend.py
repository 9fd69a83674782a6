"""The CPU fast path's denoising step: the fused decoder buffer and the fused sampling pass.

``CpuBackend`` implements ``reference.generate.DenoisingBackend``, so that the one generation loop
(``reference.generate.generate``) runs the fast path with the reference's arguments, results and
random-draw contract. What differs is only how a step is computed:

* one (B, C, V) float32 buffer serves the whole run: the decoder writes soft-capped logits into it, the
  fused sampling pass (``fast.sampling``) turns each row into its probabilities in place, and the next
  step's self-conditioning reads those probabilities from it (the reference recomputes the same softmax of
  the processed logits). With a draw source that draws by the inverse-CDF rule from uniforms
  (``DrawSource.categorical_uniforms``) nothing else proportional to the vocabulary is allocated per step;
  any other source is handed the (B, C, V) probabilities as in the reference;
* rows that finished denoising are not decoded again (the reference runs them and discards the result);
  the loop freezes what they report;
* acceptance and renoising are the reference's (``generate.HostAcceptance``); a replaced ``denoiser`` runs
  on the reference's step (``fast.Model.denoising_backend``);
* a bfloat16 model (``fast.Model(dtype="bfloat16")``) self-conditions on the processed logits cast to
  bfloat16, as upstream's ``generate`` does (SPEC §10.1 B8), not on the float32 probabilities the sampling
  pass leaves: each step keeps those logits' bfloat16 bits (a (B, C, V) uint16 buffer, half the logits'
  bytes) before the pass, and the next step widens and softmaxes them into the shared buffer.

With the same seeded source, fast and reference produce the same tokens unless a decision of the
reference falls within float32 rounding of a tie (see ``fast.sampling``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from diffusiongemma.reference.draws import DrawSource
from diffusiongemma.reference.primitives import BFLOAT16
from diffusiongemma.reference.generate import HostAcceptance, StepOutput
from diffusiongemma.reference.stages import TRANSFORMERS
from diffusiongemma.reference.support.observer import NULL_OBSERVER, Observer

from .sampling import FusedSampler

__all__ = ["CpuBackend"]


class CpuBackend(HostAcceptance):
    """One denoising step on the CPU fast path (``reference.generate.DenoisingBackend``).

    model: a ``fast.Model``. draws: the run's draw source. batch_size: B. observer: receives each step's
    logits (the fused decoder reports no layer internals).
    """

    def __init__(self, model: Any, draws: DrawSource, batch_size: int, observer: Observer = NULL_OBSERVER):
        self.model, self.draws, self.observer = model, draws, observer
        self.B, self.C, self.V = int(batch_size), int(model.config.canvas_length), int(model.config.vocab_size)
        self.acceptor = TRANSFORMERS.sampler.start(1, TRANSFORMERS.threshold)  # the spec's entropy bound
        self.sampler = FusedSampler()
        # logits, then probabilities, then next step's SC input, all in one buffer; allocated by the first
        # canvas, after the loop's size checks (``check_budget``) have accepted the run
        self.buffer: np.ndarray | None = None
        self.cache: Any = None
        self.has_sc = False  # the buffer holds self-conditioning probabilities (bfloat16 run: sc_bits holds its input)
        self.bf16 = bool(getattr(model, "bf16", False))
        self.sc_bits: np.ndarray | None = None  # bfloat16 run: (B, C, V) uint16, bf16(processed logits)

    def context(self) -> Any:
        """The run keeps the BLAS library on one thread throughout (``fast.blas.CpuArrays.serial_blas``): the
        kernels' tiles are the products' parallelism, and changing the BLAS thread count per call would
        wake its thread pool every step."""
        scope = getattr(self.model.xp, "serial_blas", None)
        return scope() if scope is not None else contextlib.nullcontext()

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None, canvas: np.ndarray) -> None:
        B, C, V = self.B, self.C, self.V
        self.cache, self.has_sc = cache, False
        if self.buffer is None:
            self.buffer = np.empty((B, C, V), dtype=np.float32)
        if self.bf16 and self.sc_bits is None:
            self.sc_bits = np.empty((B, C, V), dtype=np.uint16)
        if sc_logits is not None:  # user SC logits (first canvas): their softmax (bfloat16 run: their bits)
            if self.bf16:
                self.model.ops.bf16_bits_of(np.ascontiguousarray(sc_logits, dtype=np.float32).reshape(B * C, V),
                                            0.0, self.sc_bits.reshape(B * C, V))
            else:
                self.model.ops.softmax(sc_logits.reshape(B * C, V), self.buffer.reshape(B * C, V))
            self.has_sc = True

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> StepOutput:
        B, C, V = self.B, self.C, self.V
        live = np.flatnonzero(~finished)  # rows to decode and sample this step
        if self.bf16 and self.has_sc:  # B8: softmax of the bfloat16 processed logits, in float32
            for row in live:
                np.copyto(self.buffer[row], self.sc_bits[row].view(BFLOAT16))
                self.model.ops.softmax(self.buffer[row], self.buffer[row])
        self.model.decode_rows(canvas[live], live, self.cache, self.buffer if self.has_sc else None, self.buffer)
        if self.bf16:  # the next step's input: this step's logits / temperature, cast to bfloat16
            for row in live:
                self.model.ops.bf16_bits_of(self.buffer[row], 0.0 if temp is None else float(temp), self.sc_bits[row])
        if self.observer.records:  # a copy of the live rows, only for an observer that keeps it
            self.observer.logits(self.buffer[live], rows=live)
        uniforms = self.draws.categorical_uniforms(B, C)  # (B, C) float64, or None: the source needs probs
        result = self.sampler(self.buffer, live, temp, uniforms, probs=self.buffer)  # (c)-(f) fused
        draft = np.zeros((B, C), dtype=np.int64)
        entropies = np.zeros((B, C), dtype=np.float32)
        draft[live], entropies[live] = result.draft, result.entropies  # (e), (f)
        if uniforms is not None:
            sampled = np.zeros((B, C), dtype=np.int64)
            sampled[live] = result.sampled  # (d)
        else:  # finished rows' probabilities are stale: their draws are made and the loop discards them
            sampled = np.array(self.draws.categorical(self.buffer), dtype=np.int64)  # (d) (B, C)
        self.has_sc = True
        return StepOutput(draft, sampled, entropies)
