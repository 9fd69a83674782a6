"""Writing the project's format: storage dtype casts, sharded safetensors files, atomic output.

* ``to_storage`` turns a source tensor (float32, bfloat16 or float16) into the storage dtype.
  float32 output widens exactly. bfloat16 output keeps a bfloat16 source bit for bit and rounds
  anything else from float32 to nearest, ties to even (ml_dtypes' cast; torch's
  ``tensor.to(torch.bfloat16)`` rounds the same way). A float16 source is widened to float32 first,
  which is exact, so it is rounded once.
* ``ShardWriter`` packs tensors, in the order given, into ``weights-00001.safetensors``,
  ``weights-00002.safetensors``, ... so that no file exceeds ``shard_size`` bytes of tensor data
  unless one tensor alone is larger (a tensor is never split). It holds at most one shard's
  tensors in memory. Every file's metadata carries a digest of its tensors (names, dtypes, shapes,
  bytes), which the index repeats (``file_digests``), so that a reader can tell files of two
  conversions apart without hashing anything itself.
* ``atomic_directory`` builds the output in a hidden sibling directory and swaps it into place at the
  end (see its docstring for the guarantees), and removes the hidden directories that interrupted
  conversions left behind.
* A write that fails for lack of space or a file-size limit raises ``WriteError`` naming the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from diffusiongemma.reference.support.errors import CheckpointError, InputError
from diffusiongemma.reference.support.checkpoint_io import INDEX_FILE, STORAGE_DTYPES, to_float32
from diffusiongemma.reference.support.checkpoint_io import check_finite as _check_finite

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
WEIGHT_FILE_PATTERN = "weights-{:05d}.safetensors"
DIGEST_KEY = "diffusiongemma.digest"  # safetensors metadata key of a weight file's content digest
STALE_AFTER_S = 24 * 3600  # a hidden partial directory untouched this long is removed whoever wrote it


class WriteError(OSError):
    """Writing the output failed (no space left, a file-size limit, an I/O error); the message names the
    file and the cause, ``errno`` is the system's code. The partial output has been removed."""


def write_error(path: str, exc: BaseException) -> WriteError:
    """A ``WriteError`` for a failed write of ``path`` (an ``OSError`` or safetensors' I/O error)."""
    code = getattr(exc, "errno", None)
    if code is None:
        match = re.search(r"os error (\d+)", str(exc))
        code = int(match.group(1)) if match else errno.EIO
    reason = os.strerror(code)
    hint = {errno.ENOSPC: "free some space or choose another destination",
            errno.EFBIG: "a file-size limit (ulimit -f) is in force; raise it or use a smaller --shard-size",
            errno.EDQUOT: "the disk quota is exhausted"}.get(code, "")
    return WriteError(code, f"cannot write {path}: {reason}" + (f" ({hint})" if hint else ""))


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


def check_free_space(dst: str | os.PathLike, needed: int) -> None:
    """Raise ``WriteError`` (ENOSPC) when the file system of ``dst``'s parent has less than ``needed`` bytes free.

    ``needed`` is the tensor bytes of the output (a replace with ``force`` keeps the old checkpoint until
    the new one is complete, so its space does not count as free). Headers and side files are small
    next to it and are not counted.
    """
    parent = os.path.dirname(os.path.abspath(os.fspath(dst)))
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return
    if needed > free:
        raise WriteError(errno.ENOSPC, f"cannot write {os.fspath(dst)}: no space left on device (the output needs "
                                       f"{needed:,} bytes but {parent} has {free:,} bytes free); nothing was written")


def check_finite(array: np.ndarray, name: str = "tensor") -> None:
    """Raise ``CheckpointError`` naming ``name`` if ``array`` holds a NaN or an infinity.

    The same rule as ``reference.weights.check_finite`` (one rule for every layout and loader).
    """
    _check_finite(array, name, "refusing to write a broken checkpoint")


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
        self.digests: dict[str, str] = {}  # file name -> content digest (also in that file's metadata)
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
        path = os.path.join(self.directory, filename)
        digest = hashlib.blake2b(digest_size=16)
        for name, array in self._pending.items():
            digest.update(f"{name}|{array.dtype.name}|{array.shape};".encode())
            digest.update(array.reshape(-1).view(np.uint8).data)
        self.digests[filename] = digest.hexdigest()
        try:
            # one metadata key only: safetensors writes its metadata map in hash order, which varies per call
            save_file(self._pending, path, metadata={DIGEST_KEY: self.digests[filename]})
        except (OSError, SafetensorError) as exc:
            raise write_error(path, exc) from exc
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


