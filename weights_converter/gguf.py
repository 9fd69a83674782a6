"""Reading llama.cpp GGUF files of architecture ``diffusion-gemma`` (the layout of unsloth's releases).

    load_gguf_checkpoint(path) -> (ModelConfig, {project name: float32 array})   (Model.from_pretrained("x.gguf"))
    convert_gguf(src, dst, ...) -> ConversionSummary                              (diffusiongemma-convert x.gguf out/)
    gguf_text_side(path) -> TextSide                                              (tokenizer and chat template)
    gguf_generation_config(path) -> dict                                          (generation_config.json layout)

The layout reproduced is what llama.cpp's converter (``conversion/diffusion_gemma.py`` on top of
``Gemma4Model``, PR #24423) writes from a transformers ``DiffusionGemmaForBlockDiffusion`` checkpoint:

* metadata under ``diffusion-gemma.*`` (block_count, embedding_length, feed_forward_length,
  expert_feed_forward_length, expert_count, expert_used_count, attention.head_count, per-layer
  attention.head_count_kv, attention.key_length(_swa) = value_length(_swa), attention.sliding_window,
  per-layer bool attention.sliding_window_pattern, attention.layer_norm_rms_epsilon, rope.freq_base (full
  layers), rope.freq_base_swa (sliding layers; absent means rope.freq_base, as llama.cpp's loader does),
  final_logit_softcapping), plus ``diffusion.canvas_length`` and the sampler defaults ``diffusion.eb_*``
  (not arch-prefixed);
* tensors named as in ``GGUF_NAMES`` below. The encoder contributes only its layer scalars
  (``blk.N.enc_layer_output_scale``); ``blk.N.layer_output_scale`` is the decoder's. The expert
  gate and up projections stay fused (``ffn_gate_up_exps``; split ``ffn_gate_exps`` + ``ffn_up_exps`` are
  accepted too, as the llama.cpp loader does). ``output.weight`` is absent (tied to ``token_embd``); if
  present it must equal it. Full layers have no ``attn_v``.
* ``rope_freqs.weight`` ((global_head_dim/2,) float32, ``[1.0]*n_rot + [1e30]*(rest)``) encodes the
  proportional RoPE of full layers: ``partial_rotary_factor = 2*n_rot / global_head_dim``.
* Norm weights are stored as transformers holds them: ``Gemma4Model.norm_shift`` is 0 (DiffusionGemma's
  RMSNorm multiplies by ``w``, not ``1 + w`` as Gemma 1-3, whose converters add 1).
* GGUF lists dimensions fastest-first (``ne``); the numpy shape is ``ne`` reversed, which is the
  transformers shape (the converter writes the torch tensors unchanged), so no transposition happens.

Dequantization: every tensor type ``gguf.quants.dequantize`` handles (F32, F16, BF16, Q4_0..Q8_0, the
K-quants Q2_K..Q6_K, the IQ types, ...) is widened to float32, one tensor at a time; tensor bytes are read
with ``np.fromfile`` at the tensor's offset, so the file is never mapped in whole.

Errors: ``CheckpointError`` names the file and the key or tensor (another architecture, a missing,
unknown or misshapen tensor, an unknown or non-dequantizable type, a truncated file, a metadata key of the
wrong type); ``ConfigError`` comes from ``ModelConfig`` for values it rejects.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from diffusiongemma.reference.config import FULL, SLIDING, ModelConfig, RopeParameters
from diffusiongemma.reference.support.errors import CheckpointError, InputError
from diffusiongemma.reference.support.checkpoint_io import FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, STORAGE_DTYPES
from diffusiongemma.reference.weights import expected_shapes

ARCHITECTURE = "diffusion-gemma"
GGUF_MAGIC = b"GGUF"

# project tensor name (reference/weights.py) -> GGUF tensor name; "{l}" is the layer index.
GGUF_NAMES = {
    "embed_tokens": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "self_conditioning.pre_norm": "self_cond_pre_norm.weight",
    "self_conditioning.gate_proj": "self_cond_gate.weight",
    "self_conditioning.up_proj": "self_cond_up.weight",
    "self_conditioning.down_proj": "self_cond_down.weight",
    "input_layernorm": "blk.{l}.attn_norm.weight",
    "q_proj": "blk.{l}.attn_q.weight",
    "k_proj": "blk.{l}.attn_k.weight",
    "v_proj": "blk.{l}.attn_v.weight",
    "o_proj": "blk.{l}.attn_output.weight",
    "q_norm": "blk.{l}.attn_q_norm.weight",
    "k_norm": "blk.{l}.attn_k_norm.weight",
    "post_attention_layernorm": "blk.{l}.post_attention_norm.weight",
    "pre_feedforward_layernorm": "blk.{l}.ffn_norm.weight",
    "mlp.gate_proj": "blk.{l}.ffn_gate.weight",
    "mlp.up_proj": "blk.{l}.ffn_up.weight",
    "mlp.down_proj": "blk.{l}.ffn_down.weight",
    "post_feedforward_layernorm_1": "blk.{l}.post_ffw_norm_1.weight",
    "router.proj": "blk.{l}.ffn_gate_inp.weight",
    "router.scale": "blk.{l}.ffn_gate_inp.scale",
    "router.per_expert_scale": "blk.{l}.ffn_down_exps.scale",
    "pre_feedforward_layernorm_2": "blk.{l}.pre_ffw_norm_2.weight",
    "experts.gate_up_proj": "blk.{l}.ffn_gate_up_exps.weight",
    "experts.down_proj": "blk.{l}.ffn_down_exps.weight",
    "post_feedforward_layernorm_2": "blk.{l}.post_ffw_norm_2.weight",
    "post_feedforward_layernorm": "blk.{l}.post_ffw_norm.weight",
    "encoder_layer_scalar": "blk.{l}.enc_layer_output_scale.weight",
    "decoder_layer_scalar": "blk.{l}.layer_output_scale.weight",
}
SPLIT_EXPERTS = ("blk.{l}.ffn_gate_exps.weight", "blk.{l}.ffn_up_exps.weight")  # the loader's fallback
ROPE_FREQS = "rope_freqs.weight"
OUTPUT = "output.weight"  # an untied head; the converter never writes it (tied to token_embd)
_FROZEN_FREQ_FACTOR = 1e20  # a rope_freqs entry at least this large freezes its pair (the converter writes 1e30)

_INTEGER_TYPES = frozenset(range(0, 6)) | {10, 11}  # GGUFValueType UINT8..INT32, UINT64, INT64
_FLOAT_TYPES = frozenset({6, 12})  # FLOAT32, FLOAT64
_BOOL, _STRING, _ARRAY = 7, 8, 9
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True when ``path`` is a file whose first four bytes are the GGUF magic (or that ends in ``.gguf``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# ================================================================================================ file
@dataclass
class GGUFCheckpoint:
    """The header-level view of a GGUF file: metadata fields and tensor infos (no tensor data read)."""

    path: str  # the .gguf file
    fields: dict[str, Any]  # metadata key -> gguf ReaderField
    tensors: dict[str, Any]  # GGUF tensor name -> gguf ReaderTensor (offset, type, ne)
    config: ModelConfig | None = None  # filled by ``open`` from the metadata

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFCheckpoint":
        """Parse the header of ``path`` and build its ``ModelConfig``.

        Raises ``CheckpointError`` for a file that is missing, not GGUF, truncated, of another architecture,
        has an unknown tensor type or a metadata key of the wrong type, and ``ConfigError`` for values
        ``ModelConfig`` rejects.
        """
        try:
            from gguf import GGUFReader
        except ImportError as exc:  # pragma: no cover - gguf is an install requirement
            raise CheckpointError(f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)") from exc
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"GGUF file {path!r} does not exist")
        try:
            reader = GGUFReader(path, "r")
        except Exception as exc:  # the reader raises ValueError/IndexError/KeyError on malformed headers
            raise CheckpointError(_diagnose(path) or f"{path}: not a readable GGUF file ({exc})") from exc
        if reader.byte_order != "I":  # tensor bytes are read directly below, in this machine's order
            raise CheckpointError(f"{path}: a GGUF file of the other byte order (big-endian) is not supported")
        size = os.path.getsize(path)
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > size:
                raise CheckpointError(f"{path}: tensor {tensor.name!r} is truncated (its data ends at byte "
                                      f"{tensor.data_offset + tensor.n_bytes}, the file has {size} bytes)")
        checkpoint = cls(path=path, fields=dict(reader.fields), tensors={t.name: t for t in reader.tensors})
        del reader  # drop the memory map; tensor data is read with np.fromfile
        arch = checkpoint.string("general.architecture")
        if arch != ARCHITECTURE:
            raise CheckpointError(f"{path}: general.architecture is {arch!r}, expected {ARCHITECTURE!r} "
                                  "(a DiffusionGemma GGUF from llama.cpp's converter)")
        checkpoint.config = _read_config(checkpoint)
        return checkpoint

    # ------------------------------------------------------------------------------------- metadata
    def has(self, key: str) -> bool:
        return key in self.fields

    def _field(self, key: str, optional: bool):
        field = self.fields.get(key)
        if field is None and not optional:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
        return field

    def _wrong_type(self, key: str, field, expected: str) -> CheckpointError:
        kind = "/".join(_TYPE_NAMES.get(int(t), str(int(t))) for t in field.types)
        return CheckpointError(f"{self.path}: metadata key {key!r} has type {kind}, expected {expected}")

    def integer(self, key: str, default: Any = ..., array: bool = False) -> Any:
        """An integer key; with ``array`` an integer array (as a list) is accepted too."""
        field = self._field(key, optional=default is not ...)
        if field is None:
            return default
        types = [int(t) for t in field.types]
        if types[0] in _INTEGER_TYPES:
            return int(field.contents())
        if array and types[0] == _ARRAY and types[-1] in _INTEGER_TYPES:
            return [int(v) for v in field.contents()]
        raise self._wrong_type(key, field, "an integer" + (" or an integer array" if array else ""))

    def real(self, key: str, default: Any = ...) -> Any:
        """A FLOAT32/FLOAT64 key as a Python float; a FLOAT32 value is read as the shortest decimal that
        rounds to it, i.e. the number the converter was given (1e-6 rather than 9.99999997e-7)."""
        field = self._field(key, optional=default is not ...)
        if field is None:
            return default
        if int(field.types[0]) not in _FLOAT_TYPES:
            raise self._wrong_type(key, field, "FLOAT32 or FLOAT64")
        if int(field.types[0]) == 6:  # FLOAT32: the shortest decimal that rounds to it (1e-6, not 9.99e-7)
            return float(str(np.float32(field.contents())))
        return float(field.contents())

    def string(self, key: str, default: Any = ...) -> Any:
        field = self._field(key, optional=default is not ...)
        if field is None:
            return default
        if int(field.types[0]) != _STRING:
            raise self._wrong_type(key, field, "STRING")
        return field.contents()

    def boolean(self, key: str, default: Any = ...) -> Any:
        field = self._field(key, optional=default is not ...)
        if field is None:
            return default
        if int(field.types[0]) != _BOOL:
            raise self._wrong_type(key, field, "BOOL")
        return bool(field.contents())

    def array(self, key: str, element: str, default: Any = ...) -> Any:
        """An array key whose elements are ``element`` ("string", "integer", "real" or "bool")."""
        field = self._field(key, optional=default is not ...)
        if field is None:
            return default
        types = [int(t) for t in field.types]
        ok = {"string": lambda t: t == _STRING, "integer": lambda t: t in _INTEGER_TYPES,
              "real": lambda t: t in _FLOAT_TYPES or t in _INTEGER_TYPES, "bool": lambda t: t == _BOOL}[element]
        if types[0] != _ARRAY or not (len(types) == 1 or ok(types[-1])):
            raise self._wrong_type(key, field, f"an array of {element}s")
        return list(field.contents()) if len(types) > 1 else []

    # ------------------------------------------------------------------------------------- tensors
    def numpy_shape(self, name: str) -> tuple[int, ...]:
        """The numpy shape of GGUF tensor ``name`` (its ``ne`` reversed)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def read(self, name: str) -> np.ndarray:
        """GGUF tensor ``name`` dequantized to a float32 array of its numpy shape (a fresh copy)."""
        from gguf import GGMLQuantizationType, quants

        tensor = self.tensors[name]
        qtype = GGMLQuantizationType(tensor.tensor_type)
        raw = np.fromfile(self.path, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.data_offset)
        if raw.size != tensor.n_bytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        data = raw.view(tensor.data.dtype).reshape(tensor.data.shape)
        try:
            if qtype == GGMLQuantizationType.F32:
                out = data
            elif qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.F64):
                out = data.astype(np.float32)
            else:
                out = quants.dequantize(data, qtype)
        except NotImplementedError as exc:
            raise CheckpointError(f"{self.path}: tensor {name!r} has type {qtype.name}, which the gguf package "
                                  "cannot dequantize") from exc
        out = np.ascontiguousarray(out, dtype=np.float32).reshape(self.numpy_shape(name))
        return out


