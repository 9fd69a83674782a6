"""Block-diffusion generation: the loop over canvases and denoising steps.

    prompt -> encode -> for each canvas (block of C tokens):
        canvas <- C uniform random ids
        for cur_step n = N, N-1, ..., 1 (until every row is finished):
            logits <- denoise(canvas, cache, self-conditioning logits)
            sampler stages (sampling.py) -> draft, next canvas, finished rows
        commit the draft, apply EOS/pad, encode it, next canvas

``generate`` reproduces transformers 5.24.0 ``DiffusionGemmaGenerationMixin.generate`` (SPEC §8) for the
text path with its default dynamic cache: same lengths, same order of random draws, same tokens given the
same logits and draws. The model is reached only through ``model.config`` (``vocab_size``,
``canvas_length``), ``model.new_cache(B)``, ``model.encode`` and ``model.denoise``; the last two can be
replaced (``encoder=``, ``denoiser=``), which is how the tests replay transformers' own logits.

Differences from transformers, all deliberate: bad settings raise ``ConfigError`` / ``InputError`` instead
of being accepted or failing later (an integer ``confidence_threshold`` such as 10 is accepted as 10.0; a
``max_length`` that leaves no room after the prompt is an error instead of returning the prompt alone);
NaN logits raise ``SamplingError``; randomness comes from an explicit ``DrawSource``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .draws import DrawSource, as_draw_source
from .errors import ConfigError, InputError
from .sampling import (StableAndConfident, argmax_tokens, check_logits, entropy_bound_accept, finalize_canvas,
                       freeze_rows, renoise, scale_logits, softmax_and_entropy, temperature, tokens_per_forward)

__all__ = ["GenerationConfig", "GenerationResult", "GenerationCallback", "StepInfo", "CanvasInfo", "generate",
           # the loop's plumbing, shared with the fast paths (fast/generate.py, fast/gpu.py):
           "resolve_config", "check_special_ids", "check_prompt", "check_start_canvas", "check_start_sc_logits",
           "new_token_budget", "run_denoiser", "notify", "readonly", "commit_canvas", "finish_run"]

DEFAULT_MAX_NEW_TOKENS = 256  # transformers lets max_length take over only while max_new_tokens has this value
SAMPLER_CLASS_NAME = "EntropyBoundSamplerConfig"  # the only sampler transformers knows
# generation_config.json keys that transformers accepts but that do not change the text-only reference loop.
_IGNORED_KEYS = frozenset({"return_dict_in_generate", "cache_config", "disable_compile", "bos_token_id",
                           "_commit_hash", "_from_model_config", "transformers_version"})


# ================================================================================================ configuration
@dataclass(frozen=True)
class GenerationConfig:
    """Settings of ``generate``, with transformers' ``DiffusionGemmaGenerationConfig`` names and defaults.

    Build it directly, with ``from_dict`` / ``from_pretrained`` (a checkpoint's ``generation_config.json``),
    or derive one with ``replace(**changes)``. Every value is checked on construction; a bad one raises
    ``ConfigError`` naming the field and the value.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # tokens to generate; rounded up to whole canvases, never truncated
    max_length: int | None = None  # total length bound (prompt, cache included, + new); takes over only while
    #                                max_new_tokens is 256, and once set also stops when the output reaches it
    max_denoising_steps: int = 48  # N: most denoising steps per canvas; also the schedule's denominator
    entropy_bound: float = 0.1  # β of the acceptance rule (JSON: sampler_config.entropy_bound)
    t_min: float | None = 0.4  # temperature of the (never reached) step 0; None with t_max: no schedule
    t_max: float | None = 0.8  # temperature of the first step; must exceed t_min
    stability_threshold: int | None = 1  # s: the draft must repeat over s+1 steps (0: no stability needed);
    #                                      None (or confidence None): no adaptive stopping, always N steps
    confidence_threshold: float | None = 0.005  # γ: stop needs mean entropy < γ (nats, strict)
    eos_token_id: tuple[int, ...] = ()  # ids that end a row (an int or a list is accepted); () = none
    pad_token_id: int | None = None  # id written after EOS; None disables every pad rewrite

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, minimum=1))
        set_("max_length", _integer("max_length", self.max_length, minimum=1, optional=True))
        set_("max_denoising_steps", _integer("max_denoising_steps", self.max_denoising_steps, minimum=1))
        set_("entropy_bound", _real("entropy_bound", self.entropy_bound, positive=True))
        set_("t_min", _real("t_min", self.t_min, positive=False, optional=True))
        set_("t_max", _real("t_max", self.t_max, positive=False, optional=True))
        if self.t_min is not None and self.t_max is not None and not self.t_max > self.t_min:
            raise ConfigError(f"t_max ({self.t_max!r}) must be greater than t_min ({self.t_min!r})")
        set_("stability_threshold", _integer("stability_threshold", self.stability_threshold, minimum=0,
                                             optional=True))
        set_("confidence_threshold", _real("confidence_threshold", self.confidence_threshold, positive=True,
                                           optional=True))
        set_("eos_token_id", _token_ids("eos_token_id", self.eos_token_id))
        set_("pad_token_id", _integer("pad_token_id", self.pad_token_id, minimum=0, optional=True))

    # -------------------------------------------------------------------------------------------- derived
    @property
    def uses_temperature(self) -> bool:
        """True when the linear temperature schedule applies (transformers needs both t_min and t_max)."""
        return self.t_min is not None and self.t_max is not None

    @property
    def uses_adaptive_stopping(self) -> bool:
        """True when the stable-and-confident rule exists (both thresholds set), enabling early exit."""
        return self.stability_threshold is not None and self.confidence_threshold is not None

    def replace(self, **changes: Any) -> "GenerationConfig":
        """A copy with some fields changed (validated). Raises ``ConfigError`` for an unknown field."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown generation setting(s) {unknown}; known: {sorted(names)}")
        return dataclasses.replace(self, **changes)

    # -------------------------------------------------------------------------------------------- files
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GenerationConfig":
        """Read transformers' ``generation_config.json`` layout.

        The entropy bound lives in ``sampler_config = {"_cls_name": "EntropyBoundSamplerConfig",
        "entropy_bound": ...}``. A null value means "not set", so the default applies (transformers fills
        unset fields from its global defaults). Keys transformers accepts but the reference does not need
        (``return_dict_in_generate``, ``bos_token_id``, metadata...) are ignored; ``cache_implementation``
        must be absent, null or "dynamic" (other caches change the numbers; SPEC §8.5). Any other key raises
        ``ConfigError``, as transformers does.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a generation config must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"entropy_bound"}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in _IGNORED_KEYS:
                continue
            if key == "cache_implementation":
                if value not in (None, "dynamic"):
                    raise ConfigError(f"cache_implementation {value!r} is not supported: the reference reproduces "
                                      "the default dynamic cache only")
            elif key == "sampler_config":
                bound = _sampler_entropy_bound(value)
                if bound is not None:
                    values["entropy_bound"] = bound
            elif key in names:
                if value is not None:
                    values[key] = value
            else:
                raise ConfigError(f"unknown generation_config key {key!r}")
        return cls(**values)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "GenerationConfig":
        """Read ``generation_config.json`` from a checkpoint directory (or that file itself).

        Raises ``FileNotFoundError`` when the file is missing and ``ConfigError`` for invalid JSON or values.
        """
        file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else os.fspath(path)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no generation config at {file!r}")
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{file!r} is not valid JSON: {error}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The transformers ``generation_config.json`` layout (``from_dict`` reads it back unchanged)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "max_denoising_steps": self.max_denoising_steps,
            "sampler_config": {"_cls_name": SAMPLER_CLASS_NAME, "entropy_bound": self.entropy_bound},
            "t_min": self.t_min,
            "t_max": self.t_max,
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": self.confidence_threshold,
            "eos_token_id": list(self.eos_token_id) if self.eos_token_id else None,
            "pad_token_id": self.pad_token_id,
        }
        if self.max_length is not None:
            out["max_length"] = self.max_length
        return out


