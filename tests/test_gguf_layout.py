"""GGUF header and tensor layout checks (``weights_converter/gguf.py``, ``read_gguf_header``).

Each case starts from a valid file written the way llama.cpp's converter writes one (``tests/test_gguf.py``'s
``write_gguf``) and damages one thing in its bytes: a count, an offset, a name, a string, the alignment.
Before these checks most such files loaded and gave a model with tensors read from the wrong bytes; now each
is refused with a ``GGUFLayoutError`` (a ``CheckpointError``) naming the file, the tensor or key, and the
expected and found values. The byte positions patched here come from our own walk of the header below,
independent of the reader under test.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import gguf

from diffusiongemma.reference import CheckpointError, InputError, Model
from diffusiongemma.weights_converter.gguf import GGUFLayoutError, load_gguf_checkpoint
from tests.hf_tiny import tiny_model
from tests.test_gguf import SPEC, write_gguf

SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def walk(data: bytes) -> dict:
    """Byte positions in a well-formed little-endian GGUF v3 file: kv entries and tensor infos."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(at):
        n = struct.unpack_from("<Q", data, at)[0]
        return data[at + 8:at + 8 + n].decode(), at + 8 + n

    kv = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        kind = struct.unpack_from("<I", data, pos)[0]
        value_at = pos + 4
        pos = value_at
        if kind == 8:
            _, pos = string(pos)
        elif kind == 9:
            sub, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                pos = string(pos)[1] if sub == 8 else pos + SCALAR_SIZE[sub]
        else:
            pos += SCALAR_SIZE[kind]
        kv[key] = value_at
    tensors = {}
    for _ in range(n_tensors):
        start = pos
        name, pos = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        dims_at = pos + 4
        offset_at = dims_at + 8 * n_dims + 4
        tensors[name] = {"info": start, "n_dims": pos, "offset_at": offset_at,
                         "offset": struct.unpack_from("<Q", data, offset_at)[0],
                         "ne": struct.unpack_from(f"<{n_dims}Q", data, dims_at)}
        pos = offset_at + 8
    return {"n_tensors": n_tensors, "n_kv": n_kv, "kv": kv, "tensors": tensors, "header_end": pos}


@pytest.fixture(scope="module")
def hf():
    return tiny_model(SPEC, seed=3)


@pytest.fixture(scope="module")
def good(hf, tmp_path_factory) -> bytes:
    """The bytes of a valid F32 file (its last tensor is rope_freqs.weight, which may be absent)."""
    path = write_gguf(tmp_path_factory.mktemp("good") / "m.gguf", hf)
    load_gguf_checkpoint(path)  # the undamaged file loads
    with open(path, "rb") as f:
        return f.read()


def damaged(tmp_path, data: bytes | bytearray, name: str = "bad.gguf") -> str:
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


def patch_u64(data: bytes, at: int, value: int) -> bytearray:
    out = bytearray(data)
    struct.pack_into("<Q", out, at, value)
    return out


def refused(path: str, pattern: str) -> str:
    with pytest.raises(GGUFLayoutError, match=pattern) as info:
        load_gguf_checkpoint(path)
    message = str(info.value)
    assert message.startswith(path) and "\n" not in message
    assert isinstance(info.value, CheckpointError)
    return message


# ------------------------------------------------------------------------------------------------ counts
def test_tensor_count_one_less_is_refused(tmp_path, good):
    """The last tensor info is read as padding and every offset lands on the wrong bytes: refused, saying which
    count is wrong and what the bytes hold. The converter refuses too and writes nothing."""
    layout = walk(good)
    path = damaged(tmp_path, patch_u64(good, 8, layout["n_tensors"] - 1))
    n = layout["n_tensors"]
    refused(path, rf"the header's tensor count is {n - 1}, but the file holds {n} tensor entries")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "diffusiongemma.weights_converter.cli", path, str(out),
                             "--no-progress"], capture_output=True, text=True)
    assert result.returncode == 1 and f"tensor count is {n - 1}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_tensor_count_one_more_is_refused(tmp_path, good):
    n = walk(good)["n_tensors"]
    path = damaged(tmp_path, patch_u64(good, 8, n + 1))
    refused(path, rf"the header's tensor count is {n + 1}, but the file holds {n} tensor entries")


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_metadata_count_is_named_as_such(tmp_path, good, delta):
    """Not "tensor 'diffusion-gemma.embedding_length' has unknown ggml type id": the count is named."""
    n = walk(good)["n_kv"]
    path = damaged(tmp_path, patch_u64(good, 16, n + delta))
    refused(path, rf"the header's metadata key/value count is {n + delta}, but the file holds {n} "
                  r"metadata key/value entries")