# ================================================================================================ config
def _per_layer(checkpoint: GGUFCheckpoint, key: str, n_layers: int) -> list[int]:
    """An integer key stored once or per layer, as a per-layer list."""
    value = checkpoint.integer(key, array=True)
    if isinstance(value, list):
        if len(value) != n_layers:
            raise CheckpointError(f"{checkpoint.path}: metadata key {key!r} has {len(value)} entries, "
                                  f"expected block_count={n_layers}")
        return value
    return [value] * n_layers


def _layer_types(checkpoint: GGUFCheckpoint, arch: str, n_layers: int) -> tuple[str, ...]:
    """``attention.sliding_window_pattern``: a per-layer bool array (Gemma 4), or an integer period n
    (llama.cpp's ``set_swa_pattern``: layer i is sliding unless i % n == n - 1)."""
    key = f"{arch}.attention.sliding_window_pattern"
    field = checkpoint._field(key, optional=False)
    types = [int(t) for t in field.types]
    if types[0] == _ARRAY and types[-1] in {_BOOL} | _INTEGER_TYPES:
        flags = [bool(v) for v in field.contents()]
        if len(flags) != n_layers:
            raise CheckpointError(f"{checkpoint.path}: metadata key {key!r} has {len(flags)} entries, "
                                  f"expected block_count={n_layers}")
    elif types[0] in _INTEGER_TYPES:
        period = int(field.contents())
        if period <= 0:
            raise CheckpointError(f"{checkpoint.path}: metadata key {key!r} must be positive, got {period}")
        flags = [i % period < period - 1 for i in range(n_layers)]
    else:
        raise checkpoint._wrong_type(key, field, "an array of bools or an integer")
    return tuple(SLIDING if swa else FULL for swa in flags)


