"""Writing a DiffusionGemma checkpoint as a llama.cpp GGUF file (architecture ``diffusion-gemma``).

    write_gguf(src, dst, gguf_type="f32") -> GGUFSummary      (diffusiongemma convert MODEL out.gguf)

``src`` is anything ``Model.from_pretrained`` reads (a converted directory, a transformers directory, a GGUF
file). The file is the one llama.cpp's own converter (``conversion/diffusion_gemma.py`` on ``Gemma4Model``,
PR #24423) would write from the transformers checkpoint, so a transformers 5.24 user, whose config keeps
``global_head_dim`` and the full layers' key/value heads under ``per_layer_config`` where that converter does
not look, need not patch it. ``weights_converter/gguf.py`` reads it back (and documents the layout):

* metadata ``diffusion-gemma.*``: block_count, context_length, embedding_length, feed_forward_length,
  attention.head_count, per-layer attention.head_count_kv (INT32 array), key/value_length (full layers) and
  key/value_length_swa, sliding_window, per-layer bool sliding_window_pattern, layer_norm_rms_epsilon,
  causal = false, rope.freq_base / freq_base_swa, rope.dimension_count (the full head) /
  dimension_count_swa, expert_count, expert_used_count, expert_feed_forward_length,
  final_logit_softcapping, shared_kv_layers = 0, embedding_length_per_layer_input = 0; and, not
  arch-prefixed, ``diffusion.canvas_length`` and the sampler defaults ``diffusion.eb_*`` from the
  checkpoint's generation settings;
* tensors named by ``gguf.GGUF_NAMES`` with the experts' gate and up projections fused
  (``ffn_gate_up_exps``), the encoder's and the decoder's layer scalars apart, no ``output.weight`` (tied),
  and ``rope_freqs.weight`` = ``[1.0] * n_rot + [1e30] * rest`` for the full layers' proportional RoPE
  (all 1.0 for plain RoPE: llama.cpp's loader requires the tensor for full layers);
* the tokenizer as llama.cpp's vocabulary loader reads it: a byte-level BPE (``tokenizer.json`` with a
  ByteLevel pre-tokenizer, like the shipped tiny-kjv) as ``tokenizer.ggml.model = "gpt2"`` with
  ``tokenizer.ggml.pre = "gpt-2"``; a SentencePiece-style BPE (U+2581 for spaces, byte fallback, Gemma's) as
  ``"gemma4"``; tokens in id order, padded to the embedding's vocab_size with unused ``[PAD{i}]`` entries
  (llama.cpp draws random canvas ids over its token count), token types (special added tokens CONTROL),
  merges as ``"left right"``, the bos / eos (the second end id as eot) / pad / unk / mask ids (llama.cpp's
  diffusion CLI refuses a vocabulary without a mask token: the tokenizer's ``mask_token``, else a token
  ``<mask>``, else the pad id), ``add_bos_token`` as the tokenizer adds BOS, ``add_space_prefix`` false;
* ``tokenizer.chat_template``: the checkpoint's template; a checkpoint without one gets a pass-through
  template (the user text as is), because llama.cpp's diffusion CLI always applies a template and would
  otherwise wrap the prompt in ChatML.

Types (``gguf_type``): ``f32`` keeps every tensor float32, bit for bit. ``f16`` and ``q8_0`` store the
matrices as F16 / Q8_0 (``gguf.quants``, llama.cpp's rounding) and keep float32 what llama.cpp's converter
keeps float32: 1-D tensors, ``*_norm.weight``, the router's ``ffn_gate_inp.weight`` and the ``.scale``
tensors; a Q8_0 matrix whose rows are not whole 32-element blocks falls back to F16, as there. A finite weight
that F16 or Q8_0 cannot hold (above 65,504 in an F16 matrix; a Q8_0 block whose scale, its largest magnitude
over 127, is above 65,504) is refused by name (tensor, value, index): the file never gets an inf that the
checkpoint did not have.

Errors: ``InputError`` for a bad ``gguf_type`` or destination (exists without ``force``, not ``.gguf``),
``CheckpointError`` for a source without a tokenizer llama.cpp can read, or a model the format cannot hold
(more than two end ids, a RoPE llama.cpp does not implement). The file is written to a temporary name
beside ``dst`` (``.<name>.partial-<host>-<pid>-<start>-XXXX.gguf``) and renamed, so a failure leaves no
partial file, and one that a SIGKILL left is removed by the next export to ``dst`` once its writer is gone. The
file gets the mode the umask gives (0644 under 022). A full disk raises ``WriteError`` ("No space left on
device", naming ``dst``). Without ``force`` a second export to the same new path is refused (``InputError``)
while the first runs, and the final rename never replaces a file that appeared meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffusiongemma.reference import InputError
from diffusiongemma.reference.config import FULL, SLIDING, ModelConfig
from diffusiongemma.reference.weights import expected_shapes

from diffusiongemma.weights_converter.gguf import ARCHITECTURE, ROPE_FREQS, gguf_name

_LEGACY_PARTIAL = re.compile(r"^\.partial-[A-Za-z0-9_]{8}\.gguf$")  # earlier versions' unowned partial files

__all__ = ["GGUF_TYPES", "GGUFSummary", "write_gguf", "write_model_gguf", "PASS_THROUGH_TEMPLATE"]

GGUF_TYPES = ("f32", "f16", "q8_0")
PASS_THROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
_FROZEN = 1e30  # rope_freqs entry of a pair that does not rotate (llama.cpp's converter writes 1e30)
_A = ARCHITECTURE

# llama.cpp token types (llama.h LLAMA_TOKEN_TYPE_*)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GGUFSummary:
    """What ``write_gguf`` wrote."""

    source: str
    destination: str
    gguf_type: str
    num_tensors: int
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type name -> tensor count
    file_bytes: int = 0
    tokenizer_model: str = ""
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.tensor_types.items()))
        lines = [f"wrote {self.destination} ({self.file_bytes} bytes, {self.num_tensors} tensors: {kinds}; "
                 f"tokenizer {self.tokenizer_model}) from {self.source}"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


# ================================================================================================ tensors
def _storage_type(gguf: Any, name: str, shape: tuple[int, ...], gguf_type: str):
    """The ggml type a tensor of ``shape`` is stored as, by llama.cpp's converter rules (module docstring)."""
    Q = gguf.GGMLQuantizationType
    if (gguf_type == "f32" or len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith(".ffn_gate_inp.weight")
            or not name.endswith(".weight")):
        return Q.F32
    if gguf_type == "f16":
        return Q.F16
    block = gguf.GGML_QUANT_SIZES[Q.Q8_0][0]
    return Q.Q8_0 if shape[-1] % block == 0 else Q.F16


