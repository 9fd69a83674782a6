"""GGUF checkpoints (``weights_converter/gguf.py``): llama.cpp's ``diffusion-gemma`` layout read back and
checked against transformers.

The files are written here the way llama.cpp's converter (``conversion/diffusion_gemma.py`` on
``Gemma4Model``) and ``llama-quantize`` write them, from a tiny randomised transformers model: the converter's
tensor names (``HF_TO_GGUF``, transcribed from the converter and gguf-py's tensor map, independently of the
reader's table), its metadata keys, 1-D tensors kept F32, matrices in the requested type when their rows
(ne[0]) are a whole number of blocks, else F16 (llama-quantize's fallback). The K-quant encoders below are
simple (not llama.cpp's search for the best scales) but produce valid blocks: the reader's output is checked
against our own decoding formula of each format, so orientation and layout errors show.

Two comparisons per type:

* **same rounding on both sides**: transformers runs on the dequantized weights (the reader's float32
  tensors copied into it), so the only difference left is float32 summation order: ``ATOL`` as in
  ``test_model_parity`` (2e-4 on logits of magnitude O(1)-O(10)). This holds for every type.
* **against the unquantized model**, within a bound derived from the format. Each format stores a weight
  as a grid point of step ``s`` (per block) and rounds to nearest, so the error is at most ``s/2`` per
  weight (asserted exactly, block by block, for our encoders) and, over a block, close to uniform on
  ``[-s/2, s/2]``: relative RMS error ``rho = RMS(W_q - W) / RMS(W)`` (measured on the file, per type:
  F16 ~3e-4, BF16 ~2e-3, Q8_0 ~5e-3, Q6_K ~1e-2, Q5_K ~2e-2, Q4_K ~4e-2). To first order the logits move
  linearly in the weight error. We measure the model's response ``D_ref`` (max |logit change|) to an
  independent Gaussian perturbation of every matrix with relative RMS ``rho_ref = 1e-3``, and bound the
  quantized logits' error by ``3 * (rho / rho_ref) * D_ref``: linear scaling of a sum of many independent
  small errors (the same second moment gives the same distribution of logit errors, whatever the shape of
  the per-weight error), with a factor 3 for the fluctuation of a maximum over C*V entries between two
  independent draws and for second-order terms at the coarsest type. The test also checks that the error is
  not far *below* the scaled reference (more than 20x), which would mean the file was not really
  quantized as claimed.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q

from diffusiongemma.reference.support.errors import CheckpointError
from diffusiongemma.reference.model import Model
from diffusiongemma.weights_converter import convert
from diffusiongemma.checkpoint import TextSide
from diffusiongemma.weights_converter.gguf import GGUFCheckpoint, gguf_text_side, load_gguf_checkpoint
from diffusiongemma.weights_converter.names import hf_name
from tests.hf_oracle import hf_cache, hf_denoise, hf_encode
from tests.hf_tiny import FULL, SLIDING, TinySpec, tiny_model

ATOL = 2e-4
ARCH = "diffusion-gemma"
# Rows of every matrix are a multiple of 256, so the K-quants (256-element super-blocks) apply everywhere.
SPEC = TinySpec(vocab_size=128, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL], num_attention_heads=4, num_key_value_heads=2,
                num_global_key_value_heads=1, head_dim=64, global_head_dim=128, num_experts=4, top_k_experts=2,
                sliding_window=8, canvas_length=16)

# HF key (after llama.cpp's "language_model." strip and "model.decoder." -> "model.") -> GGUF name.
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "layer_scalar": "layer_output_scale.weight",
}
SELF_CONDITIONING = {"pre_norm.weight": "self_cond_pre_norm.weight", "gate_proj.weight": "self_cond_gate.weight",
                     "up_proj.weight": "self_cond_up.weight", "down_proj.weight": "self_cond_down.weight"}


# ================================================================================================ K-quant encoders
def _f16_up(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= x (x >= 0), as float32."""
    h = x.astype(np.float16)
    h = np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float32)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of gguf's ``Q4_K.get_scale_min``: eight 6-bit scales and mins into 12 bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=1)


def _affine_k(blocks: np.ndarray, qmax: int):
    """Q4_K/Q5_K scales: eight sub-blocks of 32, w = d*sc*q - dmin*m, no clipping (see the module docstring).

    Returns (d16, dmin16, sc, m, q, step) with step = d16*sc per sub-block.
    """
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = sub.max(axis=2)
    dmin = _f16_up((-lo).max(axis=1) / 63)
    m = np.where(dmin[:, None] > 0, np.ceil(-lo / np.where(dmin[:, None] > 0, dmin[:, None], 1)), 0)
    offset = dmin[:, None] * m
    span = (hi + offset) / qmax
    d = _f16_up(span.max(axis=1) / 63)
    sc = np.where(d[:, None] > 0, np.ceil(span / np.where(d[:, None] > 0, d[:, None], 1)), 0)
    step = (d[:, None] * sc).astype(np.float32)
    safe = np.where(step > 0, step, 1)
    q = np.clip(np.rint((sub + offset[..., None]) / safe[..., None]), 0, qmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8).reshape(n, 256), step


def encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, m, q, _ = _affine_k(blocks, 15)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(n, 2), _pack_scales(sc, m), qs], axis=1)


def encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, m, q, _ = _affine_k(blocks, 31)
    low, high = (q & 0x0F).reshape(n, 4, 2, 32), (q >> 4).reshape(n, 8, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = np.zeros((n, 32), np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(n, 2), _pack_scales(sc, m), qh, qs],
                          axis=1)


def encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Sixteen sub-blocks of 16, w = d*sc*(q - 32), int8 scales rounded up so that no value clips."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d = _f16_up(scale.max(axis=1) / 127)
    sc = np.where(d[:, None] > 0, np.ceil(scale / np.where(d[:, None] > 0, d[:, None], 1)), 0)
    step = d[:, None] * sc
    q = (np.clip(np.rint(sub / np.where(step > 0, step, 1)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    low, high = (q & 0x0F).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = np.zeros((n, 2, 32), np.uint8)
    for s in range(4):
        qh |= high[:, :, s] << (2 * s)
    return np.concatenate([ql, qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=1)


K_ENCODERS = {Q.Q4_K: encode_q4_k, Q.Q5_K: encode_q5_k, Q.Q6_K: encode_q6_k}


def decode_reference(raw: np.ndarray, qtype) -> np.ndarray:
    """Our own decoding of a K-quant block array (from the formats' definitions), independent of gguf.quants."""
    n = raw.shape[0]
    if qtype == Q.Q6_K:
        ql, qh, sc, d = raw[:, :128], raw[:, 128:192], raw[:, 192:208].view(np.int8), raw[:, 208:210]
        d = d.copy().view(np.float16).astype(np.float32).reshape(n)
        low = np.stack([ql.reshape(n, 2, 64) & 0x0F, ql.reshape(n, 2, 64) >> 4], axis=2).reshape(n, 256)
        high = np.stack([(qh.reshape(n, 2, 32) >> (2 * s)) & 3 for s in range(4)], axis=2).reshape(n, 256)
        q = (low | (high << 4)).astype(np.float32) - 32
        return (d[:, None, None] * sc.astype(np.float32)[:, :, None] * q.reshape(n, 16, 16)).reshape(n, 256)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n)
    s = raw[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1).astype(np.float32)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1).astype(np.float32)
    qs = raw[:, -128:]
    q = np.stack([qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4], axis=2).reshape(n, 256)
    if qtype == Q.Q5_K:
        qh = raw[:, 16:48]
        q = q | (np.stack([(qh >> b) & 1 for b in range(8)], axis=1).reshape(n, 256) << 4)
    q = q.astype(np.float32).reshape(n, 8, 32)
    return (d[:, None, None] * sc[:, :, None] * q - dmin[:, None, None] * mn[:, :, None]).reshape(n, 256)


def quantize(array: np.ndarray, qtype) -> np.ndarray:
    """``array`` (float32, rows a multiple of the block) as the bytes llama-quantize would store."""
    if qtype in K_ENCODERS:
        blocks = array.reshape(-1, 256).astype(np.float32)
        raw = K_ENCODERS[qtype](blocks)
        return raw.reshape(*array.shape[:-1], array.shape[-1] // 256 * raw.shape[1])
    return gguf.quants.quantize(array.astype(np.float32), qtype)


# ================================================================================================ the writer
def gguf_tensors(model) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as llama.cpp's converter maps a DiffusionGemmaForBlockDiffusion state dict."""
    out: dict[str, np.ndarray] = {}
    for key, value in model.state_dict().items():
        array = value.detach().float().numpy().copy()
        key = key.replace("language_model.", "")
        if "vision" in key or key == "lm_head.weight":
            continue  # vision dropped; the head is tied to token_embd
        if key.startswith("model.encoder."):
            if key.endswith("layer_scalar"):
                out[f"blk.{key.split('.')[3]}.enc_layer_output_scale.weight"] = array
            continue  # the encoder's other weights are the decoder's
        if key.startswith("model.decoder.self_conditioning."):
            out[SELF_CONDITIONING[key[len("model.decoder.self_conditioning."):]]] = array
            continue
        key = "model." + key[len("model.decoder."):]
        if key in HF_TO_GGUF:
            out[HF_TO_GGUF[key]] = array
        else:
            _, _, layer, rest = key.split(".", 3)
            out[f"blk.{layer}.{HF_TO_GGUF[rest]}"] = array
    from diffusiongemma.reference.config import ModelConfig

    cfg = ModelConfig.from_transformers(model.config.to_dict())
    head_dim = cfg.layer_head_dim[cfg.layer_types.index(FULL)]
    n_rot = int(head_dim * cfg.rope_parameters[FULL].partial_rotary_factor / 2)
    out["rope_freqs.weight"] = np.array([1.0] * n_rot + [1e30] * (head_dim // 2 - n_rot), np.float32)
    return out


def write_gguf(path, model, qtype=Q.F32, *, tensors=None, tokenizer=None, generation=None, edit_metadata=None,
               types=None) -> str:
    """Write ``model`` as llama.cpp's converter + llama-quantize would; returns the path.

    qtype: the type of matrices (llama-quantize's target); 1-D tensors stay F32, matrices whose rows are not
    whole blocks fall back to F16. tensors: replaces the GGUF tensor dict (for bad-input tests).
    tokenizer: a tokenizers.json dict to store as tokenizer.ggml.* (the Gemma 4 converter's keys).
    generation: generation_config.json dict for the diffusion.eb_* keys. edit_metadata(writer-ready list):
    callback that may change the (key, type, value) list before writing. types: GGUF name -> forced type.
    """
    from diffusiongemma.reference.config import ModelConfig

    cfg = ModelConfig.from_transformers(model.config.to_dict())  # transformers 5.24 keeps per-layer values apart
    full = cfg.layer_types.index(FULL)
    sliding = cfg.layer_types.index(SLIDING) if SLIDING in cfg.layer_types else full
    tensors = gguf_tensors(model) if tensors is None else tensors
    meta: list[tuple[str, str, object]] = [
        (f"{ARCH}.block_count", "u32", cfg.num_hidden_layers),
        (f"{ARCH}.context_length", "u32", cfg.max_position_embeddings),
        (f"{ARCH}.embedding_length", "u32", cfg.hidden_size),
        (f"{ARCH}.feed_forward_length", "u32", cfg.intermediate_size),
        (f"{ARCH}.attention.head_count", "u32", cfg.num_attention_heads),
        (f"{ARCH}.attention.head_count_kv", "arr_i32", list(cfg.layer_num_key_value_heads)),
        (f"{ARCH}.attention.layer_norm_rms_epsilon", "f32", cfg.rms_norm_eps),
        (f"{ARCH}.attention.key_length", "u32", cfg.layer_head_dim[full]),
        (f"{ARCH}.attention.value_length", "u32", cfg.layer_head_dim[full]),
        (f"{ARCH}.attention.key_length_swa", "u32", cfg.layer_head_dim[sliding]),
        (f"{ARCH}.attention.value_length_swa", "u32", cfg.layer_head_dim[sliding]),
        (f"{ARCH}.attention.sliding_window", "u32", cfg.sliding_window),
        (f"{ARCH}.attention.sliding_window_pattern", "arr_bool", [t == SLIDING for t in cfg.layer_types]),
        (f"{ARCH}.attention.shared_kv_layers", "u32", 0),
        (f"{ARCH}.attention.causal", "bool", False),
        (f"{ARCH}.embedding_length_per_layer_input", "u32", 0),
        (f"{ARCH}.expert_feed_forward_length", "u32", cfg.moe_intermediate_size),
        (f"{ARCH}.expert_count", "u32", cfg.num_experts),
        (f"{ARCH}.expert_used_count", "u32", cfg.top_k_experts),
        (f"{ARCH}.rope.freq_base", "f32", cfg.rope_parameters[FULL].rope_theta),
        (f"{ARCH}.rope.freq_base_swa", "f32", cfg.rope_parameters[SLIDING].rope_theta),
        (f"{ARCH}.rope.dimension_count", "u32", cfg.layer_head_dim[full]),
        (f"{ARCH}.rope.dimension_count_swa", "u32", cfg.layer_head_dim[sliding]),
        (f"{ARCH}.final_logit_softcapping", "f32", cfg.final_logit_softcapping),
        ("diffusion.canvas_length", "u32", cfg.canvas_length),
        ("tokenizer.ggml.bos_token_id", "u32", 2),
        ("tokenizer.ggml.eos_token_id", "u32", 1),
        ("tokenizer.ggml.padding_token_id", "u32", 0),
    ]
    if generation is not None:
        for key, name, kind in (("eb_max_steps", "max_denoising_steps", "u32"), ("eb_t_min", "t_min", "f32"),
                                ("eb_t_max", "t_max", "f32"), ("eb_stability_threshold", "stability_threshold", "u32"),
                                ("eb_confidence_threshold", "confidence_threshold", "f32")):
            if name in generation:
                meta.append((f"diffusion.{key}", kind, generation[name]))
        if "sampler_config" in generation:
            meta.append(("diffusion.eb_entropy_bound", "f32", generation["sampler_config"]["entropy_bound"]))
    if tokenizer is not None:
        meta += tokenizer_metadata(tokenizer)
    if edit_metadata is not None:
        meta = edit_metadata(meta)
    writer = gguf.GGUFWriter(os.fspath(path), ARCH)
    for key, kind, value in meta:
        if key == "general.architecture":
            continue
        if kind == "u32":
            writer.add_uint32(key, value)
        elif kind == "f32":
            writer.add_float32(key, value)
        elif kind == "bool":
            writer.add_bool(key, value)
        elif kind == "str":
            writer.add_string(key, value)
        elif kind == "arr_bool":
            writer.add_key_value(key, [bool(v) for v in value], gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.BOOL)
        elif kind == "arr_i32":
            writer.add_key_value(key, [int(v) for v in value], gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.INT32)
        else:  # arrays of strings / floats
            writer.add_array(key, value)
    for name, array in tensors.items():
        kind = (types or {}).get(name, qtype if array.ndim >= 2 else Q.F32)
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if array.shape[-1] % block:
            kind = Q.F16
        if kind == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)


def tokenizer_metadata(tokenizer_json: dict) -> list:
    """tokenizer.ggml.* as the Gemma 4 converter writes it from an HF tokenizer.json (tokens in id order,
    token types, merges as "left right", special ids, add_bos_token) plus tokenizer.chat_template."""
    vocab = dict(tokenizer_json["model"]["vocab"])
    added = {t["id"]: t for t in tokenizer_json["added_tokens"]}
    for i, t in added.items():
        vocab[t["content"]] = i
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    types = [3 if i in added and added[i]["special"] else 4 if i in added else
             6 if tokens[i].startswith("<0x") and len(tokens[i]) == 6 else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    kind = "gpt2" if tokenizer_json.get("pre_tokenizer", {}) and tokenizer_json["pre_tokenizer"].get("type") == "ByteLevel" \
        else "gemma4"
    return [("tokenizer.ggml.model", "str", kind), ("tokenizer.ggml.tokens", "arr", tokens),
            ("tokenizer.ggml.scores", "arr", [0.0] * len(tokens)), ("tokenizer.ggml.token_type", "arr_i32", types),
            ("tokenizer.ggml.merges", "arr", merges), ("tokenizer.ggml.unknown_token_id", "u32", 3),
            ("tokenizer.ggml.add_bos_token", "bool", True), ("tokenizer.ggml.add_space_prefix", "bool", False),
            ("tokenizer.chat_template", "str", "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n"
                                               "{{ m['content'] }}<turn|>\n{% endfor %}<|turn>model\n")]


# ================================================================================================ fixtures
@pytest.fixture(scope="module")
def hf():
    return tiny_model(SPEC, seed=3)


@pytest.fixture(scope="module")
def hf_smooth():
    from dataclasses import replace

    return tiny_model(replace(SPEC, top_k_experts=SPEC.num_experts), seed=3)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(5).integers(5, SPEC.vocab_size, size=(2, 12))


def ours_logits(model: Model, prompt: np.ndarray) -> list[np.ndarray]:
    rng = np.random.default_rng(9)
    cache = model.new_cache(prompt.shape[0])
    model.encode(prompt, cache)
    canvas = rng.integers(0, SPEC.vocab_size, size=(prompt.shape[0], SPEC.canvas_length))
    first = model.denoise(canvas, cache)
    return [first, model.denoise(canvas, cache, (first / np.float32(0.7)).astype(np.float32))]


def hf_logits(model, prompt: np.ndarray, sc: np.ndarray) -> list[np.ndarray]:
    rng = np.random.default_rng(9)
    cache = hf_cache(model)
    hf_encode(model, cache, prompt)
    canvas = rng.integers(0, SPEC.vocab_size, size=(prompt.shape[0], SPEC.canvas_length))
    return [hf_denoise(model, cache, canvas), hf_denoise(model, cache, canvas, sc)]


def hf_with(model, tensors: dict[str, np.ndarray]):
    """A copy of the transformers model holding ``tensors`` (project names; encoder tied, scalars separate)."""
    import copy

    import torch

    clone = copy.deepcopy(model)
    state = {}
    for name, array in tensors.items():
        key = hf_name(name)
        state[key] = torch.tensor(array)
        if key.startswith("model.decoder.") and "layer_scalar" not in key and "self_conditioning" not in key:
            state["model.encoder.language_model." + key[len("model.decoder."):]] = state[key]
    state["lm_head.weight"] = state["model.decoder.embed_tokens.weight"]
    missing, unexpected = clone.load_state_dict(state, strict=False)
    assert not unexpected and all("vision" in k for k in missing), (missing, unexpected)
    return clone


def relative_rms(a: dict, b: dict) -> float:
    """RMS over every matrix of (a - b) relative to the RMS of b."""
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in b if b[k].ndim >= 2)
    den = sum(float(np.sum(b[k].astype(np.float64) ** 2)) for k in b if b[k].ndim >= 2)
    return (num / den) ** 0.5


def project_tensors(model) -> dict[str, np.ndarray]:
    from diffusiongemma.weights_converter.names import project_name

    out = {}
    for key, value in model.state_dict().items():
        name = project_name(key)
        if name is not None:
            out[name] = value.detach().float().numpy().copy()
    return out


# ================================================================================================ tests
def test_f32_file_is_the_transformers_model(tmp_path, hf, prompt):
    """F32: every tensor comes back bit for bit, the config equals the transformers one, logits agree."""
    from diffusiongemma.reference.config import ModelConfig

    config, tensors = load_gguf_checkpoint(write_gguf(tmp_path / "m.gguf", hf))
    expected = ModelConfig.from_transformers(hf.config.to_dict())
    assert config == expected
    originals = project_tensors(hf)
    assert set(tensors) == set(originals)
    for name, array in tensors.items():
        np.testing.assert_array_equal(array, originals[name], err_msg=name)
    ours = ours_logits(Model(config, tensors), prompt)
    theirs = hf_logits(hf, prompt, (ours[0] / np.float32(0.7)).astype(np.float32))
    for a, b in zip(ours, theirs):
        assert np.max(np.abs(a - b)) < ATOL


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_quantized_file_matches_transformers(tmp_path, hf, prompt, qtype):
    """The type's per-weight bound, our own decoding of the blocks, and (same rounding on both sides) logits
    equal to transformers' within float32 noise. The legacy 32-blocks (Q4_0..Q5_1, quantized by the gguf
    package itself) get the same-rounding check only."""
    path = write_gguf(tmp_path / f"m-{qtype.name}.gguf", hf, qtype)
    checkpoint = GGUFCheckpoint.open(path)
    matrix_types = {checkpoint.tensors[n].tensor_type for n in checkpoint.tensors
                    if len(checkpoint.tensors[n].shape) >= 2}
    assert matrix_types == {qtype}, matrix_types  # every matrix really is in the type under test
    config, tensors = load_gguf_checkpoint(path)
    originals = project_tensors(hf)

    # the format's own per-weight bound, against our independent decoding of the stored blocks
    if qtype in K_ENCODERS:
        for gguf_name_, tensor in checkpoint.tensors.items():
            if tensor.tensor_type != qtype:
                continue
            raw = np.fromfile(path, np.uint8, tensor.n_bytes, offset=tensor.data_offset)
            ours_decoded = decode_reference(raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]), qtype)
            if gguf_name_ == "token_embd.weight":
                np.testing.assert_array_equal(tensors["embed_tokens"].reshape(-1, 256), ours_decoded)
    for name, array in tensors.items():
        w = originals[name]
        if w.ndim < 2:
            np.testing.assert_array_equal(array, w, err_msg=name)  # 1-D tensors stay F32
            continue
        blocks, wq = w.reshape(-1, 32), array.reshape(-1, 32)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        # half a grid step, per format: F16/BF16 relative 2^-11/2^-8 per value; Q8_0 amax/127/2 (+ f16 scale);
        # K-quants: the coarsest step of a super-block is (max-min)/qmax widened by the 6-bit scale rounding.
        limit = {Q.F16: np.abs(blocks) * 2.0 ** -11 + 6e-8, Q.BF16: np.abs(blocks) * 2.0 ** -8,
                 Q.Q8_0: amax / 127 * (0.5 + 127 * 2.0 ** -11) + 1e-9}.get(qtype)
        if limit is not None:
            assert np.all(np.abs(wq - blocks) <= limit), name
    if qtype in K_ENCODERS:
        qmax = {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 63}[qtype]
        for name, array in tensors.items():
            w = originals[name]
            if w.ndim < 2:
                continue
            sup = w.reshape(-1, 256)
            span = sup.max(axis=1) - np.minimum(sup.min(axis=1), 0) if qtype != Q.Q6_K else 2 * np.abs(sup).max(axis=1)
            # step <= (span/qmax)*(1 + 1/sc) with sc >= 1 for the largest sub-block: at most twice span/qmax
            bound = span[:, None] / qmax * (1 + 2.0 / 63) + 2e-7 * np.abs(sup).max(axis=1)[:, None]
            assert np.all(np.abs(array.reshape(-1, 256) - sup) <= bound), name

    ours = ours_logits(Model(config, tensors), prompt)
    sc = (ours[0] / np.float32(0.7)).astype(np.float32)
    same = hf_logits(hf_with(hf, tensors), prompt, sc)
    for a, b in zip(ours, same):
        assert np.max(np.abs(a - b)) < ATOL, f"{qtype.name}: {np.max(np.abs(a - b)):.3e} with the same rounding"



@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q4_K], ids=lambda q: q.name)
def test_quantized_logits_within_derived_bound(tmp_path, hf_smooth, prompt, qtype):
    """Against the unquantized transformers model: |logit error| <= 3 * (rho / rho_ref) * D_ref (module docstring).

    The model routes every token to all experts (top_k = E): with top_k < E the logits are not a continuous
    function of the weights (a weight error of any size can flip a near-tied expert choice and move a logit
    by O(1)), so no weight-error bound on the logits exists there; the same-rounding test covers top_k < E.
    """
    config, tensors = load_gguf_checkpoint(write_gguf(tmp_path / f"s-{qtype.name}.gguf", hf_smooth, qtype))
    originals = project_tensors(hf_smooth)
    ours = ours_logits(Model(config, tensors), prompt)
    sc = (ours[0] / np.float32(0.7)).astype(np.float32)
    rho = relative_rms(tensors, originals)
    rho_ref = 1e-3
    rng = np.random.default_rng(11)
    perturbed = {k: (v + rho_ref * np.sqrt(np.mean(v.astype(np.float64) ** 2)) * rng.standard_normal(v.shape)
                     ).astype(np.float32) if v.ndim >= 2 else v for k, v in originals.items()}
    reference = hf_logits(hf_smooth, prompt, sc)
    d_ref = max(float(np.max(np.abs(a - b)))
                for a, b in zip(hf_logits(hf_with(hf_smooth, perturbed), prompt, sc), reference))
    bound = 3 * (rho / rho_ref) * d_ref
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, reference))
    print(f"{qtype.name}: rho={rho:.2e} D_ref={d_ref:.2e} bound={bound:.3e} error={error:.3e}")
    assert error <= bound, f"{qtype.name}: logit error {error:.3e} > derived bound {bound:.3e} (rho={rho:.2e})"
    assert error >= bound / 60, f"{qtype.name}: error {error:.3e} suspiciously far below {bound:.3e}"


