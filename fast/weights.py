"""The fast paths' weight layout: the checkpoint's tensors repacked once, for the CPU and the GPU alike.

Both fast paths read a layer's attention projections as one fused matrix and the dense MLP's gate and up
projections as one, so that a block makes one product where the reference makes two or three. ``pack``
builds that layout from the project's tensor names (``reference.weights``), widening to float32 (a
``Q8_0Tensor`` too), and hands every array to ``upload`` (identity on the CPU; a copy to the device on the
GPU). The CPU passes ``experts`` to keep the routed experts in its own panel layout (``fast.experts``),
and ``keep_bf16`` to keep the other large matrices of a bfloat16 checkpoint bfloat16 (``MATRICES_KEPT_BF16``;
its products widen them tile by tile, ``_kernels.gemm_bf16``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.quantized import BFLOAT16, is_bfloat16, widen

__all__ = ["LayerWeights", "PackedWeights", "pack", "pack_layer", "StoreArrays", "host_float32", "MATRICES_KEPT_BF16",
           "LAYER_TENSOR_NAMES"]

#: The fields ``pack(keep_bf16=True)`` keeps bfloat16 when every tensor they are built from is: the products
#: ``x @ W.T`` of the attention, the dense MLP and the self-conditioning MLP. The embedding stays float32:
#: its soft-embedding product ``probs @ E`` sums over the whole vocabulary in one BLAS call, whose operand
#: would have to be widened whole (or summed in another order). The router (E, H) is small and stays float32.
MATRICES_KEPT_BF16 = ("qkv", "o_proj", "mlp_gate_up", "mlp_down", "sc_gate_up", "sc_down")


def host_float32(array: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy (or view) of ``array`` on the host."""
    return np.ascontiguousarray(array, dtype=np.float32)


@dataclass
class LayerWeights:
    """One transformer block's tensors, repacked (float32, C-contiguous, on the model's device; with
    ``pack(keep_bf16=True)`` the matrices of ``MATRICES_KEPT_BF16`` may be bfloat16)."""

    sliding: bool  # sliding-window layer (else full attention, no v_proj)
    head_dim: int  # d of this layer
    num_kv_heads: int  # g of this layer
    qkv: Any  # (n_h*d + g*d [+ g*d], H): [q_proj; k_proj; v_proj (sliding only)]
    o_proj: Any  # (H, n_h*d)
    q_norm: Any  # (d,)
    k_norm: Any  # (d,)
    input_norm: Any  # (H,) input_layernorm
    post_attention_norm: Any  # (H,)
    pre_ffn_norm: Any  # (H,) dense branch input norm
    mlp_gate_up: Any  # (2*I_d, H): [gate_proj; up_proj]
    mlp_down: Any  # (H, I_d)
    post_ffn_norm_1: Any  # (H,) dense branch output norm
    router: Any  # (E, H)
    router_scale: Any  # (H,)
    per_expert_scale: Any  # (E,)
    pre_ffn_norm_2: Any  # (H,) expert input norm
    expert_gate_up: Any  # (E, 2*I_e, H), gate rows first (None when ``experts`` holds them)
    expert_down: Any  # (E, H, I_e) (None when ``experts`` holds them)
    post_ffn_norm_2: Any  # (H,) expert output norm
    post_ffn_norm: Any  # (H,)
    encoder_scalar: np.float32  # layer scalar of the encoder stack
    decoder_scalar: np.float32  # layer scalar of the decoder stack
    experts: Any = None  # the experts in a backend's own layout (CPU: fast.experts.ExpertPanels), or None


#: ``LayerWeights`` fields kept as one checkpoint tensor each -> that tensor's name under ``layers.{l}.``
#: (the diagnosis of non-finite logits names tensors by these; q/k/v and the fused gate/up are split apart).
LAYER_TENSOR_NAMES = {
    "o_proj": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm", "input_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "pre_ffn_norm": "pre_feedforward_layernorm",
    "mlp_down": "mlp.down_proj", "post_ffn_norm_1": "post_feedforward_layernorm_1", "router": "router.proj",
    "router_scale": "router.scale", "per_expert_scale": "router.per_expert_scale",
    "pre_ffn_norm_2": "pre_feedforward_layernorm_2", "expert_gate_up": "experts.gate_up_proj",
    "expert_down": "experts.down_proj", "post_ffn_norm_2": "post_feedforward_layernorm_2",
    "post_ffn_norm": "post_feedforward_layernorm", "encoder_scalar": "encoder_layer_scalar",
    "decoder_scalar": "decoder_layer_scalar"}