# ------------------------------------------------------------------------------------------------ offsets
@pytest.mark.parametrize("shift", [4, 1, -4])
def test_misaligned_offset_is_refused(tmp_path, good, shift):
    """final_norm's data offset moved by a few bytes used to load a wrong final_norm."""
    info = walk(good)["tensors"]["output_norm.weight"]
    path = damaged(tmp_path, patch_u64(good, info["offset_at"], info["offset"] + shift))
    refused(path, rf"tensor 'output_norm\.weight' has data offset {info['offset'] + shift}, not a multiple of "
                  r"the alignment 32")


def test_overlapping_offsets_are_refused(tmp_path, good):
    """Layer 1's q_proj starting inside layer 0's: both tensors named, with their byte ranges."""
    tensors = walk(good)["tensors"]
    a, b = tensors["blk.0.attn_q.weight"], tensors["blk.1.attn_q.weight"]
    path = damaged(tmp_path, patch_u64(good, b["offset_at"], a["offset"] + 64))
    refused(path, r"tensor 'blk\.1\.attn_q\.weight' \(data bytes \d+\.\.\d+\) overlaps tensor "
                  r"'blk\.0\.attn_q\.weight' \(data bytes \d+\.\.\d+\)")


def test_two_tensors_at_the_same_bytes_are_refused(tmp_path, good):
    """Layer 1's q_proj pointing at layer 0's bytes used to load as a copy of layer 0's."""
    tensors = walk(good)["tensors"]
    a, b = tensors["blk.0.attn_q.weight"], tensors["blk.1.attn_q.weight"]
    path = damaged(tmp_path, patch_u64(good, b["offset_at"], a["offset"]))
    refused(path, rf"tensors 'blk\.0\.attn_q\.weight' and 'blk\.1\.attn_q\.weight' point at the same bytes "
                  rf"\(data offset {a['offset']}\)")