_ENCODE_CHUNK_BYTES = 64 * 2 ** 20  # float32 bytes of the rows widened and encoded at a time


def _encoded(gguf: Any, value: Any, qtype, name: str = "tensor") -> np.ndarray:
    """The file's bytes of one tensor (``value``: an array, or a ``StreamedTensor`` of a mapped checkpoint),
    encoded a block of rows at a time so that no more than ``_ENCODE_CHUNK_BYTES`` of float32 values and their
    encoding's temporaries are alive besides the result (types work along the last axis: exact by rows)."""
    shape = tuple(value.shape)
    if len(shape) <= 1:
        return _encode(gguf, np.asarray(value, dtype=np.float32), qtype, name)
    Q = gguf.GGMLQuantizationType
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype) if qtype == Q.Q8_0 else shape
    out = np.empty(byte_shape, dtype={Q.F32: np.float32, Q.F16: np.float16}.get(qtype, np.uint8))
    row_bytes = 4 * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, _ENCODE_CHUNK_BYTES // max(1, row_bytes))
    for a in range(0, shape[0], step):
        out[a:a + step] = _encode(gguf, np.asarray(value[a:a + step], dtype=np.float32), qtype, name, a)
    return out


F16_MAX = float(np.finfo(np.float16).max)  # 65504: the largest finite half-precision number
Q8_0_MAX = F16_MAX * 127  # a Q8_0 block stores max|x| / 127 as float16: about 8.3e6 at most


def _encode(gguf: Any, array: np.ndarray, qtype, name: str = "tensor", row0: int = 0) -> np.ndarray:
    """``array`` stored as ``qtype``. F16 and Q8_0 hold a narrower range than float32: a finite value they
    would turn into inf (above 65,504 for F16; a Q8_0 block whose largest magnitude over 127, its scale, is
    above 65,504) is refused with ``InputError`` naming the tensor, the value and where it is, never
    written as inf. ``row0``: where ``array``'s first row stands in the tensor (a block of its rows), for the
    message."""
    Q = gguf.GGMLQuantizationType
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == Q.F32:
        return array
    if qtype == Q.F16:
        with np.errstate(over="ignore"):
            encoded = array.astype(np.float16)
        _refuse_overflow(name, array, np.isinf(encoded) & np.isfinite(array), "F16", f"|x| <= {F16_MAX:g}", row0)
        return encoded
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    peaks = np.abs(array.reshape(-1, block)).max(axis=1) / np.float32(127)  # each block's scale, as gguf computes it
    with np.errstate(over="ignore"):
        too_large = np.isinf(peaks.astype(np.float16))
    if too_large.any():
        blocks = np.repeat(too_large, block).reshape(array.shape)
        _refuse_overflow(name, array, blocks, "Q8_0",
                         f"|x| <= about {Q8_0_MAX:.3g}: a block's scale max|x|/127 is float16", row0)
    return gguf.quants.quantize(array, qtype)


