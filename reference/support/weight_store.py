"""The weight store: a checkpoint's tensors left in their files until a layer uses them.

A DiffusionGemma checkpoint at the released shape is 50.5 GB in bfloat16 (100 GB widened to float32), more
than an ordinary machine's memory. So ``Model.from_pretrained`` never reads it whole: the reader maps each
weight file into memory (``mmap``, read-only) and hands over a ``WeightStore``, one ``StoredTensor`` per
project name (``reference.weights``), each a view of its bytes in the file. Nothing is read until a tensor
is used; what a pass has read stays only in the page cache, which the kernel drops when memory runs short
(the pages are clean: they can always be read again from the file).

    store = open_checkpoint(path)[1]      # headers read, shapes checked, no weight read
    store["layers.3.q_proj"].float32()    # (out, in) float32: widened now, dropped by the caller after use
    store["embed_tokens"].float32(ids)    # only the rows asked for

Checks: names and shapes are checked against ``weights.expected_shapes`` when the store is opened (from the
files' headers); a weight file too short for its own header is refused then too, before any of its data is
read. Finiteness (``check_finite``, the one rule for every layout, same named errors) is checked tensor by tensor, over the
mapping, the first time each tensor is read (``WeightStore.checked``), so that a run starts without reading
the whole model first, and still never computes on a NaN or infinite weight.

Files that change under a run: a mapping keeps the file it was made from. ``convert --force`` replaces a
checkpoint by renaming a new directory into place, so a run that mapped the old files keeps reading them
whole, the old version, to the end.

``StreamedWeights`` is how the reference reads the store: a mapping from names to float32 arrays (rounded to
the model's dtype) that widens each tensor when it is asked for and keeps nothing, except that a tensor larger
than ``STREAM_BYTES`` widened (the embedding table, the experts at the released shape) comes as a
``StreamedTensor``: an array-like that widens only what an expression touches (rows of the table, one
expert), and computes its products with a float32 operand block of rows at a time.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from .errors import CheckpointError
from .quantized import BFLOAT16, Q8_0Tensor, widen

__all__ = ["check_finite", "MappedFile", "StoredTensor", "WeightStore", "StreamedWeights", "StreamedTensor",
           "STREAM_BYTES", "BLOCK_BYTES", "safetensors_header", "safetensors_tensor", "span"]

STREAM_BYTES = 256 * 2 ** 20  # a tensor whose float32 copy is larger is widened piece by piece (StreamedTensor)
BLOCK_BYTES = 64 * 2 ** 20  # float32 bytes of one block of rows of a StreamedTensor's products


_FINITE_CHECK_CHUNK = 1 << 22  # elements per chunk of the finiteness scan (bounds its temporary)


def check_finite(array: np.ndarray, name: str = "tensor", what: str = "refusing a broken checkpoint",
                 offset: int = 0) -> None:
    """Raise ``CheckpointError`` naming ``name`` if ``array`` holds a NaN or an infinity.

    The one finiteness rule for weights of every layout (converted, transformers, in memory): a NaN or
    infinite weight is refused wherever it comes from, since it would turn into NaN logits, or, in a norm
    weight, into logits soft-capped to +-c that still generate. Scans in chunks so that the boolean
    temporary stays small for multi-gigabyte tensors; the message counts NaN and infinite values and
    gives the first flat index (plus ``offset``, when ``array`` is a piece of a larger tensor).
    """
    if isinstance(array, Q8_0Tensor):  # its int8 values are finite; its scales may not be
        array = array.scales
    flat = np.asarray(array).reshape(-1)
    for start in range(0, flat.size, _FINITE_CHECK_CHUNK):
        chunk = flat[start:start + _FINITE_CHECK_CHUNK]
        if not np.isfinite(chunk).all():
            values = flat.astype(np.float32)
            nan, inf = int(np.count_nonzero(np.isnan(values))), int(np.count_nonzero(np.isinf(values)))
            first = int(np.flatnonzero(~np.isfinite(values))[0])
            raise CheckpointError(f"tensor {name!r} holds {nan + inf} NaN or infinite value(s) ({nan} NaN, "
                                  f"{inf} inf, in {array.dtype}; the first at flat index {first + offset} is "
                                  f"{float(values[first])}); {what}")


# ------------------------------------------------------------------------------------------------ files
class MappedFile:
    """One weight file, opened once and mapped read-only; ``bytes`` is a uint8 view of the whole file.

    The mapping holds the file itself (its inode), not its name: a file renamed over ``path`` afterwards
    does not change what this maps. Raises ``CheckpointError`` naming the file when it cannot be opened or
    is empty."""

    def __init__(self, path: str, name: str | None = None):
        self.path = path  # for messages (the user's path)
        try:
            with open(path if name is None else name, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size == 0:
                    raise CheckpointError(f"{path}: empty file (0 bytes), not a weight file")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open weight file ({exc.strerror or exc})") from exc
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)  # (size,) read-only

    def prefetch(self, offset: int, count: int) -> None:
        """Ask the kernel to start reading ``count`` bytes from ``offset`` into the page cache now, in the
        background (``madvise(MADV_WILLNEED)``), so that a later pass finds them read; a no-op where the
        platform has no such advice."""
        advice = getattr(mmap, "MADV_WILLNEED", None)
        if advice is None or count <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            self._map.madvise(advice, start, min(self.size, offset + count) - start)
        except (OSError, ValueError):  # advice only: reading on demand still works
            pass

    def view(self, offset: int, count: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """``count`` bytes from ``offset`` as a read-only array of ``dtype`` and ``shape`` (no copy)."""
        return self.bytes[offset:offset + count].view(dtype).reshape(shape)

    def head(self, count: int) -> bytes:
        """The first ``count`` bytes (fewer if the file is shorter), read from the mapping."""
        return bytes(self._map[:count])


_SAFETENSORS_NUMPY = {"F32": np.dtype("<f4"), "BF16": BFLOAT16, "F16": np.dtype("<f2"), "F64": np.dtype("<f8"),
                      "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
                      "U8": np.dtype("u1"), "BOOL": np.dtype("?")}


def safetensors_header(file: MappedFile) -> tuple[dict[str, dict], dict[str, str], int]:
    """``(tensors, metadata, data_start)`` of a safetensors file: each tensor's ``dtype``, ``shape`` and absolute
    byte ``offset``/``nbytes`` in the file, checked against the file's size before any data is read.

    The format (safetensors' own specification): 8 bytes little-endian header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data, offsets
    counted from its start. The ``safetensors`` library reads it too, but copies every tensor it returns;
    here the tensors stay views of the mapping. Raises ``CheckpointError`` naming the file for a file too
    short for its header or for a tensor's data, a header that is not JSON, and a tensor whose byte count
    does not match its dtype and shape.
    """
    path = file.path
    if file.size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({file.size} bytes, shorter than the 8-byte "
                              "header length)")
    n = int.from_bytes(file.head(8), "little")
    if 8 + n > file.size:
        raise CheckpointError(f"{path}: truncated safetensors file (its header says {n} header bytes, the file "
                              f"has {file.size - 8} after the length)")
    try:
        header = json.loads(file.head(8 + n)[8:])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header (not UTF-8 JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: unreadable safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + n
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
            begin, end = int(begin), int(end)
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({exc!r})") from None
        itemsize = _SAFETENSORS_NUMPY[dtype].itemsize if dtype in _SAFETENSORS_NUMPY else None
        if itemsize is not None and end - begin != itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} data bytes, but dtype {dtype} and shape "
                                  f"{list(shape)} need {itemsize * int(np.prod(shape, dtype=np.int64))}")
        if not 0 <= begin <= end or start + end > file.size:
            raise CheckpointError(f"{path}: truncated safetensors file (tensor {name!r} ends at byte {start + end}, "
                                  f"the file has {file.size})")
        tensors[name] = {"dtype": dtype, "shape": shape, "offset": start + begin, "nbytes": end - begin}
    return tensors, {str(k): str(v) for k, v in metadata.items()}, start


def safetensors_array(file: MappedFile, entry: dict) -> np.ndarray:
    """The tensor of one ``safetensors_header`` entry as a read-only view of the mapping."""
    return file.view(entry["offset"], entry["nbytes"], _SAFETENSORS_NUMPY[entry["dtype"]], entry["shape"])


def safetensors_tensor(file: MappedFile, entry: dict, where: str) -> "StoredTensor":
    """A ``StoredTensor`` over one ``safetensors_header`` entry, with its ``prefetch``."""
    tensor = StoredTensor.of_array(safetensors_array(file, entry), where)
    tensor.prefetch = span(file, entry["offset"], entry["nbytes"])
    return tensor


def span(file: MappedFile, offset: int, nbytes: int) -> Callable[[], None]:
    """The ``prefetch`` of a tensor that lies at ``offset`` in ``file``, ``nbytes`` long."""
    return lambda: file.prefetch(offset, nbytes)


# ------------------------------------------------------------------------------------------------ tensors
Index = Any  # what may index a tensor's leading axis: None (all), an int, a slice or an integer array


class StoredTensor:
    """One tensor as its file stores it: float32, bfloat16, float16, Q8_0 or another GGUF type.

    ``read(index)`` -> the stored values of ``index`` along the first axis (None: all), as a view of the
    mapping where the type allows (a ``Q8_0Tensor`` for Q8_0); ``float32(index)`` -> those values widened to
    float32 (a view, no copy, when the file stores float32). ``shape`` is the tensor's (project) shape,
    ``kind`` its storage type, ``where`` how messages name it (file and key).
    """

    def __init__(self, shape: tuple[int, ...], kind: str, where: str, read: Callable[[Index], Any],
                 stored_nbytes: int):
        self.shape = tuple(int(s) for s in shape)
        self.kind = kind
        self.where = where
        self._read = read
        self.stored_nbytes = int(stored_nbytes)
        self.blocks = None  # Q8_0: the file's blocks, uint8 (..., N, K/32*34), a view of the mapping
        self.prefetch: Callable[[], None] = lambda: None  # start reading its bytes in the background (``span``)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its float32 values (what widening it whole would take)."""
        return 4 * int(np.prod(self.shape, dtype=np.int64))

    def read(self, index: Index = None):
        return self._read(index)

    def float32(self, index: Index = None) -> np.ndarray:
        return widen(self._read(index))

    def chunks(self) -> Iterator[tuple[int, Any]]:
        """``(flat offset, stored values)`` in pieces of the first axis (bounded memory for a scan of the whole
        tensor)."""
        if self.ndim == 0 or self.shape[0] == 0:
            yield 0, self.read()
            return
        row = max(1, self.nbytes // self.shape[0])
        step = max(1, BLOCK_BYTES // row)
        for start in range(0, self.shape[0], step):
            yield start * (row // 4), self.read(slice(start, start + step))

    @classmethod
    def of_array(cls, array: np.ndarray, where: str) -> "StoredTensor":
        """A stored tensor over an array (a view of a mapping): float32, bfloat16 or float16."""
        kind = {np.dtype("<f4"): "float32", BFLOAT16: "bfloat16", np.dtype("<f2"): "float16"}.get(array.dtype)
        if kind is None:
            raise CheckpointError(f"{where}: unsupported dtype {array.dtype} (expected float32, bfloat16 or float16)")
        return cls(array.shape, kind, where, lambda index: array if index is None else array[index], array.nbytes)

    @classmethod
    def of_q8_0(cls, blocks: np.ndarray, shape: tuple[int, ...], where: str) -> "StoredTensor":
        """A Q8_0 tensor over the file's blocks (uint8 (..., N, K/32*34))."""
        def read(index):
            part = blocks if index is None else blocks[index]
            return Q8_0Tensor.from_blocks(part, part.shape[:-1] + (shape[-1],))
        tensor = cls(shape, "q8_0", where, read, blocks.nbytes)
        tensor.blocks = blocks  # the file's bytes, for a kernel that reads Q8_0 where it lies
        return tensor

    @classmethod
    def joined(cls, parts: list["StoredTensor"], axis: int, where: str) -> "StoredTensor":
        """Several stored tensors joined along ``axis`` (> 0): a GGUF file's split expert gate and up."""
        shape = list(parts[0].shape)
        shape[axis] = sum(p.shape[axis] for p in parts)

        def read(index):
            pieces = [p.read(index) for p in parts]
            along = axis - 1 if isinstance(index, (int, np.integer)) else axis
            if all(isinstance(p, Q8_0Tensor) for p in pieces):
                return Q8_0Tensor.concatenate(pieces, axis=along)
            if len({np.asarray(p).dtype for p in pieces if not isinstance(p, Q8_0Tensor)}) == 1 and \
                    not any(isinstance(p, Q8_0Tensor) for p in pieces):
                return np.concatenate(pieces, axis=along)
            return np.concatenate([widen(p) for p in pieces], axis=along)
        kinds = {p.kind for p in parts}
        joined = cls(tuple(shape), kinds.pop() if len(kinds) == 1 else "mixed", where, read,
                     sum(p.stored_nbytes for p in parts))
        joined.prefetch = lambda: [p.prefetch() for p in parts] and None
        return joined


class WeightStore(Mapping):
    """A checkpoint's tensors by project name (``StoredTensor``), over the weight files' mappings.

    ``checked(name)`` is the tensor after its finiteness check (run over the mapping in chunks, once per
    tensor, the first time it is asked for; ``extra_checks`` may add one per name, e.g. that a tied copy equals
    its source). ``stored_nbytes`` is the bytes the files hold for the model's tensors. Holding the store
    holds the mappings; ``close`` is never needed (they go with the store).
    """

    def __init__(self, tensors: dict[str, StoredTensor], files: list[Any], source: str,
                 extra_checks: dict[str, Callable[[], None]] | None = None):
        self._tensors = tensors
        self.files = files  # what must stay alive for the views (MappedFile, a gguf reader...)
        self.source = source  # the checkpoint's path, for messages
        self._extra = dict(extra_checks or {})
        self._checked: set[str] = set()

    def __getitem__(self, name: str) -> StoredTensor:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def stored_nbytes(self) -> int:
        return sum(t.stored_nbytes for t in self._tensors.values())

    def replace(self, name: str, value) -> None:
        """Hold ``value`` (an array of the tensor's shape) in memory in place of tensor ``name`` from now on: a
        caller's change to a loaded model's weights (a mutation test, an experiment). Taken as given, as an
        assignment into a model's dict of arrays is: no finiteness check."""
        array = np.ascontiguousarray(value, dtype=np.float32)
        if tuple(array.shape) != self._tensors[name].shape:
            raise CheckpointError(f"tensor {name!r}: a replacement of shape {tuple(array.shape)} for shape "
                                  f"{self._tensors[name].shape}")
        self._tensors[name] = StoredTensor.of_array(array, f"{name} (replaced in memory)")
        self._checked.add(name)

    def prefetch(self, prefix: str) -> None:
        """Start reading every tensor whose name starts with ``prefix`` (e.g. the next layer's, "layers.4.") in the
        background, so that the file reads overlap the computation of the layer before."""
        for name, tensor in self._tensors.items():
            if name.startswith(prefix):
                tensor.prefetch()

    def checked(self, name: str) -> StoredTensor:
        """``self[name]``, its values checked finite the first time (``CheckpointError`` naming it if not)."""
        tensor = self._tensors[name]
        if name not in self._checked:
            for offset, piece in tensor.chunks():
                if isinstance(piece, Q8_0Tensor) or not _all_finite(piece):
                    check_finite(piece, name, "refusing to run on it", offset)  # names the values (a Q8_0's scales)
            if name in self._extra:
                self._extra[name]()
            self._checked.add(name)
        return tensor


_NON_FINITE_BITS = {BFLOAT16: 0x7F80, np.dtype("<f2"): 0x7C00}  # 16-bit types: exponent all ones


def _all_finite(piece: np.ndarray) -> bool:
    """Whether every value of ``piece`` is finite; a 16-bit float's from its bits (all exponent bits set: NaN or
    infinity), which is twice as fast as ``np.isfinite`` on bfloat16."""
    limit = _NON_FINITE_BITS.get(piece.dtype)
    if limit is None:
        return bool(np.isfinite(piece).all())
    return piece.size == 0 or int((piece.view(np.uint16) & 0x7FFF).max()) < limit


# ------------------------------------------------------------------------------------------------ the reference's view
class StreamedWeights(Mapping):
    """The reference's weights over a ``WeightStore``: ``self[name]`` is the float32 tensor rounded to ``dtype``,
    widened when asked for and not kept (the caller drops it after use), or a ``StreamedTensor`` for a tensor
    above ``STREAM_BYTES``. ``layer(l)`` is the same view of layer ``l``'s tensors without their prefix."""

    def __init__(self, store: WeightStore, dtype: np.dtype, prefix: str = "", stream_bytes: int | None = None,
                 next_prefix: str | None = None):
        self.store, self.dtype, self.prefix, self.next_prefix = store, dtype, prefix, next_prefix
        self.stream_bytes = STREAM_BYTES if stream_bytes is None else stream_bytes
        self._names = [n[len(prefix):] for n in store if n.startswith(prefix)]

    def __getitem__(self, name: str):
        from ..primitives import round_to

        if name not in self._names:
            raise KeyError(name)
        if name == "input_layernorm" and self.next_prefix is not None:  # a block begins: read the next one ahead
            self.store.prefetch(self.next_prefix)
        tensor = self.store.checked(self.prefix + name)
        if tensor.nbytes > self.stream_bytes:
            return StreamedTensor(tensor, self.dtype)
        return _rounded(tensor, tensor.float32(), self.dtype)

    def __setitem__(self, name: str, value) -> None:
        """Replace a tensor by an array held in memory (``WeightStore.replace``), for every view of the store."""
        if name not in self._names:
            raise KeyError(name)
        self.store.replace(self.prefix + name, value)

    def __contains__(self, name) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def layer(self, l: int) -> "StreamedWeights":
        """Layer ``l``'s tensors; reading its first one (``input_layernorm``) starts reading layer ``l + 1``'s
        in the background (``WeightStore.prefetch``)."""
        return StreamedWeights(self.store, self.dtype, f"{self.prefix}layers.{l}.", self.stream_bytes,
                               f"{self.prefix}layers.{l + 1}.")


def _rounded(tensor: StoredTensor, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` (``tensor``'s, widened) rounded to the model's ``dtype``; a bfloat16 tensor's values already are
    bfloat16 numbers, so the bfloat16 run takes them as they are (the rounding would return them unchanged)."""
    from ..primitives import BFLOAT16, round_to

    if dtype == BFLOAT16 and tensor.kind == "bfloat16":
        return values
    return round_to(values, dtype)


class StreamedTensor:
    """A large weight that widens only what an expression reads: ``t[i]`` (an expert, rows of the table) and its
    products with an array on the left, of it and of its transpose (``x @ W^T``, ``p @ W``: a block of rows
    widened at a time, ``BLOCK_BYTES`` each). Values are
    float32 rounded to the model's dtype, as the whole tensor widened would hold them.

    Block products sum in the same float32 as one product; ``p @ t`` adds the blocks' partial sums in order,
    which differs from a single BLAS call by float32 rounding only. ``np.asarray(t)`` widens it whole.
    """

    __array_ufunc__ = None  # ``x @ t`` calls ``t.__rmatmul__`` instead of converting t whole

    def __init__(self, tensor: StoredTensor, dtype: np.dtype):
        self.tensor, self.dtype = tensor, dtype
        self.shape, self.ndim = tensor.shape, tensor.ndim

    def __getitem__(self, index) -> np.ndarray:
        return _rounded(self.tensor, self.tensor.float32(index), self.dtype)

    def __array__(self, dtype=None, copy=None):
        whole = _rounded(self.tensor, self.tensor.float32(), self.dtype)
        return whole if dtype is None else whole.astype(dtype)

    def _blocks(self) -> Iterator[tuple[int, int]]:
        rows = self.shape[0]
        step = max(1, BLOCK_BYTES // max(1, self.tensor.nbytes // max(1, rows)))
        for a in range(0, rows, step):
            yield a, min(rows, a + step)

    @property
    def T(self) -> "_Transposed":
        return _Transposed(self)

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        """``x @ W`` for this tensor W (R, H): the sum over row blocks of x's columns a:b times W's rows a:b."""
        out = None
        for a, b in self._blocks():
            part = x[..., a:b] @ self[a:b]
            out = part if out is None else out + part
        return out


class _Transposed:
    """The transpose of a ``StreamedTensor`` (R, H), for ``x @ W^T`` (..., R): each block of output columns from one
    block of rows."""

    __array_ufunc__ = None

    def __init__(self, streamed: StreamedTensor):
        self.streamed = streamed
        self.shape = streamed.shape[::-1]

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        t = self.streamed
        out = np.empty(x.shape[:-1] + (t.shape[0],), dtype=np.float32)
        for a, b in t._blocks():
            out[..., a:b] = x @ t[a:b].T
        return out
