"""One denoising step on the device: the sampling pass and the acceptance kernel."""

from __future__ import annotations

from typing import Any

import numpy as np


from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.errors import SamplingError


from . import launch as gl


def _flat_rows(batch_rows: np.ndarray, C: int) -> np.ndarray:
    """int32 indices of the (B*C, V) rows belonging to ``batch_rows``: b*C + c."""
    return (np.asarray(batch_rows, dtype=np.int64)[:, None] * C + np.arange(C)).reshape(-1).astype(np.int32)


class _StepOutputs:
    """Device outputs of one sampling pass over R rows."""

    def __init__(self, dev: Any, R: int):
        self.argmax = dev.empty((R,), np.int64)
        self.entropy = dev.empty((R,), np.float32)
        self.sampled = dev.zeros((R,), np.int64)
        self.flags = dev.empty((R,), np.int32)


def _raise_for_flags(flags: np.ndarray, flat_rows: np.ndarray, C: int, what: str, error=SamplingError) -> None:
    """Raise naming the first (row, position) whose logits hold NaN / +inf / no finite value."""
    bad = np.flatnonzero(flags)
    if bad.size == 0:
        return
    i = int(bad[0])
    row, pos = divmod(int(flat_rows[i]), C)
    f = int(flags[i])
    reason = "NaN" if f & 1 else "+inf" if f & 2 else "no finite value (all -inf)"
    raise error(f"{what} at (row, position) {(row, pos)} hold {reason}; cannot sample a token")


# ================================================================================================ generation

class _DeviceSampler:
    """One denoising step on the device for the rows still denoising; owns the (B, C, V) buffer."""

    def __init__(self, model: Any, B: int, C: int, V: int, draws: Any, logits_hook: Any):
        self.model, self.dev = model, model.device
        self.B, self.C, self.V = B, C, V
        self.draws = draws
        self.logits_hook = logits_hook
        self.buffer = self.dev.empty((B, C, V), np.float32)  # the one (C x V) float32 buffer per sequence
        self.has_sc = False  # buffer holds self-conditioning probabilities for every row

    def start_canvas(self, sc_logits: np.ndarray | None) -> None:
        """Start a canvas: no self-conditioning, or the caller's logits (first canvas only)."""
        self.has_sc = False
        if sc_logits is not None:
            self.buffer[...] = self.dev.to_device(sc_logits)
            self.model._softmax_in_place(self.buffer, np.arange(self.B), "self_conditioning_logits")
            self.has_sc = True

    def _uniforms(self) -> np.ndarray | None:
        """The categorical uniforms of ``SeededDraws`` (its exact generator call), or None for another source."""
        if type(self.draws) is SeededDraws:
            return self.draws.generator.random(size=(self.B, self.C), dtype=np.float64)
        return None

    def step(self, canvas: np.ndarray, live: np.ndarray, temp: np.float32 | None, bound: float) -> dict:
        """Decoder pass, sampling pass and acceptance for the batch rows ``live``; returns host arrays
        (len(live), C): draft, entropies, sampled, accepted, next canvas."""
        dev, B, C, V = self.dev, self.B, self.C, self.V
        model = self.model
        cap = model.config.final_logit_softcapping
        if self.logits_hook is not None:
            logits = np.asarray(self.logits_hook(canvas, live), dtype=np.float32)
            self.buffer[dev.to_device(live)] = dev.to_device(logits[live])
            cap = 0.0
        else:
            model._decoder_logits(dev.to_device(canvas[live]), self._cache, live, self.buffer, self.has_sc)
        flat = _flat_rows(live, C)
        n = flat.shape[0]
        out = _StepOutputs(dev, n)
        uniforms = self._uniforms()
        temp_value = 0.0 if temp is None else float(temp)
        what = "denoiser logits" if temp is None else f"logits divided by temperature {float(temp)!r}"
        dev.launch(gl.sample_rows(self.buffer.reshape(B * C, V), dev.to_device(flat), cap, temp_value,
                                  None if uniforms is None else dev.to_device(uniforms[live].reshape(-1)),
                                  out.argmax, out.entropy, out.sampled, out.flags))
        _raise_for_flags(dev.to_host(out.flags), flat, C, what)
        if uniforms is None:  # any other draw source decides on the host, from the probabilities
            probs = dev.to_host(self.buffer)
            frozen = np.setdiff1d(np.arange(B), live)
            probs[frozen] = np.float32(1.0 / V)  # not recomputed; their draws are consumed and discarded
            sampled = self.draws.categorical(probs)
            out.sampled = dev.to_device(np.ascontiguousarray(sampled[live].reshape(-1)))
        noise = self.draws.renoise_ids(B, C, V)
        accepted = dev.empty((live.shape[0], C), np.uint8)
        next_canvas = dev.empty((live.shape[0], C), np.int64)
        entropy = out.entropy.reshape(live.shape[0], C)
        sampled_dev = out.sampled.reshape(live.shape[0], C)
        dev.launch(gl.accept_renoise(entropy, sampled_dev, dev.to_device(noise[live]), bound, accepted, next_canvas))
        self.has_sc = True
        shape = (live.shape[0], C)
        return {"draft": dev.to_host(out.argmax).reshape(shape), "entropies": dev.to_host(entropy),
                "sampled": dev.to_host(sampled_dev), "accepted": dev.to_host(accepted).astype(bool),
                "canvas": dev.to_host(next_canvas)}

