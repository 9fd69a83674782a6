"""The DiffusionGemma model: a causal encoder that fills a KV cache and a bidirectional decoder that
denoises a canvas reading that cache.

    text -> input_ids -> Model.encode (appends to the cache) -> for each canvas:
        Model.denoise(canvas, cache, self-conditioning logits) -> logits (B, C, V)   x  denoising steps
    -> commit -> Model.encode(committed canvas) -> next canvas

Encoder and decoder share every weight except the per-layer scalar (``encoder_layer_scalar`` vs
``decoder_layer_scalar``). By default all computation is float32 NumPy; bfloat16 checkpoints are widened
exactly, each tensor as a layer uses it (``support/weight_store.py``: the weights stay in their files). ``Model(..., dtype="bfloat16")`` is upstream's bfloat16 run instead (SPEC §10): weights
rounded to bfloat16 on load, arithmetic in float32, every result rounded where transformers loaded with
``dtype=torch.bfloat16`` stores a bfloat16 tensor (``primitives.round_to``). Upstream:
``DiffusionGemmaEncoderTextModel`` and ``DiffusionGemmaDecoderModel`` of transformers 5.24.0 with its
default ``DynamicCache``.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

import numpy as np

from .cache import KVCache
from .config import ModelConfig
from .layers import attend, feed_forward, lower_index_top_k, project_qkv
from .masks import canvas_window, decoder_visibility, encoder_visibility
from .primitives import (compute_dtype, embed, gated_mlp, linear, rms_norm, rope_cos_sin, rope_inverse_frequencies,
                         round_to, softcap)
from .support.checkpoint_io import check_tensors, open_checkpoint
from .support.weight_store import StreamedWeights, WeightStore
from .support.checks import (check_attention_mask, check_denoise_inputs, check_model_cache, check_positions,
                             check_token_ids)
from .support.diagnosis import forward_fault
from .support.errors import InputError
from .support.observer import NULL_OBSERVER, Observer


ATTENTION_SCORE_BYTES = 32 * 2 ** 20  # the encoder attends in query blocks whose float32 scores fit in this


class Model:
    """DiffusionGemma text model with NumPy weights.

    ``DENOISE_REPORTS``: ``denoise`` takes ``observer=`` (the layer outputs a trace records), ``sc_embedding=``
    (a peer's rounding of the self-conditioning embedding) and
    ``canvas_window=`` (a peer's window stage); the generation loop passes both.

    Build it with ``Model.from_pretrained(path)`` or ``Model(config, tensors)`` where ``tensors`` maps the
    project's tensor names (``reference.weights``) to float32 arrays.

    ``dtype``: "float32" (default) or "bfloat16", the dtype transformers would be loaded with
    (``from_pretrained(..., dtype=torch.bfloat16)``). In bfloat16 every tensor is rounded to bfloat16 on load
    (exact for a bfloat16 checkpoint) and kept as float32 arrays holding bfloat16 values; the cache then
    holds bfloat16 values too. ``self.dtype`` is the NumPy dtype (``primitives.FLOAT32`` / ``BFLOAT16``).
    Raises ``ConfigError`` for another dtype.
    """

    DENOISE_REPORTS = True
    # The router's top-K selection, (probs (N, E), K) -> (N, K) indices: ties to the lower expert index
    # (trap T25). ``variants.router.torch_cpu_top_k`` on an instance reproduces torch's CPU order instead.
    router_top_k = staticmethod(lower_index_top_k)

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: str | np.dtype = "float32"):
        check_tensors(tensors, config)
        self.config = config
        self.dtype = compute_dtype(dtype)
        if isinstance(tensors, WeightStore):  # a checkpoint's mapped files: each tensor widened when used, not kept
            self.tensors = StreamedWeights(tensors, self.dtype)
            self.layers = [self.tensors.layer(l) for l in range(config.num_hidden_layers)]
        else:  # arrays in memory: widened (and rounded) once
            self.tensors = {name: round_to(np.ascontiguousarray(t, dtype=np.float32), self.dtype)
                            for name, t in tensors.items()}
            self.layers = [  # per layer: that layer's tensors without the "layers.{l}." prefix
                {name[len(f"layers.{l}."):]: t for name, t in self.tensors.items() if name.startswith(f"layers.{l}.")}
                for l in range(config.num_hidden_layers)
            ]
        self._omega = {kind: rope_inverse_frequencies(config.rope_parameters[kind], d)
                       for kind, d in zip(config.layer_types, config.layer_head_dim)}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: str | np.dtype = "float32") -> "Model":
        """Open a converted checkpoint directory, a transformers checkpoint directory or a GGUF file.

        The weights stay in their files (``support.weight_store``: mapped, each tensor widened to float32, or
        rounded for the bfloat16 run, when a layer uses it and dropped after), so memory does not grow with
        the number of layers and the first pass starts without reading the whole model.
        dtype: "float32" (default) or "bfloat16" (upstream's bfloat16 run, see the class notes).
        Raises ``CheckpointError`` when ``path`` is neither, or when its tensors are wrong (a NaN or
        infinite value: when that tensor is first used), and ``ConfigError`` for an invalid config or dtype.
        """
        compute_dtype(dtype)  # a bad dtype fails before the weights are read
        return cls(*open_checkpoint(path), dtype=dtype)

    def new_cache(self, batch_size: int) -> KVCache:
        """An empty KV cache for ``batch_size`` rows."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        return KVCache(self.config, int(batch_size))

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
        ids = check_token_ids("input_ids", input_ids, check_model_cache(cache, KVCache).batch_size, self.config.vocab_size)
        B, n = ids.shape
        if n == 0:
            raise InputError("input_ids has no tokens (shape (B, 0))")
        mask = check_attention_mask(attention_mask, (B, n))
        config = self.config
        check_positions(config, cache.length, n, f"input_ids ({n} tokens)")
        positions = cache.length + np.arange(n, dtype=np.int64)  # (n,)
        is_real = np.concatenate([cache.is_real, mask], axis=1)  # (B, L + n)
        dt = self.dtype
        tables = {kind: rope_cos_sin(np.broadcast_to(positions, (B, n)), omega, dt) for kind, omega in self._omega.items()}
        h = embed(ids, self.tensors["embed_tokens"], config.embed_scale, dt)  # (B, n, H); no input norm
        retained = []
        for l, w in enumerate(self.layers):
            kind = config.layer_types[l]
            x = rms_norm(h, w["input_layernorm"], config.rms_norm_eps, dt)
            q, k, v = project_qkv(x, w, config, l, *tables[kind], dt)
            keys = np.concatenate([cache.keys[l], k], axis=2)  # (B, g, T_l + n, d)
            values = np.concatenate([cache.values[l], v], axis=2)
            key_pos = np.concatenate([cache.positions(l), positions])  # (T_l + n,)
            window = config.sliding_window if config.is_sliding(l) else None
            attn = self._causal_attention(q, keys, values, positions, key_pos, is_real[:, key_pos], window)
            h = self._block_tail(h, attn, w, w["encoder_layer_scalar"])
            if not np.isfinite(h).all():
                raise forward_fault(self.tensors, "encode", f"the output of encoder layer {l}", h, l, cache)
            retained.append((keys, values))
        out = rms_norm(h, self.tensors["final_norm"], config.rms_norm_eps, dt)
        for l, (keys, values) in enumerate(retained):  # commit only once every layer succeeded
            cache.retain(l, keys, values)
        cache.is_real = is_real
        return out

    # ------------------------------------------------------------------ decoder
    def self_conditioning_embedding(self, logits: np.ndarray) -> np.ndarray:
        """Soft embedding of self-conditioning logits: ``softmax(logits) @ E * sqrt(H)``.

        logits: (B, C, V) float32 (in generation: the previous step's temperature-scaled logits;
        trap T11). Returns (B, C, H) float32. The softmax runs in float32 over the vocabulary.
        In bfloat16 the chain is upstream's (SPEC §10 B8): ``generate`` casts the processed logits to the
        embedding dtype (``processed_logits.to(embeddings_dtype)``), the decoder softmaxes them in float32,
        casts the probabilities to bfloat16, multiplies by the bfloat16 table and by the scale cast to
        bfloat16, each product rounded. The first cast is done here, so that ``denoise`` takes the
        float32 logits a loop holds.
        """
        dt = self.dtype
        logits = round_to(logits, dt)
        z = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=-1, keepdims=True)
        soft = round_to(round_to(probs, dt) @ self.tensors["embed_tokens"], dt)
        return round_to(soft * round_to(np.float32(self.config.embed_scale), dt), dt)

    def canvas_input(self, canvas: np.ndarray, self_conditioning_logits: np.ndarray | None,
                     self_conditioning_mask: np.ndarray | None = None,
                     sc_embedding: Callable | None = None) -> np.ndarray:
        """Decoder input ``norm(embed(canvas) + SC_MLP(pre_norm(u)))`` with a weightless outer norm.

        canvas: (B, C) int. self_conditioning_logits: (B, C, V) float32 or None (first denoising step:
        u = 0, and the MLP of 0 is exactly 0). self_conditioning_mask: (B,) bool or None, training only:
        rows with False get u = 0 as if no logits were given. sc_embedding: None, or a peer's treatment of
        the soft embedding u (JAX rounds it to bfloat16, ``variants/temperature.py``). Returns (B, C, H) float32. The canvas
        embedding is RMS-normalised even at the first step (trap T10). Upstream: the decoder's
        ``self_conditioning`` module.
        """
        config, t, dt = self.config, self.tensors, self.dtype
        e = embed(canvas, t["embed_tokens"], config.embed_scale, dt)  # (B, C, H)
        if self_conditioning_logits is None:  # upstream: the MLP of zeros is zeros, e + 0 = e
            return rms_norm(e, None, config.rms_norm_eps, dt)
        u = self.self_conditioning_embedding(self_conditioning_logits)
        if sc_embedding is not None:
            u = sc_embedding(u)
        if self_conditioning_mask is not None:
            u = u * np.asarray(self_conditioning_mask, dtype=np.float32)[:, None, None]
        signal = gated_mlp(rms_norm(u, t["self_conditioning.pre_norm"], config.rms_norm_eps, dt),
                           t["self_conditioning.gate_proj"], t["self_conditioning.up_proj"],
                           t["self_conditioning.down_proj"], dt)
        return rms_norm(round_to(e + signal, dt), None, config.rms_norm_eps, dt)

    def denoise(self, canvas: np.ndarray, cache: KVCache, self_conditioning_logits: np.ndarray | None = None,
                self_conditioning_mask: np.ndarray | None = None, *,
                observer: Observer = NULL_OBSERVER, canvas_window: Callable = canvas_window,
                sc_embedding: Callable | None = None) -> np.ndarray:
        """One decoder pass: logits for every canvas position. Never writes the cache.

        canvas: (B, C) int token ids in [0, V), C = ``config.canvas_length``, at positions
            ``cache.length .. cache.length + C - 1``.
        cache: the encoder cache (B rows). Full layers attend to all L cached tokens, sliding layers to the
            last min(L, W - 1) they retain, plus the whole canvas, bidirectionally (SPEC §7.3).
        self_conditioning_logits: (B, C, V) float32 or None (first step of a canvas).
        self_conditioning_mask: (B,) bool or None (training: per-row switch for self-conditioning).
        observer: an ``observer.Observer`` (e.g. a trace recorder inside a step): it receives the decoder
            input (after self-conditioning) and every layer's output (B, C, H).
        canvas_window: (key positions (T,), L, C, W) -> (C, T) bool, the retained keys of a sliding layer that
            each canvas query sees: ``masks.canvas_window`` (all of them, the spec), or a peer's window stage
            (``variants/window.py``; JAX's returns (C, T + C), the canvas keys included).
        sc_embedding: None, or a peer's treatment of the self-conditioning soft embedding (``canvas_input``).
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
            config, canvas, check_model_cache(cache, KVCache).batch_size, self_conditioning_logits, self_conditioning_mask)
        B, C = ids.shape
        check_positions(config, cache.length, C, f"the canvas ({C} tokens)")
        positions = cache.length + np.arange(C, dtype=np.int64)
        dt = self.dtype
        tables = {kind: rope_cos_sin(np.broadcast_to(positions, (B, C)), omega, dt) for kind, omega in self._omega.items()}
        h = self.canvas_input(ids, self_conditioning_logits, self_conditioning_mask, sc_embedding)
        if not np.isfinite(h).all():
            raise forward_fault(self.tensors, "denoise", "the decoder input (canvas embedding + self-conditioning)", h, None)
        observer.decoder_input(h)
        for l, w in enumerate(self.layers):
            x = rms_norm(h, w["input_layernorm"], config.rms_norm_eps, dt)
            q, k, v = project_qkv(x, w, config, l, *tables[config.layer_types[l]], dt)
            keys = np.concatenate([cache.keys[l], k], axis=2)  # (B, g, T_l + C, d): read-only use of the cache
            values = np.concatenate([cache.values[l], v], axis=2)
            window = (canvas_window(cache.positions(l), cache.length, C, config.sliding_window)
                      if config.is_sliding(l) else None)  # (C, T_l): retained keys each query sees
            visible = decoder_visibility(cache.is_real[:, cache.positions(l)], C, window)  # (B, 1 or C, T_l + C)
            h = self._block_tail(h, attend(q, keys, values, visible, dt), w, w["decoder_layer_scalar"])
            if not np.isfinite(h).all():
                raise forward_fault(self.tensors, "denoise", f"the output of decoder layer {l}", h, l, cache)
            observer.decoder_layer(l, h)
        raw = self.output_logits(h, capped=False)
        if not np.isfinite(raw).all():
            raise forward_fault(self.tensors, "denoise", "the logits before the soft-cap", raw, None)
        return softcap(raw, config.final_logit_softcapping)

    def output_logits(self, h: np.ndarray, capped: bool = True) -> np.ndarray:
        """Final norm, tied output projection and (unless ``capped`` is False) soft-cap: (..., H) -> (..., V).

        In bfloat16 the projection's output is rounded (``lm_head``), then widened: the soft-cap is float32
        (``logits.to(torch.float32)`` before ``final_logit_softcapping``)."""
        h = rms_norm(h, self.tensors["final_norm"], self.config.rms_norm_eps, self.dtype)
        logits = linear(h, self.tensors["embed_tokens"], self.dtype)
        return softcap(logits, self.config.final_logit_softcapping) if capped else logits

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
            return attend(q, keys, values, encoder_visibility(positions, key_pos, key_real, window), self.dtype)
        out = np.empty((B, S, n_h * d), dtype=np.float32)
        for a in range(0, S, block):
            b = min(S, a + block)
            out[:, a:b] = attend(q[:, a:b], keys, values, encoder_visibility(positions[a:b], key_pos, key_real, window),
                                 self.dtype)
        return out

    # ------------------------------------------------------------------ shared block
    def _block_tail(self, h: np.ndarray, attn: np.ndarray, w: dict, layer_scalar: np.ndarray) -> np.ndarray:
        """Everything in a block after attention: output projection, both residual adds, the layer scalar.

        h: residual (B, S, H); attn: concatenated heads (B, S, n_h*d). The scalar multiplies the whole
        residual stream, residual included (trap T9). Returns (B, S, H). In bfloat16 both residual sums and
        the scaled stream are rounded (``residual + hidden_states``; ``hidden_states *= self.layer_scalar``,
        a bfloat16 buffer).
        """
        eps, dt = self.config.rms_norm_eps, self.dtype
        h = round_to(h + rms_norm(linear(attn, w["o_proj"], dt), w["post_attention_layernorm"], eps, dt), dt)
        h = round_to(h + feed_forward(h, w, self.config, self.router_top_k, dtype=dt), dt)
        return round_to(h * layer_scalar, dt)