def _refuse_overflow(name: str, array: np.ndarray, bad: np.ndarray, kind: str, limit: str, row0: int = 0) -> None:
    """``InputError`` naming the tensor, its largest offending value and its index when ``bad`` has any entry
    (``row0`` added to the first index: ``array`` may be a block of the tensor's rows)."""
    if not bad.any():
        return
    values = np.where(bad, np.abs(array), -1.0)
    at = np.unravel_index(int(np.argmax(values)), array.shape)
    where = [int(i) for i in at]
    if where:
        where[0] += row0
    raise InputError(f"tensor {name} holds {array[at]} at {where}, which {kind} cannot "
                     f"store ({limit}; it would become inf); export it with --gguf-type f32, which keeps every "
                     "float32 value")


def _rope_freqs(config: ModelConfig) -> np.ndarray | None:
    """``rope_freqs.weight`` of the full layers, or None when the model has no full layer."""
    if FULL not in config.layer_types:
        return None
    d = config.layer_head_dim[config.layer_types.index(FULL)]
    rope = config.rope_parameters[FULL]
    if rope.rope_type == "default":
        n_rot = d // 2
    elif rope.rope_type == "proportional":
        n_rot = int(d * rope.partial_rotary_factor / 2)
    else:
        raise InputError(f"full-attention RoPE type {rope.rope_type!r} has no llama.cpp encoding "
                         "(supported: default, proportional)")
    return np.array([1.0] * n_rot + [_FROZEN] * (d // 2 - n_rot), dtype=np.float32)


# ================================================================================================ metadata
def _model_metadata(w: Any, config: ModelConfig) -> None:
    types = config.layer_types
    full = types.index(FULL) if FULL in types else 0
    sliding = types.index(SLIDING) if SLIDING in types else full
    if SLIDING in types and config.rope_parameters[SLIDING].rope_type != "default":
        raise InputError(f"sliding-attention RoPE type {config.rope_parameters[SLIDING].rope_type!r}: llama.cpp "
                         "rotates whole sliding heads with plain RoPE")
    theta_full = (config.rope_parameters[FULL] if FULL in types else config.rope_parameters[SLIDING]).rope_theta
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(int(getattr(config, "max_position_embeddings", 131072)))
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv([int(g) for g in config.layer_num_key_value_heads])
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_key_length(config.layer_head_dim[full])
    w.add_value_length(config.layer_head_dim[full])
    w.add_key_length_swa(config.layer_head_dim[sliding])
    w.add_value_length_swa(config.layer_head_dim[sliding])
    w.add_sliding_window(config.sliding_window)
    w.add_sliding_window_pattern([t == SLIDING for t in types])
    w.add_causal_attention(False)
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.top_k_experts)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_rope_freq_base(float(theta_full))
    if SLIDING in types:
        w.add_rope_freq_base_swa(float(config.rope_parameters[SLIDING].rope_theta))
    w.add_rope_dimension_count(config.layer_head_dim[full])
    w.add_rope_dimension_count_swa(config.layer_head_dim[sliding])
    w.add_final_logit_softcapping(float(config.final_logit_softcapping))
    w.add_uint32("diffusion.canvas_length", config.canvas_length)


def _generation_metadata(w: Any, src: str, notes: list[str] | None = None) -> None:
    """``diffusion.eb_*`` from the source's generation settings (absent keys: llama.cpp's defaults apply).

    llama.cpp's CLI reads these floats back through ``std::to_string`` ("%f", six decimals) and ``strtof``; a
    value that does not survive that (1e-7 becomes 0) is written as is and named in ``notes``."""
    from diffusiongemma.checkpoint import load_generation_config

    try:
        gen = load_generation_config(src)
    except (FileNotFoundError, OSError):
        return
    w.add_uint32("diffusion.eb_max_steps", int(gen.max_denoising_steps))
    w.add_float32("diffusion.eb_t_min", float(gen.t_min))
    w.add_float32("diffusion.eb_t_max", float(gen.t_max))
    w.add_float32("diffusion.eb_entropy_bound", float(gen.entropy_bound))
    w.add_uint32("diffusion.eb_stability_threshold", int(gen.stability_threshold))
    w.add_float32("diffusion.eb_confidence_threshold", float(gen.confidence_threshold))
    for key, value in (("t_min", gen.t_min), ("t_max", gen.t_max), ("entropy_bound", gen.entropy_bound),
                       ("confidence_threshold", gen.confidence_threshold)):
        seen = np.float32(float(f"{float(np.float32(value)):f}"))
        if notes is not None and seen != np.float32(value):
            notes.append(f"diffusion.eb_{key} = {value!r} reaches llama.cpp's sampler as {float(seen)!r} (it reads "
                         "the value back printed with six decimals)")


def _tokenizer_metadata(gguf: Any, w: Any, src: str, config: ModelConfig, notes: list[str]) -> str:
    """``tokenizer.ggml.*`` and ``tokenizer.chat_template``; returns the tokenizer model name written."""
    from diffusiongemma.checkpoint import load_text_side
    from diffusiongemma.reference import CheckpointError

    text = load_text_side(src)
    spec = json.loads(text.tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(f"{src}: the tokenizer is a {model.get('type')!r} model; a GGUF for llama.cpp needs a "
                              "BPE tokenizer (byte-level like GPT-2, or SentencePiece-style like Gemma)")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {int(t["id"]): t for t in spec.get("added_tokens", [])}
    for i, t in added.items():
        vocab[t["content"]] = i
    size = max(max(vocab.values()) + 1, config.vocab_size)
    if size > config.vocab_size:
        raise CheckpointError(f"{src}: the tokenizer has ids up to {size - 1}, beyond the model's vocab_size "
                              f"{config.vocab_size}")
    tokens: list[str | None] = [None] * size
    for token, i in vocab.items():
        tokens[i] = token
    types = []
    for i, token in enumerate(tokens):
        if token is None:
            tokens[i] = f"[PAD{i}]"
            types.append(_UNUSED)
        elif i in added:
            types.append(_CONTROL if added[i].get("special") else _USER_DEFINED)
        elif token.startswith("<0x") and token.endswith(">") and len(token) == 6:
            types.append(_BYTE)
        else:
            types.append(_NORMAL)
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{src}: the tokenizer maps one token string to several ids; llama.cpp's vocabulary "
                              "needs one string per id")
    pre = json.dumps(spec.get("pre_tokenizer"))
    byte_level = '"ByteLevel"' in pre
    kind = "gpt2" if byte_level else "gemma4"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not byte_level and not model.get("byte_fallback"):
        raise CheckpointError(f"{src}: the tokenizer is neither byte-level (ByteLevel pre-tokenizer) nor a "
                              "SentencePiece-style BPE with byte fallback; llama.cpp has no matching vocabulary type")
    w.add_tokenizer_model(kind)
    if byte_level:
        w.add_tokenizer_pre("gpt-2")  # GPT-2's split regex, as tokenizers' ByteLevel(use_regex=True)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * size)
    w.add_token_types(types)
    w.add_token_merges(merges)

    def find(name: str | None) -> int | None:
        return vocab.get(name) if name else None

    config_file = os.path.join(src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)),
                               "tokenizer_config.json")
    tok_config: dict = {}
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            tok_config = json.load(f)

    def configured(key: str) -> int | None:
        value = tok_config.get(key)
        return find(value.get("content") if isinstance(value, dict) else value)

    eos = [int(e) for e in config.eos_token_id]
    if len(eos) > 2:
        raise CheckpointError(f"{src}: {len(eos)} end ids {eos}; a GGUF holds two (eos_token_id, eot_token_id)")
    w.add_bos_token_id(int(config.bos_token_id))
    w.add_eos_token_id(eos[0])
    if len(eos) == 2:
        w.add_eot_token_id(eos[1])
    w.add_pad_token_id(int(config.pad_token_id))
    unk = configured("unk_token")
    if unk is None and model.get("unk_token"):
        unk = find(model["unk_token"])
    if unk is not None:
        w.add_unk_token_id(unk)
    mask = configured("mask_token")
    if mask is None:
        mask = find("<mask>")
    if mask is None:
        mask = int(config.pad_token_id)
        notes.append(f"the tokenizer has no mask token; tokenizer.ggml.mask_token_id is the pad id {mask} "
                     "(llama.cpp's diffusion CLI needs one; DiffusionGemma never feeds it)")
    w.add_mask_token_id(mask)
    probe = text.tokenizer.encode("a", add_special_tokens=True).ids
    w.add_add_bos_token(bool(probe) and probe[0] == int(config.bos_token_id))
    w.add_add_space_prefix(False)
    if text.chat_template:
        w.add_chat_template(text.chat_template)
    else:
        w.add_chat_template(PASS_THROUGH_TEMPLATE)
        notes.append("the checkpoint has no chat template; the GGUF gets a pass-through template (llama.cpp's "
                     "diffusion CLI always applies one)")
    return kind


