"""Stopping stages: when a row stops denoising its canvas early ("stable and confident").

A stopping stage combines two choices: the threshold test on the mean entropy (``STRICT`` mean < γ, the
spec, or ``NON_STRICT`` <= γ) and what "stable" compares (``ARGMAX_HISTORY``, the spec's last-s drafts;
diffusers' min-1 history; JAX's input canvas; llama.cpp's held counter). ``stage.make(s, γ, comparison)``
builds the per-run stopper: ``reset()`` at each canvas, ``__call__(draft, entropies, input_canvas) -> (B,)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..stages import ArgmaxHistory, Strict
from ..support.errors import ConfigError


# ------------------------------------------------------------------------------------------ the test
@dataclass(frozen=True)
class NonStrict:
    name: ClassVar[str] = "non-strict"
    source: ClassVar[str] = "JAX EntropyEarlyStop: mean H <= γ"

    def __call__(self, mean: np.ndarray, threshold: np.float32) -> np.ndarray:
        return mean <= threshold


def _confident(entropies: np.ndarray, threshold: np.float32, comparison: Any) -> np.ndarray:
    return comparison(np.mean(np.asarray(entropies, dtype=np.float32), axis=-1, dtype=np.float32), threshold)


# ------------------------------------------------------------------------------------------ stoppers
class ArgmaxHistoryStop:
    """Stable = the draft equals each of the last s drafts (filled with -1 per canvas); ``min_history=1`` is
    diffusers' ``max(s, 1)`` history (s = 0 acts as s = 1). Upstream: diffusers' pipeline loop."""

    def __init__(self, stability_threshold: int, confidence_threshold: float, comparison: Any,
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
    into this step (at step 0 the random initial canvas). Only the equivalent of stability 1 exists; a
    caller's stability_threshold is ignored."""

    def __init__(self, confidence_threshold: float, comparison: Any):
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

    def __init__(self, stability_threshold: int, confidence_threshold: float, comparison: Any):
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


# ------------------------------------------------------------------------------------------ stages
@dataclass(frozen=True)
class ArgmaxHistoryMin1:
    name: ClassVar[str] = "argmax-history-min1"
    source: ClassVar[str] = "diffusers: history of max(s, 1) argmaxes, so s = 0 behaves as s = 1"

    def make(self, stability_threshold: int, confidence_threshold: float, comparison: Any) -> Any:
        return ArgmaxHistoryStop(stability_threshold, confidence_threshold, comparison, min_history=1)


@dataclass(frozen=True)
class InputCanvas:
    name: ClassVar[str] = "input-canvas"
    source: ClassVar[str] = "JAX TokenStabilityEarlyStop: argmax equals the canvas fed into this step"

    def make(self, stability_threshold: int, confidence_threshold: float, comparison: Any) -> Any:
        return InputCanvasStop(confidence_threshold, comparison)


@dataclass(frozen=True)
class HeldCounter:
    name: ClassVar[str] = "held-counter"
    source: ClassVar[str] = "llama.cpp: held = held + 1 if argmax repeats else 0; stable when held >= s"

    def make(self, stability_threshold: int, confidence_threshold: float, comparison: Any) -> Any:
        return HeldCounterStop(stability_threshold, confidence_threshold, comparison)


STRICT, NON_STRICT = Strict(), NonStrict()
ARGMAX_HISTORY, ARGMAX_HISTORY_MIN1, INPUT_CANVAS, HELD_COUNTER = (ArgmaxHistory(), ArgmaxHistoryMin1(),
                                                                   InputCanvas(), HeldCounter())
COMPARISONS = {s.name: s for s in (STRICT, NON_STRICT)}
HISTORIES = {s.name: s for s in (ARGMAX_HISTORY, ARGMAX_HISTORY_MIN1, INPUT_CANVAS, HELD_COUNTER)}
