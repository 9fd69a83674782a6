"""One transformer block of the fast paths, written once for the CPU and the GPU (SPEC §4).

``layer`` is the host-side order of one encoder or decoder block: input norm, fused q/k(/v) projection,
per-head norms with RoPE, attention over the KV cache plus the call's own keys, output projection,
post-attention norm and residual, then the dense MLP and the routed experts side by side and the block's
fused tail (three norms, residual, layer scalar). ``gated_mlp`` (the dense MLP and the self-conditioning
MLP) and ``experts`` (router on the raw residual, experts on ``pre_feedforward_layernorm_2``, trap T7) are
its two sub-sequences. Around it, also once: ``blocks`` (every layer in order, the encoder's or the decoder's
layer scalars, the error naming the first layer whose output is not finite), ``encoder_hidden`` (embedding
and blocks), ``decoder_hidden`` (canvas embedding plus the self-conditioning signal, its check, blocks,
final norm), ``self_conditioning_signal`` (SPEC §7.1), and the reference's input checks of ``encode`` and
``denoise`` (``encode_inputs``, ``denoise_inputs``, ``check_cache``). A new dtype changes the ops objects
and the weights they hold, not this order. Every array operation goes through two objects:

* ``ops``, the device's operations (``fast.model.CpuOps``: the Cython kernels and the tiled BLAS on
  ``Workspace`` buffers; ``fast.gpu.model.GpuOps``: CUDA launches and cuBLAS on a ``CupyDevice`` /
  ``SimDevice``, fresh device buffers so that a captured pass keeps each of them): ``buffer(name, shape,
  dtype)``, ``matmul(a, b, out)``, ``embed(ids, table, signal, normed, out)``, ``rms_norm(x, weight,
  out)``, ``router_input(h, weight, out)`` (``rms_norm * hidden_size ** -0.5``), ``heads(...)``,
  ``residual_norm_add(h, y, weight)``, ``gated_gelu(gate_up, out)``, ``route(...)``, ``expert_mix(w, x,
  indices, weights)`` (the experts after routing, in the device's own layout), ``feed_forward_residual(h,
  dense, moe, w, scalar)`` (returns how many rows of the new residual are not finite, or 0 where the
  device does not check), ``count_non_finite_rows(h)`` and ``non_finite(...)`` (the error naming the
  stage and layer), the self-conditioning input's ``probs_times_embedding``, ``scale`` and ``mask_rows``,
  and, so that a profiler can wrap them (``benchmarks/bench_fast.py``), ``layer``, ``gated_mlp`` and
  ``experts`` (normally this module's functions);
* ``keys``, the pass's key set (one per backend and pass): ``new_kv(l, w)`` returns storage for the call's
  keys and values (N, g, S, d), ``rope(l)`` the (S, d/2) cos and sin, ``attend(l, w, q, k, v, out)`` runs
  the attention and keeps what the pass keeps of the new keys; ``cache``, the pass's cache (named by the
  non-finite error).

Nothing here copies between host and device, so a decoder pass on the GPU stays capturable (``graph.py``).

What still differs between the backends, behind those objects (and why):

* buffers: the CPU reuses named ``Workspace`` buffers; the GPU allocates each from its memory pool (a
  captured pass keeps every buffer it used, so nothing may be reused across passes behind its back);
* encoder keys: the CPU writes a full layer's keys straight into the cache slots and a sliding layer's into
  its ring right after its attention, marking the cache unusable if the pass fails midway; the GPU keeps
  every layer's keys and commits them after the last layer (the cache is unchanged on failure);
* non-finite checks: the CPU's fused tail counts non-finite rows per layer and the model raises
  ``NonFiniteError`` naming the layer; the GPU pass has no per-layer check (a flagged step is re-run on the
  host, ``fast/gpu/diagnosis.py``);
* the router's scaling: the CPU multiplies after its norm kernel, the GPU folds it into the norm's ``post``
  factor (the same float32 product of the same rounded values);
* the experts: CPU panels of a register-tiled kernel (Q8_0 or bf16 kept), GPU grouping into tiles and a
  grouped GEMM;
* RoPE tables: memoised per (layer type, start, length) on the CPU; uploaded once per pass (and kept for a
  canvas's steps) on the GPU;
* the checks of a call's inputs are this module's (``encode_inputs``, ``denoise_inputs``, ``check_cache``),
  but only the CPU refuses a pass whose activations exceed the host's free memory (``check_pass_memory``:
  the GPU's activations live on the device, whose allocator says so itself);
* the self-conditioning input: the CPU multiplies the probabilities of contiguous rows by the embedding in
  one product (else row by row), the GPU row by row; a row switched off by the training mask is
  multiplied by 0 on the CPU, set to 0 on the GPU;
* the tied head and the soft-cap stay each model's own: the CPU caps (and checks) the logits it writes
  row by row, the GPU writes raw logits into its step's buffer (capped by the sampling kernel);
* the self-conditioning softmax before the pass: a CPU kernel, or the GPU's sampling kernel at zero
  temperature.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusiongemma.reference.support.checks import (check_attention_mask, check_denoise_inputs, check_positions,
                                                     check_token_ids)
from diffusiongemma.reference.support.errors import InputError

__all__ = ["check_cache", "encode_inputs", "denoise_inputs", "encoder_hidden", "decoder_hidden",
           "self_conditioning_signal", "blocks", "layer", "gated_mlp", "experts"]


# ------------------------------------------------------------------------------------------ the shared checks
def check_cache(cache: Any, cache_class: type) -> Any:
    """``cache`` if it is a ``cache_class`` still usable; ``InputError`` otherwise (a foreign object, or a
    cache an encode call left unusable when it failed midway)."""
    if not isinstance(cache, cache_class):
        raise InputError(f"cache must be a {cache_class.__name__} from Model.new_cache, got {type(cache).__name__}")
    if getattr(cache, "unusable", None):
        raise InputError(f"this cache cannot be used any more: {cache.unusable}; start a new one")
    return cache


def encode_inputs(config: Any, input_ids: Any, cache: Any, attention_mask: Any, cache_class: type) -> tuple:
    """The reference's checks of an ``encode`` call (SPEC §6), on the host, before anything is computed:
    returns the ids (B, n) int64 and the mask (B, n) uint8. ``InputError`` for a foreign or unusable cache,
    ids out of range or of the wrong shape, no tokens, a misshapen mask, positions past
    ``max_position_embeddings``."""
    ids = check_token_ids("input_ids", input_ids, check_cache(cache, cache_class).batch_size, config.vocab_size)
    B, n = ids.shape
    if n == 0:
        raise InputError("input_ids has no tokens (shape (B, 0))")
    mask = check_attention_mask(attention_mask, (B, n)).astype(np.uint8)
    check_positions(config, cache.length, n, f"input_ids ({n} tokens)")
    return ids, mask


def denoise_inputs(config: Any, canvas: Any, cache: Any, sc_logits: Any, sc_mask: Any, cache_class: type) -> tuple:
    """The reference's checks of a ``denoise`` call (SPEC §7): ``check_denoise_inputs`` (ids, shapes, the
    self-conditioning logits and mask) and the canvas's positions; returns its (ids, logits, mask)."""
    checked = check_denoise_inputs(config, canvas, check_cache(cache, cache_class).batch_size, sc_logits, sc_mask)
    C = checked[0].shape[1]
    check_positions(config, cache.length, C, f"the canvas ({C} tokens)")
    return checked


