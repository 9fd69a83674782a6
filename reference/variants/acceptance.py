"""Acceptance stages: which proposed tokens enter the next canvas, and what the others become.

The spec (``stages.EntropyBound``, transformers' ``EntropyBoundSampler``) accepts the lowest-entropy prefix under
the entropy bound and renoises the rest (``sampling.entropy_bound_accept``, ``sampling.renoise``). The
peers' other samplers keep a revealed/committed mask per canvas, so a stage makes a fresh per-run
``Acceptor`` (``stage.start(max_steps, threshold)``) with:

    begin_canvas(canvas)                 a canvas starts from ``canvas`` (B, C) int64
    __call__(step, input_canvas, noise, bound) -> (accepted (B, C) bool, next canvas (B, C) int64)
                                         ``step``: the backend's StepOutput (draft, sampled, entropies,
                                         confidence), ``input_canvas``: the canvas this step read
    revealed_all(B) -> (B,) bool         rows that the sampler itself ends (all positions revealed)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..stages import EntropyBound
from ..support.errors import ConfigError


# ------------------------------------------------------------------------------------------ transfer rules
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


# ------------------------------------------------------------------------------------------ acceptors
class ConfidenceThresholdAcceptor:
    """mlx-vlm's confidence-threshold sampler: revealed positions keep their token, the rest are noise."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.revealed: np.ndarray | None = None  # (B, C) bool
        self.tokens: np.ndarray | None = None  # (B, C) int64 tokens revealed so far

    def begin_canvas(self, canvas: np.ndarray) -> None:
        self.revealed = np.zeros(canvas.shape, dtype=bool)
        self.tokens = np.array(canvas, dtype=np.int64, copy=True)

    def __call__(self, step: Any, input_canvas: np.ndarray, noise: np.ndarray,
                 bound: float) -> tuple[np.ndarray, np.ndarray]:
        accepted = confidence_threshold_accept(step.confidence, self.revealed, self.threshold)
        self.tokens = np.where(accepted, step.sampled, self.tokens)
        self.revealed = self.revealed | accepted
        return accepted, np.where(self.revealed, self.tokens, noise).astype(np.int64)

    def revealed_all(self, batch_size: int) -> np.ndarray:
        return self.revealed.all(axis=-1)


class BlockRefinementAcceptor:
    """diffusers' BlockRefinementScheduler (uniform mode): committed positions keep the input's token."""

    def __init__(self, threshold: float, max_steps: int):
        self.threshold, self.max_steps = threshold, max_steps
        self.committed: np.ndarray | None = None  # (B, C) bool
        self.step_index = 0

    def begin_canvas(self, canvas: np.ndarray) -> None:
        self.committed = np.zeros(canvas.shape, dtype=bool)
        self.step_index = 0

    def __call__(self, step: Any, input_canvas: np.ndarray, noise: np.ndarray,
                 bound: float) -> tuple[np.ndarray, np.ndarray]:
        accepted = block_refinement_accept(step.confidence, self.committed, self.step_index, self.max_steps,
                                           self.threshold)
        self.step_index += 1
        kept = np.where(accepted, step.sampled, input_canvas)
        self.committed = self.committed | accepted
        return accepted, np.where(self.committed, kept, noise).astype(np.int64)

    def revealed_all(self, batch_size: int) -> np.ndarray:
        return np.zeros(batch_size, dtype=bool)


# ------------------------------------------------------------------------------------------ stages
@dataclass(frozen=True)
class ConfidenceThreshold:
    name: ClassVar[str] = "confidence-threshold"
    source: ClassVar[str] = "mlx-vlm confidence-threshold (its default): reveal p >= threshold, else the best"

    def start(self, max_steps: int, threshold: float) -> ConfidenceThresholdAcceptor:
        return ConfidenceThresholdAcceptor(threshold)


@dataclass(frozen=True)
class BlockRefinement:
    name: ClassVar[str] = "block-refinement"
    source: ClassVar[str] = ("diffusers BlockRefinementScheduler, uniform mode: cumulative quota + confidence; "
                             "it never applies the temperature schedule (drafts, entropies and SC use raw logits)")

    def start(self, max_steps: int, threshold: float) -> BlockRefinementAcceptor:
        return BlockRefinementAcceptor(threshold, max_steps)


@dataclass(frozen=True)
class AutoRegressiveEuler:
    name: ClassVar[str] = "auto-regressive-euler"
    source: ClassVar[str] = "mlx-vlm auto-regressive-euler (before #1347): accept with probability 1/n"

    def start(self, max_steps: int, threshold: float) -> Any:
        raise ConfigError("the auto-regressive-euler sampler needs per-position uniforms that no draw source "
                          "provides; use variants.acceptance.ar_euler_accept directly")


ENTROPY_BOUND, CONFIDENCE_THRESHOLD, BLOCK_REFINEMENT, AR_EULER = (EntropyBound(), ConfidenceThreshold(),
                                                                   BlockRefinement(), AutoRegressiveEuler())
SAMPLERS = {s.name: s for s in (ENTROPY_BOUND, CONFIDENCE_THRESHOLD, BLOCK_REFINEMENT, AR_EULER)}
