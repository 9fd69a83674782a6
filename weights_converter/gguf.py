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
  final_logit_softcapping, context_length), plus ``diffusion.canvas_length`` and the sampler defaults ``diffusion.eb_*``
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
with ``os.pread`` at the tensor's offset, through the descriptor the header was read from (a file renamed
over the path meanwhile cannot mix its bytes in), so the file is never held in memory whole. F64 and the
integer types are refused for weights (no converter writes them; a relabelled F32 tensor would be misread).

Layout checks (``read_gguf_header``, before any metadata is interpreted): the header is walked with our own
parser and refused with ``GGUFLayoutError`` (a ``CheckpointError``) naming the key or tensor and the expected
and found values when the magic, version or byte order is wrong; a count disagrees with the bytes (a count one
off is named as such); a string is not UTF-8 or runs past the end; a key or tensor name repeats; a value type,
tensor type or bool byte is unknown; ``general.alignment`` is not a UINT32 power of two; ``n_dims`` is outside
1..4 or ``ne[0]`` not a whole number of blocks; a tensor offset is misaligned, outside the data section,
overlapping another tensor, or not where llama.cpp's loader expects it (back to back in header order, each
padded to the alignment); the padding before the data section or after a tensor is not zero (which also
catches a tensor relabelled to a smaller type: its unread bytes would be the padding); bytes follow the last
tensor.

Errors: ``CheckpointError`` names the file and the key or tensor (another architecture, a missing,
unknown or misshapen tensor, an unknown or non-dequantizable type, a truncated file, a metadata key of the
wrong type, a value DiffusionGemma cannot honour: ``attention.causal`` true, shared KV layers, per-layer input
embeddings, ``rope.dimension_count`` other than ``key_length``); ``ConfigError`` comes from ``ModelConfig``
for values it rejects. ``context_length`` is the model's ``max_position_embeddings``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Iterator

import numpy as np

from diffusiongemma.reference.config import FULL, SLIDING, ModelConfig, RopeParameters
from diffusiongemma.reference.support.config_checks import MAX_LAYERS
from diffusiongemma.reference.support.errors import CheckpointError, ConfigError, InputError
from diffusiongemma.reference.support.checkpoint_io import FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, STORAGE_DTYPES
from diffusiongemma.reference.support.quantized import BFLOAT16, Q8_0Tensor, is_bfloat16, widen
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


# ================================================================================================ layout
class GGUFLayoutError(CheckpointError):
    """A GGUF file whose header or tensor layout does not hold together: counts that disagree with the bytes,
    a tensor offset that is misaligned, outside the data section or overlapping another tensor, a duplicate
    name or key, a string that is not UTF-8, a bad ``general.alignment`` or ``n_dims``. The message names the
    file, the key or tensor, and the expected and found values."""


class _Problem(Exception):
    """One layout problem found while walking a header (turned into ``GGUFLayoutError`` with the path)."""


GGML_MAX_DIMS = 4  # llama.cpp refuses tensors of more dimensions
GGML_MAX_NAME = 64  # llama.cpp's limit on a tensor name, terminating NUL included
DEFAULT_ALIGNMENT = 32
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_RAW_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}  # other types are read as bytes (blocks), as gguf's reader does


@dataclass
class GGUFField:
    """One metadata key/value pair: ``types`` is ``[type]`` or ``[ARRAY, element type]`` (GGUFValueType ids)."""

    name: str
    types: list[int]
    value: Any
    offset: int  # byte of the key in the file

    def contents(self) -> Any:
        return self.value


@dataclass
class GGUFTensorInfo:
    """One tensor info of the header; ``shape`` is GGUF's ``ne`` (fastest dimension first)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    offset: int  # from the start of the data section, as stored
    data_offset: int = 0  # absolute byte in the file (filled once the data section is known)


@dataclass
class GGUFHeader:
    version: int
    alignment: int
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensorInfo]
    header_end: int  # first byte after the tensor infos
    data_start: int  # header_end rounded up to the alignment


class _Bytes:
    """A cursor over the file's bytes (a memory map) that reports where a read ran out."""

    def __init__(self, data, size: int):
        self.data, self.size, self.pos = data, size, 0
        self.where = "the header"

    def take(self, n: int) -> bytes:
        if n > self.size - self.pos:
            raise _Problem(f"the file is truncated inside {self.where} (at byte {self.pos}, {n} more bytes needed, "
                           f"the file has {self.size})")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, what: str) -> str:
        start = self.pos
        length = self.unpack("<Q")
        if length > self.size - self.pos:
            raise _Problem(f"the file is truncated inside {self.where}: {what} at byte {start} declares a string "
                           f"of {length} bytes, but only {self.size - self.pos} bytes remain")
        raw = self.take(length)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Problem(f"{what} at byte {start} is not valid UTF-8 (byte {raw[exc.start]:#04x} at position "
                           f"{exc.start} of {raw[:40]!r})") from None


