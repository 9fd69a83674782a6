"""Semantic variants: the generation loop as other DiffusionGemma implementations run it.

transformers 5.24.0 is the default and the specification (SPEC §8). Other implementations make different
choices at a few stages of the same loop (SPEC §11, docs/PEERS.md). A ``Semantics`` is a named, frozen set
of those choices; ``generate(..., semantics="jax")`` runs the reference loop with them, so that a porter who
checks another implementation compares it with a reference that makes the same choices, difference by
difference, instead of with transformers.

Stages and their choices (each value is a module constant; the source of each choice is in ``SWITCHES``):

    commit             what a finished canvas commits: the argmax draft, the last sampled-and-renoised
                       canvas, or the sampled canvas unless the row stopped early (then the argmax)
    stop_comparison    the stopping rule's threshold test: mean entropy < γ (strict) or <= γ
    stop_history       what "stable" compares: the argmax history (-1 filled; s = 0 means always
                       stable), the same with s = 0 read as 1, the canvas fed into the step, or a
                       held counter over consecutive equal argmaxes
    canvas_window      the prompt keys a canvas query sees in a sliding layer: the last W-1 for every
                       query, the last W-1-i for the query at canvas offset i, or the last W
    temperature        how T_n is rounded: float32 operations as torch, double rounded once to float32
                       (Python arithmetic), or C float arithmetic ((t_max - t_min) * n / N)
    sc_temperature     the self-conditioning input: the processed logits z / T, or z * float32(1 / T)
    last_canvas        every canvas has C positions, or mlx-vlm's rule min(C, max(remaining, 64))
    eos                what an end token does to the committed canvas and to the output
    sampler            the acceptance stage: entropy-bound, mlx-vlm's confidence-threshold, mlx-vlm's
                       former auto-regressive Euler, diffusers' BlockRefinement (uniform mode)
    denoiser_draw      the token a position proposes: a categorical draw, or the argmax (temperature 0)

What the reference cannot reproduce is said where it matters: bfloat16 arithmetic (JAX divides bf16
logits), other random streams (JAX's threefry, llama.cpp's mt19937, vLLM's Gumbel-max), vLLM's single
shared layer scalar (a weights question, not a loop one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from .cache import KVCache
from .errors import ConfigError
from .sampling import (argmax_tokens, check_logits, entropy_bound_accept, finalize_canvas, renoise,
                       softmax_and_entropy, temperature as float32_temperature)

__all__ = ["Semantics", "SEMANTICS", "SWITCHES", "get_semantics", "schedule_temperature", "scale_for_sc",
           "ArgmaxHistoryStop", "InputCanvasStop", "HeldCounterStop", "make_stopper", "committed_tokens",
           "finalize_variant", "trim_output", "canvas_length_for", "confidence_threshold_accept",
           "block_refinement_accept", "ar_euler_accept", "VariantBackend", "sliding_window_keys", "variant_backend",
           "variant_cache", "WideWindowCache"]

# ------------------------------------------------------------------------------------------ choice values
COMMIT_ARGMAX, COMMIT_SAMPLED, COMMIT_SAMPLED_UNLESS_STOPPED = "argmax", "sampled", "sampled-unless-stopped"
STRICT, NON_STRICT = "strict", "non-strict"
HISTORY_ARGMAX, HISTORY_ARGMAX_MIN1, HISTORY_INPUT, HISTORY_HELD = ("argmax-history", "argmax-history-min1",
                                                                    "input-canvas", "held-counter")
WINDOW_W1, WINDOW_W1_I, WINDOW_W = "W-1", "W-1-i", "W"
TEMP_FLOAT32, TEMP_DOUBLE, TEMP_C_FLOAT = "float32", "double", "c-float"
SC_DIVIDE, SC_MULTIPLY_INVERSE, SC_RAW = "divide", "multiply-inverse", "raw"
LAST_FULL, LAST_MLX = "full", "remaining-min-64"
EOS_TRANSFORMERS, EOS_JAX, EOS_STOP_EXCLUDED, EOS_LLAMA, EOS_FIRST_ID, EOS_CUT_AFTER = (
    "transformers", "jax", "stop-excluded", "llama.cpp", "first-id-only", "cut-after")
SAMPLER_ENTROPY, SAMPLER_CONFIDENCE, SAMPLER_AR_EULER, SAMPLER_BLOCK = (
    "entropy-bound", "confidence-threshold", "auto-regressive-euler", "block-refinement")
DRAW_CATEGORICAL, DRAW_ARGMAX = "categorical", "argmax"

# Every switch, its allowed values and where each value comes from (docs/PEERS.md has the details and the
# commits read). This table is what docs/SPEC.md's peer table names.
SWITCHES: dict[str, dict[str, str]] = {
    "commit": {
        COMMIT_ARGMAX: "transformers _denoising_step commits the argmax draft; llama.cpp, mlx-vlm, vLLM alike",
        COMMIT_SAMPLED: "JAX sample_next_canvas returns the last SampleFromPredictions canvas",
        COMMIT_SAMPLED_UNLESS_STOPPED: "diffusers DiffusionGemmaPipeline appends scheduler prev_sample; "
                                       "rows frozen by the stopping rule get the argmax",
    },
    "stop_comparison": {
        STRICT: "transformers StableAndConfidentStoppingCriteria, mlx-vlm, llama.cpp, diffusers: mean H < γ",
        NON_STRICT: "JAX EntropyEarlyStop: mean H <= γ",
    },
    "stop_history": {
        HISTORY_ARGMAX: "transformers: last s argmax drafts, filled with -1 (s = 0: always stable)",
        HISTORY_ARGMAX_MIN1: "diffusers: history of max(s, 1) argmaxes, so s = 0 behaves as s = 1",
        HISTORY_INPUT: "JAX TokenStabilityEarlyStop: argmax equals the canvas fed into this step",
        HISTORY_HELD: "llama.cpp: held = held + 1 if argmax repeats else 0; stable when held >= s",
    },
    "canvas_window": {
        WINDOW_W1: "transformers DynamicSlidingWindowLayer keeps W-1 keys; mlx-vlm, llama.cpp alike",
        WINDOW_W1_I: "JAX main since 09e7b48 (2026-07-06): block-local mask AND the per-query sliding mask",
        WINDOW_W: "JAX 195a977..0360c66: skip_sliding_mask=True, the canvas sees the last W prompt keys",
    },
    "temperature": {
        TEMP_FLOAT32: "transformers LinearTemperatureScheduleLogitsProcessor: float32 tensor arithmetic",
        TEMP_DOUBLE: "mlx-vlm _diffusion_linear_temperature, diffusers EntropyBoundScheduler, vLLM, SGLang: "
                     "Python float, rounded to float32 when it meets the logits",
        TEMP_C_FLOAT: "llama.cpp diffusion_generate_entropy_bound: t_min + (t_max - t_min) * n / S in float",
    },
    "sc_temperature": {
        SC_DIVIDE: "transformers, JAX, mlx-vlm, diffusers EntropyBound: SC input is z / T",
        SC_MULTIPLY_INVERSE: "llama.cpp: softmax(z * temp_inv) with temp_inv = 1 / T in float",
        SC_RAW: "diffusers BlockRefinementScheduler: pred_logits are the raw logits z",
    },
    "last_canvas": {
        LAST_FULL: "transformers, JAX, llama.cpp, diffusers: every canvas has canvas_length positions",
        LAST_MLX: "mlx-vlm stream_diffusion_generate: min(C, max(remaining, min(C, 64))) unless full canvas",
    },
    "eos": {
        EOS_TRANSFORMERS: "transformers _finalize_canvas: EOS kept, pad after it when pad_token_id is set",
        EOS_JAX: "JAX _truncate_canvas_at_stop_tokens: PAD=0 after the first end token, end token kept",
        EOS_STOP_EXCLUDED: "mlx-vlm: emission stops at the first EOS id, which is not emitted; "
                           "also stops at max_new_tokens",
        EOS_LLAMA: "llama.cpp trim_canvas: cut at the first EOG (excluded) or a stride-1/2 loop of >= 6",
        EOS_FIRST_ID: "diffusers: only the tokenizer's single eos_token_id ends a row; no rewrite",
        EOS_CUT_AFTER: "vLLM server stop handling [I]: the output ends after the first EOS, no pad",
    },
    "sampler": {
        SAMPLER_ENTROPY: "transformers EntropyBoundSampler; JAX, llama.cpp, vLLM, mlx-vlm entropy-bound, "
                         "diffusers EntropyBoundScheduler",
        SAMPLER_CONFIDENCE: "mlx-vlm confidence-threshold (its default): reveal p >= threshold, else the best",
        SAMPLER_AR_EULER: "mlx-vlm auto-regressive-euler (before #1347): accept with probability 1/n",
        SAMPLER_BLOCK: "diffusers BlockRefinementScheduler, uniform mode: cumulative quota + confidence; "
                       "it never applies the temperature schedule (drafts, entropies and SC use raw logits)",
    },
    "denoiser_draw": {
        DRAW_CATEGORICAL: "transformers torch.multinomial; JAX, llama.cpp, diffusers EntropyBound",
        DRAW_ARGMAX: "mlx-vlm at temperature 0 (its default); diffusers BlockRefinement at temperature 0",
    },
}


@dataclass(frozen=True)
class Semantics:
    """One implementation's choices at each stage of the loop (values: the constants above, see SWITCHES)."""

    name: str  # the name ``generate(semantics=...)`` and ``--semantics`` take
    commit: str = COMMIT_ARGMAX  # what a finished canvas commits
    stop_comparison: str = STRICT  # mean entropy < γ, or <= γ
    stop_history: str = HISTORY_ARGMAX  # what "stable" compares
    canvas_window: str = WINDOW_W1  # prompt keys a canvas query sees in a sliding layer
    temperature: str = TEMP_FLOAT32  # rounding of the schedule's T_n
    sc_temperature: str = SC_DIVIDE  # the next step's self-conditioning input
    last_canvas: str = LAST_FULL  # length of each canvas
    eos: str = EOS_TRANSFORMERS  # end-token handling
    sampler: str = SAMPLER_ENTROPY  # the acceptance stage
    denoiser_draw: str = DRAW_CATEGORICAL  # the token each position proposes
    threshold: float = 0.9  # confidence-threshold / block-refinement threshold (mlx-vlm 0.9, diffusers 0.95)
    note: str = ""  # one line: what this variant cannot reproduce

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name in SWITCHES and getattr(self, f.name) not in SWITCHES[f.name]:
                raise ConfigError(f"semantics {self.name!r}: {f.name} must be one of {sorted(SWITCHES[f.name])}, "
                                  f"got {getattr(self, f.name)!r}")

    @property
    def is_default(self) -> bool:
        """True when every choice is transformers' (the loop then needs none of this module)."""
        return all(getattr(self, name) == getattr(SEMANTICS["transformers"], name) for name in SWITCHES)

    def replace(self, **changes: Any) -> "Semantics":
        """A copy with some choices changed (validated); e.g. mlx-vlm with the entropy-bound sampler."""
        return dataclasses.replace(self, **changes)

    def switches(self) -> dict[str, str]:
        """{stage: choice} for every stage (reports print this)."""
        return {name: getattr(self, name) for name in SWITCHES}


