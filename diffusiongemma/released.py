"""Random-weight checkpoints at the released shape of ``google/diffusiongemma-26B-A4B-it``, written tensor by
tensor in transformers' layout.

    make_checkpoint("DIR", layers=2)                          # 2 of the 30 layers at the released width, bf16
    make_checkpoint("DIR", layers=12, scale=64, dtype="float32")   # the released pattern, every width / 64
    make_checkpoint("DIR", layers=6, hidden_size=256, num_experts=8, gguf="q8_0")   # explicit widths, + GGUF

    diffusiongemma make-checkpoint DIR --layers 2 [--dtype bfloat16|float32] [--seed S] [--scale N]
                                   [--hidden-size H ...] [--gguf f32|f16|q8_0] [--force]

What is released, and where it is written down: ``ReleasedShape`` holds every width of the released text model
(docs/SPEC.md §1 and §2.1, checked against transformers 5.24.0's ``DiffusionGemmaTextConfig``: its class
defaults are Gemma 4's smaller sizes, so each released value is set explicitly). ``layers`` keeps the released
layer pattern over any number of layers: layer i is full attention when (i + 1) % 6 == 0, and the last layer
is full (transformers forces that too). ``hf_config`` builds the ``DiffusionGemmaConfig`` through
transformers' own class, which turns ``global_head_dim`` / ``num_global_key_value_heads`` into its
``per_layer_config``; ``save_pretrained`` writes that with the layer indices zero-padded to a common width
("05", "11", ... for 30 layers), as in the released ``config.json``. The vision tower is the one-layer,
16-wide one of the project's tiny models (text is all this project runs; the released tower would add about
0.55 B parameters that no text path reads).

The file layout is what ``save_pretrained`` writes for that config (``tensor_shapes``; the test suite checks
it against transformers' own state dict and files): the decoder's text weights, the encoder's layer scalars
(the only encoder-text tensors stored: the rest are tied to the decoder's), the vision tower, no ``lm_head``
(tied to the embedding). One file ``model.safetensors`` when the weights fit in ``shard_size`` bytes, else
``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``, as the released checkpoint is
stored. Beside them: ``config.json`` (transformers' ``save_pretrained`` of the config),
``generation_config.json`` (the released sampler settings, SPEC §2.2, with end id 1 only: ids 106 and 50 are
Gemma's turn tokens, ordinary words in this tokenizer) and the shipped tiny-kjv model's byte-level BPE
tokenizer (4,093 tokens; ``vocab_size`` must be at least 4,096 so that the image ids stay clear of it).

The values (``tensor_chunks``): every tensor is drawn from its own generator, seeded by ``seed`` and the
tensor's name, so a tensor does not depend on the layer count or on the others (layer 0 of a 2-layer and of a
30-layer checkpoint are the same). Matrices and embeddings are uniform with standard deviation
1/sqrt(fan in) (the last axis: a forward pass keeps activations of order one, and the tied logits of order
one, so every backend stays finite); 1-D tensors (norm weights, router scales) uniform in [0.75, 1.25]
(near one, but each different); layer scalars uniform in [0.5, 1.5], the encoder's and the decoder's drawn
apart. Every value is a bfloat16 number (the float32 draw with its low 16 bits cleared), so the float32 and
the bfloat16 checkpoint of one seed hold the same weights.

Memory: nothing holds a tensor. Each one is drawn, converted and written in chunks of ``CHUNK_ELEMENTS``
values straight into the safetensors file (whose format is written here: an 8-byte little-endian header
length, the JSON header with every tensor's dtype, shape and byte range, then the raw bytes), so writing the
30-layer, 50.5 GB bfloat16 checkpoint takes tens of MB beyond the interpreter. Each finished file is flushed
to disk and dropped from the page cache. The output is built in a hidden sibling directory and renamed into
place at the end: a failure or Ctrl-C leaves nothing at the destination, and what a killed write left is
removed by the next write to the same destination once its process is gone.

GGUF (``gguf=``): the checkpoint is then converted by ``diffusiongemma.gguf_writer.write_gguf`` into
``DIR/model-<type>.gguf``. That converter reads the checkpoint through its mapping and encodes and writes one
tensor at a time, so the maker refuses a GGUF only when the largest tensor's encoding does not fit in the
memory available (before writing anything).

torch is not needed; transformers is (its config class is the point).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from diffusiongemma.reference.support.errors import InputError

SLIDING, FULL = "sliding_attention", "full_attention"
DTYPES = ("bfloat16", "float32")
GGUF_TYPES = ("f32", "f16", "q8_0")  # those of diffusiongemma.gguf_writer
GGUF_BYTES = {"f32": 4, "f16": 2, "q8_0": 34 / 32}  # bytes per weight at most (Q8_0: 32 int8 + a float16 scale)
SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float32": "F32"}
BYTES = {"bfloat16": 2, "float32": 4}
DEFAULT_SHARD_SIZE = 5 * 10 ** 9  # bytes of tensor data per file (the released checkpoint's files are about this)
CHUNK_ELEMENTS = 1 << 22  # values drawn and written at a time (16 MiB of float32)
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
MIN_VOCAB = 4096  # the tiny-kjv tokenizer's 4,093 tokens, then the three image ids
# The released image placeholder / begin-of-image / end-of-image ids (used when vocab_size is the released one;
# a reduced vocabulary puts them at its top three ids, as the project's tiny models do).
RELEASED_IMAGE_IDS = (258_880, 255_999, 258_882)
# The one-layer vision tower of the project's tiny models (diffusiongemma/tiny.py): text never reads it.
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=8)
# Released sampler settings (SPEC §2.2); end id 1 only (see the module docstring).
GENERATION_CONFIG = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID], "pad_token_id": PAD_ID, "max_new_tokens": 256,
                     "max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8,
                     "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
                     "stability_threshold": 1, "confidence_threshold": 0.005}

__all__ = ["ReleasedShape", "released_shape", "layer_types", "hf_config", "tensor_shapes", "tensor_chunks",
           "make_checkpoint", "MadeCheckpoint", "DTYPES", "GGUF_TYPES", "DEFAULT_SHARD_SIZE"]


# ------------------------------------------------------------------------------------------------ the shape
@dataclass(frozen=True)
class ReleasedShape:
    """The widths of the released text model (defaults: ``google/diffusiongemma-26B-A4B-it``, SPEC §2.1).

    ``layers`` layers in the released pattern (``layer_types``). Sliding layers have ``num_key_value_heads``
    KV heads of ``head_dim``; full layers ``num_global_key_value_heads`` of ``global_head_dim`` (K = V, no
    v_proj). The fields not listed are fixed at their released values by ``hf_config``: RoPE (sliding theta
    1e4; full proportional, partial_rotary_factor 0.25, theta 1e6), final_logit_softcapping 30,
    rms_norm_eps 1e-6, gelu_pytorch_tanh, use_bidirectional_attention "vision", max_position_embeddings
    262,144, tied embeddings, pad / eos / bos 0 / 1 / 2.
    """

    layers: int = 30
    vocab_size: int = 262_144
    hidden_size: int = 2816
    intermediate_size: int = 2112  # the dense MLP and the self-conditioning MLP
    moe_intermediate_size: int = 704  # one expert
    num_experts: int = 128
    top_k_experts: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 8  # sliding layers
    num_global_key_value_heads: int = 2  # full layers
    head_dim: int = 256  # sliding layers
    global_head_dim: int = 512  # full layers
    sliding_window: int = 1024
    canvas_length: int = 256

    def layer_types(self) -> list[str]:
        return layer_types(self.layers)

    def check(self) -> "ReleasedShape":
        """Raise ``InputError`` naming the field (and its command-line option) for a shape transformers or
        this project cannot build; returns ``self``."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{_named(f.name)} must be a positive integer, got {value!r}")
        rules = [
            (self.vocab_size >= MIN_VOCAB, "vocab_size",
             f"must be at least {MIN_VOCAB} (the tokenizer's 4,093 tokens and the three image ids)"),
            (self.top_k_experts <= self.num_experts, "top_k_experts",
             f"must be at most num_experts ({self.num_experts})"),
            (self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"must divide num_attention_heads ({self.num_attention_heads})"),
            (self.num_attention_heads % self.num_global_key_value_heads == 0, "num_global_key_value_heads",
             f"must divide num_attention_heads ({self.num_attention_heads})"),
            (self.head_dim % 2 == 0, "head_dim", "must be even (RoPE rotates pairs)"),
            (self.global_head_dim % 2 == 0, "global_head_dim", "must be even (RoPE rotates pairs)"),
            (self.sliding_window >= 2, "sliding_window", "must be at least 2"),
        ]
        for ok, name, rule in rules:
            if not ok:
                raise InputError(f"{_named(name)} {rule}, got {getattr(self, name)}")
        return self

    def parameters(self) -> int:
        """Parameters stored (text and the tiny vision tower; the tied embedding once)."""
        return sum(math.prod(s) for s in tensor_shapes(self).values())