# ---------------------------------------------------------------------------------------------- atomic output
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # names a writer's machine
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # linux/fs.h
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276, "ppc64le": 357, "s390x": 347}


def _process_start(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks since boot (Linux), 0 when unknown.

    Together with the pid it identifies a process for good: a pid that has been reused has another start.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _alive(pid: int, start: int) -> bool:
    """True unless process ``pid`` (started at ``start``, 0 = unknown) is certainly gone."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    except OSError:
        return True
    if start and _process_start(pid) not in (0, start):
        return False  # the pid now belongs to another process
    return True


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)`` through ctypes; False when the system or file system lacks it.

    Raises ``OSError`` for a real failure (e.g. ``EEXIST`` under RENAME_NOREPLACE).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    a, b = os.fsencode(src), os.fsencode(dst)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        result = fn(_AT_FDCWD, a, _AT_FDCWD, b, flags)
    else:
        number = _SYS_RENAMEAT2.get(os.uname().machine)
        if number is None:
            return False
        libc.syscall.restype = ctypes.c_long
        result = libc.syscall(ctypes.c_long(number), ctypes.c_int(_AT_FDCWD), a, ctypes.c_int(_AT_FDCWD), b,
                              ctypes.c_uint(flags))
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # kernel or file system without this flag (EPERM: seccomp filters)
    raise OSError(code, f"renameat2({src!r}, {dst!r}): {os.strerror(code)}")


def _swap(new: str, dst: str) -> bool:
    """Atomically exchange the directories ``new`` and ``dst``; False when no atomic exchange exists here."""
    if _renameat2(new, dst, _RENAME_EXCHANGE):
        return True
    if sys.platform == "darwin":  # renamex_np(..., RENAME_SWAP)
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "renamex_np", None)
        if fn is not None and fn(os.fsencode(new), os.fsencode(dst), ctypes.c_uint(0x2)) == 0:
            return True
    return False


def _fsync_tree(directory: str) -> None:
    """Flush every file of ``directory`` and the directory itself to stable storage."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _hidden_name(dst: str, kind: str) -> str:
    """Prefix of a hidden sibling of ``dst``: ``.<name>.<kind>-<host>-<pid>-<start>-`` (the owner is in the name)."""
    pid = os.getpid()
    return f".{os.path.basename(dst)}.{kind}-{_HOST}-{pid}-{_process_start(pid)}-"


def _newest_mtime(path: str) -> float:
    newest = os.lstat(path).st_mtime
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                pass
    return newest


def cleanup_stale(dst: str | os.PathLike, stale_after: float = STALE_AFTER_S) -> list[str]:
    """Remove (or put back) what interrupted conversions to ``dst`` left in its parent directory.

    Candidates are only hidden siblings named by ``atomic_directory``: ``.<name>.partial-<host>-<pid>-
    <start>-*`` (a directory being built, or an old checkpoint being deleted after a swap; or a file, a
    GGUF export's output being written by ``diffusiongemma.gguf_writer``) and
    ``.<name>.replaced-...`` (an old checkpoint moved aside by the two-rename fallback), plus the
    ``.<name>.partial-XXXXXXXX[.replaced]`` directories of earlier versions. One is touched only if its
    writer is certainly gone: same machine and that process (pid and start time) no longer runs, or
    nothing in it was modified for ``stale_after`` seconds (another machine, an unnamed owner). A
    ``.replaced`` directory whose writer died while ``dst`` is missing is the interrupted replace's old
    checkpoint: it is renamed back to ``dst`` instead of being removed. Returns the paths handled.
    """
    dst = os.path.abspath(os.fspath(dst))
    parent, base = os.path.dirname(dst), os.path.basename(dst)
    owned = re.compile(rf"^\.{re.escape(base)}\.(partial|replaced)-([0-9a-f]{{8}})-(\d+)-(\d+)-")
    legacy = re.compile(rf"^\.{re.escape(base)}\.partial-[A-Za-z0-9_]{{8}}(\.replaced)?$")
    handled = []
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return handled
    now = time.time()
    for entry in entries:
        path = os.path.join(parent, entry)
        match, old_style = owned.match(entry), legacy.match(entry)
        if not (match or old_style) or os.path.islink(path) or not (os.path.isdir(path) or os.path.isfile(path)):
            continue  # a partial is a directory (a conversion) or a file (a GGUF export)
        try:
            old = now - _newest_mtime(path) > stale_after
        except OSError:
            continue
        dead = bool(match) and match.group(2) == _HOST and not _alive(int(match.group(3)), int(match.group(4)))
        if not (dead or old):
            continue
        replaced = (match.group(1) == "replaced") if match else bool(old_style.group(1))
        try:
            if replaced and not os.path.lexists(dst) and os.path.isfile(os.path.join(path, INDEX_FILE)):
                os.rename(path, dst)  # an interrupted fallback replace: the old checkpoint goes back
            elif os.path.isdir(path):
                remove_checkpoint_directory(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        handled.append(path)
    return handled


def remove_checkpoint_directory(path: str) -> None:
    """Delete a checkpoint directory index first, so that a reader still inside it (through a handle opened
    before a replace) finds ``INDEX_FILE`` gone and knows that a replace is in progress
    (``checkpoint_io.CheckpointChanged``), whichever weight file it misses; errors are ignored."""
    try:
        os.unlink(os.path.join(path, INDEX_FILE))
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(dst: str | os.PathLike, force: bool = False) -> Iterator[str]:
    """Yield a fresh hidden sibling of ``dst`` to write into; on success put it in place as ``dst``.

    Guarantees (readers: ``reference.weights.load_converted``):

    * Nothing half-written is ever visible at ``dst``: the files are written and flushed (fsync) in a
      hidden sibling ``.<name>.partial-<host>-<pid>-<start>-XXXX``, which becomes ``dst`` in one rename.
    * A ``force`` replace never leaves ``dst`` missing: the new directory and the old one are swapped in
      one atomic step, ``renameat2(RENAME_EXCHANGE)`` on Linux (``renamex_np(RENAME_SWAP)`` on macOS);
      only then is the old one, now under the hidden name, deleted. A kill at any moment leaves ``dst``
      holding the old or the new checkpoint, whole. Where no atomic exchange exists (another OS, a file
      system without it) the old directory is renamed to ``.<name>.replaced-...`` and the new one into
      place: a kill between the two renames leaves ``dst`` missing for a moment, and the next run puts
      the old one back (``cleanup_stale``).
    * A reader that opened ``dst`` before the swap keeps reading the old directory through its handle;
      each weight file carries its digest, repeated in the index, so a reader that mixes files notices.
    * On any exception, ``KeyboardInterrupt`` included, the hidden directory is removed, ``dst`` is left
      as it was (absent, or the old checkpoint under ``force``) and the exception propagates. Only a
      hard kill (SIGKILL, power loss) leaves a hidden directory behind, and the next run to the same
      ``dst`` removes it once its writer is gone (``cleanup_stale``).
    """
    dst = os.path.abspath(os.fspath(dst))
    check_destination(dst, force)
    cleanup_stale(dst)
    check_destination(dst, force)  # a put-back old checkpoint now occupies dst
    parent = os.path.dirname(dst)
    tmp = tempfile.mkdtemp(prefix=_hidden_name(dst, "partial"), dir=parent)
    try:
        yield tmp
        _apply_umask(tmp)
        _fsync_tree(tmp)
        check_destination(dst, force)  # something may have appeared at dst meanwhile
        if os.path.lexists(dst):
            if _swap(tmp, dst):  # tmp now holds the old checkpoint
                _fsync_dir(parent)
                remove_checkpoint_directory(tmp)
            else:
                old = tempfile.mkdtemp(prefix=_hidden_name(dst, "replaced"), dir=parent)
                os.rename(dst, old)  # replaces the empty placeholder directory
                try:
                    os.rename(tmp, dst)
                except BaseException:
                    os.rename(old, dst)
                    raise
                _fsync_dir(parent)
                remove_checkpoint_directory(old)
        else:
            if not _renameat2(tmp, dst, _RENAME_NOREPLACE):
                os.rename(tmp, dst)
            _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