SEMANTICS: dict[str, Semantics] = {v.name: v for v in (
    Semantics("transformers"),
    Semantics("jax", commit=COMMIT_SAMPLED, stop_comparison=NON_STRICT, stop_history=HISTORY_INPUT,
              canvas_window=WINDOW_W1_I, eos=EOS_JAX,
              note="JAX main @7691fd4; bf16 logit division and threefry draws are not reproduced"),
    Semantics("llama.cpp", stop_history=HISTORY_HELD, temperature=TEMP_C_FLOAT, sc_temperature=SC_MULTIPLY_INVERSE,
              eos=EOS_LLAMA, note="PR #24423; mt19937 draws and the F16 SC embedding copy are not reproduced"),
    Semantics("vllm", temperature=TEMP_DOUBLE, eos=EOS_CUT_AFTER,
              note="Gumbel-max draws, top-k/top-p and the shared layer scalar are not reproduced"),
    Semantics("mlx-vlm", temperature=TEMP_DOUBLE, last_canvas=LAST_MLX, eos=EOS_STOP_EXCLUDED,
              sampler=SAMPLER_CONFIDENCE, denoiser_draw=DRAW_ARGMAX, threshold=0.9,
              note="mlx-vlm 0.7.10 defaults (confidence-threshold 0.9, temperature 0); "
                   "replace(sampler='entropy-bound') for its entropy-bound sampler"),
    Semantics("diffusers", commit=COMMIT_SAMPLED_UNLESS_STOPPED, stop_history=HISTORY_ARGMAX_MIN1,
              temperature=TEMP_DOUBLE, eos=EOS_FIRST_ID,
              note="diffusers 0.42.1 with EntropyBoundScheduler; replace(sampler='block-refinement', "
                   "sc_temperature='raw', denoiser_draw='argmax', threshold=0.95) "
                   "for BlockRefinementScheduler"),
)}