def test_offset_outside_the_data_section_is_refused(tmp_path, good):
    layout = walk(good)
    info = layout["tensors"]["blk.2.attn_k.weight"]
    beyond = (len(good) // 32 + 4) * 32
    path = damaged(tmp_path, patch_u64(good, info["offset_at"], beyond))
    refused(path, rf"tensor 'blk\.2\.attn_k\.weight' has data offset {beyond}, outside the data section")


def test_gap_between_tensors_is_refused(tmp_path, good):
    """llama.cpp's rule: tensors back to back in header order. The last one moved one alignment later (the file
    grown to hold it) leaves a hole."""
    layout = walk(good)
    name = list(layout["tensors"])[-1]
    info = layout["tensors"][name]
    data = patch_u64(good, info["offset_at"], info["offset"] + 32) + bytes(32)
    path = damaged(tmp_path, data)
    refused(path, rf"tensor '{name}' has data offset {info['offset'] + 32}, expected {info['offset']}")


def test_bytes_after_the_last_tensor_are_refused(tmp_path, good):
    path = damaged(tmp_path, good + bytes(64))
    refused(path, r"the file has 64 bytes after the data of its \d+ tensors")


# ------------------------------------------------------------------------------------------------ names, types
def test_n_dims_beyond_ggml_is_refused(tmp_path, good):
    """n_dims 100 is named as such (it used to read as an unknown type)."""
    info = walk(good)["tensors"]["blk.0.attn_k.weight"]
    data = bytearray(good)
    struct.pack_into("<I", data, info["n_dims"], 100)
    refused(damaged(tmp_path, data), r"tensor 'blk\.0\.attn_k\.weight' has n_dims 100, expected 1\.\.4")


def test_duplicate_tensor_name_is_refused(tmp_path, good):
    tensors = walk(good)["tensors"]
    at = tensors["blk.1.attn_q.weight"]["info"] + 8
    data = bytearray(good)
    data[at:at + len("blk.1.attn_q.weight")] = b"blk.0.attn_q.weight"
    refused(damaged(tmp_path, data), r"tensor 'blk\.0\.attn_q\.weight' appears twice in the tensor infos")


def test_non_utf8_architecture_names_the_key(tmp_path, good):
    """A bare UnicodeDecodeError before; now the key and the byte."""
    at = walk(good)["kv"]["general.architecture"] + 8  # past the string length
    data = bytearray(good)
    assert data[at:at + 15] == b"diffusion-gemma"
    data[at + 3] = 0xFF
    refused(damaged(tmp_path, data), r"the string value of metadata key 'general\.architecture' at byte \d+ is "
                                     r"not valid UTF-8 \(byte 0xff at position 3")


def test_duplicate_metadata_key_is_refused(tmp_path, good):
    """The EOS id key renamed in place to the BOS id key (same length): one of the two values would be lost."""
    at = walk(good)["kv"]["tokenizer.ggml.eos_token_id"] - 4 - len("tokenizer.ggml.eos_token_id")
    data = bytearray(good)
    assert data[at:at + 27] == b"tokenizer.ggml.eos_token_id"
    data[at:at + 27] = b"tokenizer.ggml.bos_token_id"
    refused(damaged(tmp_path, data), r"metadata key 'tokenizer\.ggml\.bos_token_id' appears twice \(bytes \d+ and "
                                     r"\d+\)")


# ------------------------------------------------------------------------------------------------ alignment
def _with_alignment(meta, value):
    return [m for m in meta if m[0] != "general.alignment"] + [("general.alignment", "u32", value)]


@pytest.mark.parametrize("value", [0, 3, 48])
def test_alignment_not_a_positive_power_of_two_is_refused(tmp_path, hf, value):
    """general.alignment 0 was a bare ZeroDivisionError traceback; 3 and 48 are not powers of two."""
    path = write_gguf(tmp_path / "a.gguf", hf, edit_metadata=lambda meta: _with_alignment(meta, value))
    refused(path, rf"metadata key 'general\.alignment' is {value}, expected a positive power of two")


def test_alignment_of_the_wrong_type_is_refused(tmp_path, hf):
    edit = lambda meta: [m for m in meta if m[0] != "general.alignment"] + [("general.alignment", "f32", 32.0)]  # noqa: E731
    path = write_gguf(tmp_path / "a.gguf", hf, edit_metadata=edit)
    refused(path, r"metadata key 'general\.alignment' has type FLOAT32, expected UINT32")


def test_declared_alignment_is_honoured(tmp_path, hf, good):
    """A file laid out with 64-byte alignment (the key written by the writer itself) loads to the same tensors;
    the same bytes declaring 32 are refused (their offsets are then not where the layout puts them)."""
    writer_alignment = 64

    def write(path):
        import tests.test_gguf as t

        original = gguf.GGUFWriter

        class Aligned(original):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.add_custom_alignment(writer_alignment)

        t.gguf.GGUFWriter = Aligned
        try:
            return write_gguf(path, hf)
        finally:
            t.gguf.GGUFWriter = original

    path = write(tmp_path / "a64.gguf")
    _, tensors = load_gguf_checkpoint(path)
    _, expected = load_gguf_checkpoint(damaged(tmp_path, good, "good.gguf"))
    assert all(np.array_equal(tensors[k], expected[k]) for k in expected)
    data = bytearray(open(path, "rb").read())
    struct.pack_into("<I", data, walk(bytes(data))["kv"]["general.alignment"], 32)
    with pytest.raises(GGUFLayoutError):
        load_gguf_checkpoint(damaged(tmp_path, data, "a32.gguf"))


# ------------------------------------------------------------------------------------------------ metadata
def test_context_length_is_the_position_limit(tmp_path, hf):
    """A file declaring 64 positions refuses a 300-token prompt (the limit used to be 131072 whatever it said)."""
    edit = lambda meta: [m for m in meta if not m[0].endswith(".context_length")] + [  # noqa: E731
        ("diffusion-gemma.context_length", "u32", 64)]
    path = write_gguf(tmp_path / "c.gguf", hf, edit_metadata=edit)
    model = Model.from_pretrained(path)
    assert model.config.max_position_embeddings == 64
    prompt = np.random.default_rng(0).integers(5, SPEC.vocab_size, size=(1, 300))
    with pytest.raises(InputError, match=r"max_position_embeddings=64"):
        model.encode(prompt, model.new_cache(1))
    drop = lambda meta: [m for m in meta if not m[0].endswith(".context_length")]  # noqa: E731
    with pytest.raises(CheckpointError, match=r"metadata key 'diffusion-gemma\.context_length' is missing"):
        load_gguf_checkpoint(write_gguf(tmp_path / "d.gguf", hf, edit_metadata=drop))


@pytest.mark.parametrize("key, kind, value", [
    ("diffusion-gemma.attention.causal", "bool", True),
    ("diffusion-gemma.attention.shared_kv_layers", "u32", 2),
    ("diffusion-gemma.embedding_length_per_layer_input", "u32", 256),
    ("diffusion-gemma.rope.dimension_count", "u32", 64),
])
def test_metadata_the_model_cannot_honour_is_refused(tmp_path, hf, key, kind, value):
    """Keys DiffusionGemma has one value for (or, for rope.dimension_count, must equal key_length) are read."""
    edit = lambda meta: [m for m in meta if m[0] != key] + [(key, kind, value)]  # noqa: E731
    path = write_gguf(tmp_path / "k.gguf", hf, edit_metadata=edit)
    with pytest.raises(CheckpointError, match=rf"metadata key '{key}' "):
        load_gguf_checkpoint(path)


def test_an_empty_or_foreign_file_is_named(tmp_path):
    empty = damaged(tmp_path, b"", "empty.gguf")
    with pytest.raises(CheckpointError, match=r"truncated inside the header"):
        load_gguf_checkpoint(empty)
    foreign = damaged(tmp_path, b"PK\x03\x04" + bytes(60), "zip.gguf")
    with pytest.raises(CheckpointError, match=r"not a GGUF file \(magic bytes b'PK\\x03\\x04'"):
        load_gguf_checkpoint(foreign)
    assert os.path.getsize(foreign) == 64


def test_tensors_come_from_the_file_whose_header_was_read(tmp_path, hf, good):
    """A file renamed over the path after the header was read (a replace) does not mix its bytes in: the
    tensors are read through the descriptor the header came from."""
    from diffusiongemma.weights_converter.gguf import GGUFCheckpoint, iter_gguf_tensors

    path = damaged(tmp_path, good, "m.gguf")
    checkpoint = GGUFCheckpoint.open(path)
    other = bytearray(good)
    info = walk(good)["tensors"]["output_norm.weight"]
    start = -(-walk(good)["header_end"] // 32) * 32 + info["offset"]
    other[start:start + 4 * info["ne"][0]] = np.full(info["ne"][0], 7.0, np.float32).tobytes()
    replacement = damaged(tmp_path, other, "new.gguf")
    os.replace(replacement, path)
    tensors = dict(iter_gguf_tensors(checkpoint))
    assert not np.any(tensors["final_norm"] == 7.0)
    _, expected = load_gguf_checkpoint(path)  # a new reader sees the new file
    assert np.all(expected["final_norm"] == 7.0)
