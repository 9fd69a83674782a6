"""Grouped-query attention of the fast path: BLAS products around a fused masked softmax.

For every batch row and KV head j, the r query heads that share j (GQA) are taken together as one
(r, S, d) strided view of the queries, so keys and values are never repeated in memory:

    scores (r, S, T) = Q_j . [cached keys ++ new keys]^T      two BLAS products into one buffer
    weights          = masked float32 softmax of each row      ``_kernels.masked_softmax``
    out_j  (r, S, d) = weights . [cached values ++ new values]  two BLAS products, written straight
                                                                into the heads' columns of ``out``

Keys come from two places: slots of the KV cache (a sliding layer's ring, in slot order; position per
slot) and keys computed in this call (the canvas in the decoder, the new tokens in the encoder). Queries
are processed in chunks so that the score buffer stays bounded, and for causal sliding-window attention
each chunk only touches the keys its queries can see, so a long prompt costs O(S * W), not O(S^2).

Same math as ``reference.layers.attend`` with the visibility of ``reference.masks`` (scale 1.0, float32
softmax, a query that sees no key gets zeros); sums run in BLAS order. A bfloat16 model (``model.bf16``)
rounds the scores and the weights inside ``masked_softmax``; its caller rounds ``out`` (SPEC §10.1 B5).
"""

from __future__ import annotations

import math

import numpy as np

SCORE_BUDGET = 1 << 22  # floats of one score buffer (16 MiB): queries are chunked to stay below it


def attend(model, q: np.ndarray, q_pos: np.ndarray, cache_k: np.ndarray, cache_v: np.ndarray, rows: np.ndarray,
           n_cache: int, slot_pos: np.ndarray, cache_real: np.ndarray, new_k: np.ndarray, new_v: np.ndarray,
           new_pos: np.ndarray, new_real: np.ndarray, window: int, causal: bool, out: np.ndarray) -> None:
    """Attention of queries over cached and new keys, written into ``out``.

    model: supplies ``xp`` (array module for the products), ``ops`` (kernels) and ``workspace``.
    q: (N, S, n_h, d) queries at positions q_pos (S,) int64.
    cache_k, cache_v: (B_c, g, slots, d); query row n reads cache row rows[n], slots [0, n_cache); slot t
        holds position slot_pos[t] (-1: empty); cache_real (B_c, P) uint8 realness per position.
    new_k, new_v: (N, g, S_new, d) at positions new_pos (S_new,), realness new_real (N, S_new) uint8.
    window: sliding window W for causal sliding attention (key visible iff pos > p - W), 0 for none.
    causal: key visible only if pos <= p. out: (N, S, n_h * d) float32, heads concatenated in order.
    """
    xp, ops, ws = model.xp, model.ops, model.workspace
    bf16 = bool(getattr(model, "bf16", False))  # the bfloat16 run: scores and weights rounded (the caller rounds out)
    N, S, n_h, d = q.shape
    g = cache_k.shape[1]
    r = n_h // g
    n_new = new_k.shape[2]
    cache_positions = slot_pos[:n_cache]
    chunk = query_chunk(S, r, n_cache, n_new, window, causal)
    heads = out.reshape(N, S, g, r, d)  # view: (row, query, kv head, shared query head, dim)
    cached_real = ws.get("attn_cached_real", (n_cache,), np.uint8)
    for n in range(N):
        row = int(rows[n])
        np.take(cache_real[row], cache_positions, out=cached_real)  # scanned slots are all filled
        for s0 in range(0, S, chunk):
            s1 = min(S, s0 + chunk)
            c_hi, lo, hi = _key_ranges(n_cache, n_new, s0, s1, window, causal, q_pos, new_pos, cache_positions)
            T = c_hi + hi - lo
            key_pos = ws.get("attn_key_pos", (T,), np.int64)
            key_real = ws.get("attn_key_real", (T,), np.uint8)
            key_pos[:c_hi], key_pos[c_hi:] = cache_positions[:c_hi], new_pos[lo:hi]
            key_real[:c_hi], key_real[c_hi:] = cached_real[:c_hi], new_real[n, lo:hi]
            scores = ws.get("attn_scores", (r, s1 - s0, T))
            spare = ws.get("attn_partial", (r, s1 - s0, d))
            for j in range(g):
                qj = q[n, s0:s1, j * r:(j + 1) * r].transpose(1, 0, 2)  # (r, s, d) strided view
                if c_hi:
                    xp.matmul(qj, cache_k[row, j, :c_hi].T, out=scores[:, :, :c_hi])
                if hi > lo:
                    xp.matmul(qj, new_k[n, j, lo:hi].T, out=scores[:, :, c_hi:])
                ops.masked_softmax(scores.reshape(-1, T), q_pos[s0:s1], key_pos, key_real, window, causal, bf16)
                oj = heads[n, s0:s1, j].transpose(1, 0, 2)  # (r, s, d) view into out
                if c_hi:
                    xp.matmul(scores[:, :, :c_hi], cache_v[row, j, :c_hi], out=oj)
                else:
                    oj.fill(0.0)
                if hi > lo:
                    xp.matmul(scores[:, :, c_hi:], new_v[n, j, lo:hi], out=spare)
                    xp.add(oj, spare, out=oj)


def query_chunk(S: int, r: int, n_cache: int, n_new: int, window: int, causal: bool) -> int:
    """Queries per chunk, so that one (r, chunk, T) score buffer stays within ``SCORE_BUDGET`` floats.

    A chunk of c queries sees T <= n_cache + n_new keys; with causal sliding attention (window W > 0) also
    T <= n_cache + c + W - 1 (``_key_ranges``), which bounds c by the positive root of c (c + a) = budget,
    a = n_cache + W - 1. The larger of the two bounds holds; so a small window no longer lets a long prompt's
    chunk grow to the whole prompt (S^2 scores), and a window larger than the prompt (even 2^31 - 1) no
    longer shrinks chunks to one query.
    """
    budget = SCORE_BUDGET // max(1, r)
    chunk = budget // max(1, n_cache + n_new)
    if causal and window > 0 and n_new:
        a = n_cache + window - 1
        chunk = max(chunk, (math.isqrt(a * a + 4 * budget) - a) // 2)
    return max(1, min(S, chunk))


def _key_ranges(n_cache: int, n_new: int, s0: int, s1: int, window: int, causal: bool, q_pos: np.ndarray,
                new_pos: np.ndarray, cache_positions: np.ndarray) -> tuple[int, int, int]:
    """Keys a chunk of queries [s0, s1) may see: cache slots [0, c_hi) and new keys [lo, hi).

    Only ever drops keys that the mask would hide from every query of the chunk (the mask still decides
    each score): without causality every key is kept. Causal, with new keys: they are the queries
    themselves in order, so none after the chunk is needed; with a window, none before
    ``s0 - window + 1`` either, and no cache slot once the chunk's first query no longer reaches the
    newest cached position. Causal without new keys (a full layer encoding straight into its cache):
    slots hold ascending positions, so those after the chunk's last query are dropped.
    """
    c_hi, lo, hi = n_cache, 0, n_new
    if not causal:
        return c_hi, lo, hi
    if n_new:
        hi = min(n_new, s1)
        if window > 0:
            lo = max(0, s0 - window + 1)
            if n_cache and new_pos[s0] - window >= cache_positions.max(initial=-1):
                c_hi = 0
    elif n_cache:
        c_hi = int(np.searchsorted(cache_positions, q_pos[s1 - 1], side="right"))
    return c_hi, lo, hi