def get_semantics(semantics: "str | Semantics | None") -> Semantics:
    """A name from ``SEMANTICS`` (or a ``Semantics``; None is transformers) -> ``Semantics``.

    Raises ``ConfigError`` naming the known variants for an unknown name.
    """
    if semantics is None:
        return SEMANTICS["transformers"]
    if isinstance(semantics, Semantics):
        return semantics
    if isinstance(semantics, str) and semantics in SEMANTICS:
        return SEMANTICS[semantics]
    raise ConfigError(f"unknown semantics {semantics!r}; known: {sorted(SEMANTICS)}")


# ------------------------------------------------------------------------------------------ temperature
def schedule_temperature(step: int, max_steps: int, t_min: float, t_max: float, arithmetic: str) -> np.float32:
    """T_n of the linear schedule (n = cur_step, N..1) under one rounding rule; a float32 scalar.

    float32: ``sampling.temperature`` (torch's float32 ops, bit for bit). double: the whole expression in
    Python floats, ``t_min + (t_max - t_min) * (n / N)``, rounded once (mlx-vlm, diffusers: the value meets
    float32 logits as a weak scalar). c-float: C float arithmetic in llama.cpp's order,
    ``t_min + ((t_max - t_min) * n) / N`` with float32 t_min, t_max. The three can differ in the last bit.
    """
    if arithmetic == TEMP_FLOAT32:
        return float32_temperature(step, max_steps, t_min, t_max)
    if arithmetic == TEMP_DOUBLE:
        float32_temperature(step, max_steps, t_min, t_max)  # the same range check
        return np.float32(t_min + (t_max - t_min) * (step / max_steps))
    if arithmetic == TEMP_C_FLOAT:
        float32_temperature(step, max_steps, t_min, t_max)
        lo, hi = np.float32(t_min), np.float32(t_max)
        return np.float32(lo + np.float32(np.float32(np.float32(hi - lo) * np.float32(step)) / np.float32(max_steps)))
    raise ConfigError(f"unknown temperature arithmetic {arithmetic!r}; known: {sorted(SWITCHES['temperature'])}")


