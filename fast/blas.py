"""Matrix products of the CPU fast path: NumPy's own OpenBLAS, called tile by tile from the kernels' threads.

A multi-threaded BLAS call splits its work statically over its threads and returns when the slowest is
done. On a machine whose cores also run other work, one of those threads is often waiting for its core,
so every product waits a scheduler time slice, and the BLAS threads spin while they wait, taking the
cores from the threads doing the work (a step of the small model became several times slower than one
thread with a single busy process on a two-core machine). ``CpuArrays.matmul`` therefore runs each 2-D
float32 product as ``_kernels.gemm``: tiles of the output, fixed by the shapes alone, taken by the
kernels' OpenMP threads as they come (a descheduled thread delays only its tile), each tile one call of
the same OpenBLAS with one thread. (The routed experts do not use BLAS: ``fast.experts``.)

``install`` finds the library NumPy loaded (through ``threadpoolctl``) and hands the addresses of its
64-bit-integer CBLAS ``sgemm`` and thread-count functions to the kernels. Where that is not possible (NumPy
on another BLAS, kernels built without OpenMP) or ``DIFFUSIONGEMMA_TILED_GEMM=0`` is set, ``matmul`` is
NumPy's and nothing changes but the speed. Results are NumPy's function with the BLAS's own summation
order, independent of the thread count.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import numpy as np

from diffusiongemma.reference.support.quantized import BFLOAT16

from . import _kernels

__all__ = ["install", "CpuArrays", "CPU_ARRAYS"]

# (sgemm, set_threads, get_threads) symbol names of OpenBLAS builds with 64-bit integers, as NumPy ships them
_SYMBOLS = (("scipy_cblas_sgemm64_", "scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
            ("cblas_sgemm64_", "openblas_set_num_threads64_", "openblas_get_num_threads64_"))


def _numpy_openblas() -> str | None:
    """Path of the OpenBLAS library NumPy uses, or None (another BLAS, or threadpoolctl cannot tell)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # pragma: no cover - a declared dependency
        return None
    numpy_dir = os.path.dirname(os.path.abspath(np.__file__))  # NumPy's wheels keep it in numpy.libs beside it
    candidates = [p for p in threadpool_info() if p.get("internal_api") == "openblas"]
    for pool in sorted(candidates, key=lambda p: not p["filepath"].startswith(numpy_dir)):
        return pool["filepath"]  # NumPy's own first (not SciPy's, in scipy.libs), else the only one
    return None


def install() -> bool:
    """Hand NumPy's OpenBLAS to the kernels; returns whether tiled products are in use."""
    if os.environ.get("DIFFUSIONGEMMA_TILED_GEMM", "1") == "0":
        return False
    path = _numpy_openblas()
    if path is None:
        return False
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return False
    for names in _SYMBOLS:
        if all(hasattr(library, name) for name in names):
            addresses = [ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in names]
            return bool(_kernels.set_blas(*addresses))
    return False


class CpuArrays:
    """The fast CPU model's array module: NumPy, except that ``matmul`` runs 2-D float32 products into a
    given ``out`` on ``_kernels.gemm`` (when ``tiled``); everything else is looked up on NumPy."""

    def __init__(self, tiled: bool):
        self.tiled = tiled  # products and experts on the kernels' tiled BLAS calls
        self._local = threading.local()  # per calling thread: the widened tiles of bfloat16 products

    def _bf16_scratch(self, K: int) -> np.ndarray:
        """This thread's buffer for ``_kernels.gemm_bf16`` with K columns (grown, never shrunk: a step of a
        model allocates nothing once its largest product has run)."""
        need = max(1, _kernels.max_threads()) * _kernels.GEMM_TILE_COLS * K
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.size < need:
            scratch = self._local.scratch = np.empty(need, np.float32)
        return scratch

    def __getattr__(self, name):
        return getattr(np, name)

    @contextlib.contextmanager
    def serial_blas(self):
        """Within the block, the BLAS library runs every call on the calling thread (its own thread count
        is 1, restored on exit): the products NumPy still makes (attention's batched ones) stay off the
        BLAS thread pool, whose threads would otherwise spin beside the kernels' threads. A no-op unless
        ``tiled`` (then the kernels' tiles are the only parallelism of the products)."""
        previous = _kernels.set_blas_threads(1) if self.tiled else 0
        try:
            yield
        finally:
            if previous > 1:
                _kernels.set_blas_threads(previous)

    def matmul(self, a, b, out=None):
        """``numpy.matmul(a, b, out=out)``; 2-D C-contiguous float32 operands (b or b.T C-contiguous) not
        overlapping ``out`` run on ``_kernels.gemm``. A bfloat16 ``b`` (weights kept bfloat16) is taken as
        its exact float32 values: ``_kernels.gemm_bf16`` when b.T is C-contiguous (the products
        ``x @ W.T``), else NumPy's product on b widened whole."""
        if getattr(b, "dtype", None) == BFLOAT16:
            if (self.tiled and out is not None and a.ndim == 2 and b.ndim == 2 and out.ndim == 2
                    and a.dtype == np.float32 and out.dtype == np.float32 and a.flags.c_contiguous
                    and out.flags.c_contiguous and b.T.flags.c_contiguous and not np.may_share_memory(out, a)):
                _kernels.gemm_bf16(a, b.T, out, self._bf16_scratch(a.shape[1]))
                return out
            return np.matmul(a, b.astype(np.float32), out=out)
        if (self.tiled and out is not None and a.ndim == 2 and b.ndim == 2 and out.ndim == 2
                and a.dtype == np.float32 and b.dtype == np.float32 and out.dtype == np.float32
                and a.flags.c_contiguous and out.flags.c_contiguous
                and not np.may_share_memory(out, a) and not np.may_share_memory(out, b)):
            if b.flags.c_contiguous:
                _kernels.gemm(a, b, False, out)
                return out
            if b.T.flags.c_contiguous:
                _kernels.gemm(a, b.T, True, out)
                return out
        return np.matmul(a, b, out=out)


CPU_ARRAYS = CpuArrays(install())  # shared by every fast.Model (it holds no state of its own)