@pytest.mark.slow
def test_fast_model_and_converter_read_gguf(tmp_path, hf, prompt):
    """``fast.Model.from_pretrained`` and ``diffusiongemma-convert x.gguf out/`` go through the same loader."""
    from diffusiongemma import fast

    gen = {"max_denoising_steps": 12, "t_min": 0.3, "t_max": 0.9, "stability_threshold": 2,
           "confidence_threshold": 0.01, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig",
                                                            "entropy_bound": 0.2}}
    path = write_gguf(tmp_path / "m.gguf", hf, Q.Q8_0, generation=gen)
    reference = Model.from_pretrained(path)
    quick = fast.Model.from_pretrained(path)
    a, b = ours_logits(reference, prompt), ours_logits(quick, prompt)
    for x, y in zip(a, b):
        assert np.max(np.abs(x - y)) < ATOL
    out = tmp_path / "converted"
    result = subprocess.run([sys.executable, "-m", "diffusiongemma.weights_converter.cli", path, str(out),
                             "--no-progress"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    converted = Model.from_pretrained(str(out))
    for x, y in zip(ours_logits(converted, prompt), a):
        np.testing.assert_array_equal(x, y)
    from diffusiongemma.reference.generation_config import GenerationConfig

    settings = GenerationConfig.from_pretrained(str(out))
    assert (settings.max_denoising_steps, settings.t_min, settings.t_max, settings.stability_threshold) == (12, 0.3, 0.9, 2)
    assert np.isclose(settings.entropy_bound, 0.2) and np.isclose(settings.confidence_threshold, 0.01)
    assert settings.eos_token_id == (1,) and settings.pad_token_id == 0


def test_fast_model_keeps_q8_0_experts_quantized_with_the_widened_bits(tmp_path, hf, prompt):
    """``fast.Model.from_pretrained(q8_0.gguf)`` keeps the experts as Q8_0 panels (3.56x fewer bytes than
    float32: int8 values and a float32 scale per 32 of them, 1.125 bytes a weight) and computes, bit for bit, what it computes on the dequantized file (keep_quantized=False),
    the float32 path that test_fast_equivalence.py bounds against the reference."""
    from diffusiongemma import fast

    path = write_gguf(tmp_path / "q8.gguf", hf, Q.Q8_0)
    kept, widened = fast.Model.from_pretrained(path), fast.Model.from_pretrained(path, keep_quantized=False)
    assert {w.experts.kind for w in kept.layers} == {"q8_0"}
    assert {w.experts.kind for w in widened.layers} == {"float32"}
    saved = sum(w.experts.nbytes for w in widened.layers) / sum(w.experts.nbytes for w in kept.layers)
    assert abs(saved - 4 / 1.125) < 1e-9
    assert kept.weight_nbytes < widened.weight_nbytes
    for x, y in zip(ours_logits(kept, prompt), ours_logits(widened, prompt)):
        assert x.tobytes() == y.tobytes()


def test_split_expert_tensors_are_accepted(tmp_path, hf):
    """The llama.cpp loader's fallback: ffn_gate_exps + ffn_up_exps instead of the fused tensor."""
    tensors = gguf_tensors(hf)
    for l in range(len(SPEC.layer_types)):
        fused = tensors.pop(f"blk.{l}.ffn_gate_up_exps.weight")
        half = fused.shape[1] // 2
        tensors[f"blk.{l}.ffn_gate_exps.weight"], tensors[f"blk.{l}.ffn_up_exps.weight"] = fused[:, :half], fused[:, half:]
    _, loaded = load_gguf_checkpoint(write_gguf(tmp_path / "split.gguf", hf, tensors=tensors))
    np.testing.assert_array_equal(loaded["layers.0.experts.gate_up_proj"], project_tensors(hf)["layers.0.experts.gate_up_proj"])


# ------------------------------------------------------------------------------------------------ tokenizer
def _gemma_style_tokenizer() -> dict:
    """A SentencePiece-style BPE (U+2581 for spaces, <0xXX> byte fallback), trained on a few lines."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")  # as Gemma 4's
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz\u2581"))
    lines = ["in the beginning god created the heaven and the earth\n\n",
             "and the earth was without form and void", "let there be light and there was light"] * 20
    tok.train_from_iterator(lines, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces, as Gemma's vocabulary has
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    # a first-rank merge across a newline, which only the newline pre-split keeps from applying
    vocab["t\n"] = len(vocab)
    data["model"]["merges"].insert(0, ["t", "\n"])
    return data


@pytest.mark.parametrize("style", ["gemma4", "gpt2"])
def test_tokenizer_and_chat_template_from_metadata(tmp_path, hf, style):
    """No tokenizer.json beside the file: ids, decoding and the chat template come from tokenizer.ggml.*."""
    from tokenizers import Tokenizer

    from diffusiongemma.checkpoint import default_model_dir, load_text_side

    if style == "gpt2":  # the shipped model's byte-level BPE
        with open(os.path.join(default_model_dir(), "tokenizer.json"), encoding="utf-8") as f:
            data = json.load(f)
    else:
        data = _gemma_style_tokenizer()
    original = Tokenizer.from_str(json.dumps(data))
    if style == "gemma4":  # the Gemma 4 converter sets add_bos_token; the original adds BOS the same way
        from tokenizers import processors

        original.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    path = write_gguf(tmp_path / "m.gguf", hf, tokenizer=data)
    side = load_text_side(path)
    assert side is not None and side.bos_token == "<bos>" and side.eos_token == "<eos>"
    for text in ["in the beginning god created", "And the earth was without form, and void; ünïcode ☃!",
                 "  two  spaces", "<|turn>user\nlet there be light<turn|>", "light\n\nand\nthe earth \n"]:
        expected = original.encode(text).ids
        assert side.encode(text) == expected, text
        assert side.decode(expected) == original.decode(expected)
    rendered = side.apply_chat_template("hello")
    assert rendered == "<bos><|turn>user\nhello<turn|>\n<|turn>model"  # jinja drops the final newline
    same_dir = TextSide(*gguf_text_side(path))
    assert same_dir.encode("let there be light") == original.encode("let there be light").ids


# ------------------------------------------------------------------------------------------------ bad input
def _edit(key, kind=None, value=None, drop=False):
    def edit(meta):
        out = [m for m in meta if m[0] != key]
        if not drop:
            out.append((key, kind, value))
        return out
    return edit


@pytest.mark.parametrize("edit, pattern", [
    (_edit(f"{ARCH}.block_count", "str", "five"), rf"'{ARCH}\.block_count' has type STRING, expected an integer"),
    (_edit(f"{ARCH}.attention.layer_norm_rms_epsilon", "u32", 1),
     r"'diffusion-gemma\.attention\.layer_norm_rms_epsilon' has type UINT32, expected FLOAT32"),
    (_edit("diffusion.canvas_length", drop=True), r"metadata key 'diffusion\.canvas_length' is missing"),
    (_edit(f"{ARCH}.attention.sliding_window_pattern", "arr_bool", [True, False]),
     r"sliding_window_pattern' has 2 entries, expected block_count=5"),
    (_edit(f"{ARCH}.attention.value_length", "u32", 64), r"value_length' \(64\) differs from key_length \(128\)"),
])
def test_bad_metadata_names_the_key(tmp_path, hf, edit, pattern):
    path = write_gguf(tmp_path / "bad.gguf", hf, edit_metadata=edit)
    with pytest.raises(CheckpointError, match=pattern):
        Model.from_pretrained(path)


def test_other_architecture_is_refused(tmp_path, hf):
    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(os.fspath(path), "gemma4")
    writer.add_uint32("gemma4.block_count", 1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(CheckpointError, match=r"general\.architecture is 'gemma4', expected 'diffusion-gemma'"):
        Model.from_pretrained(str(path))


def test_missing_misshaped_and_unknown_tensors(tmp_path, hf):
    tensors = gguf_tensors(hf)
    missing = {k: v for k, v in tensors.items() if k != "blk.3.attn_k.weight"}
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.3\.attn_k\.weight' \(layers\.3\.k_proj.*is missing"):
        load_gguf_checkpoint(write_gguf(tmp_path / "a.gguf", hf, tensors=missing))
    misshaped = dict(tensors, **{"blk.1.ffn_down.weight": tensors["blk.1.ffn_down.weight"].T.copy()})
    misshaped["blk.1.ffn_down.weight"] = np.zeros((256, 128), np.float32)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.1\.ffn_down\.weight' .*numpy shape \(256, 128\)"):
        load_gguf_checkpoint(write_gguf(tmp_path / "b.gguf", hf, tensors=misshaped))
    extra = dict(tensors, **{"blk.2.attn_v.weight": tensors["blk.2.attn_k.weight"]})
    with pytest.raises(CheckpointError, match=r"unknown tensor 'blk\.2\.attn_v\.weight' \(layer 2 is full_attention"):
        load_gguf_checkpoint(write_gguf(tmp_path / "c.gguf", hf, tensors=extra))
    untied = dict(tensors, **{"output.weight": tensors["token_embd.weight"] + 1})
    with pytest.raises(CheckpointError, match=r"'output\.weight' differs from 'token_embd\.weight'"):
        load_gguf_checkpoint(write_gguf(tmp_path / "d.gguf", hf, tensors=untied))


def _set_tensor_type(path, name: str, type_id: int) -> None:
    """Patch the type id of tensor ``name`` in the file's tensor infos."""
    reader = gguf.GGUFReader(path)
    field = next(t.field for t in reader.tensors if t.name == name)
    offset = field.offset + 8 + len(name) + 4 + 8 * len(field.parts[3])  # name len+bytes, n_dims, dims
    del reader
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<I", type_id))


def test_unknown_type_and_truncated_file(tmp_path, hf):
    path = write_gguf(tmp_path / "m.gguf", hf)
    _set_tensor_type(path, "blk.0.attn_q.weight", 250)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.attn_q\.weight' has unknown ggml type id 250"):
        Model.from_pretrained(path)
    path = write_gguf(tmp_path / "t.gguf", hf)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"tensor '.*' is truncated"):
        Model.from_pretrained(path)
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointError, match=r"truncated inside (the metadata|metadata key)"):
        Model.from_pretrained(path)
    result = subprocess.run([sys.executable, "-m", "diffusiongemma.weights_converter.cli", path,
                             str(tmp_path / "out")], capture_output=True, text=True)
    assert result.returncode == 1 and "truncated" in result.stderr and not (tmp_path / "out").exists()