def scale_for_sc(raw: np.ndarray, processed: np.ndarray, temp: np.float32 | None, rule: str) -> np.ndarray:
    """The next step's self-conditioning logits (B, C, V) float32 from this step's raw and processed logits.

    divide: the processed logits z / T (transformers). multiply-inverse: z * float32(1 / T) (llama.cpp).
    raw: z itself (diffusers' BlockRefinementScheduler passes the unscaled logits on).
    """
    if rule == SC_DIVIDE or (rule == SC_MULTIPLY_INVERSE and temp is None):
        return processed
    if rule == SC_MULTIPLY_INVERSE:
        with np.errstate(over="ignore"):
            return np.asarray(raw, dtype=np.float32) * np.float32(np.float32(1.0) / np.float32(temp))
    if rule == SC_RAW:
        return np.array(raw, dtype=np.float32, copy=True)
    raise ConfigError(f"unknown sc_temperature {rule!r}")


# ------------------------------------------------------------------------------------------ stopping
def _confident(entropies: np.ndarray, threshold: np.float32, comparison: str) -> np.ndarray:
    mean = np.mean(np.asarray(entropies, dtype=np.float32), axis=-1, dtype=np.float32)  # (B,)
    return mean < threshold if comparison == STRICT else mean <= threshold


class ArgmaxHistoryStop:
    """Stable = the draft equals each of the last s drafts (filled with -1 per canvas); confident = the mean
    entropy passes the threshold test. ``min_history=1`` is diffusers' ``max(s, 1)`` history (s = 0 acts as
    s = 1). ``__call__(draft (B, C), entropies (B, C), input_canvas=None) -> (B,) bool``.
    Upstream: transformers ``StableAndConfidentStoppingCriteria``; diffusers' pipeline loop."""

    def __init__(self, stability_threshold: int, confidence_threshold: float, comparison: str = STRICT,
                 min_history: int = 0):
        self.s = max(int(stability_threshold), int(min_history))
        self.threshold, self.comparison = np.float32(confidence_threshold), comparison
        self.history: np.ndarray | None = None  # (s, B, C) int64

    def reset(self) -> None:
        self.history = None

    def __call__(self, draft: np.ndarray, entropies: np.ndarray, input_canvas: np.ndarray | None = None) -> np.ndarray:
        draft = np.asarray(draft, dtype=np.int64)
        if self.s == 0:
            stable = np.ones(draft.shape[0], dtype=bool)
        else:
            if self.history is None:
                self.history = np.full((self.s,) + draft.shape, -1, dtype=np.int64)
            stable = (self.history == draft[None]).all(axis=(0, 2))
            self.history = np.concatenate([self.history[1:], draft[None]], axis=0)
        return stable & _confident(entropies, self.threshold, self.comparison)


