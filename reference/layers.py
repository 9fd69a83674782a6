"""One transformer block of DiffusionGemma: attention, dense MLP, router, experts.

The encoder and the decoder run the same blocks with the same weights; only the layer scalar and the
key set / visibility differ, and those are passed in. ``w`` is the dict of one layer's tensors under
the names of ``reference.weights`` without the ``layers.{l}.`` prefix, all float32. ``dtype``: the model's
dtype (``primitives.round_to``): FLOAT32 computes in float32; BFLOAT16 rounds where upstream's bfloat16 run
stores a bfloat16 tensor (SPEC §10).
Shapes: B batch, S query tokens, T keys, H hidden, n_h query heads, g KV heads, r = n_h/g, d head dim,
E experts, K experts per token.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .config import ModelConfig
from .primitives import FLOAT32, apply_rope, gated_mlp, gelu_tanh, linear, rms_norm, round_to


def project_qkv(x: np.ndarray, w: dict, config: ModelConfig, layer: int, cos: np.ndarray, sin: np.ndarray,
                dtype: np.dtype = FLOAT32):
    """Queries, keys and values of the normed input ``x`` (B, S, H).

    Returns q (B, S, n_h, d), k (B, g, S, d), v (B, g, S, d), float32:
    q = RoPE(q_norm(x Wq)); k = RoPE(k_norm(x Wk)); v = norm(x Wv) with a weightless norm. On
    full-attention layers there is no ``v_proj``: v is the *raw* key projection ``x Wk`` (taken before
    ``k_norm`` and before RoPE), then the weightless norm (SPEC §4.1 step 3, trap T3).
    """
    B, S, _ = x.shape
    d, g = config.layer_head_dim[layer], config.layer_num_key_value_heads[layer]
    eps = config.rms_norm_eps
    q = linear(x, w["q_proj"], dtype).reshape(B, S, config.num_attention_heads, d)  # (B, S, n_h, d)
    q = apply_rope(rms_norm(q, w["q_norm"], eps, dtype), cos, sin, dtype)
    k_raw = linear(x, w["k_proj"], dtype).reshape(B, S, g, d)  # (B, S, g, d)
    v_raw = linear(x, w["v_proj"], dtype).reshape(B, S, g, d) if "v_proj" in w else k_raw
    k = apply_rope(rms_norm(k_raw, w["k_norm"], eps, dtype), cos, sin, dtype)
    v = rms_norm(v_raw, None, eps, dtype)
    return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # k, v: (B, g, S, d)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray,
           dtype: np.dtype = FLOAT32) -> np.ndarray:
    """Grouped-query attention with scale 1.0 and a float32 softmax.

    q: (B, S, n_h, d). keys, values: (B, g, T, d); KV head ``j`` serves query heads ``j*r .. j*r + r-1``.
    visible: (B, S or 1, T) bool. Returns (B, S, n_h * d) float32, heads concatenated in order.

    Scores are ``<q, k>`` with no ``1/sqrt(d)`` and no soft-cap (trap T2). A query that sees no key at
    all (a padding token whose every key is padding) gets a zero output: upstream produces an arbitrary
    mixture there, and nothing ever reads it, because padded positions are hidden from every other query.
    In bfloat16 (upstream ``eager_attention_forward``) the scores are rounded, the softmax runs in float32
    and its weights are rounded (``softmax(..., dtype=torch.float32).to(query.dtype)``) before the product
    with V, whose result is rounded too.
    """
    B, S, n_h, d = q.shape
    g = keys.shape[1]
    r = n_h // g
    q = q.reshape(B, S, g, r, d).transpose(0, 2, 3, 1, 4)  # (B, g, r, S, d)
    scores = round_to(q @ keys[:, :, None].swapaxes(-1, -2), dtype)  # (B, g, r, S, T)
    mask = visible[:, None, None, :, :]  # (B, 1, 1, S|1, T)
    scores = np.where(mask, scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    probs = np.exp(scores - peak)
    total = np.sum(probs, axis=-1, keepdims=True)
    probs = round_to(probs / np.where(total > 0, total, 1.0), dtype)
    out = round_to(probs.astype(np.float32) @ values[:, :, None], dtype)  # (B, g, r, S, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, S, n_h * d)  # (B, S, n_h*d)


def lower_index_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """The K largest router probabilities of each row, largest first, equal values by lower expert index.

    probs: (N, E) float32; k: K <= E. Returns (N, K) int64 expert indices (a stable descending sort; NaN
    last). This is the project's rule where upstream has none: transformers takes ``torch.topk``, whose
    order among equal values torch documents as not guaranteed (on the CPU it is whatever libstdc++'s
    selection leaves, e.g. experts {1, 2} of [1, 1, 1, 0] for K = 2; ``variants/router.py``). It matters
    only for an exact tie at the K-th place (trap T25); JAX's ``lax.top_k`` documents this same rule.
    """
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


def route(h: np.ndarray, w: dict, config: ModelConfig,
          top_k: "Callable[[np.ndarray, int], np.ndarray]" = lower_index_top_k, *,
          dtype: np.dtype = FLOAT32) -> tuple[np.ndarray, np.ndarray]:
    """Pick K experts per token and their weights.

    h: (N, H), the raw residual stream after attention (not a pre-FFN norm: trap T7).
    Returns (indices (N, K) int64, weights (N, K) float32):
    z = norm(h) * scale * H**-0.5 (weightless norm); p = softmax(z W_router^T) over all E experts in
    float32; take the K largest (``top_k``; by default ties go to the lower expert index, trap T25);
    renormalise them to sum to 1; then multiply each by ``per_expert_scale`` of its expert.
    Upstream: ``DiffusionGemmaTextRouter``.
    In bfloat16 the norm, the product with ``scale`` and the product with the Python float H**-0.5 (which
    torch keeps in float32) are each rounded, and so are the router logits; the softmax, the top-K weights
    and their renormalisation stay float32 (``softmax(..., dtype=torch.float32)``), ``per_expert_scale``
    (bfloat16) promoted to float32.
    """
    z = round_to(rms_norm(h, None, config.rms_norm_eps, dtype) * w["router.scale"], dtype)
    z = round_to(z * np.float32(config.hidden_size ** -0.5), dtype)
    logits = linear(z, w["router.proj"], dtype)  # (N, E)
    logits = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    top = top_k(probs, config.top_k_experts)  # (N, K)
    top_p = np.take_along_axis(probs, top, axis=-1)
    weights = top_p / top_p.sum(axis=-1, keepdims=True) * w["router.per_expert_scale"][top]
    return top, weights.astype(np.float32)


def experts(x: np.ndarray, indices: np.ndarray, weights: np.ndarray, w: dict, dtype: np.dtype = FLOAT32) -> np.ndarray:
    """Weighted sum of the chosen experts' gated MLPs.

    x: (N, H) expert input (``pre_feedforward_layernorm_2`` of the residual). indices, weights: (N, K).
    Expert e computes ``down[e] @ (gelu(G_e x) * (U_e x))`` where ``gate_up_proj[e]`` stacks the gate rows
    (first I_e) over the up rows (last I_e) (trap T8). Returns (N, H) float32. Each expert runs once on
    the tokens routed to it (a loop over experts, never over tokens). Upstream: ``DiffusionGemmaTextExperts``.
    In bfloat16, each expert's projections, GELU and product are rounded; its bfloat16 output times the
    float32 routing weight is float32, and the K weighted outputs of a token are summed in float32 and
    rounded once: transformers' default experts implementation on the CPU, ``grouped_mm_experts_forward``
    (``integrations/moe.py``: ``weighted_out.view(...).sum(dim=1)`` then ``.to(hidden_states.dtype)``). The
    class's own ``forward`` (``experts_implementation="eager"``) would instead round after each
    ``index_add_`` (SPEC §10 B6).
    """
    gate_up, down = w["experts.gate_up_proj"], w["experts.down_proj"]
    inner = down.shape[2]
    out = np.zeros_like(x)
    for e in np.unique(indices):
        token, slot = np.nonzero(indices == e)  # tokens that chose expert e, and in which top-k slot
        gu = linear(x[token], gate_up[e], dtype)  # (n_e, 2*I_e)
        y = linear(round_to(gelu_tanh(gu[:, :inner], dtype) * gu[:, inner:], dtype), down[e], dtype)  # (n_e, H)
        np.add.at(out, token, y * weights[token, slot][:, None])
    return round_to(out, dtype)


def feed_forward(h: np.ndarray, w: dict, config: ModelConfig,
                 top_k: "Callable[[np.ndarray, int], np.ndarray]" = lower_index_top_k, *,
                 dtype: np.dtype = FLOAT32) -> np.ndarray:
    """Dense MLP and routed experts in parallel on the residual ``h`` (B, S, H); returns their normed sum.

    dense = post_ffn_1(MLP(pre_ffn(h))); moe = post_ffn_2(experts(pre_ffn_2(h)) routed on raw h);
    returns post_ffn(dense + moe), (B, S, H). The ``_1`` norms belong to the dense branch and the ``_2``
    norms to the experts (SPEC §4.2). ``top_k``: the router's selection (``route``).
    """
    eps = config.rms_norm_eps
    dense = gated_mlp(rms_norm(h, w["pre_feedforward_layernorm"], eps, dtype),
                      w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"], dtype)
    dense = rms_norm(dense, w["post_feedforward_layernorm_1"], eps, dtype)
    flat = h.reshape(-1, h.shape[-1])  # (B*S, H)
    indices, weights = route(flat, w, config, top_k, dtype=dtype)
    moe = experts(rms_norm(flat, w["pre_feedforward_layernorm_2"], eps, dtype), indices, weights, w, dtype)
    moe = rms_norm(moe.reshape(h.shape), w["post_feedforward_layernorm_2"], eps, dtype)
    return rms_norm(round_to(dense + moe, dtype), w["post_feedforward_layernorm"], eps, dtype)