# ================================================================================================ writer
def write_gguf(src: str | os.PathLike, dst: str | os.PathLike, gguf_type: str = "f32", *, force: bool = False,
               name: str | None = None) -> GGUFSummary:
    """Write the checkpoint ``src`` as the GGUF file ``dst`` (see the module docstring); returns a summary."""
    from diffusiongemma.reference.model import Model

    _check_request(dst, gguf_type, force)
    src = os.fspath(src)
    return write_model_gguf(Model.from_pretrained(src), src, dst, gguf_type, force=force,
                            name=name or os.path.basename(os.path.normpath(src)))


def _check_request(dst, gguf_type: str, force: bool) -> str:
    if gguf_type not in GGUF_TYPES:
        raise InputError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    dst = os.path.abspath(os.fspath(dst))
    if not dst.lower().endswith(".gguf"):
        raise InputError(f"the GGUF destination {dst!r} must end in .gguf")
    if os.path.isdir(dst):
        raise InputError(f"{dst!r} is a directory, not a .gguf file")
    if not os.path.isdir(os.path.dirname(dst)):
        raise InputError(f"the GGUF destination's folder {os.path.dirname(dst)!r} does not exist")
    if os.path.exists(dst) and not force:
        raise InputError(f"{dst!r} already exists (pass --force to replace it)")
    return dst