def _full_rope(checkpoint: GGUFCheckpoint, head_dim: int, theta: float) -> RopeParameters:
    """The full layers' RoPE from ``rope_freqs`` (proportional) or, without it, plain RoPE."""
    if ROPE_FREQS not in checkpoint.tensors:
        return RopeParameters("default", theta)
    shape = checkpoint.numpy_shape(ROPE_FREQS)
    if shape != (head_dim // 2,):
        raise CheckpointError(f"{checkpoint.path}: tensor {ROPE_FREQS!r} has shape {shape}, expected "
                              f"({head_dim // 2},) (half the full-attention head dim {head_dim})")
    factors = checkpoint.read(ROPE_FREQS)
    n_rot = int(np.count_nonzero(factors == 1.0))
    if not (np.all(factors[:n_rot] == 1.0) and np.all(factors[n_rot:] >= _FROZEN_FREQ_FACTOR)) or n_rot == 0:
        raise CheckpointError(f"{checkpoint.path}: tensor {ROPE_FREQS!r} must be [1.0]*n + [1e30]*rest with n > 0 "
                              "(proportional RoPE); other frequency factors are not supported")
    return RopeParameters("proportional", theta, partial_rotary_factor=2 * n_rot / head_dim)


def _read_config(checkpoint: GGUFCheckpoint) -> ModelConfig:
    """The ``ModelConfig`` of a diffusion-gemma GGUF (keys listed in the module docstring)."""
    a, path = ARCHITECTURE, checkpoint.path
    n_layers = checkpoint.integer(f"{a}.block_count")
    if n_layers <= 0:
        raise CheckpointError(f"{path}: metadata key '{a}.block_count' must be positive, got {n_layers}")
    layer_types = _layer_types(checkpoint, a, n_layers)
    heads = set(_per_layer(checkpoint, f"{a}.attention.head_count", n_layers))
    if len(heads) != 1:
        raise CheckpointError(f"{path}: metadata key '{a}.attention.head_count' varies by layer ({sorted(heads)}); "
                              "DiffusionGemma has one query-head count")
    ffn = set(_per_layer(checkpoint, f"{a}.feed_forward_length", n_layers))
    if len(ffn) != 1:
        raise CheckpointError(f"{path}: metadata key '{a}.feed_forward_length' varies by layer ({sorted(ffn)})")
    kv_heads = _per_layer(checkpoint, f"{a}.attention.head_count_kv", n_layers)
    dims = {FULL: checkpoint.integer(f"{a}.attention.key_length"),
            SLIDING: checkpoint.integer(f"{a}.attention.key_length_swa", checkpoint.integer(f"{a}.attention.key_length"))}
    for kind, suffix in ((FULL, ""), (SLIDING, "_swa")):
        value = checkpoint.integer(f"{a}.attention.value_length{suffix}", dims[kind])
        if value != dims[kind]:
            raise CheckpointError(f"{path}: metadata key '{a}.attention.value_length{suffix}' ({value}) differs from "
                                  f"key_length{suffix} ({dims[kind]}); DiffusionGemma needs them equal")
    rot_swa = checkpoint.integer(f"{a}.rope.dimension_count_swa", dims[SLIDING])
    if SLIDING in layer_types and rot_swa != dims[SLIDING]:
        raise CheckpointError(f"{path}: metadata key '{a}.rope.dimension_count_swa' ({rot_swa}) must equal "
                              f"key_length_swa ({dims[SLIDING]}): sliding layers rotate the whole head")
    theta = checkpoint.real(f"{a}.rope.freq_base")
    rope = {SLIDING: RopeParameters("default", checkpoint.real(f"{a}.rope.freq_base_swa", theta)),
            FULL: _full_rope(checkpoint, dims[FULL], theta)}
    if "token_embd.weight" not in checkpoint.tensors:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
    embed_shape = checkpoint.numpy_shape("token_embd.weight")
    hidden = checkpoint.integer(f"{a}.embedding_length")
    if len(embed_shape) != 2 or embed_shape[1] != hidden:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' has shape {embed_shape}, expected "
                              f"(vocab, embedding_length={hidden})")
    eos = [checkpoint.integer("tokenizer.ggml.eos_token_id", 1)]
    eot = checkpoint.integer("tokenizer.ggml.eot_token_id", None)
    if eot is not None and eot not in eos:
        eos.append(eot)
    return ModelConfig(
        vocab_size=embed_shape[0],
        hidden_size=hidden,
        intermediate_size=ffn.pop(),
        moe_intermediate_size=checkpoint.integer(f"{a}.expert_feed_forward_length"),
        num_hidden_layers=n_layers,
        num_attention_heads=heads.pop(),
        layer_types=layer_types,
        layer_head_dim=tuple(dims[t] for t in layer_types),
        layer_num_key_value_heads=tuple(kv_heads),
        sliding_window=checkpoint.integer(f"{a}.attention.sliding_window"),
        rope_parameters={t: rope[t] for t in set(layer_types)},
        rms_norm_eps=checkpoint.real(f"{a}.attention.layer_norm_rms_epsilon"),
        final_logit_softcapping=checkpoint.real(f"{a}.final_logit_softcapping", 30.0),
        num_experts=checkpoint.integer(f"{a}.expert_count"),
        top_k_experts=checkpoint.integer(f"{a}.expert_used_count"),
        canvas_length=checkpoint.integer("diffusion.canvas_length"),
        pad_token_id=checkpoint.integer("tokenizer.ggml.padding_token_id", 0),
        bos_token_id=checkpoint.integer("tokenizer.ggml.bos_token_id", 2),
        eos_token_id=tuple(eos),
    )