# ------------------------------------------------------------------------------------------ the passes
def encoder_hidden(ops: Any, keys: Any, model: Any, ids: Any, N: int, S: int) -> Any:
    """The encoder's residual after its last block (N*S, H), before the final norm (SPEC §6): the scaled
    token embedding (no input norm) of ``ids`` (N*S,) int64 (on the device), then every block causally.
    The caller stores the keys (``keys``) and applies the final norm where it needs the hidden states."""
    h = ops.buffer("h", (N * S, model.config.hidden_size))
    ops.embed(ids, model.embed_tokens, None, False, h)
    blocks(ops, keys, model, h, N, S, decoder=False)
    return h


def decoder_hidden(ops: Any, keys: Any, model: Any, canvas: Any, N: int, C: int, signal: Any) -> Any:
    """The decoder's final-norm hidden states (N*C, H) (SPEC §7): the canvas embedding ``canvas`` (N*C,)
    int64 (on the device) plus the self-conditioning ``signal`` (N*C, H) or None, normed, then every block
    bidirectionally over the retained cache, then ``final_norm``. The tied head and the soft-cap are the
    caller's (the CPU writes capped logits row by row, the GPU raw logits into its step's buffer)."""
    M, H = N * C, model.config.hidden_size
    h = ops.buffer("h", (M, H))
    ops.embed(canvas, model.embed_tokens, signal, True, h)
    if ops.count_non_finite_rows(h):
        raise ops.non_finite("denoise", "the decoder input (canvas embedding + self-conditioning)",
                             h.reshape(N, C, H), None, None)
    blocks(ops, keys, model, h, N, C, decoder=True)
    hn = ops.buffer("x", (M, H))
    ops.rms_norm(h, model.final_norm, hn)
    return hn