def _value(cur: _Bytes, kind: int, key: str):
    """One value of GGUF type ``kind`` (scalars, strings; arrays handled by the caller)."""
    if kind == _STRING:
        return cur.string(f"the string value of metadata key {key!r}")
    value = cur.unpack(_SCALAR[kind])
    if kind == _BOOL:
        if value not in (0, 1):
            raise _Problem(f"metadata key {key!r} holds bool byte {value}, expected 0 or 1")
        return bool(value)
    return float(value) if kind in _FLOAT_TYPES else int(value)


def _read_kv(cur: _Bytes, index: int, n_kv: int) -> GGUFField:
    start = pos = cur.pos
    cur.where = f"metadata key/value pair {index} of {n_kv}"
    key = cur.string(f"the name of metadata key/value pair {index} of {n_kv}")
    if not key:
        raise _Problem(f"metadata key/value pair {index} of {n_kv} (byte {pos}) has an empty name")
    cur.where = f"metadata key {key!r}"
    kind = cur.unpack("<I")
    if kind not in _TYPE_NAMES:
        raise _Problem(f"metadata key {key!r} has unknown value type {kind} (known: 0..12)")
    if kind != _ARRAY:
        return GGUFField(key, [kind], _value(cur, kind, key), start)
    element, count = cur.unpack("<I"), cur.unpack("<Q")
    if element not in _TYPE_NAMES:
        raise _Problem(f"metadata key {key!r} is an array of unknown value type {element} (known: 0..12)")
    if element == _ARRAY:
        raise _Problem(f"metadata key {key!r} is an array of arrays, which GGUF readers do not support")
    least = 8 if element == _STRING else struct.calcsize(_SCALAR[element])
    if count > (cur.size - cur.pos) // least:
        raise _Problem(f"metadata key {key!r} declares an array of {count} {_TYPE_NAMES[element]} values, which "
                       f"cannot fit in the {cur.size - cur.pos} bytes left in the file")
    if element == _STRING:
        values = _strings(cur, count, key)
    else:
        values = np.frombuffer(cur.take(count * least), dtype=_NUMPY[element]).tolist()
        if element == _BOOL:
            bad = [v for v in values if v not in (0, 1)]
            if bad:
                raise _Problem(f"metadata key {key!r} holds bool byte {bad[0]}, expected 0 or 1")
            values = [bool(v) for v in values]
        elif element in _FLOAT_TYPES:
            values = [float(v) for v in values]
    return GGUFField(key, [kind, element], values, start)


_U64 = struct.Struct("<Q")


def _strings(cur: _Bytes, count: int, key: str) -> list[str]:
    """``count`` strings (a vocabulary: the hot loop of a header walk); a bad one is re-read by
    ``_Bytes.string`` for its message."""
    data, pos, size, unpack = cur.data, cur.pos, cur.size, _U64.unpack_from
    values = []
    append = values.append
    for i in range(count):
        start = pos
        try:
            if pos + 8 > size:
                raise ValueError
            n = unpack(data, pos)[0]
            pos += 8
            if n > size - pos:
                raise ValueError
            append(data[pos:pos + n].decode("utf-8"))
            pos += n
        except ValueError:  # UnicodeDecodeError included
            cur.pos = start
            cur.string(f"string {i} of metadata key {key!r}")
            raise AssertionError("unreachable") from None
    cur.pos = pos
    return values