def gguf_generation_config(path: str | os.PathLike | GGUFCheckpoint) -> dict[str, Any]:
    """The transformers ``generation_config.json`` dict of a GGUF, from its ``diffusion.eb_*`` keys.

    Keys the file lacks are left out (so ``GenerationConfig.from_dict`` applies transformers' defaults,
    which are also llama.cpp's fallbacks); EOS and pad ids come from the model config.
    """
    checkpoint = path if isinstance(path, GGUFCheckpoint) else GGUFCheckpoint.open(path)
    out: dict[str, Any] = {}
    for key, name in (("diffusion.eb_max_steps", "max_denoising_steps"),
                      ("diffusion.eb_stability_threshold", "stability_threshold")):
        if checkpoint.has(key):
            out[name] = checkpoint.integer(key)
    for key, name in (("diffusion.eb_t_min", "t_min"), ("diffusion.eb_t_max", "t_max"),
                      ("diffusion.eb_confidence_threshold", "confidence_threshold")):
        if checkpoint.has(key):
            out[name] = checkpoint.real(key)
    if checkpoint.has("diffusion.eb_entropy_bound"):
        out["sampler_config"] = {"_cls_name": "EntropyBoundSamplerConfig",
                                 "entropy_bound": checkpoint.real("diffusion.eb_entropy_bound")}
    config = checkpoint.config
    out["eos_token_id"] = list(config.eos_token_id)
    out["pad_token_id"] = config.pad_token_id
    return out