def self_conditioning_signal(ops: Any, model: Any, probs: Any, rows: Any, C: int, sc_mask: Any) -> Any:
    """SPEC §7.1: ``u = probs[rows] @ E * embed_scale`` (rows switched off by ``sc_mask`` zeroed), then the
    self-conditioning MLP of ``pre_norm(u)``. probs: (R, C, V) probabilities of which rows ``rows`` (N,) are
    decoded; sc_mask: None or the backend's per-row switch (``ops.mask_rows``). Returns (N*C, H)."""
    N, H = len(rows), model.config.hidden_size
    M = N * C
    u = ops.buffer("sc_u", (M, H))
    ops.probs_times_embedding(probs, rows, C, model.embed_tokens, u)
    ops.scale(u, ops.embed_scale)
    if sc_mask is not None:
        ops.mask_rows(u, N, C, rows, sc_mask)
    x = ops.buffer("x", (M, H))
    ops.rms_norm(u, model.sc_pre_norm, x)
    signal = ops.buffer("sc_signal", (M, H))
    ops.gated_mlp(x, model.sc_gate_up, model.sc_down, signal)
    return signal


def blocks(ops: Any, keys: Any, model: Any, h: Any, N: int, S: int, decoder: bool) -> None:
    """Every block of ``model`` in order on the residual ``h`` (N*S, H), with the encoder's or the decoder's
    layer scalars; the first block whose output the device finds not finite raises ``ops.non_finite``'s
    error naming that layer."""
    stage, kind = ("denoise", "decoder") if decoder else ("encode", "encoder")
    for l, w in enumerate(model.layers):
        if ops.layer(keys, l, w, h, N, S, w.decoder_scalar if decoder else w.encoder_scalar):
            raise ops.non_finite(stage, f"the output of {kind} layer {l}", h.reshape(N, S, -1), l, keys.cache)


# ------------------------------------------------------------------------------------------ one block
def layer(ops: Any, keys: Any, l: int, w: Any, h: Any, N: int, S: int, num_heads: int, scalar: Any) -> int:
    """Block ``l`` (weights ``w``, a ``fast.weights.LayerWeights``) on the residual ``h`` (N*S, H), in place.

    S: tokens per row (the encoder's new tokens, or the canvas); num_heads: query heads; scalar: the
    encoder's or the decoder's layer scalar. Returns the number of rows of the new ``h`` that are not finite
    (0 normally, and always 0 on a device that does not count them).
    """
    M, H = h.shape
    g, d = w.num_kv_heads, w.head_dim
    x = ops.buffer("x", (M, H))
    ops.rms_norm(h, w.input_norm, x)
    proj = ops.buffer("proj", (M, w.qkv.shape[0]))
    ops.matmul(x, w.qkv.T, proj)
    q = ops.buffer("q", (N, S, num_heads, d))
    new_k, new_v = keys.new_kv(l, w)
    cos, sin = keys.rope(l)
    ops.heads(proj, N, S, num_heads, g, d, w.sliding, w.q_norm, w.k_norm, cos, sin, q, new_k, new_v)
    attn = ops.buffer("attn", (N, S, num_heads * d))
    keys.attend(l, w, q, new_k, new_v, attn)
    o = ops.buffer("o", (M, H))
    ops.matmul(attn.reshape(M, num_heads * d), w.o_proj.T, o)
    ops.residual_norm_add(h, o, w.post_attention_norm)
    # feed-forward: dense MLP and routed experts side by side (SPEC §4.2); x is free again
    ops.rms_norm(h, w.pre_ffn_norm, x)
    dense = ops.buffer("dense", (M, H))
    ops.gated_mlp(x, w.mlp_gate_up, w.mlp_down, dense)
    moe = ops.experts(w, h)
    return ops.feed_forward_residual(h, dense, moe, w, scalar)


def gated_mlp(ops: Any, x: Any, gate_up: Any, down: Any, out: Any) -> None:
    """``out = (gelu(x G^T) * (x U^T)) D^T`` with [G; U] stacked in ``gate_up`` (2I, H); x (M, H), out
    (M, down.shape[0])."""
    M = x.shape[0]
    gu = ops.buffer("gate_up", (M, gate_up.shape[0]))
    ops.matmul(x, gate_up.T, gu)
    act = ops.buffer("act", (M, down.shape[1]))
    ops.gated_gelu(gu, act)
    ops.matmul(act, down.T, out)


def experts(ops: Any, w: Any, h: Any, num_experts: int, top_k: int) -> Any:
    """Router and experts on the residual ``h`` (M, H): the router reads ``rms_norm(h) * router_scale *
    H^-0.5`` (the raw residual, trap T7), the experts ``pre_feedforward_layernorm_2(h)``. Returns the
    weighted expert sum (M, H) before ``post_feedforward_layernorm_2`` (a buffer of ``ops``)."""
    M, H = h.shape
    z = ops.buffer("router_in", (M, H))
    ops.router_input(h, w.router_scale, z)
    logits = ops.buffer("router_logits", (M, num_experts))
    ops.matmul(z, w.router.T, logits)
    indices, weights = ops.buffer("top_index", (M, top_k), np.int64), ops.buffer("top_weight", (M, top_k))
    ops.route(logits, w.per_expert_scale, indices, weights)
    x = ops.buffer("expert_in", (M, H))
    ops.rms_norm(h, w.pre_ffn_norm_2, x)
    return ops.expert_mix(w, x, indices, weights)
