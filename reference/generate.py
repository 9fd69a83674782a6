"""Block-diffusion generation: the one loop over canvases and denoising steps, for every backend.

    prompt -> encode -> for each canvas k (a block of C tokens):
        canvas <- C uniform random ids
        for cur_step n = N, N-1, ..., 1 (until every row has finished denoising):
            backend.step:   logits <- denoise(canvas, cache, self-conditioning); T_n-scaled logits ->
                            draft (argmax), categorical draw, entropies             (SPEC §8.2 b-e)
            acceptance under the entropy bound, renoising of the rest                (f, g)
            freeze rows that had finished, stable-and-confident stopping             (h, i)
        commit the draft, apply EOS/pad, encode it, next canvas                      (SPEC §8.2 steps 4-5)

``generate`` reproduces transformers 5.24.0 ``DiffusionGemmaGenerationMixin.generate`` (SPEC §8) for the
text path with its default dynamic cache: same lengths, same order of random draws, same tokens given the
same logits and draws.

The loop is written once. What differs between the reference, the CPU fast path and the GPU is only the
per-step compute, behind ``DenoisingBackend`` (a decoder pass and the sampling stages on the backend's own
arrays). ``ReferenceBackend`` below is the specification: the model's ``denoise`` and the full-array stages
of ``sampling.py``. A model supplies its own backend through ``model.denoising_backend(...)``
(``fast.Model``: fused decoder buffer and sampling kernel; ``fast.gpu.Model``: device buffer and kernels);
any other model, or a replaced ``denoiser``, runs on ``ReferenceBackend``.

Differences from transformers, all deliberate: bad settings raise ``ConfigError`` / ``InputError`` instead
of being accepted or failing later (an integer ``confidence_threshold`` such as 10 is accepted as 10.0; a
``max_length`` that leaves no room after the prompt is an error, where upstream returns the prompt alone with
``max_new_tokens`` left at 256 and makes one canvas otherwise: SPEC §17 item 7);
NaN logits raise ``SamplingError``; randomness comes from an explicit ``DrawSource``; the library prints
nothing (progress is drawn by the command line from the callback).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import numpy as np

from .draws import DrawSource
from .generation_config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from .sampling import argmax_tokens, freeze_rows, scale_logits, softmax_and_entropy, tokens_per_forward
from .stages import TRANSFORMERS, Semantics, get_semantics
from .support.checks import (as_draw_source, check_budget, check_cache, check_model, check_prompt, check_special_ids,
                             check_start_canvas, check_start_sc_logits, resolve_config, run_denoiser)
from .support.errors import ConfigError, InputError
from .support.logits import check_logits
from .support.observer import (NULL_OBSERVER, CanvasInfo, GenerationCallback, Observer, StepInfo, check_callback,
                               notify, readonly)

__all__ = ["GenerationConfig", "GenerationResult", "GenerationCallback", "StepInfo", "CanvasInfo", "generate",
           "DenoisingBackend", "StepOutput", "HostAcceptance", "ReferenceBackend", "self_conditioning_input",
           "new_token_budget", "STOP_EOS", "STOP_MAX_LENGTH", "STOP_MAX_NEW_TOKENS"]

# Why a row stopped (``GenerationResult.stop_reasons``).
STOP_EOS = "eos"  # an EOS id appeared in a committed canvas
STOP_MAX_LENGTH = "max_length"  # the output reached the user's max_length (transformers' MaxLengthCriteria)
STOP_MAX_NEW_TOKENS = "max_new_tokens"  # the token budget's canvases were all made


@dataclass
class GenerationResult:
    """What ``generate`` returns (transformers: ``DiffusionGemmaGenerationOutput`` plus bookkeeping)."""

    sequences: np.ndarray  # (B, P + k*C) int64: prompt followed by k committed canvases (never truncated)
    tokens_per_forward: np.ndarray  # (B,) float32: non-pad generated tokens / decoder passes of that row
    steps_per_canvas: list[int] = field(default_factory=list)  # denoising steps executed, per canvas
    forward_passes: np.ndarray | None = None  # (B,) int64: decoder passes counted per row
    cache: Any = None  # the cache; it lacks the last canvas (never encoded; trap T23)
    stop_reasons: list[dict] = field(default_factory=list)  # per row {"reason": STOP_*, "canvas": k}


# ================================================================================================ backends
Denoiser = Callable[[np.ndarray, Any, "np.ndarray | None"], np.ndarray]
Encoder = Callable[[np.ndarray, Any, "np.ndarray | None"], Any]


class StepOutput(NamedTuple):
    """What a backend's denoising step gives the loop, each (B, C). Rows that had already finished denoising
    may hold anything: the loop replaces them with their frozen values (``sampled`` with the frozen canvas)."""

    draft: np.ndarray  # int64 argmax of the processed logits (SPEC §8.2 e)
    sampled: np.ndarray  # int64 proposed tokens: categorical draws from softmax(processed logits) (d)
    entropies: np.ndarray  # float32 entropy (nats) of softmax(processed logits) (f)
    confidence: "np.ndarray | None" = None  # float32 p(sampled), for samplers that rank by it (variants)


class DenoisingBackend(Protocol):
    """The per-step compute of one backend, on its own arrays. The loop owns everything else.

    ``begin_canvas(cache, sc_logits, canvas)``: a canvas starts from ``canvas`` (B, C) int64; ``sc_logits``
        (B, C, V) float32 is the caller's self-conditioning input for its first step, or None.
    ``step(canvas, finished, temp)``: one denoising step (SPEC §8.2 b-e) for canvas (B, C) int64; rows with
        ``finished`` (B,) bool stopped denoising earlier and keep their self-conditioning input; ``temp`` is
        the step's float32 temperature or None. Makes the categorical draw from the run's draw source (the
        only draw of the step before renoising). Returns a ``StepOutput``. Raises ``SamplingError`` for
        logits that cannot define a distribution, naming the stage (``support.logits.check_logits``).
    ``accept_and_renoise(step, canvas, noise, bound)``: (f, g) for the ``StepOutput`` of that step and the
        canvas it read -> (accepted (B, C) bool, next canvas (B, C) int64).
    ``revealed_all()``: (B,) bool rows whose acceptance stage ended them by itself (a peer's sampler that
        reveals every position); the spec's entropy bound never does.
    ``context()``: a context manager the whole run executes in (a GPU's device context).

    Optional: ``run_canvas(k, canvas, draws, stopper, config, ended, forward_passes, callback, observer,
    n_canvases, semantics)`` runs all of canvas k's steps at once and returns what ``denoise_canvas`` returns
    (the committed draft, the steps executed) with the same effects (forward passes counted, the draw
    source left where the steps leave it, the observer and callback told), or None to let ``denoise_canvas``
    run them one ``step`` at a time. A GPU uses it to keep a canvas's state on the device
    (``fast/gpu/canvas.py``); ``denoise_canvas`` below stays the specification of what a canvas does.
    """

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None, canvas: np.ndarray) -> None: ...

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> StepOutput: ...

    def accept_and_renoise(self, step: StepOutput, canvas: np.ndarray, noise: np.ndarray,
                           bound: float) -> tuple[np.ndarray, np.ndarray]: ...

    def revealed_all(self) -> np.ndarray: ...

    def context(self) -> Any: ...


class HostAcceptance:
    """Acceptance and renoising on host arrays, through the run's acceptance stage (SPEC §8.2 f, g): the one
    implementation every backend uses, unless it has its own kernel for the spec's stage (the GPU).

    Set ``self.acceptor`` (``semantics.sampler.start(N, threshold)``) and ``self.B`` before use.
    """

    acceptor: Any
    B: int

    def accept_and_renoise(self, step: StepOutput, canvas: np.ndarray, noise: np.ndarray,
                           bound: float) -> tuple[np.ndarray, np.ndarray]:
        return self.acceptor(step, canvas, noise, bound)

    def revealed_all(self) -> np.ndarray:
        return self.acceptor.revealed_all(self.B)


class ReferenceBackend(HostAcceptance):
    """The specification of a denoising step: a decoder pass, then each sampler stage as one full (B, C, V)
    array operation. Every row is decoded, also rows that finished denoising (as transformers does); the
    loop discards their results.

    denoise: (canvas (B, C) int64, cache, sc_logits (B, C, V) float32 or None) -> soft-capped logits
        (B, C, V) float32 (``model.denoise`` or a replacement); its inputs are read-only.
    draws: the run's ``DrawSource``. semantics: the run's stages (``stages.Semantics``): the proposal
        (``denoiser_draw``), the self-conditioning input (``sc_temperature``) and the acceptance
        (``sampler``). observer: receives the logits of every step. context: returns the context manager the
        run executes in (default: none).
    The self-conditioning input of the next step is this step's processed (temperature-scaled) logits; a
    row that had finished keeps its previous input (SPEC §7.1, §8.2 h).
    """

    def __init__(self, denoise: Denoiser, draws: DrawSource, vocab_size: int, batch_size: int,
                 semantics: Semantics = TRANSFORMERS, max_steps: int = 1, observer: Observer = NULL_OBSERVER,
                 context: Callable[[], Any] = contextlib.nullcontext):
        self.denoise, self.draws, self.V, self.B, self.observer = denoise, draws, int(vocab_size), int(batch_size), observer
        self.propose, self.sc_input = semantics.denoiser_draw, semantics.sc_temperature
        self.scale = semantics.temperature.scale  # how T_n meets the logits (c)
        self.acceptor = semantics.sampler.start(max_steps, semantics.threshold)
        self._context = context  # what the run executes in (a GPU model's device context for a host denoiser)
        self.cache: Any = None
        self.sc_logits: np.ndarray | None = None  # (B, C, V) float32 next step's self-conditioning input

    def context(self) -> Any:
        return self._context()

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None, canvas: np.ndarray) -> None:
        self.cache, self.sc_logits = cache, sc_logits
        self.acceptor.begin_canvas(canvas)

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> StepOutput:
        B, C = canvas.shape
        logits = run_denoiser(self.denoise, canvas, self.cache, self.sc_logits, (B, C, self.V))  # (b)
        self.observer.logits(logits)
        check_logits(logits, "denoiser logits")
        processed = self.scale(logits, temp)  # (c) a new array: it may be modified below
        if temp is not None:
            check_logits(processed, f"logits divided by temperature {float(temp)!r}")
        probs, entropies = softmax_and_entropy(processed)  # (d, f) (B, C, V), (B, C)
        draft = argmax_tokens(processed)  # (e)
        sampled = self.propose(self.draws, probs, draft, logits=processed)  # (d) (B, C)
        confidence = np.take_along_axis(probs, sampled[..., None], axis=-1)[..., 0]  # p(sampled), (B, C)
        self.sc_logits = self_conditioning_input(self.sc_input(logits, processed, temp), self.sc_logits,
                                                 finished)  # (h, j)
        return StepOutput(draft, sampled, entropies, confidence)


def self_conditioning_input(new: np.ndarray, previous: np.ndarray | None, finished: np.ndarray) -> np.ndarray:
    """The next step's self-conditioning input (B, C, V): this step's, except that a row that had finished
    keeps its previous input (SPEC §8.2 h, j). Every backend that keeps host logits calls this."""
    return new if previous is None or not finished.any() else freeze_rows(finished, new, previous)


def make_backend(model: Any, draws: DrawSource, batch_size: int, denoiser: Denoiser | None, observer: Observer,
                 semantics: Semantics, max_steps: int, options: Mapping[str, Any]) -> DenoisingBackend:
    """The model's own backend (``model.denoising_backend``, declared by the model class) when the run's
    stages are all the spec's inside a step; else ``ReferenceBackend`` over ``denoiser`` or ``model.denoise``
    (a model whose ``denoise`` reports to an observer, ``DENOISE_REPORTS = True``, gets the run's observer,
    and the run's window stage)."""
    own = getattr(type(model), "denoising_backend", None)
    if own is not None and semantics.runs_on_any_backend:
        return model.denoising_backend(draws, batch_size, denoiser=denoiser, observer=observer, **options)
    if options:
        raise InputError(f"backend_options {sorted(options)} given, but this run uses the reference's step "
                         f"({type(model).__name__} has no backend of its own for semantics {semantics.name!r})")
    if denoiser is not None:
        denoise = denoiser
    elif getattr(type(model), "DENOISE_REPORTS", False):
        def denoise(canvas, cache, sc_logits, _denoise=model.denoise, _window=semantics.canvas_window,
                    _embedding=semantics.sc_temperature.embedding):
            return _denoise(canvas, cache, sc_logits, observer=observer, canvas_window=_window.keys,
                            sc_embedding=_embedding)
    elif semantics.canvas_window == TRANSFORMERS.canvas_window:
        denoise = model.denoise
    else:
        raise ConfigError(f"semantics {semantics.name!r} needs canvas_window={semantics.canvas_window.name!r}, "
                          f"which {type(model).__name__}.denoise does not take (the reference Model does)")
    return ReferenceBackend(denoise, draws, int(model.config.vocab_size), batch_size, semantics, max_steps, observer)


# ================================================================================================ the loop
def generate(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
             generation_config: GenerationConfig | None = None, *, random: DrawSource | int | None = None,
             denoiser: Denoiser | None = None, encoder: Encoder | None = None, cache: Any = None,
             decoder_input_ids: np.ndarray | None = None, self_conditioning_logits: np.ndarray | None = None,
             callback: Any = None, trace: Observer | None = None, backend_options: Mapping[str, Any] | None = None,
             semantics: "str | Semantics | None" = None, **overrides: Any) -> GenerationResult:
    """Generate canvases of C tokens after ``input_ids`` by entropy-bound block diffusion.

    model: provides ``config.vocab_size`` (V), ``config.canvas_length`` (C), ``new_cache(B)``, and, unless
        replaced, ``encode(ids, cache, mask)`` and ``denoise(canvas, cache, sc_logits)``; optionally its own
        per-step compute, ``denoising_backend(draws, B, denoiser=, observer=, **backend_options)``.
    input_ids: (B, P) int token ids in [0, V), P >= 1; with ``cache``, only the tokens not cached yet.
    attention_mask: (B, P) of 0/1 (1 = real token), for left padding. Positions are not shifted for
        padding (trap T18): the model sees pads as occupied positions that no query attends to. Committed
        canvases are encoded with an all-ones mask (or None when no mask was given). A row of only zeros
        with nothing cached has no real token to condition on (upstream fills it with EOS at once): it is
        refused (``check_budget``); with a cache, an all-zero row continues from that row's cached tokens.
    generation_config: defaults to ``model.generation_config`` if the model has one, else
        ``GenerationConfig()``; ``**overrides`` (e.g. ``max_new_tokens=64``) change fields of it.
    random: the draw source (``draws.py``); None means ``SeededDraws(0)``, an int means ``SeededDraws(int)``.
    denoiser: replaces ``model.denoise``: (canvas (B, C) int64, cache, sc_logits (B, C, V) float32 or None)
        -> logits (B, C, V) float32, soft-capped. Inputs are read-only.
    encoder: replaces ``model.encode``: (ids (B, n) int64, cache, mask (B, n) or None) -> ignored; it must
        append the n tokens to ``cache``.
    cache: a cache holding earlier turns (its ``length`` counts toward positions and ``max_length``);
        default ``model.new_cache(B)``.
    decoder_input_ids: (B, C) starting canvas for the first canvas only (the random initial canvas is still
        drawn and discarded, trap T14). self_conditioning_logits: (B, C, V) float32 for the first step of the
        first canvas only (every other canvas starts without self-conditioning, trap T11).
    callback: a ``GenerationCallback`` (or duck-typed object): prompt, steps, canvases, result.
    trace: an ``Observer`` of the run's internals, e.g. a fresh ``diffusiongemma.trace.TraceRecorder`` (call
        its ``save`` after); it reaches the model's ``denoise`` when that takes an ``observer`` argument.
    backend_options: keyword arguments for ``model.denoising_backend`` (tests and experiments).
    semantics: run the loop with another implementation's stage choices: a name of
        ``stages.SEMANTICS`` (``"transformers"``, the default, ``"jax"``, ``"llama.cpp"``, ``"vllm"``,
        ``"mlx-vlm"``, ``"diffusers"``) or a ``stages.Semantics``. Other than transformers', a variant
        runs on the reference's per-step compute (``ReferenceBackend``), never a fast backend.

    Lengths (SPEC §8.1): with L0 = P + cache length, ``max_new_tokens`` becomes ``max_length - L0`` when
    ``max_length`` is set and ``max_new_tokens`` is left at 256; the run makes at most
    ceil(max_new_tokens / C) canvases and the output keeps whole canvases. It stops early when every row
    has ended: an EOS id anywhere in a committed canvas, or (only when ``max_length`` is set) the output
    reaching ``max_length`` columns (transformers compares the output's columns, not counting the cache).
    ``GenerationResult.stop_reasons`` says, per row, which rule ended it and in which canvas.

    Per canvas (SPEC §8.2): encode the new tokens; draw the initial canvas; run the denoising steps for
    cur_step N..1, counting a decoder pass for every row that is neither finished denoising nor an ended
    sequence, until every row is finished; commit the draft; apply the EOS/pad rules; the committed
    (rewritten) canvas is what gets encoded next.

    Bounds (``check_budget``, before anything is encoded): the run must fit in ``max_position_embeddings``
    (cache + prompt + every canvas it may make) and its KV cache, logits and activations in the available memory.

    Returns a ``GenerationResult``. Raises ``InputError`` for bad arrays, a run that cannot fit (with the
    numbers), or a model/denoiser returning the wrong shape or dtype, ``ConfigError`` for bad settings (also EOS/pad ids outside [0, V)),
    ``SamplingError`` when logits hold NaN / +inf or a position has no finite logit, and
    ``support.replay.ReplayError`` when a replayed recording does not fit.
    """
    config = resolve_config(check_model(model), generation_config, overrides)
    semantics = get_semantics(semantics)
    V, C = int(model.config.vocab_size), int(model.config.canvas_length)
    check_special_ids(config, V)
    ids, mask = check_prompt(input_ids, attention_mask, V)
    B, P = ids.shape
    start_canvas = check_start_canvas(decoder_input_ids, B, C, V)
    start_sc = check_start_sc_logits(self_conditioning_logits, B, C, V)
    observer = NULL_OBSERVER if trace is None else trace
    draws, callback = as_draw_source(random), check_callback(callback)
    observer.begin_run(model.config, config, ids, mask, draws=draws)
    draws = observer.record_draws(draws)
    backend = make_backend(model, draws, B, denoiser, observer, semantics, config.max_denoising_steps,
                           dict(backend_options or {}))
    encode = encoder if encoder is not None else model.encode

    with backend.context():
        cache = check_cache(semantics.canvas_window.new_cache(model, B) if cache is None else cache, B)
        context_length = P + int(cache.length)  # transformers' cur_len
        n_canvases = math.ceil(new_token_budget(config, context_length) / C)
        check_budget(model.config, ids, mask, cache, n_canvases)  # refuse what cannot fit, before any work
        if hasattr(cache, "reserve"):  # a preallocated cache sizes itself once for the whole run
            cache.reserve(context_length + n_canvases * C)
        stopper = (semantics.stop_history.make(config.stability_threshold, config.confidence_threshold,
                                               semantics.stop_comparison)
                   if config.uses_adaptive_stopping else None)

        sequences = ids.copy()  # (B, P), grows by C per canvas
        ended = np.zeros(B, dtype=bool)  # transformers' finished_sequences
        stop_reasons: list[dict | None] = [None] * B
        forward_passes = np.zeros(B, dtype=np.int64)
        steps_per_canvas: list[int] = []
        new_ids, new_mask = ids, mask  # what the next encode call appends
        notify(callback, "on_prompt", readonly(ids))

        for k in range(n_canvases):
            observer.begin_encode(new_ids, new_mask)
            encode(readonly(new_ids), cache, None if new_mask is None else readonly(new_mask))
            observer.end_encode(cache)
            initial = draws.canvas_ids(B, C, V)  # always drawn, even when a starting canvas is given (T14)
            canvas = start_canvas if (k == 0 and start_canvas is not None) else initial
            observer.begin_canvas(canvas)
            backend.begin_canvas(cache, start_sc if k == 0 else None, canvas)  # later canvases: no SC (T11)
            # a backend may run the canvas's steps itself, with the same results (a GPU's device loop)
            own = getattr(backend, "run_canvas", None)
            ran = None if own is None else own(k, canvas, draws, stopper, config, ended, forward_passes, callback,
                                               observer, n_canvases, semantics)
            draft, steps = ran if ran is not None else denoise_canvas(
                k, canvas, backend, draws, stopper, config, ended, forward_passes, callback, observer, n_canvases,
                V, semantics)
            steps_per_canvas.append(steps)

            sequences, tokens, ended = commit_canvas(k, draft, steps, sequences, ended, stop_reasons, config,
                                                     callback, n_canvases, semantics)
            observer.commit(tokens, ended)
            if ended.all():
                break
            new_ids = tokens
            new_mask = None if mask is None else np.ones((B, C), dtype=np.int64)

    observer.end_run(sequences)
    last = len(steps_per_canvas) - 1
    reasons = [r if r is not None else {"reason": STOP_MAX_NEW_TOKENS, "canvas": last} for r in stop_reasons]
    result = GenerationResult(
        sequences=sequences,
        tokens_per_forward=tokens_per_forward(sequences[:, P:], forward_passes, config.pad_token_id),
        steps_per_canvas=steps_per_canvas,
        forward_passes=forward_passes,
        cache=cache,
        stop_reasons=reasons,
    )
    notify(callback, "on_end", result)
    return result


def denoise_canvas(k: int, canvas: np.ndarray, backend: DenoisingBackend, draws: DrawSource,
                   stopper: Any, config: GenerationConfig, ended: np.ndarray, forward_passes: np.ndarray,
                   callback: Any, observer: Observer, n_canvases: int, V: int,
                   semantics: Semantics = TRANSFORMERS) -> tuple[np.ndarray, int]:
    """Run the denoising steps of canvas ``k``; return what it commits (B, C) int64 and the steps executed.

    ``forward_passes`` (B,) is incremented in place. The letters refer to SPEC §8.2 step 3.
    """
    B, C = canvas.shape
    N = config.max_denoising_steps
    draft = canvas  # transformers starts the draft as the initial canvas (overwritten by step 1)
    entropies = np.zeros((B, C), dtype=np.float32)  # previous step's entropies, for frozen rows
    finished = np.zeros(B, dtype=bool)  # transformers' finished_denoising
    if stopper is not None:
        stopper.reset()
    step_index = 0
    for step_index, step in enumerate(range(N, 0, -1)):
        forward_passes += ~(finished | ended)  # (a) counted before the pass, for live rows only
        observer.begin_step(~finished)
        temp = semantics.temperature(step, N, config.t_min, config.t_max) if config.uses_temperature else None
        out = backend.step(canvas, finished, temp)  # (b)-(e)
        noise = draws.renoise_ids(B, C, V)  # (g) drawn after the categorical draw
        accepted, next_canvas = backend.accept_and_renoise(out, canvas, noise, config.entropy_bound)  # (f, g)
        # (h) rows that stopped keep their state while the others go on; their draw is not reported
        new_draft = freeze_rows(finished, out.draft, draft)
        next_canvas = freeze_rows(finished, next_canvas, canvas)
        sampled = freeze_rows(finished, out.sampled, canvas)
        step_entropies = freeze_rows(finished, out.entropies, entropies)
        accepted = accepted & ~finished[:, None]
        if stopper is not None:
            finished = finished | stopper(new_draft, step_entropies, canvas)  # (i)
        finished = finished | backend.revealed_all()  # a peer's sampler may end a row itself (mlx-vlm)

        canvas, draft, entropies = next_canvas, new_draft, step_entropies  # (j)
        observer.end_step(temperature=temp, draft=draft, sampled=sampled, entropies=entropies,
                          accepted=accepted, canvas=canvas, finished=finished)
        notify(callback, "on_step", StepInfo(
            canvas_index=k, step=step, step_index=step_index,
            temperature=None if temp is None else float(temp), draft=readonly(draft),
            sampled=readonly(sampled), accepted=readonly(accepted), canvas=readonly(canvas),
            entropies=readonly(entropies), finished=readonly(finished.copy()), max_steps=N,
            n_canvases=n_canvases))
        if finished.all():  # (k) only reachable with adaptive stopping
            break
    return semantics.commit(draft, canvas, finished), step_index + 1  # SPEC §8.2 step 4: the draft


def commit_canvas(k: int, draft: np.ndarray, steps: int, sequences: np.ndarray, ended: np.ndarray,
                  stop_reasons: list, config: GenerationConfig, callback: Any, n_canvases: int = 0,
                  semantics: Semantics = TRANSFORMERS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Commit canvas ``k``'s draft (SPEC §8.2 steps 4-5) and report it to the callback.

    draft: (B, C) int64 committed canvas; sequences: (B, T) int64 so far; ended: (B,) bool rows already over;
    stop_reasons: (B,) list, filled in place for rows that end here. Applies the EOS/pad rules (the spec's:
    ``sampling.finalize_canvas``), plus transformers' MaxLengthCriteria when the user set ``max_length`` (it
    compares the output's columns, the cache not counted). Returns (sequences with the C new columns, the
    committed tokens (B, C), the new ended flags (B,)).
    """
    B, C = draft.shape
    reached_max_length = None
    if config.max_length is not None:
        reached_max_length = np.full(B, sequences.shape[1] + C >= config.max_length)
    tokens, now_ended = semantics.eos.finalize(draft, ended, config.eos_token_id, config.pad_token_id,
                                               reached_max_length)
    has_eos = np.isin(draft, config.eos_token_id).any(axis=1) if config.eos_token_id else np.zeros(B, dtype=bool)
    for b in np.flatnonzero(now_ended & ~ended):
        stop_reasons[b] = {"reason": STOP_EOS if has_eos[b] else STOP_MAX_LENGTH, "canvas": k}
    sequences = np.concatenate([sequences, tokens], axis=1)
    notify(callback, "on_canvas", CanvasInfo(k, readonly(tokens), readonly(now_ended.copy()), steps, n_canvases))
    return sequences, tokens, now_ended


# ================================================================================================ lengths
def new_token_budget(config: GenerationConfig, context_length: int) -> int:
    """transformers' ``_prepare_generated_length``: max_length wins only while max_new_tokens is 256. A
    max_length that leaves no room after the prompt and the cache is refused (``InputError``), as the
    command line refuses it."""
    budget = None if config.max_length is None else config.max_length - context_length
    if budget is not None and budget <= 0:  # refused whatever max_new_tokens is (upstream: the prompt alone at 256, else one canvas)
        raise InputError(f"max_length {config.max_length} leaves no room for new tokens after "
                         f"{context_length} prompt/cached tokens")
    if budget is not None and config.max_new_tokens == DEFAULT_MAX_NEW_TOKENS:
        return budget
    return config.max_new_tokens


