"""Elementwise and per-vector building blocks of DiffusionGemma, in float32 NumPy.

Each function is the NumPy statement of one upstream module of transformers 5.24.0
(``modeling_diffusion_gemma.py``); shapes use ``...`` for any leading axes.
"""

from __future__ import annotations

import math

import numpy as np

from .config import RopeParameters

_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x * (mean(x**2) + eps) ** -0.5``, then ``* weight`` if given.

    x: (..., D) float32. weight: (D,) float32 or None (the weightless norms: value norm, router input
    norm, self-conditioning post-norm). Returns (..., D) float32.

    Upstream: ``DiffusionGemmaRMSNorm``. The weight multiplies as stored (``x * w``, never
    ``x * (1 + w)`` as in Gemma 1-3), and the power ``-0.5`` is used rather than a reciprocal square root.
    """
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps)
    normed = x * np.power(mean_square, np.float32(-0.5))
    return normed * weight if weight is not None else normed


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3)))``.

    x: any shape, float32. Upstream: ``ACT2FN["gelu_pytorch_tanh"]``.
    """
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


def gated_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """``(gelu_tanh(x @ gate.T) * (x @ up.T)) @ down.T``, no biases.

    x: (..., H); gate, up: (I, H); down: (H, I). Returns (..., H). Upstream: ``DiffusionGemmaText4MLP``
    and the self-conditioning MLP.
    """
    return (gelu_tanh(x @ gate.T) * (x @ up.T)) @ down.T


def embed(token_ids: np.ndarray, table: np.ndarray, scale: float) -> np.ndarray:
    """Scaled embedding lookup ``table[ids] * scale``.

    token_ids: (...) int, each in [0, V). table: (V, H) float32. scale: float32(sqrt(H)) for a float32
    model (upstream multiplies by the scale cast to the weight dtype; a bf16 model would use 53.0 for
    H = 2816, see SPEC §10). Returns (..., H) float32. Upstream: ``DiffusionGemmaTextScaledWordEmbedding``.
    """
    return table[token_ids] * np.float32(scale)


def softcap(logits: np.ndarray, cap: float) -> np.ndarray:
    """Final logit soft-cap ``cap * tanh(logits / cap)`` in float32 (upstream ``final_logit_softcapping``)."""
    c = np.float32(cap)
    return c * np.tanh(logits / c)


def rope_inverse_frequencies(rope: RopeParameters, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``omega`` of one layer type, shape (head_dim // 2,) float32.

    * ``default``: ``omega_i = theta ** (-2i / head_dim)`` for every i.
    * ``proportional``: only the first ``R = int(partial_rotary_factor * head_dim // 2)`` frequencies
      rotate, with the exponent's denominator the *full* head dim; the remaining ``head_dim/2 - R``
      frequencies are 0 (cos = 1, sin = 0: those coordinates carry no position).

    Computed as upstream does, in float32: ``1 / theta ** (arange(0, 2R, 2) / head_dim)``.
    Upstream: ``compute_default_rope_parameters`` / ``_compute_proportional_rope_parameters``.
    """
    half = head_dim // 2
    if rope.rope_type == "proportional":
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
    else:
        rotated = half
    exponents = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(head_dim)
    omega = np.zeros(half, dtype=np.float32)
    omega[:rotated] = np.float32(1.0) / np.power(np.float32(rope.rope_theta), exponents)
    return omega


def rope_cos_sin(positions: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cos and sin tables for absolute ``positions``.

    positions: (B, S) int. omega: (d/2,) float32. Returns cos, sin: (B, S, d) float32, where the angle
    vector ``float32(p) * omega`` is repeated twice (the rotate-half layout).
    """
    angles = positions.astype(np.float32)[..., None] * omega  # (B, S, d/2)
    angles = np.concatenate([angles, angles], axis=-1)  # (B, S, d)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` by the position angles, rotate-half convention (pairs ``(j, j + d/2)``).

    x: (B, S, heads, d) float32. cos, sin: (B, S, d). Returns the same shape:
    ``y[:d/2] = x[:d/2] cos - x[d/2:] sin`` and ``y[d/2:] = x[d/2:] cos + x[:d/2] sin``.
    Upstream: ``apply_rotary_pos_emb`` with ``rotate_half`` (not the interleaved-pairs convention).
    """
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