@dataclass
class PackedWeights:
    """The whole model in the fast layout."""

    embed_tokens: Any  # (V, H): embedding, tied output projection and self-conditioning soft embedding
    final_norm: Any  # (H,)
    sc_pre_norm: Any  # (H,) self_conditioning.pre_norm
    sc_gate_up: Any  # (2*I_sc, H): [self_conditioning.gate_proj; self_conditioning.up_proj]
    sc_down: Any  # (H, I_sc)
    layers: list  # LayerWeights per layer


def pack(config: ModelConfig, tensors: Mapping[str, np.ndarray],
         upload: Callable[[np.ndarray], Any] = lambda array: array,
         experts: Callable[[Any, Any], Any] | None = None, release: bool = False,
         keep_bf16: bool = False, keep_bf16_embedding: bool = False, layers: bool = True,
         embedding: Any = None) -> PackedWeights:
    """Repack checked ``tensors`` (``reference.weights.check_tensors``) into the fast layout.

    upload: called on every float32 host array; returns what the model keeps (a device array on a GPU).
    experts: if given, ``experts(gate_up_proj, down_proj)`` of each layer (the checkpoint's tensors as they
    are, float32 or ``Q8_0Tensor``) becomes ``LayerWeights.experts`` and the two expert fields are None.
    release: ``tensors`` is a dict of the caller's that may be emptied: each layer's expert tensors are
    dropped from it once repacked, so that a load holds the checkpoint's copy of one layer at most.
    keep_bf16: a matrix of ``MATRICES_KEPT_BF16`` whose tensors are all bfloat16 stays bfloat16 (host
    arrays, C-contiguous, handed to ``upload`` too); otherwise everything is widened to float32.
    keep_bf16_embedding: with ``keep_bf16``, a bfloat16 ``embed_tokens`` stays bfloat16 too (the CPU's
    bfloat16 run, whose soft-embedding product need not be the float32 path's bit for bit).
    layers: False leaves ``PackedWeights.layers`` empty, for a caller that packs each layer when it needs it
    (``pack_layer``; the CPU path over a checkpoint larger than its weight budget).
    embedding: what to keep as ``embed_tokens`` instead of reading it (the CPU path's large Q8_0 or float16
    table, kept as the file stores it: ``reference.support.weight_store.StoredTensor``).
    A tensor that is a view of a mapped file (``reference.support.weight_store``) and needs no repacking is
    kept as that view (no copy): a float32 matrix of a float32 file, a bfloat16 one kept bfloat16.
    """
    t = _Widened(tensors)  # float32 values, quantized tensors dequantized (t.raw: as given)
    put = lambda array: upload(host_float32(array))  # noqa: E731
    matrix = functools.partial(_matrix, tensors, upload, keep_bf16)
    if embedding is None:
        embedding = (upload(np.ascontiguousarray(tensors["embed_tokens"]))
                     if keep_bf16 and keep_bf16_embedding and is_bfloat16(tensors["embed_tokens"])
                     else put(t["embed_tokens"]))
    return PackedWeights(
        embed_tokens=embedding,
        final_norm=put(t["final_norm"]),
        sc_pre_norm=put(t["self_conditioning.pre_norm"]),
        sc_gate_up=matrix("self_conditioning.gate_proj", "self_conditioning.up_proj"),
        sc_down=matrix("self_conditioning.down_proj"),
        layers=[pack_layer(config, tensors, l, upload, experts, release, keep_bf16)
                for l in range(config.num_hidden_layers)] if layers else [],
    )


def _matrix(tensors: Mapping[str, Any], upload: Callable, keep_bf16: bool, *names: str):
    """The named tensors stacked by rows: bfloat16 if kept (see ``pack``'s keep_bf16), else float32."""
    raw = [tensors[name] for name in names]
    if keep_bf16 and all(is_bfloat16(a) for a in raw):
        return upload(np.ascontiguousarray(raw[0] if len(raw) == 1 else np.concatenate(raw)))
    return upload(host_float32(widen(raw[0]) if len(raw) == 1 else np.concatenate([widen(a) for a in raw])))