class InputCanvasStop:
    """JAX's ``TokenStabilityEarlyStop`` AND ``EntropyEarlyStop``: stable = the argmax equals the canvas fed
    into this step (last step's sampled/renoised tokens; at step 0 the random initial canvas), confident =
    mean entropy <= γ (non-strict by default). Only the equivalent of stability 1 exists; a caller's
    stability_threshold is ignored. ``__call__`` needs ``input_canvas`` (B, C)."""

    def __init__(self, confidence_threshold: float, comparison: str = NON_STRICT):
        self.threshold, self.comparison = np.float32(confidence_threshold), comparison

    def reset(self) -> None:
        pass

    def __call__(self, draft: np.ndarray, entropies: np.ndarray, input_canvas: np.ndarray | None = None) -> np.ndarray:
        if input_canvas is None:
            raise ConfigError("the input-canvas stopping rule needs the step's input canvas")
        stable = (np.asarray(draft) == np.asarray(input_canvas)).all(axis=-1)
        return stable & _confident(entropies, self.threshold, self.comparison)


class HeldCounterStop:
    """llama.cpp's counter: ``held = held + 1`` when the argmax equals the previous step's (initially -1),
    else 0; stop when ``held >= s`` and the mean entropy passes the test. Equivalent to the argmax history
    (tests pin that), written the other way."""

    def __init__(self, stability_threshold: int, confidence_threshold: float, comparison: str = STRICT):
        self.s, self.threshold, self.comparison = int(stability_threshold), np.float32(confidence_threshold), comparison
        self.previous: np.ndarray | None = None
        self.held: np.ndarray | None = None

    def reset(self) -> None:
        self.previous, self.held = None, None

    def __call__(self, draft: np.ndarray, entropies: np.ndarray, input_canvas: np.ndarray | None = None) -> np.ndarray:
        draft = np.asarray(draft, dtype=np.int64)
        if self.previous is None:
            self.previous = np.full_like(draft, -1)
            self.held = np.zeros(draft.shape[0], dtype=np.int64)
        same = (self.previous == draft).all(axis=-1)
        self.held = np.where(same, self.held + 1, 0)
        self.previous = draft
        return (self.held >= self.s) & _confident(entropies, self.threshold, self.comparison)


def make_stopper(semantics: Semantics, stability_threshold: int | None, confidence_threshold: float | None):
    """The variant's stopping rule, or None when adaptive stopping is off (either threshold None)."""
    if stability_threshold is None or confidence_threshold is None:
        return None
    if semantics.stop_history == HISTORY_ARGMAX:
        return ArgmaxHistoryStop(stability_threshold, confidence_threshold, semantics.stop_comparison)
    if semantics.stop_history == HISTORY_ARGMAX_MIN1:
        return ArgmaxHistoryStop(stability_threshold, confidence_threshold, semantics.stop_comparison, min_history=1)
    if semantics.stop_history == HISTORY_INPUT:
        return InputCanvasStop(confidence_threshold, semantics.stop_comparison)
    return HeldCounterStop(stability_threshold, confidence_threshold, semantics.stop_comparison)


# ------------------------------------------------------------------------------------------ committing
def committed_tokens(rule: str, draft: np.ndarray, canvas: np.ndarray, stopped: np.ndarray) -> np.ndarray:
    """What a finished canvas commits, (B, C) int64.

    draft: the last executed step's argmax (frozen for stopped rows); canvas: that step's sampled and
    renoised next canvas; stopped: (B,) bool rows that the stopping rule ended (not the step budget).
    """
    if rule == COMMIT_ARGMAX:
        return np.asarray(draft, dtype=np.int64)
    if rule == COMMIT_SAMPLED:
        return np.asarray(canvas, dtype=np.int64)
    if rule == COMMIT_SAMPLED_UNLESS_STOPPED:
        return np.where(np.asarray(stopped, dtype=bool)[:, None], draft, canvas).astype(np.int64)
    raise ConfigError(f"unknown commit rule {rule!r}")