# ================================================================================================ tensors
def gguf_name(name: str) -> str:
    """The GGUF tensor name of project tensor ``name`` (e.g. ``layers.3.q_proj`` -> ``blk.3.attn_q.weight``)."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return GGUF_NAMES[rest].format(l=layer)


def plan_gguf(checkpoint: GGUFCheckpoint) -> dict[str, tuple[str, ...]]:
    """Project name -> the GGUF tensor(s) it is read from, checking names and shapes from headers alone.

    Raises ``CheckpointError`` naming the GGUF tensor for a missing, unknown or misshapen tensor.
    """
    config, path = checkpoint.config, checkpoint.path
    expected = expected_shapes(config)
    plan: dict[str, tuple[str, ...]] = {}
    for name, shape in expected.items():
        source = gguf_name(name)
        sources: tuple[str, ...] = (source,)
        if source not in checkpoint.tensors and name.endswith("experts.gate_up_proj"):
            split = tuple(s.format(l=name.split(".")[1]) for s in SPLIT_EXPERTS)
            if all(s in checkpoint.tensors for s in split):
                sources = split
        missing = [s for s in sources if s not in checkpoint.tensors]
        if missing:
            raise CheckpointError(f"{path}: tensor {missing[0]!r} ({name}, numpy shape {shape}) is missing")
        if len(sources) == 2:
            E, two_i, H = shape
            want = (E, two_i // 2, H)
            got = [checkpoint.numpy_shape(s) for s in sources]
            for s, g in zip(sources, got):
                if g != want:
                    raise CheckpointError(f"{path}: tensor {s!r} has numpy shape {g} (ne {tuple(reversed(g))}), "
                                          f"expected {want}")
        elif checkpoint.numpy_shape(source) != shape:
            got = checkpoint.numpy_shape(source)
            raise CheckpointError(f"{path}: tensor {source!r} ({name}) has numpy shape {got} (GGUF ne "
                                  f"{tuple(reversed(got))}), expected {shape} (ne {tuple(reversed(shape))})")
        plan[name] = sources
    used = {s for sources in plan.values() for s in sources} | {ROPE_FREQS}
    if OUTPUT in checkpoint.tensors:
        used.add(OUTPUT)
        if checkpoint.numpy_shape(OUTPUT) != expected["embed_tokens"]:
            raise CheckpointError(f"{path}: tensor {OUTPUT!r} has numpy shape {checkpoint.numpy_shape(OUTPUT)}, "
                                  f"expected {expected['embed_tokens']} (tied to token_embd.weight)")
    unknown = sorted(set(checkpoint.tensors) - used)
    if unknown:
        message = f"{path}: unknown tensor {unknown[0]!r}"
        if unknown[0].endswith(".attn_v.weight"):
            layer = int(unknown[0].split(".")[1])
            if layer < config.num_hidden_layers:
                message += f" (layer {layer} is {config.layer_types[layer]}, which has no v_proj: values reuse the keys)"
        raise CheckpointError(message + (f"; {len(unknown) - 1} more: {unknown[1:6]}" if len(unknown) > 1 else ""))
    return plan


def iter_gguf_tensors(checkpoint: GGUFCheckpoint, plan: dict[str, tuple[str, ...]] | None = None,
                      progress: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(project name, float32 array)`` one tensor at a time, in ``expected_shapes`` order.

    Raises ``CheckpointError`` for a tensor type the gguf package cannot dequantize, NaN/inf values, or an
    ``output.weight`` that differs from ``token_embd.weight``.
    """
    from tqdm.auto import tqdm

    from .writer import check_finite

    plan = plan if plan is not None else plan_gguf(checkpoint)
    bar = tqdm(total=len(plan), unit="tensor", desc="reading GGUF", disable=not progress, leave=False)
    try:
        for name, sources in plan.items():
            if len(sources) == 2:
                array = np.concatenate([checkpoint.read(s) for s in sources], axis=1)
            else:
                array = checkpoint.read(sources[0])
            check_finite(array, f"{sources[0]} ({name})")
            if name == "embed_tokens" and OUTPUT in checkpoint.tensors:
                head = checkpoint.read(OUTPUT)
                if not np.array_equal(head, array):
                    raise CheckpointError(f"{checkpoint.path}: tensor {OUTPUT!r} differs from 'token_embd.weight'; "
                                          "an untied output projection is not supported")
                del head
            bar.update()
            yield name, array
            del array
    finally:
        bar.close()