def _sampler_entropy_bound(value: Any) -> float | None:
    """The entropy bound inside a serialised ``sampler_config`` (None when unset)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"sampler_config must be an object, got {value!r}")
    cls_name = value.get("_cls_name", SAMPLER_CLASS_NAME)
    if cls_name != SAMPLER_CLASS_NAME:
        raise ConfigError(f"sampler_config._cls_name {cls_name!r} is not supported; only {SAMPLER_CLASS_NAME!r}")
    unknown = sorted(set(value) - {"_cls_name", "entropy_bound"})
    if unknown:
        raise ConfigError(f"unknown sampler_config key(s) {unknown}")
    return value.get("entropy_bound")


def _integer(name: str, value: Any, minimum: int, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _real(name: str, value: Any, positive: bool, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, np.ndarray)):
        raise ConfigError(f"{name} must be an integer or a list of integers, got {value!r}")
    return tuple(_integer(name, item, minimum=0) for item in items)


# ================================================================================================ observability
@dataclass(frozen=True)
class StepInfo:
    """What one denoising step did (passed to ``GenerationCallback.on_step``). Arrays are read-only.

    Frozen rows (finished denoising before this step) report their frozen draft, canvas and entropies and
    an all-False ``accepted`` row.
    """

    canvas_index: int  # k: which canvas (0-based)
    step: int  # transformers' cur_step: N at the first step, counting down
    step_index: int  # 0-based count of steps executed in this canvas (N - step)
    temperature: float | None  # T of this step (float32 value), None without a schedule
    draft: np.ndarray  # (B, C) int64 argmax of the processed logits: what would be committed now
    sampled: np.ndarray  # (B, C) int64 categorical draws
    accepted: np.ndarray  # (B, C) bool: positions whose draw entered the next canvas
    canvas: np.ndarray  # (B, C) int64 the next canvas (accepted draws, fresh noise elsewhere)
    entropies: np.ndarray  # (B, C) float32 per-position entropy (nats) of the processed logits
    finished: np.ndarray  # (B,) bool: rows whose denoising has stopped after this step


@dataclass(frozen=True)
class CanvasInfo:
    """A committed canvas (passed to ``GenerationCallback.on_canvas``). Arrays are read-only."""

    canvas_index: int  # k
    tokens: np.ndarray  # (B, C) int64 as appended to the output (after the EOS/pad rules)
    finished: np.ndarray  # (B,) bool: rows that have ended (EOS seen, or the max-length rule)
    steps: int  # denoising steps executed for this canvas


class GenerationCallback:
    """Observer of a generation run (transformers' streamer idea: ``put_draft`` per step, ``put`` per block).

    Subclass and override what you need; ``generate`` also accepts any object that has some of these
    methods (missing ones are skipped). Callbacks must not modify the arrays they receive (they are
    read-only views).
    """

    def on_prompt(self, input_ids: np.ndarray) -> None:
        """Called once with the prompt (B, P) before anything runs."""

    def on_step(self, info: StepInfo) -> None:
        """Called after every executed denoising step."""

    def on_canvas(self, info: CanvasInfo) -> None:
        """Called after every committed canvas."""

    def on_end(self, result: "GenerationResult") -> None:
        """Called once with the result."""


@dataclass
class GenerationResult:
    """What ``generate`` returns (transformers: ``DiffusionGemmaGenerationOutput`` plus bookkeeping)."""

    sequences: np.ndarray  # (B, P + k*C) int64: prompt followed by k committed canvases (never truncated)
    tokens_per_forward: np.ndarray  # (B,) float32: non-pad generated tokens / decoder passes of that row
    steps_per_canvas: list[int] = field(default_factory=list)  # denoising steps executed, per canvas
    forward_passes: np.ndarray | None = None  # (B,) int64: decoder passes counted per row
    cache: Any = None  # the cache; it lacks the last canvas (never encoded; trap T23)


def notify(callback: Any, method: str, argument: Any) -> None:
    """Call ``callback.<method>(argument)`` if the callback exists and has that method (duck typing)."""
    handler = getattr(callback, method, None) if callback is not None else None
    if handler is not None:
        handler(argument)


def readonly(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (what callbacks, denoisers and encoders receive)."""
    view = array.view()
    view.flags.writeable = False
    return view


# ================================================================================================ the loop
Denoiser = Callable[[np.ndarray, Any, "np.ndarray | None"], np.ndarray]
Encoder = Callable[[np.ndarray, Any, "np.ndarray | None"], Any]


def generate(model: Any, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
             generation_config: GenerationConfig | None = None, *, random: DrawSource | int | None = None,
             denoiser: Denoiser | None = None, encoder: Encoder | None = None, cache: Any = None,
             decoder_input_ids: np.ndarray | None = None, self_conditioning_logits: np.ndarray | None = None,
             callback: Any = None, progress: bool = True, trace: Any = None, **overrides: Any) -> GenerationResult:
    """Generate canvases of C tokens after ``input_ids`` by entropy-bound block diffusion.

    model: provides ``config.vocab_size`` (V), ``config.canvas_length`` (C), ``new_cache(B)``, and, unless
        replaced, ``encode(ids, cache, mask)`` and ``denoise(canvas, cache, sc_logits)``.
    input_ids: (B, P) int token ids in [0, V), P >= 1; with ``cache``, only the tokens not cached yet.
    attention_mask: (B, P) of 0/1 (1 = real token), for left padding. Positions are not shifted for
        padding (trap T18): the model sees pads as occupied positions that no query attends to. Committed
        canvases are encoded with an all-ones mask (or None when no mask was given).
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
    callback: a ``GenerationCallback`` (or duck-typed object). progress: show tqdm bars on stderr.
    trace: None, or a fresh ``trace.TraceRecorder`` that records the run (encoder K/V, per-step decoder
        input, layer outputs, logits and sampler state, committed canvases, draws); call its ``save`` after.
        The model's ``denoise`` receives it when it takes a ``trace`` argument (and no ``denoiser`` is given).

    Lengths (SPEC §8.1): with L0 = P + cache length, ``max_new_tokens`` becomes ``max_length - L0`` when
    ``max_length`` is set and ``max_new_tokens`` is left at 256; the run makes at most
    ceil(max_new_tokens / C) canvases and the output keeps whole canvases. It stops early when every row
    has ended: an EOS id anywhere in a committed canvas, or (only when ``max_length`` is set) the output
    reaching ``max_length`` columns (transformers compares the output's columns, not counting the cache).

    Per canvas (SPEC §8.2): encode the new tokens; draw the initial canvas; run the denoising steps of
    ``sampling.py`` for cur_step N..1, counting a decoder pass for every row that is neither finished
    denoising nor an ended sequence, until every row is finished; commit the draft; apply the EOS/pad
    rules; the committed (rewritten) canvas is what gets encoded next.

    Returns a ``GenerationResult``. Raises ``InputError`` for bad arrays or a model/denoiser returning the
    wrong shape or dtype, ``ConfigError`` for bad settings (also EOS/pad ids outside [0, V)),
    ``SamplingError`` when logits hold NaN / +inf or a position has no finite logit, and
    ``draws.ReplayError`` when a replayed recording does not fit.
    """
    config = resolve_config(model, generation_config, overrides)
    V, C = int(model.config.vocab_size), int(model.config.canvas_length)
    check_special_ids(config, V)
    ids, mask = check_prompt(input_ids, attention_mask, V)
    B, P = ids.shape
    start_canvas = check_start_canvas(decoder_input_ids, B, C, V)
    start_sc = check_start_sc_logits(self_conditioning_logits, B, C, V)
    draws = as_draw_source(random)
    denoise = denoiser if denoiser is not None else model.denoise
    encode = encoder if encoder is not None else model.encode
    if cache is None:
        cache = model.new_cache(B)
    if trace is not None:
        trace.begin_run(model.config, config, ids, mask, draws=draws)
        draws = trace.record_draws(draws)
        if denoiser is None and "trace" in inspect.signature(model.denoise).parameters:
            denoise = functools.partial(model.denoise, trace=trace)
    context_length = P + int(cache.length)  # transformers' cur_len
    n_canvases = math.ceil(new_token_budget(config, context_length) / C)
    stopper = (StableAndConfident(config.stability_threshold, config.confidence_threshold)
               if config.uses_adaptive_stopping else None)

    sequences = ids.copy()  # (B, P), grows by C per canvas
    ended = np.zeros(B, dtype=bool)  # transformers' finished_sequences
    forward_passes = np.zeros(B, dtype=np.int64)
    steps_per_canvas: list[int] = []
    new_ids, new_mask = ids, mask  # what the next encode call appends
    notify(callback, "on_prompt", readonly(ids))

    from tqdm import tqdm

    canvas_bar = tqdm(total=n_canvases, desc="canvases", unit="canvas", disable=not progress, leave=False)
    step_bar = tqdm(total=config.max_denoising_steps, desc="denoising", unit="step", disable=not progress,
                    leave=False)
    try:
        for k in range(n_canvases):
            if trace is not None:
                trace.begin_encode(new_ids, new_mask)
            encode(readonly(new_ids), cache, None if new_mask is None else readonly(new_mask))
            if trace is not None:
                trace.end_encode(cache)
            initial = draws.canvas_ids(B, C, V)  # always drawn, even when a starting canvas is given
            canvas = start_canvas if (k == 0 and start_canvas is not None) else initial
            sc_logits = start_sc if k == 0 else None
            step_bar.reset(total=config.max_denoising_steps)
            if trace is not None:
                trace.begin_canvas(canvas)
            draft, steps = _denoise_canvas(k, canvas, sc_logits, cache, denoise, draws, stopper, config, ended,
                                           forward_passes, callback, step_bar, V, trace)
            steps_per_canvas.append(steps)

            sequences, tokens, ended = commit_canvas(k, draft, steps, sequences, ended, config, callback)
            if trace is not None:
                trace.commit(tokens, ended)
            canvas_bar.update(1)
            if ended.all():
                break
            new_ids = tokens
            new_mask = None if mask is None else np.ones((B, C), dtype=np.int64)
    finally:
        step_bar.close()
        canvas_bar.close()

    if trace is not None:
        trace.end_run(sequences)
    return finish_run(sequences, P, forward_passes, steps_per_canvas, cache, config, callback)


def commit_canvas(k: int, draft: np.ndarray, steps: int, sequences: np.ndarray, ended: np.ndarray,
                  config: GenerationConfig, callback: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Commit canvas ``k``'s draft (SPEC §8.2 steps 4-5) and report it to the callback.

    draft: (B, C) int64 argmax canvas; sequences: (B, T) int64 so far; ended: (B,) bool rows already over.
    Applies the EOS/pad rules (``finalize_canvas``), plus transformers' MaxLengthCriteria when the user set
    ``max_length`` (it compares the output's columns, the cache not counted). Returns (sequences with the
    C new columns, the committed tokens (B, C), the new ended flags (B,)). Shared by every backend's loop.
    """
    B, C = draft.shape
    reached_max_length = None
    if config.max_length is not None:
        reached_max_length = np.full(B, sequences.shape[1] + C >= config.max_length)
    tokens, ended = finalize_canvas(draft, ended, config.eos_token_id, config.pad_token_id, reached_max_length)
    sequences = np.concatenate([sequences, tokens], axis=1)
    notify(callback, "on_canvas", CanvasInfo(k, readonly(tokens), readonly(ended.copy()), steps))
    return sequences, tokens, ended


def finish_run(sequences: np.ndarray, prompt_length: int, forward_passes: np.ndarray, steps_per_canvas: list[int],
               cache: Any, config: GenerationConfig, callback: Any) -> GenerationResult:
    """Build the ``GenerationResult`` (tokens per forward over the columns after the prompt) and report it
    to the callback's ``on_end``. Shared by every backend's loop."""
    result = GenerationResult(
        sequences=sequences,
        tokens_per_forward=tokens_per_forward(sequences[:, prompt_length:], forward_passes, config.pad_token_id),
        steps_per_canvas=steps_per_canvas,
        forward_passes=forward_passes,
        cache=cache,
    )
    notify(callback, "on_end", result)
    return result


def _denoise_canvas(k: int, canvas: np.ndarray, sc_logits: np.ndarray | None, cache: Any, denoise: Denoiser,
                    draws: DrawSource, stopper: StableAndConfident | None, config: GenerationConfig,
                    ended: np.ndarray, forward_passes: np.ndarray, callback: Any, step_bar: Any,
                    V: int, trace: Any = None) -> tuple[np.ndarray, int]:
    """Run the denoising steps of canvas ``k``; return its draft (B, C) int64 and the steps executed.

    ``forward_passes`` (B,) is incremented in place. The letters refer to SPEC §8.2 step 3. ``trace``: a
    ``TraceRecorder`` or None (see ``generate``).
    """
    B, C = canvas.shape
    N = config.max_denoising_steps
    draft = canvas  # transformers starts the draft as the initial canvas (overwritten by step 1)
    entropies = None  # previous step's entropies, for frozen rows
    finished = np.zeros(B, dtype=bool)  # transformers' finished_denoising
    if stopper is not None:
        stopper.reset()
    step_index = 0
    for step_index, step in enumerate(range(N, 0, -1)):
        forward_passes += ~(finished | ended)  # (a) counted before the pass, for live rows only

        if trace is not None:
            trace.begin_step(~finished)
        logits = run_denoiser(denoise, canvas, cache, sc_logits, (B, C, V))  # (b) (B, C, V) float32
        if trace is not None:
            trace.logits(logits)
        check_logits(logits, "denoiser logits")
        temp = temperature(step, N, config.t_min, config.t_max) if config.uses_temperature else None
        processed = scale_logits(logits, temp)  # (c) a new array: it may be modified below
        if temp is not None:
            check_logits(processed, f"logits divided by temperature {float(temp)!r}")
        probs, step_entropies = softmax_and_entropy(processed)  # (d, f) (B, C, V), (B, C)
        sampled = draws.categorical(probs)  # (d) (B, C)
        new_draft = argmax_tokens(processed)  # (e)
        accepted = entropy_bound_accept(step_entropies, config.entropy_bound)  # (f)
        noise = draws.renoise_ids(B, C, V)  # (g)
        next_canvas = renoise(sampled, accepted, noise)

        if stopper is not None:
            if finished.any():  # (h) rows that stopped keep their state while the others go on
                new_draft = freeze_rows(finished, new_draft, draft)
                next_canvas = freeze_rows(finished, next_canvas, canvas)
                processed[finished] = sc_logits[finished]
                step_entropies = freeze_rows(finished, step_entropies, entropies)
                accepted = accepted & ~finished[:, None]
            finished = finished | stopper(new_draft, step_entropies)  # (i)

        sc_logits, canvas, draft, entropies = processed, next_canvas, new_draft, step_entropies  # (j)
        if trace is not None:
            trace.end_step(temperature=temp, draft=draft, sampled=sampled, entropies=entropies, accepted=accepted,
                           canvas=canvas, finished=finished)
        step_bar.update(1)
        notify(callback, "on_step", StepInfo(
            canvas_index=k, step=step, step_index=step_index,
            temperature=None if temp is None else float(temp), draft=readonly(draft),
            sampled=readonly(sampled), accepted=readonly(accepted), canvas=readonly(canvas),
            entropies=readonly(entropies), finished=readonly(finished.copy())))
        if finished.all():  # (k) only reachable with adaptive stopping
            break
    return draft, step_index + 1


def run_denoiser(denoise: Denoiser, canvas: np.ndarray, cache: Any, sc_logits: np.ndarray | None,
                  shape: tuple[int, int, int]) -> np.ndarray:
    """Call the denoiser on read-only inputs and check what it returns."""
    logits = denoise(readonly(canvas), cache, None if sc_logits is None else readonly(sc_logits))
    logits = np.asarray(logits)
    if logits.shape != shape:
        raise InputError(f"the denoiser returned logits of shape {logits.shape}, expected {shape}")
    if logits.dtype != np.float32:
        raise InputError(f"the denoiser returned {logits.dtype} logits, expected float32")
    return logits


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
    if np.isnan(logits).any():
        raise InputError("self_conditioning_logits contains NaN")
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