def pack_layer(config: ModelConfig, tensors: Mapping[str, Any], l: int,
               upload: Callable[[np.ndarray], Any] = lambda array: array,
               experts: Callable[[Any, Any], Any] | None = None, release: bool = False,
               keep_bf16: bool = False) -> LayerWeights:
    """Layer ``l`` of ``pack``'s layout (same arguments)."""
    t = _Widened(tensors)
    put = lambda array: upload(host_float32(array))  # noqa: E731
    matrix = functools.partial(_matrix, tensors, upload, keep_bf16)
    p = f"layers.{l}."
    sliding = config.is_sliding(l)
    projections = [p + "q_proj", p + "k_proj"] + ([p + "v_proj"] if sliding else [])
    return LayerWeights(
        sliding=sliding, head_dim=config.layer_head_dim[l], num_kv_heads=config.layer_num_key_value_heads[l],
        qkv=matrix(*projections), o_proj=matrix(p + "o_proj"),
        q_norm=put(t[p + "q_norm"]), k_norm=put(t[p + "k_norm"]),
        input_norm=put(t[p + "input_layernorm"]), post_attention_norm=put(t[p + "post_attention_layernorm"]),
        pre_ffn_norm=put(t[p + "pre_feedforward_layernorm"]),
        mlp_gate_up=matrix(p + "mlp.gate_proj", p + "mlp.up_proj"),
        mlp_down=matrix(p + "mlp.down_proj"), post_ffn_norm_1=put(t[p + "post_feedforward_layernorm_1"]),
        router=put(t[p + "router.proj"]), router_scale=put(t[p + "router.scale"]),
        per_expert_scale=put(t[p + "router.per_expert_scale"]),
        pre_ffn_norm_2=put(t[p + "pre_feedforward_layernorm_2"]),
        expert_gate_up=None if experts else put(t[p + "experts.gate_up_proj"]),
        expert_down=None if experts else put(t[p + "experts.down_proj"]),
        experts=_repacked_experts(experts, tensors, p, release) if experts else None,
        post_ffn_norm_2=put(t[p + "post_feedforward_layernorm_2"]),
        post_ffn_norm=put(t[p + "post_feedforward_layernorm"]),
        encoder_scalar=np.float32(np.asarray(t[p + "encoder_layer_scalar"]).reshape(-1)[0]),
        decoder_scalar=np.float32(np.asarray(t[p + "decoder_layer_scalar"]).reshape(-1)[0]),
    )


class StoreArrays(Mapping):
    """A ``WeightStore``'s tensors as the arrays ``pack`` reads: each in its stored type, a view of the mapped
    file (a ``Q8_0Tensor`` for Q8_0), checked finite the first time it is read. ``bf16_run``: each rounded to
    bfloat16 first (the bfloat16 run; Q8_0 dequantized, then rounded), held bfloat16 with ``keep_bf16`` and
    widened to float32 without."""

    def __init__(self, store, bf16_run: bool = False, keep_bf16: bool = True, experts_stored: bool = False):
        """experts_stored: the experts' two tensors of each layer come as the store's ``StoredTensor`` itself
        (checked, not read), for a kernel that reads them where they lie (``fast.experts.ExpertRows``)."""
        self.store, self.bf16_run, self.keep_bf16, self.experts_stored = store, bf16_run, keep_bf16, experts_stored

    def __getitem__(self, name: str):
        if self.experts_stored and name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return self.store.checked(name)
        value = self.store.checked(name).read()
        if self.bf16_run:
            if not is_bfloat16(value):
                value = widen(value).astype(BFLOAT16)
            if not self.keep_bf16:
                value = widen(value)
        return value

    def __iter__(self):
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)


class _Widened:
    """``tensors[name]`` as float32 (``quantized.widen``); ``raw[name]`` as given."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.raw = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        return widen(self.raw[name])


def _repacked_experts(experts: Callable[[Any, Any], Any], tensors, prefix: str, release: bool) -> Any:
    names = (prefix + "experts.gate_up_proj", prefix + "experts.down_proj")
    repacked = experts(tensors[names[0]], tensors[names[1]])
    if release:
        for name in names:
            del tensors[name]
    return repacked