def _begin_export(dst: str, force: bool) -> str:
    """The hidden file ``.<name>.partial-<host>-<pid>-<start>-XXXX.gguf`` beside ``dst`` to write into.

    First removes what exports to ``dst`` killed before they could clean up left behind (their writer no
    longer runs: ``writer.cleanup_stale``) and unowned ``.partial-*.gguf`` files of earlier versions untouched
    for a day. Without ``force``, refuses with ``InputError`` while another live process is exporting to
    ``dst`` (its partial file names it), so that two exports to one new path cannot both succeed.
    """
    from diffusiongemma.weights_converter import writer

    parent, base = os.path.dirname(dst), os.path.basename(dst)
    writer.cleanup_stale(dst)
    now = time.time()
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if _LEGACY_PARTIAL.match(entry) and os.path.isfile(path) and not os.path.islink(path):
            with contextlib.suppress(OSError):
                if now - os.lstat(path).st_mtime > writer.STALE_AFTER_S:
                    os.unlink(path)
    if not force:
        prefix = f".{base}.partial-"
        for entry in os.listdir(parent):
            if entry.startswith(prefix):
                raise InputError(f"{dst!r} is being written by another export (its partial file {entry!r} "
                                 "belongs to a process that still runs); wait for it, or pass --force")
    try:
        fd, tmp = tempfile.mkstemp(prefix=writer._hidden_name(dst, "partial"), suffix=".gguf", dir=parent)
    except OSError as exc:  # e.g. a read-only folder: name the destination, not the hidden file
        raise writer.write_error(dst, exc) from None
    os.close(fd)
    return tmp


