"""Attention visibility as pure functions of positions, window and padding.

A visibility matrix ``M[b, q, t]`` is True when query ``q`` of row ``b`` may attend to key ``t``.
Positions are absolute token indices (left padding counts: a left-padded row's first real token sits at
position = number of pads, exactly as upstream, which never remaps positions).
"""

from __future__ import annotations

import numpy as np

from .support.errors import InputError


def encoder_visibility(query_positions: np.ndarray, key_positions: np.ndarray, key_is_real: np.ndarray,
                       sliding_window: int | None) -> np.ndarray:
    """Causal (optionally sliding-window) visibility of the encoder.

    query_positions: (S,) int, absolute positions of the new tokens.
    key_positions: (T,) int, absolute positions of the keys (retained cache entries, then the new tokens).
    key_is_real: (B, T) bool, False for padding keys.
    sliding_window: W for sliding layers (key k visible from q iff ``q - W < k <= q``: W keys including the
        query itself), None for full layers (``k <= q``).
    Returns (B, S, T) bool.

    Upstream: ``create_causal_mask`` / ``create_sliding_window_causal_mask`` over a ``DynamicCache``
    (SPEC §6 step 2, trap T5).
    """
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = k <= q
    if sliding_window is not None:
        visible &= k > q - sliding_window
    return visible[None, :, :] & key_is_real[:, None, :]


def decoder_visibility(cache_key_is_real: np.ndarray, canvas_length: int,
                       window: np.ndarray | None = None) -> np.ndarray:
    """Bidirectional visibility of the canvas over ``[retained cache ++ canvas]``.

    cache_key_is_real: (B, T_cache) bool, False for padded cache entries. window: None (a full layer) or
    (C, T_cache) bool, the retained keys each canvas query sees in a sliding layer (``canvas_window``), or
    (C, T_cache + C) for a peer whose window also limits the canvas keys.
    Returns (B, 1, T_cache + canvas_length) bool without a window, else (B, C, T_cache + C): every real
    cached key the window shows and every canvas key is visible. There is no causal mask; for the spec's
    window (all True) the sliding window acts only through which entries the cache retains (``cache.py``).

    Upstream: ``create_diffusion_decoder_attention_mask`` with a ``DynamicCache`` (SPEC §7.3, trap T6).
    """
    batch = cache_key_is_real.shape[0]
    canvas = np.ones((batch, canvas_length), dtype=bool)
    visible = np.concatenate([cache_key_is_real, canvas], axis=1)[:, None, :]  # (B, 1, T + C)
    if window is None:
        return visible
    if window.shape[-1] == visible.shape[-1]:  # the window covers the canvas keys too (JAX, variants/window.py)
        return visible & window[None]
    return visible & np.concatenate([window, np.ones((canvas_length, canvas_length), dtype=bool)], axis=1)[None]


def canvas_window(key_positions: np.ndarray, prompt_end: int, canvas_length: int, sliding_window: int) -> np.ndarray:
    """Which keys a sliding layer's cache retains that each canvas query sees: all of them.

    key_positions: (T,) absolute positions of the retained keys (the last W - 1 before the canvas, trap T5);
    prompt_end: L, the first canvas position. Returns (C, T) bool, all True: the window acts only through
    the entries the cache keeps, the same for every canvas query (SPEC §7.3). Other implementations narrow
    this per query (``variants/window.py``).
    Upstream: ``DynamicSlidingWindowLayer`` keeps W - 1 keys; ``create_diffusion_decoder_attention_mask``.
    """
    return np.ones((canvas_length, np.shape(key_positions)[0]), dtype=bool)


def cache_retains(key_positions: np.ndarray, context_length: np.ndarray, sliding_window: int | None) -> np.ndarray:
    """Which of the first ``context_length`` positions a layer's KV cache still holds when a canvas starts.

    key_positions: (S,) int; context_length: (B,) int L (tokens encoded before the canvas);
    sliding_window: W for a sliding layer (it keeps the last W - 1 positions, trap T5), None for a full
    layer (it keeps all L). Returns (B, S) bool.
    """
    k, L = np.asarray(key_positions)[None, :], np.asarray(context_length)[:, None]
    kept = k < L
    if sliding_window is not None:
        kept &= k >= L - (sliding_window - 1)
    return kept


def training_decoder_visibility(context_length: np.ndarray, key_is_real: np.ndarray, canvas_length: int,
                                sliding_window: int) -> dict[str, np.ndarray]:
    """The decoder's visibility in training, where the clean prefix and the canvas sit in one sequence.

    context_length: (B,) int L = P + kC; key_is_real: (B, S) bool keep-mask of the encoder sequence;
    canvas_length: C; sliding_window: W. Returns {"full_attention": (B, S + C), "sliding_attention":
    (B, S + C)} bool, one row per example shared by its canvas queries: exactly what ``decoder_visibility``
    gives at inference over the entries the cache retains after encoding the L-token prefix
    (``cache_retains``), so training and inference see the same keys (TRAINING.md §2.3).
    """
    key_is_real = np.asarray(key_is_real) != 0
    if key_is_real.ndim != 2:
        raise InputError(f"key_is_real must be 2-D (B, S), got shape {key_is_real.shape}")
    B, S = key_is_real.shape
    L = np.asarray(context_length)
    if L.shape != (B,) or not np.issubdtype(L.dtype, np.integer) or np.any((L < 0) | (L > S)):
        raise InputError(f"context_length must be {B} integers in [0, {S}], got {L.tolist()}")
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) or sliding_window < 1:
        raise InputError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
    positions = np.arange(S)
    return {kind: decoder_visibility(key_is_real & cache_retains(positions, L, window),
                                     canvas_length)[:, 0, :]
            for kind, window in (("full_attention", None), ("sliding_attention", sliding_window))}
