"""Temperature stages: how T_n of the linear schedule is rounded, and what the next step's
self-conditioning input is made of.

Every stage is a small object; ``Semantics`` holds one of each kind. The spec's own choices
(transformers 5.24.0), ``stages.Float32Schedule`` and ``stages.DivideSC``, are included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

from ..sampling import scale_logits, temperature as spec_temperature
from ..stages import DivideSC, Float32Schedule
from .jax_draws import jax_temperature


# ------------------------------------------------------------------------------------------ T_n
@dataclass(frozen=True)
class DoubleSchedule:
    """T_n as Python floats, ``t_min + (t_max - t_min) * (n / N)``, rounded once to float32 where it meets
    the float32 logits."""

    name: ClassVar[str] = "double"
    source: ClassVar[str] = ("mlx-vlm _diffusion_linear_temperature, diffusers EntropyBoundScheduler, vLLM, "
                             "SGLang: Python float, rounded to float32 when it meets the logits")

    def __call__(self, step: int, max_steps: int, t_min: float, t_max: float) -> np.float32:
        spec_temperature(step, max_steps, t_min, t_max)  # the same range check
        return np.float32(t_min + (t_max - t_min) * (step / max_steps))

    def scale(self, logits: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        return scale_logits(logits, temp)  # a division, as the spec


@dataclass(frozen=True)
class CFloatSchedule:
    """T_n in C float arithmetic in llama.cpp's order, ``t_min + (t_max - t_min) * ((float) n / (float) N)``:
    the step fraction is rounded first (it differs from ``((t_max - t_min) * n) / N`` in the last bit for 151
    of the 2080 pairs n <= N <= 64 at t = [0.4, 0.8])."""

    name: ClassVar[str] = "c-float"
    source: ClassVar[str] = ("llama.cpp diffusion_generate_entropy_bound: t_min + (t_max - t_min) * ((float) cur_step "
                             "/ (float) S) in float")

    def __call__(self, step: int, max_steps: int, t_min: float, t_max: float) -> np.float32:
        spec_temperature(step, max_steps, t_min, t_max)
        lo, hi = np.float32(t_min), np.float32(t_max)
        fraction = np.float32(np.float32(step) / np.float32(max_steps))
        return np.float32(lo + np.float32(np.float32(hi - lo) * fraction))

    def scale(self, logits: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        """How T_n meets the logits in llama.cpp: ``row[v] * temp_inv`` with ``temp_inv = 1.0f / t`` (argmax,
        entropy and the categorical draw all read this product), not ``z / T``."""
        if temp is None:
            return np.array(logits, dtype=np.float32, copy=True)
        with np.errstate(over="ignore"):
            return np.asarray(logits, dtype=np.float32) * np.float32(np.float32(1.0) / np.float32(temp))


# ------------------------------------------------------------------------------------------ SC input
@dataclass(frozen=True)
class MultiplyInverseSC:
    """z * float32(1 / T) in float (llama.cpp's softmax(z * temp_inv))."""

    name: ClassVar[str] = "multiply-inverse"
    source: ClassVar[str] = "llama.cpp: softmax(z * temp_inv) with temp_inv = 1 / T in float"
    embedding: ClassVar[Any] = None  # the soft embedding as computed

    def __call__(self, raw: np.ndarray, processed: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        if temp is None:
            return processed
        with np.errstate(over="ignore"):
            return np.asarray(raw, dtype=np.float32) * np.float32(np.float32(1.0) / np.float32(temp))


@dataclass(frozen=True)
class RawSC:
    """The raw logits z (diffusers' BlockRefinementScheduler passes the unscaled logits on)."""

    name: ClassVar[str] = "raw"
    source: ClassVar[str] = "diffusers BlockRefinementScheduler: pred_logits are the raw logits z"
    embedding: ClassVar[Any] = None  # the soft embedding as computed

    def __call__(self, raw: np.ndarray, processed: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        return np.array(raw, dtype=np.float32, copy=True)


@dataclass(frozen=True)
class XlaSchedule:
    """T_n as JAX's compiled shaper computes it, and the logits multiplied by float32(1 / T_n), not divided
    (``jax_draws.jax_temperature``: XLA turns a division by a broadcast value into a multiplication by its
    reciprocal and fuses the multiply-add of the schedule). ``scale`` is how T_n meets the logits."""

    name: ClassVar[str] = "xla"
    source: ClassVar[str] = ("JAX AnnealingTemperatureShaper as XLA compiles it: p = 1 - i * (1/N), "
                             "T = fma(1 - (1 - p), t_max - t_min, t_min), logits * (1/T); read from its output")

    def __call__(self, step: int, max_steps: int, t_min: float, t_max: float) -> np.float32:
        spec_temperature(step, max_steps, t_min, t_max)  # the same range check
        return jax_temperature(max_steps - step, max_steps, t_min, t_max)[0]

    def scale(self, logits: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        if temp is None:
            return np.array(logits, dtype=np.float32, copy=True)
        with np.errstate(over="ignore"):
            return np.asarray(logits, dtype=np.float32) * np.float32(np.float32(1.0) / np.float32(temp))


@dataclass(frozen=True)
class Bfloat16EmbeddingSC(DivideSC):
    """The processed logits, as the spec; the soft embedding made of them is rounded to bfloat16 before the
    self-conditioning MLP (JAX carries it in a bfloat16 array even with float32 parameters).
    ``embedding`` is applied by the model (``Model.denoise(sc_embedding=)``)."""

    name: ClassVar[str] = "bfloat16-embedding"
    source: ClassVar[str] = ("JAX sample_next_canvas: sc_embeddings carried as bfloat16 "
                             "(out.sc_embeddings.astype(carry dtype)), then cast back to float32")

    def embedding(self, u: np.ndarray) -> np.ndarray:
        return np.asarray(u, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


FLOAT32_SCHEDULE, DOUBLE_SCHEDULE, C_FLOAT_SCHEDULE, XLA_SCHEDULE = (Float32Schedule(), DoubleSchedule(),
                                                                     CFloatSchedule(), XlaSchedule())
DIVIDE, MULTIPLY_INVERSE, RAW, BFLOAT16_EMBEDDING = DivideSC(), MultiplyInverseSC(), RawSC(), Bfloat16EmbeddingSC()
TEMPERATURES = {s.name: s for s in (FLOAT32_SCHEDULE, DOUBLE_SCHEDULE, C_FLOAT_SCHEDULE, XLA_SCHEDULE)}
SC_INPUTS = {s.name: s for s in (DIVIDE, MULTIPLY_INVERSE, RAW, BFLOAT16_EMBEDDING)}


@dataclass(frozen=True)
class NoSchedule:
    """No temperature: the logits are used as they are (diffusers' BlockRefinementScheduler never applies
    the schedule; its drafts, entropies and self-conditioning see the raw logits)."""

    name: ClassVar[str] = "none"
    source: ClassVar[str] = "diffusers BlockRefinementScheduler: the temperature schedule is never applied"

    def __call__(self, step: int, max_steps: int, t_min: float, t_max: float) -> None:
        return None

    def scale(self, logits: np.ndarray, temp: np.float32 | None) -> np.ndarray:
        return scale_logits(logits, temp)  # a division, as the spec


NO_SCHEDULE = NoSchedule()
TEMPERATURES[NO_SCHEDULE.name] = NO_SCHEDULE
