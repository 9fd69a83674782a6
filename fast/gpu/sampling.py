"""One denoising step on the device: the decoder pass, the sampling kernel and the acceptance kernel.

``GpuBackend`` implements ``reference.generate.DenoisingBackend`` for ``fast.gpu.Model``, so that the one
generation loop (``reference.generate.generate``) runs on the GPU with the reference's arguments, lengths,
EOS/pad rules, callbacks and draw order (SPEC §8).

Self-conditioning keeps exactly one (canvas x vocabulary) float32 buffer per sequence: the decoder writes
its logits there, the sampling pass turns them into probabilities in place, and the next step's
self-conditioning input reads those probabilities (softmax of the processed logits, SPEC §7.1) before the
decoder overwrites the buffer with new logits. Rows that finished denoising are not recomputed, so their
probabilities stay as they were (the reference's freezing, SPEC §8.2 h). A bfloat16 model keeps a second such
buffer (``sc_buffer``): its self-conditioning input is the softmax of the processed logits rounded to bfloat16
(SPEC B8), not the sampling pass's probabilities. The per-step ``step`` copies its raw logits there first
(``_keep_raw_logits``) and computes them with separate launches; the device loop's sampling kernel writes
them there itself (``launch.sample_step``'s bf16 flag), the same bits.

Within a canvas, ``run_canvas`` (``canvas.py``) runs the steps with every piece of the loop's state on the
device and the host reading only a small stop flag every ``sync_every`` steps and the committed draft; the
per-step ``step`` / ``accept_and_renoise`` below serve the runs it does not cover (``canvas.applies``: a
recording observer, a draw source other than ``SeededDraws``, another implementation's semantics, or
``device_loop=False``), through the spec's own loop. A test's logits hook runs on either path.

Randomness never comes from the device: with ``SeededDraws`` the uniforms of the categorical draw come from
the same Philox call the reference makes and are copied to the device; any other source is given the
probabilities on the host. A replaced ``denoiser`` runs on the host, so a run with one uses the reference's
step (``ReferenceBackend``) inside the device context.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusiongemma.reference.generate import StepOutput
from diffusiongemma.reference.support.errors import SamplingError
from diffusiongemma.reference.support.observer import NULL_OBSERVER, Observer

from . import canvas as canvas_loop
from . import graph
from . import launch as gl
from .canvas import SYNC_EVERY
from .flags import flat_rows, raise_for_flags

__all__ = ["GpuBackend"]


class _StepOutputs:
    """Device outputs of one sampling pass over R rows."""

    def __init__(self, dev: Any, R: int):
        self.argmax = dev.empty((R,), np.int64)
        self.entropy = dev.empty((R,), np.float32)
        self.sampled = dev.zeros((R,), np.int64)
        self.flags = dev.empty((R,), np.int32)


class GpuBackend:
    """One denoising step on the device for the rows still denoising; owns the (B, C, V) buffer.

    model: a ``fast.gpu.Model``. draws: the run's draw source. batch_size: B. observer: receives each step's
    logits (copied to the host only for an observer that records). logits_hook: tests only; ``hook(canvas
    (B, C) int64, rows)`` -> soft-capped host logits (B, C, V) replaces the decoder, so that the same logits
    can be fed to this backend and to the reference's.
    """

    def __init__(self, model: Any, draws: Any, batch_size: int, observer: Observer = NULL_OBSERVER,
                 logits_hook: Any = None, device_loop: bool = True, sync_every: int = SYNC_EVERY,
                 graphs: bool | None = None):
        self.model, self.dev = model, model.device
        self.device_loop, self.sync_every = bool(device_loop), int(sync_every)  # see run_canvas
        # replay the whole step captured once per canvas (graph.py): on cuda-sim by default; on a GPU when
        # asked (graphs=True), until a GPU run has checked CuPy's capture of it
        self.graphs = (not graph.on_gpu(self.dev)) if graphs is None else bool(graphs)
        self._outputs: _StepOutputs | None = None
        self.B, self.C, self.V = int(batch_size), int(model.config.canvas_length), int(model.config.vocab_size)
        self.draws, self.observer, self.logits_hook = draws, observer, logits_hook
        self.buffer: Any = None  # the one (C x V) buffer per row, allocated by the first canvas (after check_budget)
        self.has_sc = False  # buffer holds self-conditioning probabilities for every row
        # a bfloat16 model's self-conditioning probabilities (softmax of the processed logits rounded to bfloat16,
        # SPEC B8) in a buffer of their own; None: they are the buffer's (float32 run, a caller's logits)
        self.sc_probs: Any = None
        self._sc_buffer: Any = None
        self.cache: Any = None

    def context(self) -> Any:
        return self.dev.context()

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None, canvas: np.ndarray) -> None:
        """Start a canvas: no self-conditioning, or the caller's logits (first canvas only)."""
        self.cache, self.has_sc, self.sc_probs = cache, False, None
        if self.buffer is None:
            with self.dev.context():
                self.buffer = self.dev.empty((self.B, self.C, self.V), np.float32)
        if sc_logits is not None:
            self.buffer[...] = self.dev.to_device(sc_logits)
            self.model._softmax_in_place(self.buffer, np.arange(self.B), "self_conditioning_logits")
            self.has_sc = True

    def outputs(self, R: int) -> _StepOutputs:
        """The sampling pass's output arrays for up to R rows, allocated once per run."""
        if self._outputs is None or self._outputs.argmax.shape[0] < R:
            with self.dev.context():
                self._outputs = _StepOutputs(self.dev, R)
        return self._outputs

    def run_canvas(self, k: int, canvas: np.ndarray, draws: Any, stopper: Any, config: Any, ended: np.ndarray,
                   forward_passes: np.ndarray, callback: Any, observer: Observer, n_canvases: int,
                   semantics: Any) -> tuple[np.ndarray, int] | None:
        """The canvas's steps on the device (``canvas.run_canvas``), or None when this run needs the spec's
        loop (``canvas.applies``)."""
        if not canvas_loop.applies(self, draws, observer, semantics, stopper):
            return None
        with self.dev.context():
            try:
                return canvas_loop.run_canvas(self, k, canvas, draws, stopper, config, ended, forward_passes,
                                              callback, n_canvases, semantics)
            except SamplingError as error:  # NaN/+inf logits: name the layer, as the CPU paths do
                raise self.model.diagnose_non_finite(error, canvas, self.cache) from None

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> StepOutput:
        """Decoder pass and sampling pass for the rows not finished (SPEC §8.2 b-e)."""
        dev, B, C, V = self.dev, self.B, self.C, self.V
        live = np.flatnonzero(~finished)
        cap = self.model.config.final_logit_softcapping
        if self.logits_hook is not None:
            logits = np.asarray(self.logits_hook(canvas, live), dtype=np.float32)
            self.buffer[dev.to_device(live)] = dev.to_device(logits[live])
            cap = 0.0
        else:
            self.model._decoder_logits(dev.to_device(canvas[live]), self.cache, live, self.buffer, self.has_sc,
                                       sc_probs=self.sc_probs)
        raw = self._keep_raw_logits(live)
        if self.observer.records:
            self.observer.logits(self.model.softcapped_host_logits(self.buffer, live, cap), rows=live)
        flat = flat_rows(live, C)
        out = _StepOutputs(dev, flat.shape[0])
        uniforms = self.draws.categorical_uniforms(B, C)  # (B, C) float64, or None: the source needs probs
        dev.launch(gl.sample_rows(self.buffer.reshape(B * C, V), dev.to_device(flat), cap,
                                  0.0 if temp is None else float(temp),
                                  None if uniforms is None else dev.to_device(uniforms[live].reshape(-1)),
                                  out.argmax, out.entropy, out.sampled, out.flags))
        try:
            raise_for_flags(dev.to_host(out.flags), flat, C, temp)
        except SamplingError as error:  # NaN/+inf logits: name the layer, as the CPU paths do
            raise self.model.diagnose_non_finite(error, canvas, self.cache) from None
        if raw is not None:
            self._bf16_self_conditioning(raw, live, cap, temp)
        sampled = np.zeros((B, C), dtype=np.int64)  # rows not decoded: the loop reports their frozen canvas
        if uniforms is None:  # any other draw source decides on the host, from the probabilities
            probs = dev.to_host(self.buffer)
            frozen = np.setdiff1d(np.arange(B), live)
            probs[frozen] = np.float32(1.0 / V)  # not recomputed; their draws are consumed and discarded
            sampled[live] = np.asarray(self.draws.categorical(probs))[live]
        else:
            sampled[live] = dev.to_host(out.sampled).reshape(live.shape[0], C)
        self.has_sc = True
        draft, entropies = np.zeros((B, C), dtype=np.int64), np.zeros((B, C), dtype=np.float32)
        draft[live] = dev.to_host(out.argmax).reshape(live.shape[0], C)
        entropies[live] = dev.to_host(out.entropy).reshape(live.shape[0], C)
        return StepOutput(draft, sampled, entropies)

    def sc_buffer(self) -> Any:
        """A bfloat16 model's (B, C, V) float32 buffer of self-conditioning probabilities (SPEC B8), allocated
        by its first use and kept for the run."""
        if self._sc_buffer is None:
            with self.dev.context():
                self._sc_buffer = self.dev.empty((self.B, self.C, self.V), np.float32)
        return self._sc_buffer

    def _keep_raw_logits(self, live: np.ndarray) -> Any:
        """A bfloat16 model: a copy of the step's raw logits (B, C, V) before the sampling pass turns them into
        probabilities (rows ``live`` written), for ``_bf16_self_conditioning``; None for a float32 model."""
        if not getattr(self.model, "bf16", False):
            return None
        self.sc_buffer()
        for b in live:
            self._sc_buffer[int(b)] = self.buffer[int(b)]
        return self._sc_buffer

    def _bf16_self_conditioning(self, raw: Any, live: np.ndarray, cap: float, temp: Any) -> None:
        """The next step's self-conditioning probabilities of a bfloat16 model, in place of ``raw``'s rows
        ``live``: the processed logits (soft-cap, then temperature, float32 as the sampling kernel computes
        them) rounded to bfloat16, then the float32 softmax (``Model._softmax_in_place``), as upstream's
        bfloat16 run feeds them (SPEC B8). Rows not decoded keep their earlier probabilities."""
        dev = self.dev
        for b in live:
            row = raw[int(b)]
            if cap:
                dev.launch(gl.softcap(row, cap))
            if temp is not None and float(temp) > 0:
                dev.xp.divide(row, np.float32(temp), out=row)
        self.model._softmax_in_place(raw, live, "self_conditioning_logits")
        self.sc_probs = raw

    def accept_and_renoise(self, step: StepOutput, canvas: np.ndarray, noise: np.ndarray,
                           bound: float) -> tuple[np.ndarray, np.ndarray]:
        """The spec's entropy-bound acceptance and renoising (SPEC §8.2 f, g) as one kernel on all B rows."""
        dev = self.dev
        entropies, sampled = step.entropies, step.sampled
        shape = entropies.shape
        accepted = dev.empty(shape, np.uint8)
        next_canvas = dev.empty(shape, np.int64)
        dev.launch(gl.accept_renoise(dev.to_device(np.ascontiguousarray(entropies, dtype=np.float32)),
                                     dev.to_device(np.ascontiguousarray(sampled, dtype=np.int64)),
                                     dev.to_device(np.ascontiguousarray(noise, dtype=np.int64)), bound,
                                     accepted, next_canvas))
        return dev.to_host(accepted).astype(bool), dev.to_host(next_canvas)

    def revealed_all(self) -> np.ndarray:
        """The entropy-bound sampler never ends a row by itself."""
        return np.zeros(self.B, dtype=bool)