def _read_tensor_info(cur: _Bytes, index: int, n_tensors: int) -> GGUFTensorInfo:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    pos = cur.pos
    cur.where = f"tensor info {index} of {n_tensors}"
    name = cur.string(f"the name of tensor info {index} of {n_tensors}")
    if not name:
        raise _Problem(f"tensor info {index} of {n_tensors} (byte {pos}) has an empty name")
    if len(name.encode("utf-8")) >= GGML_MAX_NAME:
        raise _Problem(f"tensor {name[:80]!r} has a name of {len(name.encode('utf-8'))} bytes, at most "
                       f"{GGML_MAX_NAME - 1} are allowed")
    cur.where = f"the info of tensor {name!r}"
    n_dims = cur.unpack("<I")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise _Problem(f"tensor {name!r} has n_dims {n_dims}, expected 1..{GGML_MAX_DIMS}")
    shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
    n_elements = 1
    for n in shape:
        if n >= 2 ** 63:
            raise _Problem(f"tensor {name!r} has dimension {n} in ne {shape}, which is negative as int64")
        n_elements *= n
    if n_elements >= 2 ** 63:
        raise _Problem(f"tensor {name!r} has ne {shape}: {n_elements} elements overflow int64")
    type_id = cur.unpack("<I")
    try:
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise _Problem(f"tensor {name!r} has unknown ggml type id {type_id}") from None
    if shape[0] % block:
        raise _Problem(f"tensor {name!r} of type {qtype.name} has ne[0]={shape[0]}, not a multiple of the "
                       f"type's block size {block}")
    offset = cur.unpack("<Q")
    return GGUFTensorInfo(name, shape, qtype, n_elements, n_elements // block * type_size, offset)


def _walk(data, size: int, counts: tuple[int, int] | None = None) -> GGUFHeader:
    """Parse and check the header and the tensor layout of a GGUF file; ``counts`` overrides the header's
    (n_tensors, n_kv), which is how a wrong count is diagnosed. Raises ``_Problem``."""
    cur = _Bytes(data, size)
    magic = cur.take(4)
    if magic != GGUF_MAGIC:
        raise _Problem(f"not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    version = cur.unpack("<I")
    if version not in (2, 3):
        if struct.unpack(">I", struct.pack("<I", version))[0] in (2, 3):
            raise _Problem("a GGUF file of the other byte order (big-endian) is not supported")
        raise _Problem(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if counts is not None:
        n_tensors, n_kv = counts
    fields: dict[str, GGUFField] = {}
    for i in range(n_kv):
        _add_kv(fields, _read_kv(cur, i, n_kv))
    return _walk_tensors(cur, data, size, version, fields, n_tensors)


def _add_kv(fields: dict, field: GGUFField) -> None:
    if field.name in fields:
        raise _Problem(f"metadata key {field.name!r} appears twice (bytes {fields[field.name].offset} and "
                       f"{field.offset})")
    fields[field.name] = field


def _metadata_count(data, size: int, n_tensors: int, n_kv: int) -> int | None:
    """The number of metadata key/value pairs after which the rest of the file parses as ``n_tensors`` tensor
    infos and a valid data section, when that differs from the header's ``n_kv``; None when no count does.

    The pairs are read one at a time (each once), and after each the tensor infos are tried from there, so a
    count that is off by any amount is found in one pass over the metadata (only on the error path)."""
    cur = _Bytes(data, size)
    cur.pos = 24
    version = struct.unpack_from("<I", data, 4)[0]
    fields: dict[str, GGUFField] = {}
    for k in range(n_kv + (size - 24) // 13 + 1):  # a key/value pair takes at least 13 bytes
        if k != n_kv:
            rest = _Bytes(data, size)
            rest.pos = cur.pos
            try:
                _walk_tensors(rest, data, size, version, fields, n_tensors)
                return k
            except _Problem:
                pass
        try:
            _add_kv(fields, _read_kv(cur, k, k + 1))
        except (_Problem, struct.error):
            return None
    return None


def _tensor_count(data, size: int, n_tensors: int, n_kv: int) -> int | None:
    """The number of tensor infos with which the file holds together, when the metadata parses with ``n_kv``
    pairs and that number differs from the header's ``n_tensors``; None otherwise.

    The infos are read greedily (a read past the last one runs into the zero padding and stops at once), then
    the counts are tried from the largest down, at most 64 of them, each a walk of the infos (error path only)."""
    cur = _Bytes(data, size)
    cur.pos = 24
    version = struct.unpack_from("<I", data, 4)[0]
    fields: dict[str, GGUFField] = {}
    try:
        for i in range(n_kv):
            _add_kv(fields, _read_kv(cur, i, n_kv))
    except (_Problem, struct.error):
        return None
    start, read = cur.pos, 0
    while True:
        try:
            _read_tensor_info(cur, read, read + 1)
        except (_Problem, struct.error):
            break
        read += 1
    for k in range(read, max(read - 64, -1), -1):
        if k == n_tensors:
            continue
        rest = _Bytes(data, size)
        rest.pos = start
        try:
            _walk_tensors(rest, data, size, version, fields, k)
            return k
        except _Problem:
            continue
    return None


def _walk_tensors(cur: _Bytes, data, size: int, version: int, fields: dict, n_tensors: int) -> GGUFHeader:
    """The tensor infos and data-section checks of ``_walk``, from ``cur`` (just after the metadata)."""
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        field = fields["general.alignment"]
        if field.types != [4]:
            kind = "/".join(_TYPE_NAMES[t] for t in field.types)
            raise _Problem(f"metadata key 'general.alignment' has type {kind}, expected UINT32")
        alignment = field.value
        if alignment <= 0 or alignment & (alignment - 1):
            raise _Problem(f"metadata key 'general.alignment' is {alignment}, expected a positive power of two")
    tensors: list[GGUFTensorInfo] = []
    names: dict[str, int] = {}
    for i in range(n_tensors):
        info = _read_tensor_info(cur, i, n_tensors)
        if info.name in names:
            raise _Problem(f"tensor {info.name!r} appears twice in the tensor infos (entries {names[info.name]} "
                           f"and {i})")
        names[info.name] = i
        tensors.append(info)
    header_end = cur.pos
    data_start = -(-header_end // alignment) * alignment
    if data_start > size and tensors:
        raise _Problem(f"the file is truncated before the data section (it starts at byte {data_start}, the file "
                       f"has {size})")
    padding = bytes(data[header_end:min(data_start, size)])
    if padding.strip(b"\0"):
        raise _Problem(f"the {len(padding)} bytes between the tensor infos (ending at byte {header_end}) and the "
                       f"data section (byte {data_start}) are not zero padding")
    section = max(size - data_start, 0)
    for t in tensors:
        t.data_offset = data_start + t.offset
        if t.offset % alignment:
            raise _Problem(f"tensor {t.name!r} has data offset {t.offset}, not a multiple of the alignment "
                           f"{alignment} (nearest aligned offsets {t.offset // alignment * alignment} and "
                           f"{-(-t.offset // alignment) * alignment})")
        if t.offset >= section and t.n_bytes:
            raise _Problem(f"tensor {t.name!r} has data offset {t.offset}, outside the data section (bytes 0.."
                           f"{section - 1}, from byte {data_start} to the end of the file)")
        if t.offset + t.n_bytes > section:
            raise _Problem(f"tensor {t.name!r} is truncated (its data ends at byte {t.data_offset + t.n_bytes}, "
                           f"the file has {size} bytes)")
    ordered = sorted((t for t in tensors if t.n_bytes), key=lambda t: (t.offset, names[t.name]))
    for before, after in zip(ordered, ordered[1:]):
        if after.offset < before.offset + before.n_bytes:
            if after.offset == before.offset:
                raise _Problem(f"tensors {before.name!r} and {after.name!r} point at the same bytes (data offset "
                               f"{after.offset})")
            raise _Problem(f"tensor {after.name!r} (data bytes {after.offset}..{after.offset + after.n_bytes - 1}) "
                           f"overlaps tensor {before.name!r} (data bytes {before.offset}.."
                           f"{before.offset + before.n_bytes - 1})")
    expected = 0
    for t in tensors:  # llama.cpp's rule: back to back in header order, each padded to the alignment
        if t.offset != expected:
            raise _Problem(f"tensor {t.name!r} has data offset {t.offset}, expected {expected} (tensors follow "
                           f"one another in header order, each padded to {alignment} bytes)")
        end = data_start + t.offset + t.n_bytes  # the tensor's bytes end here; its padding must be zero
        padding = bytes(data[end:min(data_start + t.offset + -(-t.n_bytes // alignment) * alignment, size)])
        if padding.strip(b"\0"):
            raise _Problem(f"tensor {t.name!r} of type {t.tensor_type.name} and ne {t.shape} ends at byte {end}, "
                           f"but the {len(padding)} padding bytes after it are not zero: its type or shape does "
                           "not match the data written (a tensor relabelled to a smaller type?)")
        expected += -(-t.n_bytes // alignment) * alignment
    if tensors and size > data_start + expected:
        raise _Problem(f"the file has {size - data_start - expected} bytes after the data of its {len(tensors)} "
                       f"tensors (the data section should end at byte {data_start + expected}, the file has {size})")
    if not tensors and size > data_start:
        raise _Problem(f"the file has {size - data_start} bytes after a header that lists no tensors")
    return GGUFHeader(version, alignment, fields, tensors, header_end, data_start)


def read_gguf_header(path: str | os.PathLike, fd: int | None = None) -> GGUFHeader:
    """The checked header of the GGUF file ``path`` (no tensor data read; the file is memory-mapped).

    Refuses, with ``GGUFLayoutError`` naming the key or tensor: a bad magic, version or byte order; a count
    that disagrees with the bytes (a metadata or tensor count off by any amount is found and named as such);
    a truncated header; unknown
    value or tensor types; strings that are not UTF-8; duplicate keys or tensor names; a ``general.alignment``
    that is not a UINT32 power of two; ``n_dims`` outside 1..4; ``ne[0]`` not a whole number of blocks; a tensor
    offset that is misaligned, outside the data section, overlapping another tensor, or not where llama.cpp's
    layout puts it (back to back in header order); non-zero padding; bytes after the last tensor.
    """
    import mmap

    path = os.fspath(path)
    if fd is None:  # ``fd``: an open descriptor of ``path``, read instead of opening the name again
        with open(path, "rb") as f:
            return read_gguf_header(path, f.fileno())
    size = os.fstat(fd).st_size
    data = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
    try:
        try:
            return _walk(data, size)
        except _Problem as problem:
            declared = struct.unpack_from("<QQ", data, 8) if size >= 24 else None
            if declared is not None:
                n_tensors, n_kv = declared
                found = _metadata_count(data, size, n_tensors, n_kv)
                if found is not None:
                    raise GGUFLayoutError(f"{path}: the header's metadata key/value count is {n_kv}, but the file "
                                          f"holds {found} metadata key/value entries (with {n_kv}: {problem})") from None
                found = _tensor_count(data, size, n_tensors, n_kv)
                if found is not None:
                    raise GGUFLayoutError(f"{path}: the header's tensor count is {n_tensors}, but the file holds "
                                          f"{found} tensor entries (with {n_tensors}: {problem})") from None
            raise GGUFLayoutError(f"{path}: {problem}") from None
    finally:
        if size:
            data.close()


# ================================================================================================ file
@dataclass
class GGUFCheckpoint:
    """The header-level view of a GGUF file: metadata fields and tensor infos (no tensor data read)."""

    path: str  # the .gguf file
    fields: dict[str, GGUFField]  # metadata key -> field (types, contents())
    tensors: dict[str, GGUFTensorInfo]  # GGUF tensor name -> tensor info (offset, type, ne)
    config: ModelConfig | None = None  # filled by ``open`` from the metadata
    alignment: int = DEFAULT_ALIGNMENT
    fd: int | None = dataclass_field(default=None, repr=False)  # the file as opened: tensors come from the same bytes

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFCheckpoint":
        """Read and check the header of ``path`` (``read_gguf_header``) and build its ``ModelConfig``.

        Raises ``CheckpointError`` (``GGUFLayoutError`` for the header and layout checks) for a file that is
        missing, not GGUF, truncated, inconsistent, of another architecture, has an unknown tensor type or a
        metadata key of the wrong type, and ``ConfigError`` for values ``ModelConfig`` rejects.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"GGUF file {path!r} does not exist")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            header = read_gguf_header(path, fd)
        except BaseException:
            os.close(fd)
            raise
        # the descriptor stays open: a file renamed over ``path`` meanwhile cannot mix its tensors in
        checkpoint = cls(path=path, fields=header.fields, tensors={t.name: t for t in header.tensors},
                         alignment=header.alignment, fd=fd)
        arch = checkpoint.string("general.architecture")
        if arch != ARCHITECTURE:
            raise CheckpointError(f"{path}: general.architecture is {arch!r}, expected {ARCHITECTURE!r} "
                                  "(a DiffusionGemma GGUF from llama.cpp's converter)")
        try:
            checkpoint.config = _read_config(checkpoint)
        except ConfigError as exc:  # ModelConfig's checks name its field; say which file and key it came from
            key = _CONFIG_KEYS.get(str(exc).split(" ", 1)[0])
            raise ConfigError(f"{path}: {exc}" + (f" (metadata key {key!r})" if key else "")) from None
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
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def read(self, name: str, keep_quantized: bool = False, keep_bf16: bool = False) -> np.ndarray | Q8_0Tensor:
        """GGUF tensor ``name`` dequantized to a float32 array of its numpy shape (a fresh copy); with
        ``keep_quantized`` a Q8_0 tensor comes as a ``Q8_0Tensor`` instead (its int8 values and scales), with
        ``keep_bf16`` a BF16 tensor as a bfloat16 array (its bits as stored)."""
        from gguf import GGMLQuantizationType, quants

        tensor = self.tensors[name]
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if self.fd is None or not hasattr(os, "pread"):
            raw = np.fromfile(self.path, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.data_offset)
        else:  # from the descriptor opened with the header (a writable copy of the bytes)
            raw = _pread(self.fd, tensor.n_bytes, tensor.data_offset)
        if raw.size != tensor.n_bytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} is truncated (the file shrank after its header "
                                  "was read)")
        shape = self.numpy_shape(name)
        if qtype.name in _RAW_DTYPES:
            data = raw.view(_RAW_DTYPES[qtype.name]).reshape(shape)
        else:  # blocks: rows of bytes, as gguf's reader hands them to ``quants.dequantize``
            data = raw.reshape(quants.quant_shape_to_byte_shape(shape, qtype))
        if keep_quantized and qtype == GGMLQuantizationType.Q8_0:
            return Q8_0Tensor.from_blocks(data, shape)
        if keep_bf16 and qtype == GGMLQuantizationType.BF16:
            return np.ascontiguousarray(raw).view(BFLOAT16).reshape(shape)
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
        out = np.ascontiguousarray(out, dtype=np.float32).reshape(shape)
        return out


def _pread(fd: int, count: int, offset: int) -> np.ndarray:
    """``count`` bytes of ``fd`` from ``offset`` as a writable uint8 array (fewer at the end of the file); read
    in pieces, since one ``pread`` returns at most about 2 GiB on Linux."""
    out = np.empty(count, dtype=np.uint8)
    done = 0
    while done < count:
        piece = os.pread(fd, min(count - done, 1 << 30), offset + done)
        if not piece:
            break
        out[done:done + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        done += len(piece)
    return out[:done]


# ================================================================================================ config
_CONFIG_KEYS = {  # ModelConfig field -> the GGUF metadata key it is read from (for messages)
    "canvas_length": "diffusion.canvas_length",
    "sliding_window": f"{ARCHITECTURE}.attention.sliding_window",
    "max_position_embeddings": f"{ARCHITECTURE}.context_length",
    "rms_norm_eps": f"{ARCHITECTURE}.attention.layer_norm_rms_epsilon",
    "final_logit_softcapping": f"{ARCHITECTURE}.final_logit_softcapping",
    "num_experts": f"{ARCHITECTURE}.expert_count",
    "top_k_experts": f"{ARCHITECTURE}.expert_used_count",
    "moe_intermediate_size": f"{ARCHITECTURE}.expert_feed_forward_length",
    "intermediate_size": f"{ARCHITECTURE}.feed_forward_length",
}


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
    if not 0 < n_layers <= MAX_LAYERS:  # before per-layer lists are built from it
        raise CheckpointError(f"{path}: metadata key '{a}.block_count' must be in 1..{MAX_LAYERS}, got {n_layers}")
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
    rot = checkpoint.integer(f"{a}.rope.dimension_count", dims[FULL])
    if FULL in layer_types and rot != dims[FULL]:
        raise CheckpointError(f"{path}: metadata key '{a}.rope.dimension_count' ({rot}) must equal key_length "
                              f"({dims[FULL]}): full layers rotate a fraction of the head set by {ROPE_FREQS!r}")
    context = checkpoint.integer(f"{a}.context_length")
    if context <= 0:
        raise CheckpointError(f"{path}: metadata key '{a}.context_length' must be positive, got {context}")
    for key, supported in (("attention.causal", False), ("attention.shared_kv_layers", 0),
                           ("embedding_length_per_layer_input", 0)):
        field = checkpoint.fields.get(f"{a}.{key}")
        if field is None:
            continue
        value = checkpoint.boolean(f"{a}.{key}") if isinstance(supported, bool) else checkpoint.integer(f"{a}.{key}")
        if value != supported:
            raise CheckpointError(f"{path}: metadata key '{a}.{key}' is {value!r}; DiffusionGemma needs "
                                  f"{supported!r} (a bidirectional canvas, no shared KV layers, no per-layer "
                                  "input embeddings)")
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
        max_position_embeddings=context,
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


_NOT_WEIGHT_TYPES = frozenset({"F64", "I8", "I16", "I32", "I64"})  # ggml types no weight of this model has


def plan_gguf(checkpoint: GGUFCheckpoint) -> dict[str, tuple[str, ...]]:
    """Project name -> the GGUF tensor(s) it is read from, checking names and shapes from headers alone.

    Raises ``CheckpointError`` naming the GGUF tensor for a missing, unknown or misshapen tensor, or one of a
    type no weight has (F64, integers).
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
    for name in sorted(used & set(checkpoint.tensors)):
        kind = checkpoint.tensors[name].tensor_type.name
        if kind in _NOT_WEIGHT_TYPES:  # e.g. an F32 tensor relabelled F64 or I32: same size, misread values
            raise CheckpointError(f"{path}: tensor {name!r} has type {kind}; DiffusionGemma weights are F32, F16, "
                                  "BF16 or a quantized type (no converter writes another, llama.cpp computes with "
                                  "no other)")
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
                      progress: bool = False, keep_quantized: bool = False,
                      keep_bf16: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(project name, float32 array)`` one tensor at a time, in ``expected_shapes`` order; with
    ``keep_quantized`` a tensor stored as Q8_0 (both halves, for split expert gate/up) is a ``Q8_0Tensor``,
    with ``keep_bf16`` one stored as BF16 (both halves) a bfloat16 array.

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
                parts = [checkpoint.read(s, keep_quantized, keep_bf16) for s in sources]
                if all(isinstance(p, Q8_0Tensor) for p in parts):
                    array = Q8_0Tensor.concatenate(parts, axis=1)
                elif all(is_bfloat16(p) for p in parts):
                    array = np.concatenate(parts, axis=1)
                else:
                    array = np.concatenate([widen(p) for p in parts], axis=1)
                del parts
            else:
                array = checkpoint.read(sources[0], keep_quantized, keep_bf16)
            check_finite(array, f"{sources[0]} ({name})")
            if name == "embed_tokens" and OUTPUT in checkpoint.tensors:
                head = checkpoint.read(OUTPUT)
                if not np.array_equal(head, widen(array)):
                    raise CheckpointError(f"{checkpoint.path}: tensor {OUTPUT!r} differs from 'token_embd.weight'; "
                                          "an untied output projection is not supported")
                del head
            bar.update()
            yield name, array
            del array
    finally:
        bar.close()


def load_gguf_checkpoint(path: str | os.PathLike, progress: bool = False, keep_quantized: bool = False,
                         keep_bf16: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(config, {project name: float32 array})`` of a diffusion-gemma GGUF file (see the module docstring);
    with ``keep_quantized``, Q8_0 tensors as ``Q8_0Tensor`` (``reference.support.quantized``); with
    ``keep_bf16``, BF16 tensors as bfloat16 arrays."""
    checkpoint = GGUFCheckpoint.open(path)
    tensors = dict(iter_gguf_tensors(checkpoint, progress=progress, keep_quantized=keep_quantized,
                                     keep_bf16=keep_bf16))
    return checkpoint.config, tensors


def open_gguf_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, "WeightStore"]:
    """``(config, WeightStore)`` of a diffusion-gemma GGUF file: the file mapped, nothing read but its header.

    Names, shapes and types are checked as ``plan_gguf`` does; each tensor is a view of the mapping in its
    stored type (F32, F16 and BF16 as arrays, Q8_0 as ``Q8_0Tensor`` blocks, any other type dequantized by the
    gguf package as it is read), split expert gate/up halves joined on read; values are checked finite, and an
    ``output.weight`` equal to ``token_embd.weight``, the first time each is read (``WeightStore.checked``).
    The mapping is made from the descriptor the header was read from: the tensors come from the same file
    even if another is renamed over ``path`` meanwhile.
    """
    from gguf import GGMLQuantizationType, quants

    from diffusiongemma.reference.support.weight_store import MappedFile, StoredTensor, WeightStore, span

    checkpoint = GGUFCheckpoint.open(path)
    plan = plan_gguf(checkpoint)
    pinned = f"/proc/self/fd/{checkpoint.fd}"
    mapped = MappedFile(checkpoint.path, pinned if checkpoint.fd is not None and os.path.exists(pinned) else None)

    def stored(gguf_tensor: str, project: str) -> StoredTensor:
        tensor = _stored(gguf_tensor, project)
        info = checkpoint.tensors[gguf_tensor]
        tensor.prefetch = span(mapped, info.data_offset, info.n_bytes)
        return tensor

    def _stored(gguf_tensor: str, project: str) -> StoredTensor:
        info = checkpoint.tensors[gguf_tensor]
        qtype = GGMLQuantizationType(info.tensor_type)
        shape = checkpoint.numpy_shape(gguf_tensor)
        where = f"{checkpoint.path}: {gguf_tensor} ({project})"
        if info.data_offset + info.n_bytes > mapped.size:
            raise CheckpointError(f"{checkpoint.path}: tensor {gguf_tensor!r} is truncated (it ends at byte "
                                  f"{info.data_offset + info.n_bytes}, the file has {mapped.size})")
        if qtype == GGMLQuantizationType.BF16:
            return StoredTensor.of_array(mapped.view(info.data_offset, info.n_bytes, BFLOAT16, shape), where)
        if qtype.name in ("F32", "F16"):
            return StoredTensor.of_array(mapped.view(info.data_offset, info.n_bytes, np.dtype(_RAW_DTYPES[qtype.name]),
                                                     shape), where)
        blocks = mapped.view(info.data_offset, info.n_bytes, np.uint8, quants.quant_shape_to_byte_shape(shape, qtype))
        if qtype == GGMLQuantizationType.Q8_0:
            return StoredTensor.of_q8_0(blocks, shape, where)

        def dequantized(index):
            try:
                return np.asarray(quants.dequantize(blocks if index is None else blocks[index], qtype), dtype=np.float32)
            except NotImplementedError as exc:
                raise CheckpointError(f"{checkpoint.path}: tensor {gguf_tensor!r} has type {qtype.name}, which the "
                                      "gguf package cannot dequantize") from exc
        return StoredTensor(shape, qtype.name.lower(), where, dequantized, info.n_bytes)

    tensors = {}
    for name, sources in plan.items():
        parts = [stored(s, name) for s in sources]
        tensors[name] = parts[0] if len(parts) == 1 else StoredTensor.joined(parts, 1, f"{checkpoint.path}: {name}")
    checks = {}
    if OUTPUT in checkpoint.tensors:
        head = stored(OUTPUT, "embed_tokens")

        def tied_head():
            for (offset, table), (_, rows) in zip(tensors["embed_tokens"].chunks(), head.chunks()):
                if not np.array_equal(widen(rows), widen(table)):
                    raise CheckpointError(f"{checkpoint.path}: tensor {OUTPUT!r} differs from 'token_embd.weight'; "
                                          "an untied output projection is not supported")
        checks["embed_tokens"] = tied_head
    return checkpoint.config, WeightStore(tensors, [mapped, checkpoint], checkpoint.path, checks)


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
    Raises ``CheckpointError`` naming the file and "vocabulary" when the tokenizers library cannot build it
    (e.g. a merge whose parts are not tokens: one flipped bit in a token string).
    """
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
    try:
        return _build_tokenizer(checkpoint, kind, tokens, types, merges)
    except CheckpointError:
        raise
    except Exception as exc:  # the tokenizers library raises a bare Exception for a vocabulary it cannot build
        raise CheckpointError(f"{path}: the tokenizer vocabulary (metadata keys 'tokenizer.ggml.tokens' / "
                              f"'tokenizer.ggml.merges') is damaged: {str(exc).splitlines()[0][:200]}") from None


def _build_tokenizer(checkpoint: GGUFCheckpoint, kind: str, tokens: list, types: list, merges: list):
    """``build_tokenizer``'s work once the metadata is read; the tokenizers library may raise anything."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    path = checkpoint.path
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
