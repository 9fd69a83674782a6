"""Attention visibility as pure functions of positions, window and padding.

A visibility matrix ``M[b, q, t]`` is True when query ``q`` of row ``b`` may attend to key ``t``.
Positions are absolute token indices (left padding counts: a left-padded row's first real token sits at
position = number of pads, exactly as upstream, which never remaps positions).
"""

from __future__ import annotations

import numpy as np


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


def decoder_visibility(cache_key_is_real: np.ndarray, canvas_length: int) -> np.ndarray:
    """Bidirectional visibility of the canvas over ``[retained cache ++ canvas]``.

    cache_key_is_real: (B, T_cache) bool, False for padded cache entries.
    Returns (B, 1, T_cache + canvas_length) bool, the same for every canvas query: every real cached key
    and every canvas key is visible. There is no causal mask and no per-query window; the sliding
    window acts only through which entries a sliding layer's cache retains (``kv_cache``).

    Upstream: ``create_diffusion_decoder_attention_mask`` with a ``DynamicCache`` (SPEC §7.3, trap T6).
    """
    batch = cache_key_is_real.shape[0]
    canvas = np.ones((batch, canvas_length), dtype=bool)
    return np.concatenate([cache_key_is_real, canvas], axis=1)[:, None, :]
