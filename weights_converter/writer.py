"""Writing the project's format: storage dtype casts, sharded safetensors files, atomic output.

* ``to_storage`` turns a source tensor (float32, bfloat16 or float16) into the storage dtype.
  float32 output widens exactly. bfloat16 output keeps a bfloat16 source bit for bit and rounds
  anything else from float32 to nearest, ties to even (ml_dtypes' cast; torch's
  ``tensor.to(torch.bfloat16)`` rounds the same way). A float16 source is widened to float32 first,
  which is exact, so it is rounded once.
* ``ShardWriter`` packs tensors, in the order given, into ``weights-00001.safetensors``,
  ``weights-00002.safetensors``, ... so that no file exceeds ``shard_size`` bytes of tensor data
  unless one tensor alone is larger (a tensor is never split). It holds at most one shard's
  tensors in memory.
* ``atomic_directory`` builds the output in a hidden sibling directory and renames it into place
  at the end, so a failed or interrupted conversion leaves no output directory behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from diffusiongemma.reference.errors import CheckpointError, InputError
from diffusiongemma.reference.weights import INDEX_FILE, STORAGE_DTYPES, to_float32

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
WEIGHT_FILE_PATTERN = "weights-{:05d}.safetensors"
_FINITE_CHECK_CHUNK = 1 << 22  # elements per chunk of the finiteness scan (bounds its temporary)


def to_storage(array: np.ndarray, dtype: str, name: str = "tensor") -> np.ndarray:
    """``array`` in the storage dtype ``dtype`` ("float32" or "bfloat16"), same shape.

    Returns the input itself when no cast is needed. Raises ``InputError`` for an unknown
    ``dtype``, and ``CheckpointError`` naming ``name`` for an unsupported source dtype or when the
    result holds NaN or infinity (a broken checkpoint, or a float32 value beyond bfloat16's range).
    """
    if dtype == "float32":
        out = to_float32(array, name)
    elif dtype == "bfloat16":
        if array.dtype == BFLOAT16:
            out = array
        else:
            with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf are reported just below
                out = to_float32(array, name).astype(BFLOAT16)
    else:
        raise InputError(f"dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    check_finite(out, name)
    return out


def check_finite(array: np.ndarray, name: str = "tensor") -> None:
    """Raise ``CheckpointError`` naming ``name`` if ``array`` holds a NaN or an infinity.

    Scans in chunks so that the boolean temporary stays small for multi-gigabyte tensors.
    """
    flat = array.reshape(-1)
    for start in range(0, flat.size, _FINITE_CHECK_CHUNK):
        chunk = flat[start:start + _FINITE_CHECK_CHUNK]
        if not np.isfinite(chunk).all():
            bad = int(np.count_nonzero(~np.isfinite(flat)))
            raise CheckpointError(f"tensor {name!r} holds {bad} NaN or infinite value(s) "
                                  f"(in {array.dtype}); refusing to write a broken checkpoint")


class ShardWriter:
    """Packs named tensors into numbered safetensors files inside ``directory``.

    ``add`` appends a tensor to the current shard, first writing the shard out if the tensor
    would push it past ``shard_size`` bytes. ``close`` writes the last shard and returns the
    ``{tensor name: file name}`` map for the index.
    """

    def __init__(self, directory: str | os.PathLike, shard_size: int):
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size <= 0:
            raise InputError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
        self.directory = os.fspath(directory)
        self.shard_size = shard_size
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        """Queue ``array`` (C-contiguous float32 or bfloat16) under ``name``."""
        if name in self.weight_map or name in self._pending:
            raise CheckpointError(f"tensor {name!r} written twice")
        if self._pending and self._pending_bytes + array.nbytes > self.shard_size:
            self._flush()
        self._pending[name] = np.ascontiguousarray(array)
        self._pending_bytes += array.nbytes

    def close(self) -> dict[str, str]:
        """Write the last shard; returns the tensor -> file map."""
        if self._pending:
            self._flush()
        return dict(self.weight_map)

    def _flush(self) -> None:
        filename = WEIGHT_FILE_PATTERN.format(len(self.files) + 1)
        save_file(self._pending, os.path.join(self.directory, filename), metadata={"format": "diffusiongemma"})
        self.files.append(filename)
        self.weight_map.update({name: filename for name in self._pending})
        self._pending, self._pending_bytes = {}, 0


def check_destination(dst: str | os.PathLike, force: bool) -> None:
    """Raise unless ``dst`` may be (re)created.

    ``dst`` must not exist, or, with ``force``, must be a directory that is empty or holds a
    converted checkpoint (so that ``--force`` can never delete an unrelated directory). Its parent
    directory must exist. Raises ``FileExistsError`` or ``FileNotFoundError`` naming the path.
    """
    dst = os.fspath(dst)
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{dst}: parent directory {parent} does not exist")
    if not os.path.lexists(dst):
        return
    if not force:
        raise FileExistsError(f"{dst} already exists; pass --force (force=True) to replace it")
    if not os.path.isdir(dst) or os.path.islink(dst):
        raise FileExistsError(f"{dst} exists and is not a directory; refusing to replace it even with --force")
    if os.listdir(dst) and not os.path.isfile(os.path.join(dst, INDEX_FILE)):
        raise FileExistsError(f"{dst} exists and is not a converted diffusiongemma checkpoint (no {INDEX_FILE}); "
                              "refusing to delete it even with --force")


def _apply_umask(directory: str) -> None:
    """Give ``directory`` and its files the permissions a plain mkdir/open would have had.

    ``mkdtemp`` creates the directory private (0700) and safetensors writes files 0600; a converted
    checkpoint should be as readable as any other file the user creates (0755 / 0644 under umask 022).
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


@contextlib.contextmanager
def atomic_directory(dst: str | os.PathLike, force: bool = False) -> Iterator[str]:
    """Yield a fresh temporary sibling of ``dst``; on success rename it to ``dst``.

    On any exception, ``KeyboardInterrupt`` included, the temporary directory is removed, ``dst``
    is left as it was (absent, or the old checkpoint under ``force``) and the exception propagates.
    With ``force`` an existing ``dst`` (see ``check_destination``) is replaced only once the new
    one is complete. Only a hard kill (SIGKILL, power loss) can leave a ``.<name>.partial-*``
    directory behind.
    """
    dst = os.path.abspath(os.fspath(dst))
    check_destination(dst, force)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.partial-", dir=os.path.dirname(dst))
    try:
        yield tmp
        _apply_umask(tmp)
        check_destination(dst, force)  # something may have appeared at dst meanwhile
        if os.path.lexists(dst):
            old = tmp + ".replaced"
            os.rename(dst, old)
            try:
                os.rename(tmp, dst)
            except BaseException:
                os.rename(old, dst)
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