def load_gguf_checkpoint(path: str | os.PathLike, progress: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(config, {project name: float32 array})`` of a diffusion-gemma GGUF file (see the module docstring)."""
    checkpoint = GGUFCheckpoint.open(path)
    tensors = dict(iter_gguf_tensors(checkpoint, progress=progress))
    return checkpoint.config, tensors


# ================================================================================================ tokenizer
def build_tokenizer(checkpoint: GGUFCheckpoint):
    """A ``tokenizers.Tokenizer`` from the ``tokenizer.ggml.*`` metadata.

    ``tokenizer.ggml.model``:
    * ``gemma4`` (Gemma 4, DiffusionGemma) and ``llama`` with merges: SentencePiece-style BPE over text whose
      spaces become U+2581, split into runs of newlines and runs of other characters (llama.cpp's gemma4
      pre-tokenizer, ``[^\\n]+|[\\n]+``), merged over UTF-8 characters by rank, with ``<0xXX>`` byte fallback
      (decoding maps U+2581 back to spaces and joins bytes); a leading U+2581 is added only when
      ``tokenizer.ggml.add_space_prefix`` is true;
    * ``gpt2``: byte-level BPE (GPT-2 pre-tokenizer and decoder);
    * ``llama`` without merges: a SentencePiece unigram model from ``tokenizer.ggml.scores``.
    Tokens of type CONTROL (3) or UNKNOWN (2) become special added tokens, USER_DEFINED (4) plain added tokens.
    ``tokenizer.ggml.add_bos_token`` (default true for gemma4) prepends BOS when encoding with special tokens.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    path = checkpoint.path
    kind = checkpoint.string("tokenizer.ggml.model")
    tokens = checkpoint.array("tokenizer.ggml.tokens", "string")
    types = checkpoint.array("tokenizer.ggml.token_type", "integer", [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: metadata key 'tokenizer.ggml.token_type' has {len(types)} entries, "
                              f"'tokenizer.ggml.tokens' has {len(tokens)}")
    merges = []
    for merge in checkpoint.array("tokenizer.ggml.merges", "string", []):
        cut = merge.find(" ", 1)  # the separator; a left part may itself start with a space
        if cut < 0:
            raise CheckpointError(f"{path}: metadata key 'tokenizer.ggml.merges' holds {merge!r}, not 'left right'")
        merges.append((merge[:cut], merge[cut + 1:]))
    vocab = {token: i for i, token in enumerate(tokens)}  # a repeated string keeps its last id, as llama.cpp
    unk_id = checkpoint.integer("tokenizer.ggml.unknown_token_id", None)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    if kind == "gpt2":
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
    elif kind == "gemma4" or (kind == "llama" and merges):
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True,
                                         fuse_unk=True))
        steps = [normalizers.Replace(" ", "\u2581")]
        if checkpoint.boolean("tokenizer.ggml.add_space_prefix", kind == "llama"):
            steps.insert(0, normalizers.Prepend("\u2581"))
        tokenizer.normalizer = normalizers.Sequence(steps)
        # llama.cpp's gemma4 pre-tokenizer: runs of newlines and runs of everything else, merged separately
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
        tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse()])
    elif kind == "llama":
        scores = checkpoint.array("tokenizer.ggml.scores", "real")
        if len(scores) != len(tokens):
            raise CheckpointError(f"{path}: metadata key 'tokenizer.ggml.scores' has {len(scores)} entries, "
                                  f"'tokenizer.ggml.tokens' has {len(tokens)}")
        tokenizer = Tokenizer(models.Unigram(list(zip(tokens, map(float, scores))), unk_id=unk_id,
                                             byte_fallback=True))
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                     normalizers.Replace(" ", "\u2581")])
        tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                               decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        raise CheckpointError(f"{path}: metadata key 'tokenizer.ggml.model' is {kind!r}; supported: "
                              "'gemma4', 'llama', 'gpt2'")
    added = [AddedToken(tokens[i], special=t in (2, 3), normalized=False)
             for i, t in enumerate(types) if t in (2, 3, 4)]
    tokenizer.add_tokens([t for t in added if not t.special])
    tokenizer.add_special_tokens([t for t in added if t.special])
    bos_id = checkpoint.integer("tokenizer.ggml.bos_token_id", None)
    add_bos = checkpoint.boolean("tokenizer.ggml.add_bos_token", kind == "gemma4")
    if add_bos and bos_id is not None and 0 <= bos_id < len(tokens):
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                                 special_tokens=[(bos, bos_id)])
    return tokenizer


