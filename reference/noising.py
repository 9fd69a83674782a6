"""The block-diffusion training objective: forward (noising) process and loss, in NumPy.

No released ``transformers`` forward computes a DiffusionGemma loss; this module writes the project's
canonical objective down as small pure functions (TRAINING.md §9). It follows TRL's example script
(``sft_diffusion_gemma.py``) wherever the upstream recipes differ, and says so function by function:

* one canvas of C response tokens is chosen per example, uniformly (``select_canvas``);
* its target is those response tokens, with ``<eos>`` filling the tail of the last canvas
  (``canvas_targets``); the decoder sees the clean L = P + kC tokens before it
  (``masks.training_decoder_visibility``);
* one time t = eps + (1 - eps) u per example (``time_from_uniform``, eps = 1e-3, TRL/NeMo);
* every canvas position is independently replaced by a uniformly drawn id with probability t, with no
  mask token (``corrupt``);
* half of the examples get self-conditioning (``self_conditioning_coin``);
* the diffusion loss is the plain mean cross-entropy over every canvas position (``diffusion_loss``),
  plus the encoder's next-token co-loss (``ar_loss``), summed with weight 1 (``total_loss``).

Random draws are explicit inputs (``NoiseDraws``). Reproducing the draws of a seeded CPU
``torch.Generator`` without torch (so that a NumPy run and a PyTorch training step consume identical
randomness, TRAINING.md §8.2) is an oracle's concern, not the objective's: ``diffusiongemma.torch_replay``.

Conventions: batch size B, canvas length C, vocabulary V, encoder sequence length S. Token arrays are
int64, uniforms float32 in [0, 1), logits float32 (soft-capped, as the HF forward returns them).
Every function raises ``InputError`` (a ``ValueError``) naming the offending value on bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .support.errors import InputError
from .support.noising_checks import (check_int_vector, check_loss_inputs, check_noise_draws,
                                     check_num_canvases, check_select_canvas, check_canvas_targets_1,
                                     check_canvas_targets_2, check_encoder_input_1, check_encoder_input_2,
                                     check_time_from_uniform, check_corrupt, check_self_conditioning_coin,
                                     check_noise_batch, check_diffusion_loss, check_ar_loss_1, check_ar_loss_2)

__all__ = [
    "EPS", "P_SELF_COND", "NoiseDraws", "NoisedBatch",
    "num_canvases", "select_canvas", "canvas_targets", "time_from_uniform", "corrupt",
    "self_conditioning_coin", "encoder_input", "noise_batch",
    "cross_entropy", "diffusion_loss", "ar_loss", "total_loss",
]

EPS = 1e-3  # lower end of t (TRL and NeMo; JAX uses U[1e-4, 1 - 1e-4))
P_SELF_COND = 0.5  # per-example self-conditioning probability (all three recipes)


# ----------------------------------------------------------------------------------------------------
# random draws


@dataclass(frozen=True)
class NoiseDraws:
    """The five random arrays of one training step, in the order TRL draws them (TRAINING.md §8.1).

    u_blk: float32 (B,)    uniform for the canvas choice
    u_t:   float32 (B, 1)  uniform for the time t
    u_cor: float32 (B, C)  per-position uniforms; position j is corrupted iff u_cor[j] < t
    r:     int64 (B, C)    replacement ids in [0, V)
    u_sc:  float32 (B,)    uniform for the self-conditioning coin
    """

    u_blk: np.ndarray
    u_t: np.ndarray
    u_cor: np.ndarray
    r: np.ndarray
    u_sc: np.ndarray

    def __post_init__(self):
        check_noise_draws(self)  # shapes (B,), (B, 1), (B, C) and uniforms in [0, 1)


# ----------------------------------------------------------------------------------------------------
# layout: which canvas, its targets, what the decoder sees


def num_canvases(resp_len, canvas: int) -> np.ndarray:
    """Number of canvases n = ceil(R / C) per row.

    resp_len: int (B,) response lengths R >= 1; canvas: C >= 1. Returns int64 (B,).
    Raises InputError for R < 1 (an empty response has no canvas to score) or C < 1.
    """
    R = check_int_vector("resp_len", resp_len)
    check_num_canvases(canvas, R)
    return (R - 1) // canvas + 1


def select_canvas(u_blk, n) -> np.ndarray:
    """Canvas index k = trunc(float32(u * n)), clamped to n - 1 (TRL and NeMo's ``floor(u * n)``).

    u_blk: float32 (B,) in [0, 1); n: int (B,) >= 1. Returns int64 (B,), uniform over {0..n-1} for
    uniform u. The product is rounded to float32 first, exactly as torch computes it; the clamp is only
    a guard (float32 u <= 1 - 2**-24 never rounds up to n for the n used in practice).
    """
    n = check_int_vector("n", n)
    u = np.asarray(u_blk, dtype=np.float32)
    check_select_canvas(u, n)
    k = (u * n.astype(np.float32)).astype(np.float32).astype(np.int64)  # float32 product, truncated
    return np.minimum(k, n - 1)


def canvas_targets(x, prompt_len, resp_len, k, canvas: int, eos_id: int = 1) -> np.ndarray:
    """Targets y (B, C) of the selected canvases, with the EOS fill.

    x: int (B, S) rows [prompt (P) | response (R) | padding]; prompt_len, resp_len, k: int (B,).
    y[b, j] = x[b, P_b + k_b*C + j] while k_b*C + j < R_b, else ``eos_id`` (only the last canvas of a
    response can be partial, and only it gets a fill; all three recipes supervise the fill).
    Raises InputError if a row is shorter than P + R or k is out of range.
    """
    x = np.asarray(x)
    check_canvas_targets_1(x)
    B, S = x.shape
    P = check_int_vector("prompt_len", prompt_len, B)
    R = check_int_vector("resp_len", resp_len, B)
    k = check_int_vector("k", k, B)
    n = num_canvases(R, canvas)
    check_canvas_targets_2(P, S, R, k, n)
    off = k[:, None] * canvas + np.arange(canvas)[None, :]  # (B, C) offsets into the response
    inside = off < R[:, None]
    col = np.where(inside, P[:, None] + off, 0)  # (B, C) columns of x (0 where filled)
    return np.where(inside, np.take_along_axis(x, col, axis=1), eos_id).astype(np.int64)


def encoder_input(x, prompt_len, resp_len, canvas: int, eos_id: int = 1, append_fill: bool = False):
    """The clean encoder sequence and its valid mask.

    Default (TRL): x itself, valid on the first P + R positions. With ``append_fill`` (JAX/NeMo) the
    response is followed by the EOS fill up to a whole number of canvases, so the AR loss also scores
    the fill. Returns (tokens int64 (B, S'), valid bool (B, S')) with S' = S (default) or
    max(P + nC) when that is longer.
    """
    x = np.asarray(x)
    check_encoder_input_1(x)
    B, S = x.shape
    P = check_int_vector("prompt_len", prompt_len, B)
    R = check_int_vector("resp_len", resp_len, B)
    check_encoder_input_2(S, P, R)
    end = P + R
    if append_fill:
        end = P + num_canvases(R, canvas) * canvas
    width = max(S, int(end.max()))
    i = np.arange(width)[None, :]
    tokens = np.zeros((B, width), np.int64)
    tokens[:, :S] = x
    fill = (i >= (P + R)[:, None]) & (i < end[:, None])
    tokens = np.where(fill, eos_id, tokens)
    return tokens, i < end[:, None]


# ----------------------------------------------------------------------------------------------------
# the forward process


def time_from_uniform(u_t, eps: float = EPS) -> np.ndarray:
    """t = eps + (1 - eps) * u in float32 (multiply, then add), so t in [eps, 1) (TRL and NeMo).

    u_t: float32 (B, 1) in [0, 1). Returns float32 (B, 1). JAX instead draws t ~ U[1e-4, 1 - 1e-4).
    """
    check_time_from_uniform(eps)
    u = np.asarray(u_t, dtype=np.float32)
    return (np.float32(eps) + np.float32(1.0 - eps) * u).astype(np.float32)


def corrupt(y, t, u_cor, r):
    """Uniform-state corruption of a canvas (no mask token; all three recipes).

    y: int (B, C) clean targets; t: float32 (B, 1) corruption rate per example; u_cor: float32 (B, C);
    r: int (B, C) replacement ids. Position j is corrupted iff u_cor[j] < t (TRL/NeMo's direction of the
    comparison; JAX draws keep = u < 1 - t, the same law from a different map) and then holds r[j].
    r may equal y[j]: the position is still flagged. Returns (x_noisy int64 (B, C), corrupted bool (B, C)).
    """
    y = np.asarray(y)
    u = np.asarray(u_cor, dtype=np.float32)
    r = np.asarray(r)
    t = np.asarray(t, dtype=np.float32)
    check_corrupt(y, u, r, t)
    corrupted = u < t
    return np.where(corrupted, r, y).astype(np.int64), corrupted


def self_conditioning_coin(u_sc, p: float = P_SELF_COND) -> np.ndarray:
    """Per-example self-conditioning flag s = u_sc < p; float32 (B,) -> bool (B,).

    Examples with s = False get a zero self-conditioning embedding in the second pass (HF's
    ``self_conditioning_mask``, as NeMo and TRL); JAX feeds zero logits instead (TRAINING.md §5).
    """
    check_self_conditioning_coin(p)
    return np.asarray(u_sc, dtype=np.float32) < np.float32(p)


@dataclass(frozen=True)
class NoisedBatch:
    """Everything the decoder and the loss need for one batch (shapes for batch B, canvas C).

    k: int64 (B,) selected canvas; context_len: int64 (B,) L = P + kC; positions: int64 (B, C) absolute
    canvas positions L + j; targets: int64 (B, C); t: float32 (B, 1); corrupted: bool (B, C);
    noisy: int64 (B, C) decoder input; self_cond: bool (B,).
    """

    k: np.ndarray
    context_len: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    t: np.ndarray
    corrupted: np.ndarray
    noisy: np.ndarray
    self_cond: np.ndarray


def noise_batch(x, prompt_len, resp_len, draws: NoiseDraws, vocab: int, eos_id: int = 1,
                eps: float = EPS, p_self_cond: float = P_SELF_COND, t=None) -> NoisedBatch:
    """Apply the whole forward process to a batch (TRAINING.md §9 steps 1-3).

    x: int (B, S) rows [prompt | response | pad]; prompt_len, resp_len: int (B,); draws: ``NoiseDraws``
    with C = draws.u_cor.shape[1]; vocab: V (replacement ids must be < V). ``t`` (float32 (B, 1)), when
    given, replaces ``time_from_uniform(draws.u_t)`` (used by the worked example). Returns ``NoisedBatch``.
    """
    canvas = draws.u_cor.shape[1]
    check_noise_batch(vocab, draws)
    k = select_canvas(draws.u_blk, num_canvases(resp_len, canvas))
    y = canvas_targets(x, prompt_len, resp_len, k, canvas, eos_id)
    tt = time_from_uniform(draws.u_t, eps) if t is None else np.asarray(t, dtype=np.float32)
    noisy, corrupted = corrupt(y, tt, draws.u_cor, draws.r)
    L = check_int_vector("prompt_len", prompt_len) + k * canvas
    return NoisedBatch(k=k, context_len=L, positions=L[:, None] + np.arange(canvas)[None, :],
                       targets=y, t=tt, corrupted=corrupted, noisy=noisy,
                       self_cond=self_conditioning_coin(draws.u_sc, p_self_cond))


# ----------------------------------------------------------------------------------------------------
# the loss


def cross_entropy(logits, targets) -> np.ndarray:
    """Per-position CE = logsumexp(z) - z[target], computed in float64.

    logits: float (..., V), finite; targets: int (...) in [0, V). Returns float64 (...).
    """
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(targets)
    check_loss_inputs(z, y)  # one finite logit row per target, targets in [0, V)
    m = z.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))[..., 0]
    return lse - np.take_along_axis(z, y[..., None], axis=-1)[..., 0]


def diffusion_loss(logits, targets) -> float:
    """Denoising loss: mean CE over all B*C canvas positions (corrupted or not, EOS fill included).

    logits: float32 (B, C, V) soft-capped decoder logits of the second (self-conditioned) pass;
    targets: int (B, C). No time weighting (JAX ``NoWeightDiscreteLoss``, NeMo, TRL). Per-example mean
    then batch mean (JAX) equals this, since every canvas has exactly C scored positions.
    """
    ce = cross_entropy(logits, targets)
    check_diffusion_loss(ce, logits)
    return float(ce.mean())


def ar_loss(logits, tokens, valid, reduction: str = "token") -> float:
    """Encoder next-token co-loss over the clean sequence, prompt included (no SFT label masking).

    logits: float32 (B, S, V) soft-capped encoder logits; tokens: int (B, S); valid: (B, S) keep-mask.
    Scored pairs: (i, i+1) with both valid, target tokens[i+1]. ``reduction``: "token" = sum over pairs
    / number of pairs (TRL, NeMo), "example" = per-row mean, then mean over all B rows, a row without a
    pair counting 0 (JAX). Raises InputError for another reduction or a batch without any pair.
    """
    v = np.asarray(valid) != 0
    tok = np.asarray(tokens)
    check_ar_loss_1(v, tok)
    pair = v[:, :-1] & v[:, 1:]  # (B, S-1)
    check_ar_loss_2(pair)
    ce = np.where(pair, cross_entropy(np.asarray(logits)[:, :-1], tok[:, 1:]), 0.0)
    if reduction == "token":
        return float(ce.sum() / pair.sum())
    if reduction == "example":
        return float((ce.sum(1) / np.maximum(pair.sum(1), 1)).mean())
    raise InputError(f"reduction must be 'token' or 'example', got {reduction!r}")


def total_loss(diff: float, ar: float, w_dec: float = 1.0, w_enc: float = 1.0) -> float:
    """L = w_dec * L_diff + w_enc * L_AR (both weights 1 in every official recipe)."""
    return float(w_dec * diff + w_enc * ar)
