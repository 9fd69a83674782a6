"""The DiffusionGemma model: a causal encoder that fills a KV cache and a bidirectional decoder that
denoises a canvas reading that cache.

    text -> input_ids -> Model.encode (appends to the cache) -> for each canvas:
        Model.denoise(canvas, cache, self-conditioning logits) -> logits (B, C, V)   x  denoising steps
    -> commit -> Model.encode(committed canvas) -> next canvas

Encoder and decoder share every weight except the per-layer scalar (``encoder_layer_scalar`` vs
``decoder_layer_scalar``). All computation is float32 NumPy; bfloat16 checkpoints are widened exactly
on load. Upstream: ``DiffusionGemmaEncoderTextModel`` and ``DiffusionGemmaDecoderModel`` of transformers
5.24.0 with its default ``DynamicCache``.
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from .cache import KVCache
from .config import ModelConfig
from .errors import InputError, NonFiniteError
from .layers import attend, feed_forward, project_qkv
from .masks import decoder_visibility, encoder_visibility
from .observer import NULL_OBSERVER, Observer
from .sampling import check_logits
from .semantics import sliding_window_keys
from .primitives import embed, gated_mlp, rms_norm, rope_cos_sin, rope_inverse_frequencies, softcap
from .weights import check_tensors, load_checkpoint


def check_token_ids(name: str, ids, batch_size: int, vocab_size: int) -> np.ndarray:
    """Validate a (batch, tokens) array of token ids; return it as contiguous int64.

    Raises ``InputError`` naming ``name`` for a non-2-D or non-integer array, a batch size other than
    ``batch_size`` (the cache's), or an id outside [0, vocab_size). Shared by every backend.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{name} must be a 2-D integer array (batch, tokens), got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    if ids.shape[0] != batch_size:
        raise InputError(f"{name} has batch size {ids.shape[0]} but the cache was made for batch size {batch_size}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].ravel()[0]
        raise InputError(f"{name} holds token id {int(bad)} outside [0, vocab_size={vocab_size})")
    return np.ascontiguousarray(ids, dtype=np.int64)


def check_attention_mask(attention_mask, shape: tuple[int, int]) -> np.ndarray:
    """Validate a 0/1 attention mask of ``shape`` (None means all ones); return it as a bool array.

    Raises ``InputError`` for another shape or values other than 0 and 1. Shared by every backend.
    """
    if attention_mask is None:
        return np.ones(shape, dtype=bool)
    mask = np.asarray(attention_mask)
    if mask.shape != tuple(shape):
        raise InputError(f"attention_mask has shape {mask.shape}, expected {tuple(shape)} like input_ids")
    if not np.isin(mask, (0, 1)).all():
        raise InputError("attention_mask must hold only 0 and 1")
    return mask.astype(bool)


def check_denoise_inputs(config: ModelConfig, canvas, batch_size: int, self_conditioning_logits=None,
                         self_conditioning_mask=None) -> tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]:
    """Validate the inputs of a decoder pass once, for every backend's ``denoise``.

    canvas: (B, C) int ids with B = ``batch_size`` (the cache's) and C = ``config.canvas_length``.
    self_conditioning_logits: (B, C, V) float (host array; a device array is only shape-checked) or None.
    self_conditioning_mask: (B,) bool or None.
    Returns (ids (B, C) int64, logits float32 (or the device array as given) or None, mask (B,) bool or None).
    Raises ``InputError`` naming the argument: wrong canvas length, ids out of range, logits of the wrong
    shape, holding NaN or +inf or a position with only -inf (named by (row, position)), a mask of the wrong
    shape.
    """
    ids = check_token_ids("canvas", canvas, batch_size, config.vocab_size)
    B, C = ids.shape
    if C != config.canvas_length:
        raise InputError(f"canvas has length {C}, but this model's canvas_length is {config.canvas_length}")
    sc = self_conditioning_logits
    if sc is not None:
        expected = (B, C, config.vocab_size)
        if not hasattr(sc, "shape"):
            sc = np.asarray(sc, dtype=np.float32)
        if tuple(sc.shape) != expected:
            raise InputError(f"self_conditioning_logits has shape {tuple(sc.shape)}, expected {expected}")
        if isinstance(sc, np.ndarray):
            sc = np.ascontiguousarray(sc, dtype=np.float32)
            check_logits(sc, "self_conditioning_logits", InputError)  # NaN, +inf, a row of only -inf
    mask = self_conditioning_mask
    if mask is not None:
        if np.shape(mask) != (B,):
            raise InputError(f"self_conditioning_mask has shape {np.shape(mask)}, expected {(B,)}")
        mask = np.asarray(mask, dtype=bool)
    return ids, sc, mask


def check_positions(config: ModelConfig, start: int, count: int, what: str) -> None:
    """Refuse ``count`` tokens at positions ``start .. start + count - 1`` beyond ``max_position_embeddings``.

    Raises ``InputError`` with the numbers (the rotary tables and the trained model end there). Shared by
    every backend's ``encode`` and ``denoise`` and by the generation loop's up-front budget.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and start + count > limit:
        raise InputError(f"{what} would occupy positions {start}..{start + count - 1}, but this model has "
                         f"max_position_embeddings={limit} (positions 0..{limit - 1}); {start} are already "
                         f"used by the cache")


def first_non_finite(array: np.ndarray) -> str:
    """``"NaN at (row, position) (b, s)"`` / ``"+inf ..."`` for the first non-finite entry of (B, S, ...)."""
    array = np.asarray(array)
    where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
    value = float(array[where])
    return f"{'NaN' if value != value else ('+inf' if value > 0 else '-inf')} at (row, position) {where[:2]}"


def non_finite_error(stage: str, where: str, array: np.ndarray, weights: Mapping[str, np.ndarray],
                     inputs: Mapping[str, np.ndarray] = {}) -> NonFiniteError:
    """The ``NonFiniteError`` for ``array``, the first value of the forward pass that was not finite.

    stage: "encode" or "denoise"; where: what ``array`` is ("the output of decoder layer 2"). The cause
    is looked for in what that computation read: ``inputs`` first (name -> array, e.g. the cache's keys of
    that layer), then ``weights`` (project tensor name -> array; weights are checked when a model is built,
    so a non-finite one was changed afterwards). When all are finite, float32 overflowed there. Shared by
    every backend, so that the same fault gives the same message.
    """
    cause = None
    for kind, items in (("input", inputs), ("weight", weights)):
        for name, value in items.items():
            value = np.asarray(value)
            if value.size and not np.isfinite(value).all():
                bad = value.reshape(-1)[~np.isfinite(value.reshape(-1))][0]
                cause = f"{kind} {name!r} holds {'NaN' if bad != bad else float(bad)}"
                break
        if cause:
            break
    if cause is None:
        cause = ("every weight and input it read is finite, so float32 overflowed there "
                 "(weights or activations too large)")
    return NonFiniteError(f"{stage}: {where} is not finite ({first_non_finite(array)}); {cause}")


ATTENTION_SCORE_BYTES = 32 * 2 ** 20  # the encoder attends in query blocks whose float32 scores fit in this


class Model:
    """DiffusionGemma text model with NumPy weights.

    Build it with ``Model.from_pretrained(path)`` or ``Model(config, tensors)`` where ``tensors`` maps the
    project's tensor names (``reference.weights``) to float32 arrays.
    """

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray]):
        check_tensors(tensors, config)
        self.config = config
        self.tensors = {name: np.ascontiguousarray(t, dtype=np.float32) for name, t in tensors.items()}
        self.layers = [  # per layer: that layer's tensors without the "layers.{l}." prefix
            {name[len(f"layers.{l}."):]: t for name, t in self.tensors.items() if name.startswith(f"layers.{l}.")}
            for l in range(config.num_hidden_layers)
        ]
        self._omega = {kind: rope_inverse_frequencies(config.rope_parameters[kind], d)
                       for kind, d in zip(config.layer_types, config.layer_head_dim)}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Model":
        """Load a converted checkpoint directory, or a transformers checkpoint directory (converted in memory).

        Raises ``CheckpointError`` when ``path`` is neither, or when its tensors are wrong, and
        ``ConfigError`` for an invalid config.
        """
        return cls(*load_checkpoint(path))

    def new_cache(self, batch_size: int) -> KVCache:
        """An empty KV cache for ``batch_size`` rows."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        return KVCache(self.config, int(batch_size))

    # ------------------------------------------------------------------ input checks
    def _check_cache(self, cache: KVCache) -> KVCache:
        if not isinstance(cache, KVCache):
            raise InputError(f"cache must be a KVCache from Model.new_cache, got {type(cache).__name__}")
        return cache

    def _check_ids(self, name: str, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        return check_token_ids(name, ids, self._check_cache(cache).batch_size, self.config.vocab_size)

    # ------------------------------------------------------------------ encoder
    def encode(self, input_ids: np.ndarray, cache: KVCache, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Run the causal encoder over new tokens and append their keys/values to ``cache``.

        input_ids: (B, n) int token ids in [0, V), at positions ``cache.length .. cache.length + n - 1``
            (positions continue from everything cached, padding included; trap T18).
        attention_mask: (B, n) of 0/1 (1 = real token, 0 = padding), default all ones. Padding keys are
            hidden from every query.
        Returns the encoder's final-norm hidden states (B, n, H) float32 (upstream ``last_hidden_state``;
        generation does not use them, the autoregressive training loss does). Padded positions hold
        unspecified values.
        Long inputs attend in query blocks (``ATTENTION_SCORE_BYTES`` of scores each), so memory grows
        linearly with n, not quadratically (blocks change BLAS's summation order: float32 rounding only).
        Raises ``InputError`` for ids out of range, wrong shapes, a cache of another batch size or positions
        beyond ``max_position_embeddings``; ``NonFiniteError`` naming the first encoder layer whose output
        is not finite, and why. The cache is left unchanged on error.
        """
        ids = self._check_ids("input_ids", input_ids, cache)
        B, n = ids.shape
        if n == 0:
            raise InputError("input_ids has no tokens (shape (B, 0))")
        mask = check_attention_mask(attention_mask, (B, n))
        config = self.config
        check_positions(config, cache.length, n, f"input_ids ({n} tokens)")
        positions = cache.length + np.arange(n, dtype=np.int64)  # (n,)
        is_real = np.concatenate([cache.is_real, mask], axis=1)  # (B, L + n)
        tables = {kind: rope_cos_sin(np.broadcast_to(positions, (B, n)), omega) for kind, omega in self._omega.items()}
        h = embed(ids, self.tensors["embed_tokens"], config.embed_scale)  # (B, n, H); no input norm
        retained = []
        for l, w in enumerate(self.layers):
            kind = config.layer_types[l]
            x = rms_norm(h, w["input_layernorm"], config.rms_norm_eps)
            q, k, v = project_qkv(x, w, config, l, *tables[kind])
            keys = np.concatenate([cache.keys[l], k], axis=2)  # (B, g, T_l + n, d)
            values = np.concatenate([cache.values[l], v], axis=2)
            key_pos = np.concatenate([cache.positions(l), positions])  # (T_l + n,)
            window = config.sliding_window if config.is_sliding(l) else None
            attn = self._causal_attention(q, keys, values, positions, key_pos, is_real[:, key_pos], window)
            h = self._block_tail(h, attn, w, w["encoder_layer_scalar"])
            if not np.isfinite(h).all():
                raise self._non_finite("encode", f"the output of encoder layer {l}", h, l, cache)
            retained.append((keys, values))
        for l, (keys, values) in enumerate(retained):  # commit only once every layer succeeded
            cache.retain(l, keys, values)
        cache.is_real = is_real
        return rms_norm(h, self.tensors["final_norm"], config.rms_norm_eps)

    # ------------------------------------------------------------------ decoder
    def self_conditioning_embedding(self, logits: np.ndarray) -> np.ndarray:
        """Soft embedding of self-conditioning logits: ``softmax(logits) @ E * sqrt(H)``.

        logits: (B, C, V) float32 (in generation: the previous step's temperature-scaled logits;
        trap T11). Returns (B, C, H) float32. The softmax runs in float32 over the vocabulary.
        """
        z = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=-1, keepdims=True)
        return (probs @ self.tensors["embed_tokens"]) * np.float32(self.config.embed_scale)

    def canvas_input(self, canvas: np.ndarray, self_conditioning_logits: np.ndarray | None,
                     self_conditioning_mask: np.ndarray | None = None) -> np.ndarray:
        """Decoder input ``norm(embed(canvas) + SC_MLP(pre_norm(u)))`` with a weightless outer norm.

        canvas: (B, C) int. self_conditioning_logits: (B, C, V) float32 or None (first denoising step:
        u = 0, and the MLP of 0 is exactly 0). self_conditioning_mask: (B,) bool or None, training only:
        rows with False get u = 0 as if no logits were given. Returns (B, C, H) float32. The canvas
        embedding is RMS-normalised even at the first step (trap T10). Upstream: the decoder's
        ``self_conditioning`` module.
        """
        config, t = self.config, self.tensors
        e = embed(canvas, t["embed_tokens"], config.embed_scale)  # (B, C, H)
        if self_conditioning_logits is None:
            return rms_norm(e, None, config.rms_norm_eps)
        u = self.self_conditioning_embedding(self_conditioning_logits)
        if self_conditioning_mask is not None:
            u = u * np.asarray(self_conditioning_mask, dtype=np.float32)[:, None, None]
        signal = gated_mlp(rms_norm(u, t["self_conditioning.pre_norm"], config.rms_norm_eps),
                           t["self_conditioning.gate_proj"], t["self_conditioning.up_proj"],
                           t["self_conditioning.down_proj"])
        return rms_norm(e + signal, None, config.rms_norm_eps)

    def denoise(self, canvas: np.ndarray, cache: KVCache, self_conditioning_logits: np.ndarray | None = None,
                self_conditioning_mask: np.ndarray | None = None, *,
                observer: Observer = NULL_OBSERVER, canvas_window: str = "W-1") -> np.ndarray:
        """One decoder pass: logits for every canvas position. Never writes the cache.

        canvas: (B, C) int token ids in [0, V), C = ``config.canvas_length``, at positions
            ``cache.length .. cache.length + C - 1``.
        cache: the encoder cache (B rows). Full layers attend to all L cached tokens, sliding layers to the
            last min(L, W - 1) they retain, plus the whole canvas, bidirectionally (SPEC §7.3).
        self_conditioning_logits: (B, C, V) float32 or None (first step of a canvas).
        self_conditioning_mask: (B,) bool or None (training: per-row switch for self-conditioning).
        observer: an ``observer.Observer`` (e.g. a trace recorder inside a step): it receives the decoder
            input (after self-conditioning) and every layer's output (B, C, H).
        canvas_window: the prompt keys a canvas query sees in a sliding layer (``semantics.py``): "W-1"
            (transformers: every retained key, for every query) or "W-1-i" (JAX main: query i sees keys at
            positions >= L + i - W + 1). "W" is "W-1" on a cache that retains W keys.
        Returns soft-capped logits (B, C, V) float32 (upstream: lm_head output, cast to float32, then
        ``c * tanh(z / c)``).
        Raises ``InputError`` for a wrong canvas length, ids out of range, self-conditioning logits of the
        wrong shape or holding NaN, +inf or a position of only -inf, a cache of another batch size, or
        positions beyond ``max_position_embeddings``; ``NonFiniteError`` naming the decoder input or the
        first decoder layer whose output is not finite, and the weight or cache entry that explains it
        (the logits are checked before the soft-cap, which would turn an infinity into +-c).
        """
        config = self.config
        ids, self_conditioning_logits, self_conditioning_mask = check_denoise_inputs(
            config, canvas, self._check_cache(cache).batch_size, self_conditioning_logits, self_conditioning_mask)
        B, C = ids.shape
        check_positions(config, cache.length, C, f"the canvas ({C} tokens)")
        positions = cache.length + np.arange(C, dtype=np.int64)
        tables = {kind: rope_cos_sin(np.broadcast_to(positions, (B, C)), omega) for kind, omega in self._omega.items()}
        h = self.canvas_input(ids, self_conditioning_logits, self_conditioning_mask)
        if not np.isfinite(h).all():
            raise self._non_finite("denoise", "the decoder input (canvas embedding + self-conditioning)", h, None)
        observer.decoder_input(h)
        for l, w in enumerate(self.layers):
            x = rms_norm(h, w["input_layernorm"], config.rms_norm_eps)
            q, k, v = project_qkv(x, w, config, l, *tables[config.layer_types[l]])
            keys = np.concatenate([cache.keys[l], k], axis=2)  # (B, g, T_l + C, d): read-only use of the cache
            values = np.concatenate([cache.values[l], v], axis=2)
            visible = decoder_visibility(cache.is_real[:, cache.positions(l)], C)  # (B, 1, T_l + C)
            if canvas_window == "W-1-i" and config.is_sliding(l):  # a per-query window (semantics="jax")
                window = sliding_window_keys("W-1-i", cache.positions(l), cache.length, C, config.sliding_window)
                visible = visible & np.concatenate([window, np.ones((C, C), dtype=bool)], axis=1)[None]
            h = self._block_tail(h, attend(q, keys, values, visible), w, w["decoder_layer_scalar"])
            if not np.isfinite(h).all():
                raise self._non_finite("denoise", f"the output of decoder layer {l}", h, l, cache)
            observer.decoder_layer(l, h)
        raw = self.output_logits(h, capped=False)
        if not np.isfinite(raw).all():
            raise self._non_finite("denoise", "the logits before the soft-cap", raw, None)
        return softcap(raw, config.final_logit_softcapping)

    def output_logits(self, h: np.ndarray, capped: bool = True) -> np.ndarray:
        """Final norm, tied output projection and (unless ``capped`` is False) soft-cap: (..., H) -> (..., V)."""
        h = rms_norm(h, self.tensors["final_norm"], self.config.rms_norm_eps)
        logits = h @ self.tensors["embed_tokens"].T
        return softcap(logits, self.config.final_logit_softcapping) if capped else logits

    # ------------------------------------------------------------------ failure diagnosis
    def _non_finite(self, stage: str, where: str, array: np.ndarray, layer: int | None,
                    cache: KVCache | None = None) -> NonFiniteError:
        """``non_finite_error`` with the weights (and cache entries) that computation read."""
        if layer is None:
            names = [n for n in self.tensors if not n.startswith("layers.")]
        else:
            names = [n for n in self.tensors if n.startswith(f"layers.{layer}.")]
            if layer == 0:
                names += [n for n in self.tensors if not n.startswith("layers.")]
        inputs = {}
        if cache is not None and layer is not None:
            inputs = {f"cache keys of layer {layer}": cache.keys[layer],
                      f"cache values of layer {layer}": cache.values[layer]}
        return non_finite_error(stage, where, array, {n: self.tensors[n] for n in names}, inputs)

    def _causal_attention(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray,
                          key_pos: np.ndarray, key_real: np.ndarray, window: int | None) -> np.ndarray:
        """Encoder attention of the queries at ``positions`` (B, S, n_h, d) over (B, g, T, d) keys/values.

        Builds the visibility (``encoder_visibility``) and the scores per block of queries, so that memory
        is O(block * T) instead of O(S * T). Inputs whose scores fit in one block take the one-block path
        unchanged; split blocks agree with it to float32 rounding (BLAS sums in another order).
        """
        B, S, n_h, d = q.shape
        T = keys.shape[2]
        block = max(1, ATTENTION_SCORE_BYTES // (4 * B * n_h * max(T, 1)))
        if block >= S:
            return attend(q, keys, values, encoder_visibility(positions, key_pos, key_real, window))
        out = np.empty((B, S, n_h * d), dtype=np.float32)
        for a in range(0, S, block):
            b = min(S, a + block)
            out[:, a:b] = attend(q[:, a:b], keys, values, encoder_visibility(positions[a:b], key_pos, key_real, window))
        return out

    # ------------------------------------------------------------------ shared block
    def _block_tail(self, h: np.ndarray, attn: np.ndarray, w: dict, layer_scalar: np.ndarray) -> np.ndarray:
        """Everything in a block after attention: output projection, both residual adds, the layer scalar.

        h: residual (B, S, H); attn: concatenated heads (B, S, n_h*d). The scalar multiplies the whole
        residual stream, residual included (trap T9). Returns (B, S, H).
        """
        eps = self.config.rms_norm_eps
        h = h + rms_norm(attn @ w["o_proj"].T, w["post_attention_layernorm"], eps)
        h = h + feed_forward(h, w, self.config)
        return h * layer_scalar
