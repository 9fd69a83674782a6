"""Block-diffusion generation on the fast path: the reference loop with the fused sampler.

Same arguments, same results and the same random-draw contract as ``reference.generate.generate`` (its
docstring is the specification; its ``GenerationConfig``, ``GenerationResult``, callbacks, input checks
and draw sources are used as they are). What differs is how a step is computed:

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
* a custom ``denoiser`` (or a model that is not a ``fast.Model``) is called exactly as the reference calls
  it, on every row, with the processed logits as self-conditioning input; only the sampling is fused.

With the same seeded source, fast and reference produce the same tokens unless a decision of the
reference falls within float32 rounding of a tie (see ``fast.sampling``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from diffusiongemma.reference.draws import DrawSource, SeededDraws, as_draw_source
from diffusiongemma.reference.generate import (GenerationConfig, GenerationResult, StepInfo, check_prompt,
                                               check_special_ids, check_start_canvas, check_start_sc_logits,
                                               commit_canvas, finish_run, new_token_budget, notify, readonly,
                                               resolve_config, run_denoiser)
from diffusiongemma.reference.sampling import (StableAndConfident, entropy_bound_accept, freeze_rows, renoise,
                                               scale_logits, temperature)

from .cache import KVCache
from .model import Model
from .sampling import FusedSampler

__all__ = ["generate"]


def generate(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
             generation_config: GenerationConfig | None = None, *, random: DrawSource | int | None = None,
             denoiser=None, encoder=None, cache: Any = None, decoder_input_ids: np.ndarray | None = None,
             self_conditioning_logits: np.ndarray | None = None, callback: Any = None, progress: bool = True,
             **overrides: Any) -> GenerationResult:
    """Generate canvases of C tokens after ``input_ids`` by entropy-bound block diffusion (fast path).

    Arguments, return value and errors are those of ``reference.generate.generate``: model (a
    ``fast.Model`` for the fused decoder path, or anything the reference accepts), input_ids (B, P),
    attention_mask (B, P) 0/1, generation_config / ``**overrides``, random (DrawSource, seed or None),
    denoiser, encoder, cache, decoder_input_ids (B, C), self_conditioning_logits (B, C, V) float32,
    callback, progress. Returns a ``GenerationResult`` (sequences (B, P + k*C) int64,
    tokens_per_forward (B,) float32, steps_per_canvas, forward_passes (B,), cache). Raises
    ``InputError`` / ``ConfigError`` / ``SamplingError`` / ``draws.ReplayError`` as the reference does.
    """
    config = resolve_config(model, generation_config, overrides)
    V, C = int(model.config.vocab_size), int(model.config.canvas_length)
    check_special_ids(config, V)
    ids, mask = check_prompt(input_ids, attention_mask, V)
    B, P = ids.shape
    start_canvas = check_start_canvas(decoder_input_ids, B, C, V)
    start_sc = check_start_sc_logits(self_conditioning_logits, B, C, V)
    draws = as_draw_source(random)
    encode = encoder if encoder is not None else model.encode
    fused_decoder = denoiser is None and isinstance(model, Model)
    if cache is None:
        cache = model.new_cache(B)
    context_length = P + int(cache.length)  # transformers' cur_len
    n_canvases = math.ceil(new_token_budget(config, context_length) / C)
    if isinstance(cache, KVCache):
        cache.reserve(context_length + n_canvases * C)
    stopper = (StableAndConfident(config.stability_threshold, config.confidence_threshold)
               if config.uses_adaptive_stopping else None)
    loop = _CanvasLoop(model, config, draws, stopper, callback, B, C, V, fused_decoder,
                       denoiser if denoiser is not None else model.denoise)

    sequences = ids.copy()
    ended = np.zeros(B, dtype=bool)  # transformers' finished_sequences
    forward_passes = np.zeros(B, dtype=np.int64)
    steps_per_canvas: list[int] = []
    new_ids, new_mask = ids, mask
    notify(callback, "on_prompt", readonly(ids))

    from tqdm import tqdm

    canvas_bar = tqdm(total=n_canvases, desc="canvases", unit="canvas", disable=not progress, leave=False)
    step_bar = tqdm(total=config.max_denoising_steps, desc="denoising", unit="step", disable=not progress,
                    leave=False)
    try:
        for k in range(n_canvases):
            encode(readonly(new_ids), cache, None if new_mask is None else readonly(new_mask))
            initial = draws.canvas_ids(B, C, V)  # always drawn, even when a starting canvas is given
            canvas = start_canvas if (k == 0 and start_canvas is not None) else initial
            sc_logits = start_sc if k == 0 else None
            step_bar.reset(total=config.max_denoising_steps)
            draft, steps = loop.run(k, canvas, sc_logits, cache, ended, forward_passes, step_bar)
            steps_per_canvas.append(steps)

            sequences, tokens, ended = commit_canvas(k, draft, steps, sequences, ended, config, callback)
            canvas_bar.update(1)
            if ended.all():
                break
            new_ids = tokens
            new_mask = None if mask is None else np.ones((B, C), dtype=np.int64)
    finally:
        step_bar.close()
        canvas_bar.close()

    return finish_run(sequences, P, forward_passes, steps_per_canvas, cache, config, callback)


class _CanvasLoop:
    """The denoising steps of one canvas (SPEC §8.2 step 3), with buffers kept across canvases."""

    def __init__(self, model: Any, config: GenerationConfig, draws: DrawSource, stopper: StableAndConfident | None,
                 callback: Any, B: int, C: int, V: int, fused_decoder: bool, denoise: Any):
        self.model, self.config, self.draws, self.stopper, self.callback = model, config, draws, stopper, callback
        self.B, self.C, self.V = B, C, V
        self.fused_decoder, self.denoise = fused_decoder, denoise
        self.seeded = type(draws) is SeededDraws  # exact type: a subclass may draw differently
        self.sampler = FusedSampler()
        # fused decoder: logits, then probabilities, then next step's SC input, all in one buffer
        self.buffer = np.empty((B, C, V), dtype=np.float32)

    def _uniforms(self) -> np.ndarray:
        """The categorical draw's uniforms: the very call ``SeededDraws.categorical`` makes."""
        return self.draws.generator.random(size=(self.B, self.C), dtype=np.float64)

    def run(self, k: int, canvas: np.ndarray, sc_logits: np.ndarray | None, cache: Any, ended: np.ndarray,
            forward_passes: np.ndarray, step_bar: Any) -> tuple[np.ndarray, int]:
        """Denoise canvas ``k``; return its draft (B, C) int64 and the number of steps executed."""
        config, B, C, V = self.config, self.B, self.C, self.V
        N = config.max_denoising_steps
        draft = canvas
        sampled_prev = canvas
        entropies = np.zeros((B, C), dtype=np.float32)
        finished = np.zeros(B, dtype=bool)  # transformers' finished_denoising
        if self.stopper is not None:
            self.stopper.reset()
        has_sc = False
        if self.fused_decoder and sc_logits is not None:  # user SC logits (first canvas): their softmax
            self.model.ops.softmax(sc_logits.reshape(B * C, V), self.buffer.reshape(B * C, V))
            has_sc = True
        step_index = 0
        for step_index, step in enumerate(range(N, 0, -1)):
            forward_passes += ~(finished | ended)  # (a)
            temp = temperature(step, N, config.t_min, config.t_max) if config.uses_temperature else None
            live = np.flatnonzero(~finished)  # rows to decode and sample this step
            if self.fused_decoder:
                self.model.decode_rows(canvas[live], live, cache, self.buffer if has_sc else None, self.buffer)
                logits, probs = self.buffer, self.buffer
            else:
                logits = run_denoiser(self.denoise, canvas, cache, sc_logits, (B, C, V))
                logits = np.ascontiguousarray(logits)
                probs = self.buffer
            # fused decoder: finished rows were not decoded, so only live rows are sampled; an external
            # denoiser ran on every row, so every row is sampled and finished rows are frozen below
            rows = live if self.fused_decoder else np.arange(B, dtype=np.int64)
            uniforms = self._uniforms() if self.seeded else None
            result = self.sampler(logits, rows, temp, uniforms, probs=probs)  # (c)-(f) fused
            new_draft = draft.copy()
            new_draft[rows] = result.draft  # (e)
            step_entropies = entropies.copy()
            step_entropies[rows] = result.entropies
            if self.seeded:
                sampled = sampled_prev.copy()
                sampled[rows] = result.sampled  # (d)
            else:
                sampled = np.array(self.draws.categorical(probs), dtype=np.int64)  # (d) (B, C)
                skipped = np.ones(B, dtype=bool)
                skipped[rows] = False  # rows not decoded: their probabilities are stale, keep the last draw
                sampled[skipped] = sampled_prev[skipped]
            accepted = entropy_bound_accept(step_entropies, config.entropy_bound)  # (f)
            noise = self.draws.renoise_ids(B, C, V)  # (g)
            next_canvas = renoise(sampled, accepted, noise)
            if not self.fused_decoder:
                processed = scale_logits(logits, temp)  # next step's SC input, as the reference
            if self.stopper is not None:
                if finished.any():  # (h) finished rows keep their state while the others go on
                    new_draft = freeze_rows(finished, new_draft, draft)
                    next_canvas = freeze_rows(finished, next_canvas, canvas)
                    step_entropies = freeze_rows(finished, step_entropies, entropies)
                    accepted = accepted & ~finished[:, None]
                    if not self.fused_decoder:
                        processed[finished] = sc_logits[finished]
                finished = finished | self.stopper(new_draft, step_entropies)  # (i)
            if not self.fused_decoder:
                sc_logits = processed
            has_sc = True
            canvas, draft, entropies, sampled_prev = next_canvas, new_draft, step_entropies, sampled  # (j)
            step_bar.update(1)
            notify(self.callback, "on_step", StepInfo(
                canvas_index=k, step=step, step_index=step_index,
                temperature=None if temp is None else float(temp), draft=readonly(draft),
                sampled=readonly(sampled), accepted=readonly(accepted), canvas=readonly(canvas),
                entropies=readonly(entropies), finished=readonly(finished.copy())))
            if finished.all():  # (k)
                break
        return draft, step_index + 1
