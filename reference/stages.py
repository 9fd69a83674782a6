"""The loop's stages as objects, and the spec's choice for each (transformers 5.24.0, SPEC §8).

``generate.py`` strings the stages together; a ``Semantics`` holds one object per stage, the way a sampler
object holds its samplers. ``TRANSFORMERS`` is made of the spec's own functions (``sampling.py``,
``masks.py``); other implementations replace some stages (``variants/``, SPEC §11). A stage is called
once per use, the same way whatever it is:

    temperature(n, N, t_min, t_max) -> T_n float32 (or None: no schedule)          SPEC §8.2 c
    sc_temperature(z, ẑ, T_n) -> the next step's self-conditioning input        §7.1, §8.2 j
    denoiser_draw(draws, p, ā, logits=ẑ) -> the token each position proposes   §8.2 d
    sampler.start(N, threshold) -> an acceptor for the run: begin_canvas(x),
        acceptor(step, x, r, β) -> (accepted, next canvas), revealed_all(B)     §8.2 f, g
    stop_history.make(s, γ, stop_comparison) -> a stopper: reset(), stopper(ā, H, x) -> (B,) bool   §8.2 i
    commit(ā, x', stopped) -> what the canvas commits                           §8.2 step 4
    eos.finalize(tokens, ended, eos, pad, forced) / eos.trim(ids, eos, n)        §8.2 step 5
    canvas_window.keys(positions, L, C, W) -> (C, T) bool; canvas_window.new_cache(model, B)   §7.3

Every stage here is applied by the loop (``tests/test_semantics.py::test_every_stage_is_applied_by_the_loop``);
a peer's choice the loop cannot apply is stated in its ``Semantics.note`` instead (mlx-vlm's shorter last
canvas).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from .masks import canvas_window
from .sampling import StableAndConfident, entropy_bound_accept, finalize_canvas, renoise, scale_logits, temperature
from .support.errors import ConfigError

__all__ = ["Semantics", "TRANSFORMERS", "SEMANTICS", "register_semantics", "get_semantics"]


# ------------------------------------------------------------------------------------------ temperature (§8.2 c)
@dataclass(frozen=True)
class Float32Schedule:
    """T_n in float32 operations as torch computes it (``sampling.temperature``)."""

    name: ClassVar[str] = "float32"
    source: ClassVar[str] = "transformers LinearTemperatureScheduleLogitsProcessor: float32 tensor arithmetic"

    def __call__(self, step: int, max_steps: int, t_min: float, t_max: float) -> np.float32:
        return temperature(step, max_steps, t_min, t_max)

    def scale(self, logits: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        """How T_n meets the logits (SPEC §8.2 c): a division (``sampling.scale_logits``)."""
        return scale_logits(logits, temp)


@dataclass(frozen=True)
class DivideSC:
    """The next step's self-conditioning input is the processed logits z / T (SPEC §7.1)."""

    name: ClassVar[str] = "divide"
    source: ClassVar[str] = "transformers, JAX, mlx-vlm, diffusers EntropyBound: SC input is z / T"
    embedding: ClassVar[Any] = None  # a rounding of the soft embedding made of the input (None: as computed)

    def __call__(self, raw: np.ndarray, processed: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        return processed


# ------------------------------------------------------------------------------------------ the draw (§8.2 d)
@dataclass(frozen=True)
class CategoricalDraw:
    """One categorical draw per position from softmax(processed logits), from the run's draw source."""

    name: ClassVar[str] = "categorical"
    source: ClassVar[str] = "transformers torch.multinomial; JAX, llama.cpp, diffusers EntropyBound"

    def __call__(self, draws: Any, probs: np.ndarray, draft: np.ndarray, logits: np.ndarray | None = None) -> np.ndarray:
        if logits is not None and draws.takes_logits:  # e.g. JAX's Gumbel-max (JaxDraws)
            return draws.categorical(probs, logits=logits)
        return draws.categorical(probs)


# ------------------------------------------------------------------------------------------ acceptance (§8.2 f, g)
class EntropyBoundAcceptor:
    """Accept the lowest-entropy prefix under the bound, renoise the rest; keeps no state."""

    def begin_canvas(self, canvas: np.ndarray) -> None:
        pass

    def __call__(self, step: Any, input_canvas: np.ndarray, noise: np.ndarray,
                 bound: float) -> tuple[np.ndarray, np.ndarray]:
        accepted = entropy_bound_accept(step.entropies, bound)  # (f)
        return accepted, renoise(step.sampled, accepted, noise)  # (g)

    def revealed_all(self, batch_size: int) -> np.ndarray:
        """The entropy-bound sampler never ends a row by itself."""
        return np.zeros(batch_size, dtype=bool)


@dataclass(frozen=True)
class EntropyBound:
    name: ClassVar[str] = "entropy-bound"
    source: ClassVar[str] = ("transformers EntropyBoundSampler; JAX, llama.cpp, vLLM, mlx-vlm entropy-bound, "
                             "diffusers EntropyBoundScheduler")

    def start(self, max_steps: int, threshold: float) -> EntropyBoundAcceptor:
        return EntropyBoundAcceptor()


# ------------------------------------------------------------------------------------------ stopping (§8.2 i)
@dataclass(frozen=True)
class Strict:
    name: ClassVar[str] = "strict"
    source: ClassVar[str] = ("transformers StableAndConfidentStoppingCriteria, mlx-vlm, llama.cpp, diffusers: "
                             "mean H < γ")

    def __call__(self, mean: np.ndarray, threshold: np.float32) -> np.ndarray:
        return mean < threshold


@dataclass(frozen=True)
class ArgmaxHistory:
    """Stable = the draft equals each of the last s drafts (``sampling.StableAndConfident``)."""

    name: ClassVar[str] = "argmax-history"
    source: ClassVar[str] = "transformers: last s argmax drafts, filled with -1 (s = 0: always stable)"

    def make(self, stability_threshold: int, confidence_threshold: float, comparison: Any) -> Any:
        return StableAndConfident(stability_threshold, confidence_threshold, comparison)


# ------------------------------------------------------------------------------------------ commit (§8.2 steps 4-5)
@dataclass(frozen=True)
class CommitArgmax:
    """The argmax draft of the last executed step (frozen for stopped rows)."""

    name: ClassVar[str] = "argmax"
    source: ClassVar[str] = "transformers _denoising_step commits the argmax draft; llama.cpp, mlx-vlm, vLLM alike"

    def __call__(self, draft: np.ndarray, canvas: np.ndarray, stopped: np.ndarray) -> np.ndarray:
        return np.asarray(draft, dtype=np.int64)


@dataclass(frozen=True)
class TransformersEos:
    """EOS kept, every token after it (and every row ended before) padded when a pad id is set
    (``sampling.finalize_canvas``); the output is every committed canvas, uncut."""

    name: ClassVar[str] = "transformers"
    source: ClassVar[str] = "transformers _finalize_canvas: EOS kept, pad after it when pad_token_id is set"

    def finalize(self, tokens: np.ndarray, finished_before: np.ndarray, eos_token_ids, pad_token_id,
                 forced: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        return finalize_canvas(tokens, finished_before, eos_token_ids, pad_token_id, forced)

    def trim(self, new_tokens: list[int], eos_token_ids, max_new_tokens: int) -> list[int]:
        return [int(t) for t in new_tokens]


# ------------------------------------------------------------------------------------------ window (§7.3)
@dataclass(frozen=True)
class RetainedKeys:
    """Every key a sliding layer retains (the last W - 1), for every canvas query (``masks.canvas_window``)."""

    name: ClassVar[str] = "W-1"
    source: ClassVar[str] = "transformers DynamicSlidingWindowLayer keeps W-1 keys; mlx-vlm, llama.cpp alike"

    def keys(self, key_positions: np.ndarray, prompt_end: int, canvas_length: int, window: int) -> np.ndarray:
        return canvas_window(key_positions, prompt_end, canvas_length, window)

    def new_cache(self, model: Any, batch_size: int) -> Any:
        return model.new_cache(batch_size)


# ------------------------------------------------------------------------------------------ the set of stages
@dataclass(frozen=True)
class Semantics:
    """One implementation's stage objects. ``replace`` makes another; ``variants/`` registers the peers'
    stage choices under their names (``STAGES``), so that a name given as a string is looked up there."""

    name: str  # the name ``generate(semantics=...)`` and ``--semantics`` take
    commit: Any = CommitArgmax()  # what a finished canvas commits
    stop_comparison: Any = Strict()  # mean entropy < γ, or <= γ
    stop_history: Any = ArgmaxHistory()  # what "stable" compares
    canvas_window: Any = RetainedKeys()  # prompt keys a canvas query sees in a sliding layer
    temperature: Any = Float32Schedule()  # T_n of the schedule
    sc_temperature: Any = DivideSC()  # the next step's self-conditioning input
    eos: Any = TransformersEos()  # end-token handling
    sampler: Any = EntropyBound()  # the acceptance stage
    denoiser_draw: Any = CategoricalDraw()  # the token each position proposes
    threshold: float = 0.9  # confidence-threshold / block-refinement threshold (mlx-vlm 0.9, diffusers 0.95)
    note: str = ""  # one line: what this variant cannot reproduce

    def __post_init__(self) -> None:
        for field, choices in STAGES.items():
            value = getattr(self, field)
            if isinstance(value, str):
                if value not in choices:
                    raise ConfigError(f"semantics {self.name!r}: {field} must be one of {sorted(choices)}, got {value!r}")
                object.__setattr__(self, field, choices[value])
            elif getattr(value, "name", None) not in choices:
                raise ConfigError(f"semantics {self.name!r}: {field} must be one of {sorted(choices)}, got {value!r}")

    def replace(self, **changes: Any) -> "Semantics":
        """A copy with some stages changed (stage objects or their names), e.g.
        ``SEMANTICS["mlx-vlm"].replace(sampler="entropy-bound")``."""
        return dataclasses.replace(self, **changes)

    def switches(self) -> dict[str, str]:
        """{stage: choice name} for every stage (reports print this)."""
        return {field: getattr(self, field).name for field in STAGES}

    @property
    def runs_on_any_backend(self) -> bool:
        """True when every stage inside a denoising step is the spec's, so a model's own compiled step
        (``fast``, ``fast.gpu``) may compute it; any other runs on the reference's step."""
        return all(getattr(self, field) == getattr(TRANSFORMERS, field) for field in STEP_STAGES)


# stage field -> {choice name: stage object}; the spec's choices here, the peers' added by ``variants/``
STAGES: dict[str, dict[str, Any]] = {field.name: {field.default.name: field.default}
                                     for field in dataclasses.fields(Semantics) if hasattr(field.default, "source")}
STEP_STAGES = ("temperature", "sc_temperature", "sampler", "denoiser_draw", "canvas_window")  # inside a step
TRANSFORMERS = Semantics("transformers")
SEMANTICS: dict[str, Semantics] = {"transformers": TRANSFORMERS}  # every named semantics, by name


def register_semantics(*stages: tuple[str, Any], semantics: Mapping[str, Semantics] = {}) -> None:
    """Make other stage choices (``(field, stage object)`` pairs) and named semantics known by name."""
    for field, stage in stages:
        STAGES[field][stage.name] = stage
    SEMANTICS.update(semantics)


def get_semantics(semantics: "str | Semantics | None") -> Semantics:
    """A name from ``SEMANTICS`` (or a ``Semantics``; None is transformers) -> ``Semantics``.

    Raises ``ConfigError`` naming the known variants for an unknown name.
    """
    if semantics is None:
        return TRANSFORMERS
    if isinstance(semantics, Semantics):
        return semantics
    if isinstance(semantics, str) and semantics in SEMANTICS:
        return SEMANTICS[semantics]
    raise ConfigError(f"unknown semantics {semantics!r}; known: {sorted(SEMANTICS)}")