def _finish_file(path: str) -> None:
    """Give ``path`` the mode a plain ``open`` would have (``mkstemp`` makes it 0600) and flush it to disk."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _export_write_error(dst: str, tmp: str, exc: OSError) -> OSError:
    """``writer.WriteError`` naming ``dst`` and the system's reason. numpy's ``tofile`` reports a short write as
    ``OSError("N requested and M written")`` without an errno; one more byte written to the file gives the
    reason (ENOSPC on a full disk, EFBIG over a file-size limit)."""
    from diffusiongemma.weights_converter import writer

    if getattr(exc, "errno", None) is None:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, b"\0")
            finally:
                os.close(fd)
        except OSError as probe:
            if probe.errno is not None:
                exc = probe
    if getattr(exc, "errno", None) is None:
        exc = OSError(errno.EIO, str(exc))
    return writer.write_error(dst, exc)


def _commit(tmp: str, dst: str, force: bool) -> None:
    """Put the finished ``tmp`` in place as ``dst``: replacing it with ``force``, else only if ``dst`` is still
    absent (one atomic step; an export that finished first keeps its file and this one is refused)."""
    if force:
        os.replace(tmp, dst)
        return
    try:
        os.link(tmp, dst)  # fails with EEXIST instead of replacing
    except FileExistsError:
        raise InputError(f"{dst!r} already exists (written meanwhile by another process?); pass --force to "
                         "replace it") from None
    except OSError:  # a file system without hard links
        from diffusiongemma.weights_converter.writer import _RENAME_NOREPLACE, _renameat2

        try:
            if _renameat2(tmp, dst, _RENAME_NOREPLACE):
                return
        except FileExistsError:
            raise InputError(f"{dst!r} already exists (written meanwhile by another process?); pass --force "
                             "to replace it") from None
        if os.path.exists(dst):
            raise InputError(f"{dst!r} already exists; pass --force to replace it") from None
        os.rename(tmp, dst)
        return
    os.unlink(tmp)


def write_model_gguf(model: Any, text_source: str | os.PathLike, dst: str | os.PathLike, gguf_type: str = "f32", *,
                     force: bool = False, name: str = "diffusiongemma") -> GGUFSummary:
    """Write ``model`` (a reference ``Model``: its config and float32 tensors) as the GGUF file ``dst``, with
    the tokenizer, chat template and generation settings of the checkpoint directory (or GGUF file)
    ``text_source``."""
    import gguf

    dst = _check_request(dst, gguf_type, force)
    text_source = os.fspath(text_source)
    config = model.config
    notes: list[str] = []
    tmp = _begin_export(dst, force)
    counts: dict[str, int] = {}
    try:
        w = gguf.GGUFWriter(tmp, _A)
        w.add_name(name)
        w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                         "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
        _model_metadata(w, config)
        _generation_metadata(w, text_source, notes)
        kind = _tokenizer_metadata(gguf, w, text_source, config, notes)
        # one tensor in memory at a time: every tensor's info (name, shape, type, bytes) is declared first, from
        # shapes alone, then each is read (widened from a mapped checkpoint), encoded and written in turn
        shapes = expected_shapes(config)
        tensors: list[tuple[str, Any]] = [(gguf_name(n), n) for n in shapes]
        labels = {gguf_name(n): f"{gguf_name(n)} ({n})" for n in shapes}
        freqs = _rope_freqs(config)
        if freqs is not None:
            tensors.append((ROPE_FREQS, freqs))
        payload = 0
        for gname, source in tensors:
            shape = shapes[source] if isinstance(source, str) else tuple(source.shape)
            qtype = _storage_type(gguf, gname, shape, gguf_type)
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype) if qtype == gguf.GGMLQuantizationType.Q8_0 \
                else shape
            nbytes = int(np.prod(byte_shape, dtype=np.int64)) * {"F32": 4, "F16": 2}.get(qtype.name, 1)
            w.add_tensor_info(gname, byte_shape, np.dtype(np.uint8) if qtype.name == "Q8_0" else
                              np.dtype({"F32": np.float32, "F16": np.float16}[qtype.name]), nbytes, raw_dtype=qtype)
            payload += nbytes
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        from diffusiongemma.weights_converter.writer import check_free_space

        check_free_space(dst, payload)  # a disk that cannot hold the tensors: said before a byte is written
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for gname, source in tensors:
                value = model.tensors[source] if isinstance(source, str) else source
                qtype = _storage_type(gguf, gname, tuple(value.shape), gguf_type)
                w.write_tensor_data(_encoded(gguf, value, qtype, labels.get(gname, gname)))
                del value
            w.close()
            _finish_file(tmp)
        except InputError:  # a value the type cannot hold, found as its tensor was encoded: the partial file goes
            with contextlib.suppress(Exception):
                w.close()
            raise
        except OSError as exc:
            raise _export_write_error(dst, tmp, exc) from None
        _commit(tmp, dst, force)
        from diffusiongemma.weights_converter.writer import _fsync_dir

        _fsync_dir(os.path.dirname(dst))  # the new name is on disk too
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return GGUFSummary(source=text_source, destination=dst, gguf_type=gguf_type, num_tensors=len(tensors),
                       tensor_types=counts, file_bytes=os.path.getsize(dst), tokenizer_model=kind, notes=notes)
