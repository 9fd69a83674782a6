"""Elementwise and per-vector building blocks of DiffusionGemma, in float32 NumPy.

Each function is the NumPy statement of one upstream module of transformers 5.24.0
(``modeling_diffusion_gemma.py``); shapes use ``...`` for any leading axes.

``dtype``: the dtype the model runs in, as transformers' ``from_pretrained(dtype=...)`` sets it
(``compute_dtype``). ``FLOAT32`` (the default) computes exactly as before: every ``round_to`` is the identity.
``BFLOAT16`` is upstream's bfloat16 run (SPEC §10): arrays stay float32 (so products accumulate in
float32, as torch's bfloat16 kernels do on the CPU) and ``round_to`` rounds a result to bfloat16 exactly
where upstream stores a bfloat16 tensor.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .config import RopeParameters
from .support.errors import ConfigError

_GELU_C = np.float32(math.sqrt(2.0 / math.pi))

FLOAT32 = np.dtype(np.float32)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": FLOAT32, "bfloat16": BFLOAT16}


def compute_dtype(dtype) -> np.dtype:
    """The model dtype named by ``dtype``: "float32" / "bfloat16" (or those NumPy dtypes); None is float32.

    Raises ``ConfigError`` naming the value for anything else (float16 runs are not defined here).
    """
    if dtype is None:
        return FLOAT32
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved in (FLOAT32, BFLOAT16):
        return resolved
    raise ConfigError(f"dtype {dtype!r} is not supported; the reference runs in {' or '.join(DTYPES)}")


def round_to(x, dtype: np.dtype | None):
    """``x`` rounded to ``dtype`` (nearest, ties to even: torch's ``.to(torch.bfloat16)``) and widened back
    to float32, which holds every bfloat16 value exactly.

    The identity (``x`` itself, untouched) unless ``dtype`` is ``BFLOAT16``: a float32 run never rounds
    twice, and a float64 twin (``dtype`` float64) computes without rounding. Place it exactly where
    upstream's bfloat16 run stores a bfloat16 tensor.
    """
    if dtype != BFLOAT16:
        return x
    return np.asarray(x, dtype=np.float32).astype(BFLOAT16).astype(np.float32)


def linear(x: np.ndarray, weight: np.ndarray, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """``x @ weight.T`` (no bias), the result rounded to ``dtype``.

    x: (..., in); weight: (out, in). Returns (..., out). Upstream: ``nn.Linear``; in bfloat16 torch's CPU
    kernel accumulates in float32 and rounds the output once.
    """
    return round_to(x @ weight.T, dtype)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """RMSNorm over the last axis: ``x * (mean(x**2) + eps) ** -0.5``, then ``* weight`` if given.

    x: (..., D) float32. weight: (D,) float32 or None (the weightless norms: value norm, router input
    norm, self-conditioning post-norm). Returns (..., D) float32, rounded to ``dtype``.

    Upstream: ``DiffusionGemmaRMSNorm``. The weight multiplies as stored (``x * w``, never
    ``x * (1 + w)`` as in Gemma 1-3), and the power ``-0.5`` is used rather than a reciprocal square root.
    It computes in float32 and returns the input's dtype (``normed_output.type_as(hidden_states)``).
    """
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps)
    normed = x * np.power(mean_square, np.float32(-0.5))
    return round_to(normed * weight if weight is not None else normed, dtype)


def gelu_tanh(x: np.ndarray, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """GELU, tanh approximation: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x**3)))``.

    x: any shape, float32. Returns the same shape, rounded to ``dtype`` (torch computes a bfloat16 GELU in
    float32 and rounds once). Upstream: ``ACT2FN["gelu_pytorch_tanh"]``.
    """
    return round_to(np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x))),
                    dtype)


def gated_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """``(gelu_tanh(x @ gate.T) * (x @ up.T)) @ down.T``, no biases.

    x: (..., H); gate, up: (I, H); down: (H, I). Returns (..., H). In bfloat16 each of the five results
    (two projections, GELU, product, down projection) is rounded. Upstream: ``DiffusionGemmaText4MLP``
    and the self-conditioning MLP.
    """
    product = round_to(gelu_tanh(linear(x, gate, dtype), dtype) * linear(x, up, dtype), dtype)
    return linear(product, down, dtype)


def embed(token_ids: np.ndarray, table: np.ndarray, scale: float, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """Scaled embedding lookup ``table[ids] * scale``.

    token_ids: (...) int, each in [0, V). table: (V, H) float32. scale: float32(sqrt(H)). Upstream casts
    the scale to the weight dtype before multiplying (``self.embed_scale.to(self.weight.dtype)``): 53.065998
    in float32, 53.0 in bfloat16 for H = 2816 (SPEC §10 B1), and rounds the product. Returns (..., H)
    float32. Upstream: ``DiffusionGemmaTextScaledWordEmbedding``.
    """
    return round_to(table[token_ids] * round_to(np.float32(scale), dtype), dtype)


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


def rope_cos_sin(positions: np.ndarray, omega: np.ndarray, dtype: np.dtype = FLOAT32) -> tuple[np.ndarray, np.ndarray]:
    """Cos and sin tables for absolute ``positions``.

    positions: (B, S) int. omega: (d/2,) float32. Returns cos, sin: (B, S, d) float32, where the angle
    vector ``float32(p) * omega`` is repeated twice (the rotate-half layout). The angles and their cos
    and sin are float32; the tables are then rounded to ``dtype`` (upstream's rotary embedding returns
    ``cos.to(dtype=x.dtype)``).
    """
    angles = positions.astype(np.float32)[..., None] * omega  # (B, S, d/2)
    angles = np.concatenate([angles, angles], axis=-1)  # (B, S, d)
    return round_to(np.cos(angles), dtype), round_to(np.sin(angles), dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """Rotate ``x`` by the position angles, rotate-half convention (pairs ``(j, j + d/2)``).

    x: (B, S, heads, d) float32. cos, sin: (B, S, d). Returns the same shape:
    ``y[:d/2] = x[:d/2] cos - x[d/2:] sin`` and ``y[d/2:] = x[d/2:] cos + x[:d/2] sin``.
    Upstream: ``apply_rotary_pos_emb`` with ``rotate_half`` (not the interleaved-pairs convention): in
    bfloat16 its two products and their sum are three rounded tensor ops.
    """
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return round_to(round_to(x * cos[:, :, None, :], dtype) + round_to(rotated * sin[:, :, None, :], dtype), dtype)