def finalize_variant(rule: str, tokens: np.ndarray, finished_before: np.ndarray, eos_token_ids, pad_token_id,
                     forced: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The per-canvas end-token rule: (tokens to append (B, C) int64, finished (B,) bool).

    transformers: ``sampling.finalize_canvas``. jax: the same with PAD = 0 when no pad id is set (JAX always
    pads with 0). first-id-only: only the first EOS id ends a row, nothing is rewritten (diffusers).
    stop-excluded, llama.cpp, cut-after: an EOS id ends the row and nothing is rewritten here; the output is
    cut afterwards by ``trim_output``.
    """
    eos = tuple(eos_token_ids)
    if rule == EOS_TRANSFORMERS:
        return finalize_canvas(tokens, finished_before, eos, pad_token_id, forced)
    if rule == EOS_JAX:
        return finalize_canvas(tokens, finished_before, eos, 0 if pad_token_id is None else pad_token_id, forced)
    ids = eos[:1] if rule == EOS_FIRST_ID else eos
    tokens = np.array(tokens, dtype=np.int64, copy=True)
    hit = np.isin(tokens, np.asarray(ids, dtype=np.int64)).any(axis=-1) if ids else np.zeros(len(tokens), bool)
    finished = np.asarray(finished_before, dtype=bool) | hit
    if forced is not None:
        finished = finished | np.asarray(forced, dtype=bool)
    return tokens, finished


def _loop_start(row: list[int], repeats: int = 6) -> int | None:
    """Index where a token starts repeating at stride 1 or 2 for at least ``repeats`` repeats, else None."""
    for start in range(len(row)):
        for stride in (1, 2):
            end = start + stride * repeats
            if end <= len(row) and all(row[start + j] == row[start + j % stride] for j in range(stride * repeats)):
                if stride == 1 or row[start] != row[start + 1]:
                    return start
    return None


def trim_output(rule: str, new_tokens: list[int], eos_token_ids, max_new_tokens: int) -> list[int]:
    """The generated tokens a peer reports, from the committed canvases (one row, a list of ids).

    stop-excluded (mlx-vlm): up to the first EOS id, excluded, and at most ``max_new_tokens``.
    llama.cpp: up to the first EOS id (excluded) or the start of a stride-1/2 loop of >= 6 repeats.
    cut-after (vLLM [I]): up to and including the first EOS id. Other rules: unchanged.
    """
    eos = set(int(t) for t in eos_token_ids)
    row = [int(t) for t in new_tokens]
    if rule in (EOS_STOP_EXCLUDED, EOS_LLAMA, EOS_CUT_AFTER):
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        if cut is not None:
            row = row[:cut + 1] if rule == EOS_CUT_AFTER else row[:cut]
        if rule == EOS_LLAMA:
            loop = _loop_start(row)
            row = row if loop is None else row[:loop]
        if rule == EOS_STOP_EXCLUDED:
            row = row[:max_new_tokens]
    return row


def canvas_length_for(rule: str, model_canvas_length: int, remaining_tokens: int, min_canvas: int = 64) -> int:
    """Positions of the next canvas: C (full), or mlx-vlm's ``min(C, max(remaining, min(C, 64)))``."""
    if rule == LAST_FULL:
        return int(model_canvas_length)
    return int(min(model_canvas_length, max(remaining_tokens, min(model_canvas_length, min_canvas))))


# ------------------------------------------------------------------------------------------ acceptance
def confidence_threshold_accept(confidence: np.ndarray, revealed: np.ndarray, threshold: float,
                                force_all: bool = False) -> np.ndarray:
    """mlx-vlm's confidence-threshold transfer mask, (B, C) bool.

    confidence: (B, C) float32 probability of each position's proposed token; revealed: (B, C) bool
    positions revealed earlier. Reveal the unrevealed positions with confidence >= threshold; a row with
    unrevealed positions but none above the threshold reveals its single most confident one (first index
    on ties). ``force_all`` (its last step) reveals every unrevealed position.
    Upstream: ``_diffusion_confidence_transfer_mask`` (mlx_vlm/generate/diffusion.py, 0.7.10).
    """
    unrevealed = ~np.asarray(revealed, dtype=bool)
    if force_all:
        return unrevealed
    confidence = np.asarray(confidence, dtype=np.float32)
    transfer = unrevealed & (confidence >= np.float32(threshold))
    needs_force = unrevealed.any(axis=-1) & ~transfer.any(axis=-1)
    best = np.argmax(np.where(unrevealed, confidence, -np.inf), axis=-1)  # (B,)
    forced = (np.arange(confidence.shape[-1])[None, :] == best[:, None]) & needs_force[:, None]
    return transfer | forced


def block_refinement_accept(confidence: np.ndarray, committed: np.ndarray, step_index: int, max_steps: int,
                            threshold: float) -> np.ndarray:
    """diffusers' BlockRefinementScheduler transfer mask in uniform mode, (B, C) bool.

    The cumulative quota ``ceil((step_index + 1) * C / N)`` of committed positions is topped up with the
    most confident uncommitted positions (descending, stable order), and every uncommitted position with
    confidence > threshold is committed too. Upstream: ``BlockRefinementScheduler.step`` (diffusers 0.42.1).
    """
    confidence = np.asarray(confidence, dtype=np.float32)
    committed = np.asarray(committed, dtype=bool)
    B, C = confidence.shape
    target = ((step_index + 1) * C + max_steps - 1) // max_steps
    needed = np.clip(target - committed.sum(axis=-1), 0, None)  # (B,)
    masked = np.where(committed, -np.inf, confidence)
    order = np.argsort(-masked, axis=-1, kind="stable")
    ranks = np.argsort(order, axis=-1, kind="stable")
    return ~committed & ((ranks < needed[:, None]) | (confidence > np.float32(threshold)))


def ar_euler_accept(u_accept: np.ndarray, u_renoise: np.ndarray, step: int, max_steps: int,
                    renoise_ratio_modifier: float = 0.8) -> tuple[np.ndarray, np.ndarray]:
    """mlx-vlm's former auto-regressive Euler rule from uniforms (B, C) in [0, 1):
    (accept = u_accept < 1/n, renoise = u_renoise < modifier * (n - 1) / N). At n = 1 every position is
    accepted and none renoised. Upstream: mlx-vlm before 9b86dfa5 (PR #1347 branch)."""
    accept = np.asarray(u_accept) < 1.0 / step
    renoised = np.asarray(u_renoise) < renoise_ratio_modifier * (step - 1) / max_steps
    return accept, renoised


# ------------------------------------------------------------------------------------------ attention window
def sliding_window_keys(rule: str, key_positions: np.ndarray, prompt_end: int, canvas_length: int,
                        window: int) -> np.ndarray:
    """(C, T) bool: which cached key positions each canvas query may see in a sliding layer.

    key_positions: (T,) absolute positions of the cached keys; prompt_end: P, the first canvas position.
    W-1: the last W-1 keys for every query. W-1-i: query i (position P+i) sees keys >= P+i-W+1. W: the last
    W keys (needs a cache that retains W entries).
    """
    k = np.asarray(key_positions)[None, :]
    i = np.arange(canvas_length)[:, None]
    if rule == WINDOW_W1:
        return np.broadcast_to(k >= prompt_end - (window - 1), (canvas_length, k.shape[1])).copy()
    if rule == WINDOW_W1_I:
        return k >= prompt_end + i - window + 1
    if rule == WINDOW_W:
        return np.broadcast_to(k >= prompt_end - window, (canvas_length, k.shape[1])).copy()
    raise ConfigError(f"unknown canvas_window {rule!r}")


# ------------------------------------------------------------------------------------------ the backend
class VariantStep(NamedTuple):
    """Same fields as ``generate.StepOutput``."""

    draft: np.ndarray  # (B, C) int64 argmax of the processed logits
    sampled: np.ndarray  # (B, C) int64 proposed tokens (categorical draws or the argmax)
    entropies: np.ndarray  # (B, C) float32 entropies of the logits the stopping rule measures


class VariantBackend:
    """The reference's per-step compute with a variant's stage choices (the loop in ``generate`` is shared).

    denoise: (canvas, cache, sc_logits) -> (B, C, V) float32 soft-capped logits; draws: the run's
    ``DrawSource``. Differences from ``generate.ReferenceBackend``, each selected by the variant:
    the proposed token (categorical or argmax), the self-conditioning input, unscaled logits for
    block-refinement (its scheduler never applies the temperature), and the acceptance stage (entropy-bound, confidence-threshold,
    block-refinement; the latter two keep a revealed/committed mask per canvas).
    """

    def __init__(self, semantics: Semantics, denoise: Callable, draws: Any, vocab_size: int, max_steps: int,
                 observer: Any = None):
        if semantics.sampler == SAMPLER_AR_EULER:
            raise ConfigError("the auto-regressive-euler sampler needs per-position uniforms that no draw "
                              "source provides; use semantics.ar_euler_accept directly")
        self.semantics, self.denoise, self.draws, self.V, self.N = semantics, denoise, draws, int(vocab_size), max_steps
        self.observer = observer
        self.cache: Any = None
        self.sc_logits: np.ndarray | None = None
        self.revealed: np.ndarray | None = None  # (B, C) bool, confidence-threshold / block-refinement state
        self.draft_canvas: np.ndarray | None = None  # (B, C) int64 tokens revealed so far (confidence-threshold)
        self.confidence: np.ndarray | None = None  # (B, C) float32 p(proposed token) of the current step
        self.step_index = 0
        self.input_canvas: np.ndarray | None = None

    def context(self) -> Any:
        return contextlib.nullcontext()

    def begin_canvas(self, cache: Any, sc_logits: np.ndarray | None) -> None:
        self.cache, self.sc_logits = cache, sc_logits
        self.revealed = self.draft_canvas = None
        self.step_index = 0

    @property
    def all_revealed(self) -> np.ndarray | None:
        """(B,) bool rows whose every position is revealed (confidence-threshold's own stop), else None."""
        if self.semantics.sampler != SAMPLER_CONFIDENCE or self.revealed is None:
            return None
        return self.revealed.all(axis=-1)

    def step(self, canvas: np.ndarray, finished: np.ndarray, temp: np.float32 | None) -> VariantStep:
        s = self.semantics
        B, C = canvas.shape
        self.input_canvas = np.asarray(canvas)
        logits = np.asarray(self.denoise(canvas, self.cache, self.sc_logits))
        if self.observer is not None and hasattr(self.observer, "logits"):
            self.observer.logits(logits)
        check_logits(logits, "denoiser logits")
        unscaled = s.sampler == SAMPLER_BLOCK  # diffusers' BlockRefinement scheduler never applies T
        if temp is None or unscaled:
            processed = np.array(logits, dtype=np.float32, copy=True)
        else:
            with np.errstate(over="ignore"):
                processed = logits / np.float32(temp)
            check_logits(processed, f"logits divided by temperature {float(temp)!r}")
        probs, entropies = softmax_and_entropy(processed)
        draft = argmax_tokens(processed)
        sampled = self.draws.categorical(probs) if s.denoiser_draw == DRAW_CATEGORICAL else draft
        self.confidence = np.take_along_axis(probs, sampled[..., None], axis=-1)[..., 0]
        sc = scale_for_sc(logits, processed, temp, s.sc_temperature)
        if finished.any() and self.sc_logits is not None:
            sc = np.array(sc, copy=True)
            sc[finished] = self.sc_logits[finished]
        self.sc_logits = sc
        return VariantStep(draft, sampled, entropies)

    def accept_and_renoise(self, entropies: np.ndarray, sampled: np.ndarray, noise: np.ndarray,
                           bound: float) -> tuple[np.ndarray, np.ndarray]:
        s = self.semantics
        step_index, self.step_index = self.step_index, self.step_index + 1
        if s.sampler == SAMPLER_ENTROPY:
            accepted = entropy_bound_accept(entropies, bound)
            return accepted, renoise(sampled, accepted, noise)
        if self.revealed is None:
            self.revealed = np.zeros(sampled.shape, dtype=bool)
            self.draft_canvas = np.array(self.input_canvas, dtype=np.int64, copy=True)
        if s.sampler == SAMPLER_CONFIDENCE:
            accepted = confidence_threshold_accept(self.confidence, self.revealed, s.threshold)
            self.draft_canvas = np.where(accepted, sampled, self.draft_canvas)
            self.revealed = self.revealed | accepted
            return accepted, np.where(self.revealed, self.draft_canvas, noise).astype(np.int64)
        # block-refinement: committed positions keep the input canvas's token
        accepted = block_refinement_accept(self.confidence, self.revealed, step_index, self.N, s.threshold)
        kept = np.where(accepted, sampled, self.input_canvas)
        self.revealed = self.revealed | accepted
        return accepted, np.where(self.revealed, kept, noise).astype(np.int64)


def variant_backend(semantics: Semantics, model: Any, draws: Any, denoiser: Callable | None, observer: Any,
                    max_steps: int) -> VariantBackend:
    """The ``VariantBackend`` of a run with ``semantics``: over ``denoiser``, else ``model.denoise`` (told the
    variant's sliding window when it is not transformers' W-1). A model's own fast backend is not used:
    variants run on the reference's per-step compute."""
    denoise = denoiser
    if denoise is None:
        if semantics.canvas_window == WINDOW_W1:
            denoise = model.denoise
        else:
            import inspect

            try:
                takes = "canvas_window" in inspect.signature(model.denoise).parameters
            except (TypeError, ValueError):
                takes = False
            if not takes:
                raise ConfigError(f"semantics {semantics.name!r} needs canvas_window={semantics.canvas_window!r}, "
                                  f"which {type(model).__name__}.denoise does not take (the reference Model does)")

            def denoise(canvas, cache, sc_logits, _denoise=model.denoise, _rule=semantics.canvas_window):
                return _denoise(canvas, cache, sc_logits, canvas_window=_rule)
    return VariantBackend(semantics, denoise, draws, int(model.config.vocab_size), max_steps, observer)


def variant_cache(semantics: Semantics, model: Any, batch_size: int) -> Any:
    """The cache of a run with ``semantics``: ``model.new_cache``, except that the ``W`` window needs sliding
    layers to retain W prompt keys instead of W-1 (``WideWindowCache``)."""
    cache = model.new_cache(batch_size)
    if semantics.canvas_window != WINDOW_W:
        return cache
    if type(cache) is not KVCache:
        raise ConfigError("canvas_window 'W' needs the reference's KVCache (a model with another cache cannot "
                          "retain W prompt keys)")
    return WideWindowCache(cache.config, cache.batch_size)


class WideWindowCache(KVCache):
    """A ``KVCache`` whose sliding layers retain the last W keys (JAX releases before 2026-07-06)."""

    def layer_capacity(self, layer: int) -> int | None:
        return self.config.sliding_window if self.config.is_sliding(layer) else None