def _token(checkpoint: GGUFCheckpoint, key: str) -> str | None:
    tokens = checkpoint.array("tokenizer.ggml.tokens", "string")
    index = checkpoint.integer(key, None)
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None


def gguf_text_side(path: str | os.PathLike):
    """(tokenizer, chat template, BOS string, EOS string) from GGUF metadata (``diffusiongemma.checkpoint``
    makes its ``TextSide`` of them)."""
    checkpoint = GGUFCheckpoint.open(path)
    return (build_tokenizer(checkpoint), checkpoint.string("tokenizer.chat_template", None),
            _token(checkpoint, "tokenizer.ggml.bos_token_id"), _token(checkpoint, "tokenizer.ggml.eos_token_id"))


# ================================================================================================ convert
def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "float32",
                 shard_size: int | None = None, *, force: bool = False, progress: bool = True):
    """Convert the GGUF file ``src`` into a converted checkpoint directory ``dst`` (streaming, atomic).

    Besides the weights, ``dst`` gets ``tokenizer.json``, ``tokenizer_config.json`` and
    ``chat_template.jinja`` built from the GGUF metadata (when it has a tokenizer) and a
    ``generation_config.json`` from the ``diffusion.eb_*`` keys. Same errors as ``convert``.
    """
    from .summary import DEFAULT_SHARD_SIZE, ConversionSummary
    from .writer import ShardWriter, atomic_directory, check_destination, to_storage

    shard_size = DEFAULT_SHARD_SIZE if shard_size is None else shard_size
    if dtype not in STORAGE_DTYPES:
        raise InputError(f"dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    check_destination(dst, force)
    checkpoint = GGUFCheckpoint.open(src)
    plan = plan_gguf(checkpoint)
    source_bytes: Counter[str] = Counter()
    copied: list[str] = []
    with atomic_directory(dst, force=force) as tmp:
        writer = ShardWriter(tmp, shard_size)
        for name, array in iter_gguf_tensors(checkpoint, plan, progress=progress):
            for s in plan[name]:
                source_bytes[checkpoint.tensors[s].tensor_type.name] += int(checkpoint.tensors[s].n_bytes)
            writer.add(name, to_storage(array, dtype, f"{plan[name][0]} ({name})"))
            del array
        weight_map = writer.close()
        if checkpoint.has("tokenizer.ggml.tokens"):
            build_tokenizer(checkpoint).save(os.path.join(tmp, "tokenizer.json"))
            special = {"bos_token": _token(checkpoint, "tokenizer.ggml.bos_token_id"),
                       "eos_token": _token(checkpoint, "tokenizer.ggml.eos_token_id"),
                       "pad_token": _token(checkpoint, "tokenizer.ggml.padding_token_id"),
                       "unk_token": _token(checkpoint, "tokenizer.ggml.unknown_token_id")}
            _write_json(os.path.join(tmp, "tokenizer_config.json"),
                        {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in special.items() if v}})
            copied += ["tokenizer.json", "tokenizer_config.json"]
            template = checkpoint.string("tokenizer.chat_template", None)
            if template:
                with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
                    f.write(template)
                copied.append("chat_template.jinja")
        _write_json(os.path.join(tmp, "generation_config.json"), gguf_generation_config(checkpoint))
        copied.append("generation_config.json")
        parameter_count = sum(math.prod(s) for s in expected_shapes(checkpoint.config).values())
        from diffusiongemma import __version__

        _write_json(os.path.join(tmp, INDEX_FILE), {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dtype": dtype,
            "parameter_count": parameter_count, "model_config": checkpoint.config.to_dict(),
            "source": {"format": "gguf", "path": src, "architecture": ARCHITECTURE,
                       "tensor_types": dict(Counter(checkpoint.tensors[s].tensor_type.name
                                                    for sources in plan.values() for s in sources))},
            "converter": {"name": "diffusiongemma.weights_converter", "version": __version__},
            "weight_map": weight_map,
            "file_digests": dict(writer.digests),  # lets readers detect files of another conversion
        })
    skipped = {"rope_freqs": 1} if ROPE_FREQS in checkpoint.tensors else {}
    if OUTPUT in checkpoint.tensors:
        skipped["tied_copies"] = 1
    return ConversionSummary(source=src, destination=dst, dtype=dtype, num_tensors=len(weight_map),
                             parameter_count=parameter_count, source_bytes=dict(source_bytes),
                             output_bytes={dtype: parameter_count * (4 if dtype == "float32" else 2)},
                             skipped=skipped, files=tuple(writer.files), copied=tuple(copied))


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


