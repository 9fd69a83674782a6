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
``max_length`` that leaves no room after the prompt is an error instead of returning the prompt alone);
NaN logits raise ``SamplingError``; randomness comes from an explicit ``DrawSource``; the library prints
nothing (progress is drawn by the command line from the callback).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import numpy as np

from .draws import DrawSource, as_draw_source
from .errors import ConfigError, InputError
from .generation_config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from .observer import NULL_OBSERVER, CanvasInfo, GenerationCallback, Observer, StepInfo, notify, readonly
from .sampling import (StableAndConfident, argmax_tokens, check_logits, entropy_bound_accept, finalize_canvas,
                       freeze_rows, renoise, scale_logits, softmax_and_entropy, tokens_per_forward)
from .semantics import (Semantics, committed_tokens, finalize_variant, get_semantics, make_stopper,
                        schedule_temperature, variant_backend, variant_cache)

__all__ = ["GenerationConfig", "GenerationResult", "GenerationCallback", "StepInfo", "CanvasInfo", "generate",
           "DenoisingBackend", "StepOutput", "ReferenceBackend", "run_denoiser", "resolve_config",
           "check_special_ids", "check_prompt", "check_start_canvas", "check_start_sc_logits", "new_token_budget",
           "check_budget", "run_memory_bytes", "available_memory",
           "STOP_EOS", "STOP_MAX_LENGTH", "STOP_MAX_NEW_TOKENS"]

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
    may hold anything (the loop keeps their frozen values), except ``sampled``, which is reported as is."""

    draft: np.ndarray  # int64 argmax of the processed logits (SPEC §8.2 e)
    sampled: np.ndarray  # int64 categorical draws from softmax(processed logits) (d)
    entropies: np.ndarray  # float32 entropy (nats) of softmax(processed logits) (f)


class DenoisingBackend(Protocol):
    """The per-step compute of one backend, on its own arrays. The loop owns everything else.

    ``begin_canvas(cache, sc_logits)``: a canvas starts; ``sc_logits`` (B, C, V) float32 is the caller's
        self-conditioning input for its first step, or None (no self-conditioning).
    ``step(canvas, finished, temp)``: one denoising step (SPEC §8.2 b-e) for canvas (B, C) int64; rows with
        ``finished`` (B,) bool stopped denoising earlier and keep their self-conditioning input; ``temp`` is
        the step's float32 temperature or None. Makes the categorical draw from the run's draw source (the
        only draw of the step before renoising). Returns a ``StepOutput``. Raises ``SamplingError`` for
        logits that cannot define a distribution, naming the stage (``sampling.check_logits``' message).
    ``accept_and_renoise(entropies, sampled, noise, bound)``: (f, g) -> (accepted (B, C) bool, next canvas
        (B, C) int64).
    ``context()``: a context manager the whole run executes in (a GPU's device context).
    """

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None) -> None: ...

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> StepOutput: ...

    def accept_and_renoise(self, entropies: np.ndarray, sampled: np.ndarray, noise: np.ndarray,
                           bound: float) -> tuple[np.ndarray, np.ndarray]: ...

    def context(self) -> Any: ...


class ReferenceBackend:
    """The specification of a denoising step: a decoder pass, then each sampler stage of ``sampling.py`` as
    one full (B, C, V) array operation. Every row is decoded, also rows that finished denoising (as
    transformers does); the loop discards their results.

    denoise: (canvas (B, C) int64, cache, sc_logits (B, C, V) float32 or None) -> soft-capped logits
        (B, C, V) float32 (``model.denoise`` or a replacement); its inputs are read-only.
    draws: the run's ``DrawSource``. observer: receives the logits of every step. context: returns the
        context manager the run executes in (default: none).
    The self-conditioning input of the next step is this step's processed (temperature-scaled) logits; a
    row that had finished keeps its previous input (SPEC §7.1, §8.2 h).
    """

    def __init__(self, denoise: Denoiser, draws: DrawSource, vocab_size: int, observer: Observer = NULL_OBSERVER,
                 context: Callable[[], Any] = contextlib.nullcontext):
        self.denoise, self.draws, self.V, self.observer = denoise, draws, int(vocab_size), observer
        self._context = context  # what the run executes in (a GPU model's device context for a host denoiser)
        self.cache: Any = None
        self.sc_logits: np.ndarray | None = None  # (B, C, V) float32 next step's self-conditioning input

    def context(self) -> Any:
        return self._context()

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None) -> None:
        self.cache, self.sc_logits = cache, sc_logits

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> StepOutput:
        B, C = canvas.shape
        logits = run_denoiser(self.denoise, canvas, self.cache, self.sc_logits, (B, C, self.V))  # (b)
        self.observer.logits(logits)
        check_logits(logits, "denoiser logits")
        processed = scale_logits(logits, temp)  # (c) a new array: it may be modified below
        if temp is not None:
            check_logits(processed, f"logits divided by temperature {float(temp)!r}")
        probs, entropies = softmax_and_entropy(processed)  # (d, f) (B, C, V), (B, C)
        sampled = self.draws.categorical(probs)  # (d) (B, C)
        draft = argmax_tokens(processed)  # (e)
        if finished.any():  # (h) a row that stopped keeps its self-conditioning input
            processed[finished] = self.sc_logits[finished]
        self.sc_logits = processed  # (j)
        return StepOutput(draft, sampled, entropies)

    def accept_and_renoise(self, entropies: np.ndarray, sampled: np.ndarray, noise: np.ndarray,
                           bound: float) -> tuple[np.ndarray, np.ndarray]:
        accepted = entropy_bound_accept(entropies, bound)  # (f)
        return accepted, renoise(sampled, accepted, noise)  # (g)


def run_denoiser(denoise: Denoiser, canvas: np.ndarray, cache: Any, sc_logits: np.ndarray | None,
                 shape: tuple[int, int, int]) -> np.ndarray:
    """Call a denoiser on read-only inputs and check what it returns: (B, C, V) float32 logits."""
    logits = denoise(readonly(canvas), cache, None if sc_logits is None else readonly(sc_logits))
    logits = np.asarray(logits)
    if logits.shape != shape:
        raise InputError(f"the denoiser returned logits of shape {logits.shape}, expected {shape}")
    if logits.dtype != np.float32:
        raise InputError(f"the denoiser returned {logits.dtype} logits, expected float32")
    return logits


def make_backend(model: Any, draws: DrawSource, batch_size: int, denoiser: Denoiser | None, observer: Observer,
                 options: Mapping[str, Any]) -> DenoisingBackend:
    """The model's own backend (``model.denoising_backend``) when it has one, else ``ReferenceBackend`` over
    ``denoiser`` or ``model.denoise`` (a ``denoise`` that takes ``observer`` gets the run's observer)."""
    own = getattr(model, "denoising_backend", None)
    if own is not None:
        return own(draws, batch_size, denoiser=denoiser, observer=observer, **options)
    if options:
        raise InputError(f"backend_options {sorted(options)} given, but {type(model).__name__} has no backend "
                         "of its own to pass them to")
    if denoiser is None:
        denoise = model.denoise
        if _takes(denoise, "observer"):
            def denoise(canvas, cache, sc_logits, _denoise=model.denoise):
                return _denoise(canvas, cache, sc_logits, observer=observer)
    else:
        denoise = denoiser
    return ReferenceBackend(denoise, draws, int(model.config.vocab_size), observer)


def _takes(function: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


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
        ``semantics.SEMANTICS`` (``"transformers"``, the default, ``"jax"``, ``"llama.cpp"``, ``"vllm"``,
        ``"mlx-vlm"``, ``"diffusers"``) or a ``semantics.Semantics``. Other than transformers', a variant
        runs on the reference's per-step compute (``semantics.VariantBackend``), never a fast backend.

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
    (cache + prompt + every canvas it may make) and its KV cache and logits in the available memory.

    Returns a ``GenerationResult``. Raises ``InputError`` for bad arrays, a run that cannot fit (with the
    numbers), or a model/denoiser returning the wrong shape or dtype, ``ConfigError`` for bad settings (also EOS/pad ids outside [0, V)),
    ``SamplingError`` when logits hold NaN / +inf or a position has no finite logit, and
    ``draws.ReplayError`` when a replayed recording does not fit.
    """
    config = resolve_config(model, generation_config, overrides)
    variant = get_semantics(semantics)
    V, C = int(model.config.vocab_size), int(model.config.canvas_length)
    check_special_ids(config, V)
    ids, mask = check_prompt(input_ids, attention_mask, V)
    B, P = ids.shape
    start_canvas = check_start_canvas(decoder_input_ids, B, C, V)
    start_sc = check_start_sc_logits(self_conditioning_logits, B, C, V)
    observer = NULL_OBSERVER if trace is None else trace
    draws = as_draw_source(random)
    observer.begin_run(model.config, config, ids, mask, draws=draws)
    draws = observer.record_draws(draws)
    backend = (make_backend(model, draws, B, denoiser, observer, dict(backend_options or {})) if variant.is_default
               else variant_backend(variant, model, draws, denoiser, observer, config.max_denoising_steps))
    encode = encoder if encoder is not None else model.encode

    with backend.context():
        cache = check_cache((model.new_cache(B) if variant.is_default else variant_cache(variant, model, B))
                            if cache is None else cache, B)
        context_length = P + int(cache.length)  # transformers' cur_len
        n_canvases = math.ceil(new_token_budget(config, context_length) / C)
        check_budget(model.config, ids, mask, cache, n_canvases)  # refuse what cannot fit, before any work
        if hasattr(cache, "reserve"):  # a preallocated cache sizes itself once for the whole run
            cache.reserve(context_length + n_canvases * C)
        stopper = (StableAndConfident(config.stability_threshold, config.confidence_threshold)
                   if config.uses_adaptive_stopping else None)
        if not variant.is_default:
            stopper = make_stopper(variant, config.stability_threshold, config.confidence_threshold)

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
            backend.begin_canvas(cache, start_sc if k == 0 else None)  # later canvases: no SC (T11)
            draft, steps = denoise_canvas(k, canvas, backend, draws, stopper, config, ended, forward_passes,
                                          callback, observer, n_canvases, V, semantics=variant)
            steps_per_canvas.append(steps)

            sequences, tokens, ended = commit_canvas(k, draft, steps, sequences, ended, stop_reasons, config,
                                                     callback, n_canvases, semantics=variant)
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
                   stopper: StableAndConfident | None, config: GenerationConfig, ended: np.ndarray,
                   forward_passes: np.ndarray, callback: Any, observer: Observer, n_canvases: int,
                   V: int, semantics: Semantics | None = None) -> tuple[np.ndarray, int]:
    """Run the denoising steps of canvas ``k``; return its draft (B, C) int64 and the steps executed.

    ``forward_passes`` (B,) is incremented in place. The letters refer to SPEC §8.2 step 3.
    """
    variant = get_semantics(semantics)
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
        temp = (schedule_temperature(step, N, config.t_min, config.t_max, variant.temperature)
                if config.uses_temperature else None)
        out = backend.step(canvas, finished, temp)  # (b)-(e)
        noise = draws.renoise_ids(B, C, V)  # (g) drawn after the categorical draw
        accepted, next_canvas = backend.accept_and_renoise(out.entropies, out.sampled, noise,
                                                           config.entropy_bound)  # (f, g)
        new_draft, step_entropies = out.draft, out.entropies
        if finished.any():  # (h) rows that stopped keep their state while the others go on
            new_draft = freeze_rows(finished, new_draft, draft)
            next_canvas = freeze_rows(finished, next_canvas, canvas)
            step_entropies = freeze_rows(finished, step_entropies, entropies)
            accepted = accepted & ~finished[:, None]
        if stopper is not None:
            finished = finished | (stopper(new_draft, step_entropies) if variant.is_default  # (i)
                                   else stopper(new_draft, step_entropies, input_canvas=canvas))
        revealed = getattr(backend, "all_revealed", None)  # a variant sampler's own stop (mlx-vlm)
        if revealed is not None:
            finished = finished | revealed

        canvas, draft, entropies = next_canvas, new_draft, step_entropies  # (j)
        observer.end_step(temperature=temp, draft=draft, sampled=out.sampled, entropies=entropies,
                          accepted=accepted, canvas=canvas, finished=finished)
        notify(callback, "on_step", StepInfo(
            canvas_index=k, step=step, step_index=step_index,
            temperature=None if temp is None else float(temp), draft=readonly(draft),
            sampled=readonly(out.sampled), accepted=readonly(accepted), canvas=readonly(canvas),
            entropies=readonly(entropies), finished=readonly(finished.copy()), max_steps=N,
            n_canvases=n_canvases))
        if finished.all():  # (k) only reachable with adaptive stopping
            break
    if not variant.is_default:  # the variant's commit rule (semantics.committed_tokens)
        draft = committed_tokens(variant.commit, draft, canvas, finished)
    return draft, step_index + 1


def commit_canvas(k: int, draft: np.ndarray, steps: int, sequences: np.ndarray, ended: np.ndarray,
                  stop_reasons: list, config: GenerationConfig, callback: Any,
                  n_canvases: int = 0, semantics: Semantics | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Commit canvas ``k``'s draft (SPEC §8.2 steps 4-5) and report it to the callback.

    draft: (B, C) int64 argmax canvas; sequences: (B, T) int64 so far; ended: (B,) bool rows already over;
    stop_reasons: (B,) list, filled in place for rows that end here. Applies the EOS/pad rules
    (``finalize_canvas``), plus transformers' MaxLengthCriteria when the user set ``max_length`` (it compares
    the output's columns, the cache not counted). Returns (sequences with the C new columns, the committed
    tokens (B, C), the new ended flags (B,)).
    """
    B, C = draft.shape
    reached_max_length = None
    if config.max_length is not None:
        reached_max_length = np.full(B, sequences.shape[1] + C >= config.max_length)
    eos_rule = get_semantics(semantics).eos
    tokens, now_ended = (finalize_canvas(draft, ended, config.eos_token_id, config.pad_token_id, reached_max_length)
                         if eos_rule == "transformers" else
                         finalize_variant(eos_rule, draft, ended, config.eos_token_id, config.pad_token_id,
                                          reached_max_length))
    has_eos = np.isin(draft, config.eos_token_id).any(axis=1) if config.eos_token_id else np.zeros(B, dtype=bool)
    for b in np.flatnonzero(now_ended & ~ended):
        stop_reasons[b] = {"reason": STOP_EOS if has_eos[b] else STOP_MAX_LENGTH, "canvas": k}
    sequences = np.concatenate([sequences, tokens], axis=1)
    notify(callback, "on_canvas", CanvasInfo(k, readonly(tokens), readonly(now_ended.copy()), steps, n_canvases))
    return sequences, tokens, now_ended


# ================================================================================================ input checks
def resolve_config(model: Any, config: GenerationConfig | None, overrides: Mapping[str, Any]) -> GenerationConfig:
    """Explicit config > ``model.generation_config`` > defaults; then keyword overrides (transformers' order)."""
    if config is None:
        config = getattr(model, "generation_config", None) or GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")
    return config.replace(**overrides) if overrides else config


def check_special_ids(config: GenerationConfig, vocab_size: int) -> None:
    """Raise ``ConfigError`` when an EOS or pad id lies outside [0, vocab_size)."""
    for name, ids in (("eos_token_id", config.eos_token_id),
                      ("pad_token_id", () if config.pad_token_id is None else (config.pad_token_id,))):
        for token in ids:
            if token >= vocab_size:
                raise ConfigError(f"{name} {token} is outside the vocabulary [0, {vocab_size})")


def check_prompt(input_ids: Any, attention_mask: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate the prompt (B, P) int ids in [0, V), P >= 1, and its optional (B, P) 0/1 mask.

    Returns (ids int64, mask int64 or None). Raises ``InputError`` naming the problem.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"input_ids must be a 2-D integer array (batch, tokens), got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"input_ids must hold at least one row and one token, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)].ravel()[0]
        raise InputError(f"input_ids holds token id {int(bad)} outside [0, vocab_size={vocab_size})")
    if attention_mask is None:
        return ids.astype(np.int64), None
    mask = np.asarray(attention_mask)
    if mask.shape != ids.shape:
        raise InputError(f"attention_mask has shape {mask.shape}, expected {ids.shape} like input_ids")
    if not np.isin(mask, (0, 1)).all():
        raise InputError("attention_mask must hold only 0 and 1")
    return ids.astype(np.int64), mask.astype(np.int64)


def check_start_canvas(canvas: Any, B: int, C: int, V: int) -> np.ndarray | None:
    """Validate a caller's first canvas (B, C) int ids in [0, V), or None. Raises ``InputError``."""
    if canvas is None:
        return None
    canvas = np.asarray(canvas)
    if canvas.shape != (B, C) or not np.issubdtype(canvas.dtype, np.integer):
        raise InputError(f"decoder_input_ids must be an integer array of shape {(B, C)}, got {canvas.shape} "
                         f"{canvas.dtype}")
    if canvas.min() < 0 or canvas.max() >= V:
        raise InputError(f"decoder_input_ids holds ids outside [0, vocab_size={V})")
    return canvas.astype(np.int64)


def check_start_sc_logits(logits: Any, B: int, C: int, V: int) -> np.ndarray | None:
    """Validate a caller's first self-conditioning logits (B, C, V) float32, or None. Raises ``InputError``."""
    if logits is None:
        return None
    logits = np.asarray(logits)
    if logits.shape != (B, C, V) or logits.dtype != np.float32:
        raise InputError(f"self_conditioning_logits must be float32 of shape {(B, C, V)}, got {logits.shape} "
                         f"{logits.dtype}")
    check_logits(logits, "self_conditioning_logits", InputError)  # NaN, +inf, a position with only -inf
    return logits.copy()


def new_token_budget(config: GenerationConfig, context_length: int) -> int:
    """transformers' ``_prepare_generated_length``: max_length wins only while max_new_tokens is 256."""
    if config.max_length is not None and config.max_new_tokens == DEFAULT_MAX_NEW_TOKENS:
        budget = config.max_length - context_length
        if budget <= 0:
            raise InputError(f"max_length {config.max_length} leaves no room for new tokens after "
                             f"{context_length} prompt/cached tokens")
        return budget
    return config.max_new_tokens


def available_memory() -> int | None:
    """Bytes of memory this process could still allocate (``MemAvailable`` on Linux), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def run_memory_bytes(model_config: Any, batch_size: int, cached: int, total: int) -> int:
    """Bytes a run adds: float32 keys and values for positions ``cached .. total - 1`` of every layer (a
    sliding layer keeps at most ``sliding_window - 1``) plus four (B, C, V) float32 logit-sized buffers
    (logits, processed logits, probabilities, self-conditioning input) of one denoising step."""
    C, V = int(model_config.canvas_length), int(model_config.vocab_size)
    per_position = 0  # bytes per (row, position) over the full layers
    sliding = 0  # bytes per (row, retained position) over the sliding layers
    for layer, (g, d) in enumerate(zip(model_config.layer_num_key_value_heads, model_config.layer_head_dim)):
        if model_config.is_sliding(layer):
            sliding += 2 * 4 * g * d
        else:
            per_position += 2 * 4 * g * d
    window = int(model_config.sliding_window) - 1
    grown = per_position * (total - cached) + sliding * max(0, min(total, window) - min(cached, window))
    return batch_size * grown + 4 * 4 * batch_size * C * V


def check_budget(model_config: Any, ids: np.ndarray, mask: np.ndarray | None, cache: Any, n_canvases: int) -> None:
    """Refuse, before anything runs, a generation that cannot fit; ``InputError`` with the numbers.

    * Positions: the cache (L), the prompt (P) and up to ``n_canvases`` canvases of C occupy positions
      0 .. L + P + n_canvases * C - 1, which must stay below ``max_position_embeddings``.
    * An ``attention_mask`` row of only zeros with an empty cache: that row has no real token.
    * Memory, for a cache held in host memory (NumPy arrays): the keys/values the run adds and one
      step's logit buffers (``run_memory_bytes``) must fit in ``available_memory()``.
    Checks what ``model_config`` declares (a stand-in config without these fields skips them).
    """
    B, P = ids.shape
    C = int(model_config.canvas_length)
    L = int(cache.length)
    end = L + P + n_canvases * C
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and end > limit:
        room = (limit - L - P) // C * C
        raise InputError(f"this run needs positions 0..{end - 1} ({L} cached + {P} prompt + {n_canvases} "
                         f"canvas(es) of {C}: max_new_tokens rounded up to whole canvases), but the model has "
                         f"max_position_embeddings={limit}; at most {max(room, 0)} new tokens fit after this prompt")
    if mask is not None and L == 0:
        empty = np.flatnonzero(~np.asarray(mask).astype(bool).any(axis=1))
        if empty.size:
            raise InputError(f"attention_mask row {int(empty[0])} is all zeros: that row has no real token to "
                             "generate from (give it at least one 1, or leave the row out)")
    keys = getattr(cache, "keys", None)
    host = isinstance(keys, list) and bool(keys) and isinstance(keys[0], np.ndarray)
    if host and hasattr(model_config, "layer_head_dim"):
        needed = run_memory_bytes(model_config, B, L, L + P + (n_canvases - 1) * C)
        free = available_memory()
        if free is not None and needed > free:
            raise InputError(f"this run needs about {needed:,} bytes ({needed / 2 ** 30:.2f} GiB: KV cache and "
                             f"logits for {n_canvases} canvas(es) of {C}, {B} row(s)) but {free:,} bytes "
                             f"({free / 2 ** 30:.2f} GiB) of memory are available; lower max_new_tokens or the "
                             "batch size")


def check_cache(cache: Any, batch_size: int) -> Any:
    """Refuse an object that is not a KV cache for ``batch_size`` rows (``InputError`` naming it)."""
    length, rows = getattr(cache, "length", None), getattr(cache, "batch_size", batch_size)
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise InputError(f"cache must be a KV cache made by model.new_cache(batch_size), got {type(cache).__name__}")
    if rows != batch_size:
        raise InputError(f"cache holds {rows} rows but input_ids has {batch_size}")
    return cache
