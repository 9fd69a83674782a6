"""The fast path's tiled products (``fast.blas``, ``_kernels.gemm``); the experts' panels: test_fast_experts.py.

They must compute NumPy's products (up to the BLAS's summation order), give the same bits with one or two
threads (tiles depend on the shapes only), refuse mismatched shapes before touching
memory, and leave the BLAS library's thread count as they found it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from diffusiongemma.fast import _kernels as K
from diffusiongemma.fast.blas import CPU_ARRAYS, _numpy_openblas


def f32(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_tiled_products_are_in_use():
    """The README installs NumPy's OpenBLAS wheel and the kernels build with OpenMP: tiles must be on."""
    assert CPU_ARRAYS.tiled and K.has_gemm()


@pytest.mark.parametrize("M,K_,N", [(1, 7, 3), (64, 256, 600), (300, 70, 257), (513, 33, 1000)])
def test_gemm_matches_numpy_both_layouts(M, K_, N):
    a, w, b = f32(M, K_), f32(N, K_, seed=1), f32(K_, N, seed=2)
    out = np.full((M, N), np.nan, np.float32)
    K.gemm(a, w, True, out)  # a @ w.T (tiles cross both row and column boundaries for the larger shapes)
    np.testing.assert_allclose(out, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
    out.fill(np.nan)
    K.gemm(a, b, False, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4)
    out.fill(np.nan)
    assert CPU_ARRAYS.matmul(a, w.T, out=out) is out  # the array module's routing of a transposed weight
    np.testing.assert_allclose(out, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_gemm_with_empty_inner_dimension_writes_zeros():
    out = np.full((3, 4), np.nan, np.float32)
    K.gemm(np.empty((3, 0), np.float32), np.empty((0, 4), np.float32), False, out)
    np.testing.assert_array_equal(out, 0.0)


def test_gemm_gives_the_same_bits_with_one_or_two_threads():
    a, w = f32(300, 96), f32(700, 96, seed=1)
    results = []
    previous = K.set_parallel_threshold(0.0)
    try:
        for threads in (1, 2):
            with threadpool_limits(limits=threads):
                out = np.empty((300, 700), np.float32)
                K.gemm(a, w, True, out)
                results.append(out)
    finally:
        K.set_parallel_threshold(previous)
    np.testing.assert_array_equal(results[0], results[1])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        K.gemm(f32(4, 5), f32(6, 4), True, np.empty((4, 6), np.float32))


def numpy_blas_threads() -> int:
    """Threads of NumPy's own OpenBLAS (SciPy, loaded by transformers, brings a second one)."""
    return next(p["num_threads"] for p in threadpool_info() if p["filepath"] == _numpy_openblas())


def test_the_kernels_use_numpys_openblas_beside_scipys():
    pytest.importorskip("scipy.linalg")  # loads SciPy's own OpenBLAS, listed before NumPy's by threadpoolctl
    path = _numpy_openblas()
    assert path.startswith(os.path.dirname(os.path.abspath(np.__file__))), path  # numpy.libs, not scipy.libs


def test_blas_thread_count_is_restored():
    blas_threads = numpy_blas_threads

    with threadpool_limits(limits=2, user_api="blas"):
        K.gemm(f32(300, 64), f32(700, 64), True, np.empty((300, 700), np.float32))
        assert blas_threads() == 2
        with CPU_ARRAYS.serial_blas():
            assert blas_threads() == 1
        assert blas_threads() == 2