def _named(field_name: str) -> str:
    """``hidden_size (--hidden-size)``: a field as the Python API and the command line name it."""
    option = "--layers" if field_name == "layers" else "--" + field_name.replace("_", "-")
    return f"{field_name} ({option})"


def layer_types(layers: int) -> list[str]:
    """The released layer pattern over ``layers`` layers: five sliding layers then one full, repeating, and
    the last layer full (``DiffusionGemmaTextConfig``'s default for ``num_hidden_layers`` layers)."""
    types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)]
    if types:
        types[-1] = FULL
    return types


def released_shape(layers: int = 30, scale: int = 1, **overrides: int) -> ReleasedShape:
    """The released shape over ``layers`` layers, every width divided by ``scale`` (1: the released widths),
    then the named ``overrides`` (any ``ReleasedShape`` field). Raises ``InputError`` naming a bad value.

    Scaling divides the vocabulary, hidden size, MLP and expert widths, head sizes, expert count, window and
    canvas, with floors that keep the model well formed (the vocabulary at least 4,096, widths multiples of 8,
    at least 4 experts with top-k at most half of them); the head counts (16 / 8 / 2) stay."""
    if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
        raise InputError(f"scale (--scale) must be a positive integer, got {scale!r}")
    fields = {f.name for f in dataclasses.fields(ReleasedShape)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise InputError(f"unknown shape field(s) {unknown}; the fields are {sorted(fields - {'layers'})}")
    base = ReleasedShape()

    def d(value: int, low: int, multiple: int = 1) -> int:
        return max(low, value // scale // multiple * multiple)

    shape = ReleasedShape(layers=layers)
    if scale > 1:
        experts = d(base.num_experts, 4)
        shape = dataclasses.replace(
            shape, vocab_size=d(base.vocab_size, MIN_VOCAB), hidden_size=d(base.hidden_size, 32, 8),
            intermediate_size=d(base.intermediate_size, 16, 8),
            moe_intermediate_size=d(base.moe_intermediate_size, 8, 8), num_experts=experts,
            top_k_experts=min(base.top_k_experts, experts // 2), head_dim=d(base.head_dim, 8, 2),
            global_head_dim=d(base.global_head_dim, 16, 8), sliding_window=d(base.sliding_window, 8),
            canvas_length=d(base.canvas_length, 8))
    return dataclasses.replace(shape, **overrides).check()


def _image_ids(shape: ReleasedShape) -> tuple[int, int, int]:
    if shape.vocab_size == ReleasedShape.vocab_size:
        return RELEASED_IMAGE_IDS
    V = shape.vocab_size
    return V - 1, V - 2, V - 3


def hf_config(shape: ReleasedShape, dtype: str = "bfloat16"):
    """The ``transformers.DiffusionGemmaConfig`` of ``shape`` (built by transformers' own classes, so its
    ``per_layer_config`` is theirs), with ``dtype`` recorded as the checkpoint's storage dtype."""
    try:
        from transformers import DiffusionGemmaConfig
    except ImportError as exc:
        raise ImportError("making a checkpoint needs transformers' DiffusionGemmaConfig: pip install "
                          f"transformers==5.24.0 ({exc})") from None
    shape.check()
    image, boi, eoi = _image_ids(shape)
    text = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size, num_hidden_layers=shape.layers,
        layer_types=shape.layer_types(), num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        num_global_key_value_heads=shape.num_global_key_value_heads, global_head_dim=shape.global_head_dim,
        num_experts=shape.num_experts, top_k_experts=shape.top_k_experts, sliding_window=shape.sliding_window,
        rope_parameters={SLIDING: dict(rope_type="default", rope_theta=10_000.0),
                         FULL: dict(rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1_000_000.0)},
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        use_bidirectional_attention="vision", max_position_embeddings=262_144, tie_word_embeddings=True,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, dtype=dtype)
    config = DiffusionGemmaConfig(canvas_length=shape.canvas_length, image_token_id=image, boi_token_id=boi,
                                  eoi_token_id=eoi, tie_word_embeddings=True, text_config=text,
                                  vision_config=dict(TINY_VISION, dtype=dtype), dtype=dtype)
    config.architectures = ["DiffusionGemmaForBlockDiffusion"]
    return config


# --------------------------------------------------------------------------------------- names and values
def tensor_shapes(shape: ReleasedShape) -> dict[str, tuple[int, ...]]:
    """Every tensor ``save_pretrained`` stores for ``shape``, name -> shape, in the order written: the
    decoder's embedding, its layers one by one, final norm and self-conditioning MLP, the encoder's layer
    scalars, the vision tower. Computed from the shape alone (no torch)."""
    H, I, Ie, E = shape.hidden_size, shape.intermediate_size, shape.moe_intermediate_size, shape.num_experts
    n_h = shape.num_attention_heads
    out: dict[str, tuple[int, ...]] = {"model.decoder.embed_tokens.weight": (shape.vocab_size, H)}
    for i, kind in enumerate(shape.layer_types()):
        d, g = ((shape.head_dim, shape.num_key_value_heads) if kind == SLIDING
                else (shape.global_head_dim, shape.num_global_key_value_heads))
        p = f"model.decoder.layers.{i}."
        out[p + "layer_scalar"] = (1,)
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "self_attn.q_proj.weight"] = (n_h * d, H)
        out[p + "self_attn.k_proj.weight"] = (g * d, H)
        if kind == SLIDING:  # full layers use K = V: no v_proj
            out[p + "self_attn.v_proj.weight"] = (g * d, H)
        out[p + "self_attn.o_proj.weight"] = (H, n_h * d)
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        out[p + "pre_feedforward_layernorm.weight"] = (H,)
        out[p + "mlp.gate_proj.weight"] = (I, H)
        out[p + "mlp.up_proj.weight"] = (I, H)
        out[p + "mlp.down_proj.weight"] = (H, I)
        out[p + "post_feedforward_layernorm_1.weight"] = (H,)
        out[p + "router.scale"] = (H,)
        out[p + "router.proj.weight"] = (E, H)
        out[p + "router.per_expert_scale"] = (E,)
        out[p + "pre_feedforward_layernorm_2.weight"] = (H,)
        out[p + "experts.gate_up_proj"] = (E, 2 * Ie, H)
        out[p + "experts.down_proj"] = (E, H, Ie)
        out[p + "post_feedforward_layernorm_2.weight"] = (H,)
        out[p + "post_feedforward_layernorm.weight"] = (H,)
    out["model.decoder.norm.weight"] = (H,)
    out["model.decoder.self_conditioning.pre_norm.weight"] = (H,)
    out["model.decoder.self_conditioning.gate_proj.weight"] = (I, H)
    out["model.decoder.self_conditioning.up_proj.weight"] = (I, H)
    out["model.decoder.self_conditioning.down_proj.weight"] = (H, I)
    for i in range(shape.layers):
        out[f"model.encoder.language_model.layers.{i}.layer_scalar"] = (1,)
    out.update(_vision_shapes(H))
    return out


def _vision_shapes(H: int) -> dict[str, tuple[int, ...]]:
    """The tensors of ``TINY_VISION`` (Gemma 4's vision tower: patch 16, a 10,240-entry 2-D position table)
    and of the projection of its output into the text model's width ``H``."""
    v = TINY_VISION
    h, m, d = v["hidden_size"], v["intermediate_size"], v["head_dim"]
    patch, positions = 16, 10_240  # Gemma4VisionConfig's patch_size and position_embedding_size
    p = "model.encoder.vision_tower."
    out = {p + "patch_embedder.input_proj.weight": (h, 3 * patch * patch),
           p + "patch_embedder.position_embedding_table": (2, positions, h)}
    for i in range(v["num_hidden_layers"]):
        q = f"{p}encoder.layers.{i}."
        for name, rows in (("q", v["num_attention_heads"] * d), ("k", v["num_key_value_heads"] * d),
                           ("v", v["num_key_value_heads"] * d)):
            out[q + f"self_attn.{name}_proj.linear.weight"] = (rows, h)
        out[q + "self_attn.o_proj.linear.weight"] = (h, v["num_attention_heads"] * d)
        out[q + "self_attn.q_norm.weight"] = (d,)
        out[q + "self_attn.k_norm.weight"] = (d,)
        out[q + "mlp.gate_proj.linear.weight"] = (m, h)
        out[q + "mlp.up_proj.linear.weight"] = (m, h)
        out[q + "mlp.down_proj.linear.weight"] = (h, m)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            out[q + f"{norm}.weight"] = (h,)
    out["model.encoder.embed_vision.embedding_projection.weight"] = (H, h)
    return out


def value_range(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """The uniform range of tensor ``name``: layer scalars [0.5, 1.5], 1-D tensors [0.75, 1.25], others
    +-sqrt(3 / fan in) (standard deviation 1/sqrt(fan in), the fan in being the last axis)."""
    if name.endswith("layer_scalar"):
        return 0.5, 1.5
    if len(shape) == 1:
        return 0.75, 1.25
    a = math.sqrt(3.0 / shape[-1])
    return -a, a


def _tensor_seed(seed: int, name: str) -> list[int]:
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return [int(seed), int.from_bytes(digest, "little")]


def tensor_chunks(name: str, shape: tuple[int, ...], seed: int = 0,
                  chunk: int = CHUNK_ELEMENTS) -> Iterator[np.ndarray]:
    """The values of tensor ``name`` (row-major), as successive float32 arrays of at most ``chunk`` values,
    each value a bfloat16 number. The same ``(name, shape, seed)`` gives the same values for any ``chunk``.
    The array yielded is reused for the next chunk: use (or copy) it before asking for the next."""
    rng = np.random.default_rng(_tensor_seed(seed, name))
    low, high = value_range(name, shape)
    total = math.prod(shape)
    buffer = np.empty(min(chunk, total), dtype=np.float32)
    for start in range(0, total, chunk):
        values = buffer[:min(chunk, total - start)]
        rng.random(out=values, dtype=np.float32)  # [0, 1), one 32-bit draw each, in order whatever the chunk
        values *= np.float32(high - low)
        values += np.float32(low)
        np.bitwise_and(values.view(np.uint32), np.uint32(0xFFFF0000), out=values.view(np.uint32))
        yield values


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """The bytes of ``values`` (bfloat16 numbers held as float32) stored as ``dtype``, little-endian."""
    if dtype == "float32":
        return values if sys.byteorder == "little" else values.astype("<f4")
    return (values.view(np.uint32) >> np.uint32(16)).astype("<u2")


# ------------------------------------------------------------------------------------------------ writing
@dataclass
class MadeCheckpoint:
    """What ``make_checkpoint`` wrote."""

    path: str
    shape: ReleasedShape
    dtype: str
    seed: int
    parameters: int
    weight_bytes: int  # tensor data in the safetensors files
    files: list[str] = field(default_factory=list)  # the safetensors files, in order
    gguf: str | None = None  # the GGUF file, when asked for
    seconds: float = 0.0

    def __str__(self) -> str:
        kinds = self.shape.layer_types()
        full = sum(k == FULL for k in kinds)
        text = (f"wrote {self.path}: {self.shape.layers} layer(s) ({len(kinds) - full} sliding, {full} full), "
                f"hidden {self.shape.hidden_size}, vocabulary {self.shape.vocab_size:,}, {self.shape.num_experts} "
                f"experts (top {self.shape.top_k_experts}); {self.parameters:,} parameters, {self.dtype}, "
                f"{self.weight_bytes / 1e9:.2f} GB in {len(self.files)} safetensors file(s), seed {self.seed}")
        if self.gguf:
            text += f"; GGUF {os.path.basename(self.gguf)} ({os.path.getsize(self.gguf) / 1e9:.2f} GB)"
        return text + f"; {self.seconds:.1f} s"


def _shards(shapes: dict[str, tuple[int, ...]], dtype: str, shard_size: int) -> list[list[str]]:
    """The tensor names of each file, in order: a file closes before the tensor that would take it past
    ``shard_size`` bytes (a larger tensor gets a file of its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * BYTES[dtype]
        if shards[-1] and filled + size > shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _header(names: list[str], shapes: dict[str, tuple[int, ...]], dtype: str) -> bytes:
    """A safetensors header (length prefix included) for ``names`` stored back to back in that order, padded
    with spaces to a multiple of 8 bytes as the safetensors library writes it."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        size = math.prod(shapes[name]) * BYTES[dtype]
        entries[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shapes[name]),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_file(path: str, names: list[str], shapes: dict[str, tuple[int, ...]], dtype: str, seed: int,
                chunk: int, advance) -> None:
    with open(path, "wb") as f:
        f.write(_header(names, shapes, dtype))
        for name in names:
            for values in tensor_chunks(name, shapes[name], seed, chunk):
                f.write(memoryview(_encode(values, dtype)).cast("B"))
                advance(values.size * BYTES[dtype])
        f.flush()
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):  # written and on disk: leave the page cache to others
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _check_destination(path: str, force: bool) -> None:
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise InputError(f"OUT {path!r}: its folder {parent!r} does not exist")
    if not os.path.lexists(path):
        return
    if not force:
        raise InputError(f"OUT {path!r} already exists (pass --force, force=True, to replace it)")
    if os.path.islink(path) or not os.path.isdir(path):
        raise InputError(f"OUT {path!r} exists and is not a folder; not replacing it even with --force")
    if os.listdir(path):
        model_type = None
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            pass
        if model_type != "diffusion_gemma":
            raise InputError(f"OUT {path!r} exists and is not a DiffusionGemma checkpoint (no config.json of "
                             "model_type diffusion_gemma); not replacing it even with --force")


def _available_memory() -> int | None:
    """Bytes this process could still allocate (``reference.support.checks.available_memory``), None when
    unknown; a function of this module so that a test can stand in for it."""
    from diffusiongemma.reference.support.checks import available_memory

    return available_memory()


def make_checkpoint(path: str | os.PathLike, layers: int = 30, dtype: str = "bfloat16", seed: int = 0, *,
                    scale: int = 1, gguf: str | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
                    force: bool = False, progress: bool = False, chunk: int = CHUNK_ELEMENTS,
                    **overrides: int) -> MadeCheckpoint:
    """Write a random-weight DiffusionGemma checkpoint at the released shape into the new folder ``path``
    (see the module docstring) and return what was written.

    layers: the number of layers (released: 30), in the released pattern, the last one full. dtype:
    "bfloat16" (as released) or "float32". seed: any integer in [0, 2**64). scale and overrides (any
    ``ReleasedShape`` field, e.g. ``hidden_size=256``): narrower models (``released_shape``). gguf: also
    write ``path/model-<gguf>.gguf`` ("f32", "f16" or "q8_0") through the project's GGUF converter.
    shard_size: bytes of tensor data per safetensors file. force: replace an existing DiffusionGemma
    checkpoint folder at ``path``. progress: a progress bar on stderr. chunk: values drawn at a time.

    Raises ``InputError`` naming the argument for a bad value, an existing ``path`` (without ``force``), too
    little disk space, or a GGUF whose conversion would not fit in memory; nothing is written then.
    """
    started = time.monotonic()
    shape = released_shape(layers, scale, **overrides)
    if dtype not in DTYPES:
        raise InputError(f"dtype (--dtype) must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 64:
        raise InputError(f"seed (--seed) must be an integer in [0, 2**64), got {seed!r}")
    if gguf is not None and gguf not in GGUF_TYPES:
        raise InputError(f"gguf (--gguf) must be one of {', '.join(GGUF_TYPES)}, got {gguf!r}")
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise InputError(f"shard_size (--shard-size) must be a positive number of bytes, got {shard_size!r}")
    if not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"chunk must be a positive integer, got {chunk!r}")
    path = os.path.abspath(os.fspath(path))
    _check_destination(path, force)
    from diffusiongemma.weights_converter.writer import cleanup_stale

    cleanup_stale(path)  # hidden folders of earlier writes to ``path`` whose process is gone (a SIGKILL)

    config = hf_config(shape, dtype)
    from diffusiongemma.reference.config import ModelConfig

    ModelConfig.from_transformers(config.to_dict())  # the project reads this shape (else: ConfigError, nothing written)
    shapes = tensor_shapes(shape)
    parameters = sum(math.prod(s) for s in shapes.values())
    weight_bytes = parameters * BYTES[dtype]
    needed = weight_bytes
    if gguf is not None:
        encoded = parameters * GGUF_BYTES[gguf]
        needed += encoded
        # write_gguf reads the checkpoint through its mapping and encodes and writes one tensor at a time: it
        # holds the largest tensor's encoding and a 64 MiB block of float32 rows
        memory = max(math.prod(s) for s in shapes.values()) * GGUF_BYTES[gguf] + 3 * 2 ** 26
        available = _available_memory()
        if available is not None and memory > available:
            raise InputError(f"gguf (--gguf) {gguf}: the GGUF converter holds one encoded tensor at a time, "
                             f"{memory / 1e9:.1f} GB for the largest, and {available / 1e9:.1f} GB is available")
    free = shutil.disk_usage(os.path.dirname(path)).free
    if needed > free:
        raise InputError(f"OUT {path!r}: the checkpoint needs {int(needed):,} bytes and its folder's disk has "
                         f"{free:,} bytes free; nothing was written")

    shards = _shards(shapes, dtype, shard_size)
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    tmp = tempfile.mkdtemp(prefix=_hidden(path, "partial"), dir=os.path.dirname(path))
    from tqdm import tqdm

    bar = tqdm(total=weight_bytes, unit="B", unit_scale=True, desc=f"writing {os.path.basename(path)}",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        config.save_pretrained(tmp)
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(GENERATION_CONFIG, f, indent=2)
        _write_tokenizer(tmp)
        for filename, names in zip(files, shards):
            _write_file(os.path.join(tmp, filename), names, shapes, dtype, seed, chunk, bar.update)
        if len(files) > 1:
            index = {"metadata": {"total_parameters": parameters, "total_size": weight_bytes},
                     "weight_map": {name: filename for filename, names in zip(files, shards) for name in names}}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
        bar.close()
        gguf_path = None
        if gguf is not None:
            from diffusiongemma.gguf_writer import write_gguf

            if progress:
                print(f"converting to GGUF {gguf} ...", file=sys.stderr, flush=True)
            gguf_name = f"model-{gguf}.gguf"
            write_gguf(tmp, os.path.join(tmp, gguf_name), gguf, name=os.path.basename(path))
            gguf_path = os.path.join(path, gguf_name)
        _put_in_place(tmp, path, force)
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return MadeCheckpoint(path=path, shape=shape, dtype=dtype, seed=seed, parameters=parameters,
                          weight_bytes=weight_bytes, files=files, gguf=gguf_path,
                          seconds=time.monotonic() - started)


def _hidden(path: str, kind: str) -> str:
    """``.<name>.<kind>-<host>-<pid>-<start>-``: the converter's names for hidden siblings, so that its
    ``cleanup_stale`` removes what a killed write left once that process is gone."""
    from diffusiongemma.weights_converter.writer import _hidden_name

    return _hidden_name(path, kind)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_tokenizer(directory: str) -> None:
    """The shipped tiny-kjv model's tokenizer (byte-level BPE, 4,093 tokens: pad 0, eos 1, bos 2, unk 3,
    mask 4)."""
    from diffusiongemma.checkpoint import default_model_dir

    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))


def _put_in_place(tmp: str, path: str, force: bool) -> None:
    """Rename the finished ``tmp`` to ``path``; with ``force`` an existing checkpoint there is moved aside
    first and deleted after."""
    if os.path.lexists(path):
        _check_destination(path, force)  # it may have appeared meanwhile
        old = tempfile.mkdtemp(prefix=_hidden(path, "replaced"), dir=os.path.dirname(path))
        os.rename(path, old)  # replaces the empty placeholder
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