# ================================================================================================ diagnosis
def _diagnose(path: str) -> str | None:
    """Why the gguf reader refused ``path``, naming the key or tensor (``None`` when no cause is found).

    A plain walk over the GGUF header (magic, version, counts, key/value pairs, tensor infos) that stops at the
    first problem: a bad magic or version, an end of file inside the header, an unknown value type, an unknown
    tensor type id, or tensor data running past the end of the file.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read(min(size, 64 * 1024 * 1024))  # headers are far smaller than this
    pos = 0
    where = "the header"

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise EOFError
        pos += n
        return data[pos - n:pos]

    def u32() -> int:
        return struct.unpack("<I", take(4))[0]

    def u64() -> int:
        return struct.unpack("<Q", take(8))[0]

    def string() -> str:
        return take(u64()).decode("utf-8", "replace")

    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(kind: int, key: str) -> None:
        if kind in scalar:
            take(scalar[kind])
        elif kind == _STRING:
            string()
        elif kind == _ARRAY:
            sub, count = u32(), u64()
            for _ in range(count):
                skip(sub, key)
        else:
            raise ValueError(f"metadata key {key!r} has unknown value type {kind}")

    try:
        if take(4) != GGUF_MAGIC:
            return f"{path}: not a GGUF file (bad magic bytes)"
        version = u32()
        if version not in (2, 3):
            return f"{path}: GGUF version {version} is not supported (2 or 3)"
        n_tensors, n_kv = u64(), u64()
        alignment = 32
        for _ in range(n_kv):
            where = "the metadata"
            key = string()
            where = f"metadata key {key!r}"
            kind = u32()
            start = pos
            skip(kind, key)
            if key == "general.alignment" and kind == 4:
                alignment = struct.unpack("<I", data[start:start + 4])[0]
        infos = []
        for _ in range(n_tensors):
            where = "the tensor infos"
            name = string()
            where = f"the info of tensor {name!r}"
            dims = [u64() for _ in range(u32())]
            type_id, offset = u32(), u64()
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                return f"{path}: tensor {name!r} has unknown ggml type id {type_id}"
            infos.append((name, dims, qtype, offset))
        start = -(-pos // alignment) * alignment
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            end = start + offset + math.prod(dims) * type_size // block
            if end > size:
                return f"{path}: tensor {name!r} is truncated (its data ends at byte {end}, the file has {size})"
    except EOFError:
        return f"{path}: the file is truncated inside {where} (after {pos} bytes)"
    except ValueError as exc:
        return f"{path}: {exc}"
    return None