def test_type_without_dequantizer_is_named(tmp_path, hf):
    """A type the gguf package knows but cannot turn into floats (I32) is refused naming the tensor."""
    path = write_gguf(tmp_path / "m.gguf", hf)
    _set_tensor_type(path, "blk.4.ffn_gate_inp.scale", int(Q.I32))  # same element size as F32
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.4\.ffn_gate_inp\.scale' has type I32"):
        Model.from_pretrained(path)


def test_tensors_are_dequantized_one_at_a_time(tmp_path, hf):
    """Streaming: reading the whole file while dropping each tensor peaks near the largest tensor, not the sum."""
    import tracemalloc

    from diffusiongemma.weights_converter.gguf import iter_gguf_tensors

    checkpoint = GGUFCheckpoint.open(write_gguf(tmp_path / "m.gguf", hf, Q.Q4_K))
    sizes = [4 * int(np.prod(checkpoint.numpy_shape(n))) for n in checkpoint.tensors]
    tracemalloc.start()
    try:
        for _, array in iter_gguf_tensors(checkpoint):
            del array
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * max(sizes) < sum(sizes) / 3, (peak, max(sizes), sum(sizes))


def test_command_line_runs_a_gguf_file(tmp_path, hf, capsys):
    """`diffusiongemma generate --model x.gguf` (tokenizer and settings from the file) and `diffusiongemma convert`."""
    from diffusiongemma.cli.main import main

    path = write_gguf(tmp_path / "m.gguf", hf, Q.Q8_0, tokenizer=_gemma_style_tokenizer(),
                      generation={"max_denoising_steps": 3})
    assert main(["generate", "--model", path, "-n", "8", "--seed", "1", "--view", "plain", "in the beginning"]) == 0
    captured = capsys.readouterr()
    assert "steps per canvas [3]" in captured.out + captured.err  # diffusion.eb_max_steps
    out = tmp_path / "converted"
    assert main(["convert", path, str(out), "--no-progress"]) == 0
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(os.listdir(out))
    assert "converted" in capsys.readouterr().out
    assert main(["generate", "--model", str(out), "-n", "8", "--seed", "1", "--view", "plain",
                 "in the beginning"]) == 0
    again = capsys.readouterr()
    assert again.out.splitlines()[0] == captured.out.splitlines()[0]  # the same text from the converted copy


def test_golden_run_reproduced_from_a_gguf_of_its_weights(tmp_path):
    """The stored tiny-a golden (transformers' run) replayed by the reference on an F32 GGUF of the same weights."""
    import importlib.util

    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.trace import Trace, compare_traces, format_report

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("record_golden", os.path.join(root, "examples", "record_golden.py"))
    record_golden = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(record_golden)
    case = os.path.join(root, "tests", "golden", "tiny-a")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(os.path.join(case, "model"), dtype=torch.float32)
    path = write_gguf(tmp_path / "tiny-a.gguf", model)
    golden = os.path.join(case, "golden.trace")
    ours = record_golden.replay_reference(path, golden, str(tmp_path / "ours.trace"))
    with Trace(golden) as a, Trace(ours) as b:
        comparison = compare_traces(a, b)
    assert comparison.ok and not comparison.skipped, format_report(comparison)
