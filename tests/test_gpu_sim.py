"""The CPU executor of the CUDA kernels (``fast/gpu/sim.py``, ``fast/gpu/sim/``): its execution model and
its checks, each proved able to fail on a copy of a real kernel with one line changed.

* execution model: thread/block indices in 3-D, static and dynamic shared memory, barriers, every warp
  shuffle kind and width, ballots, atomics, on a small kernel written for this test;
* checks: an off-by-one bound (bounds), a removed ``__syncthreads()`` (race), a shuffle inside a divergent
  branch and a barrier one thread skips (divergence), a global write every thread of a block, or every
  block, makes to one element (race in global memory; with that check off, schedule independence: the
  thread and block orders decide the output), a shared array read before it is written (schedule
  independence, through the differing poison), each reported with the kernel, the argument or shared
  array, the block, the thread, the index and the source line;
* launch geometry checks (``__launch_bounds__``, shared-memory limits), NULL pointers, and the stale-build
  rule (a changed source is compiled at run time, never run from an old build).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu import sim
from diffusiongemma.fast.gpu.sim import KernelCheckError, KernelLibrary, SimDevice

f32, i64, i32, u8 = np.float32, np.int64, np.int32, np.uint8

PROBE = r"""
#include "common.cuh"
// out[b, t, :] for block b (linear), thread t (linear): indices, shuffles, shared memory, atomics.
extern "C" __global__ void __launch_bounds__(128) probe(const float* x, int* ids, float* shuf, int* counts,
                                                       float* sums, double* dsh, int n) {
    __shared__ float tile[128];
    extern __shared__ __align__(16) unsigned char dg_smem[];
    int* dyn = (int*)dg_smem;
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    const long long at = (long long)b * nt + t;
    int* o = ids + at * 8;
    o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
    o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z; o[6] = gridDim.x * 100 + blockDim.x; o[7] = warpSize;
    const float v = x[at];
    tile[t] = v;
    dyn[nt - 1 - t] = t;
    __syncthreads();
    const int lane = t & 31;
    float* s = shuf + at * 8;
    s[0] = tile[nt - 1 - t];                               // another thread's value, after the barrier
    s[1] = (float)dyn[t];
    s[2] = __shfl_xor_sync(DG_FULL_MASK, v, 5);
    s[3] = __shfl_up_sync(DG_FULL_MASK, v, 3);
    s[4] = __shfl_down_sync(DG_FULL_MASK, v, 2, 8);        // width 8
    s[5] = __shfl_sync(DG_FULL_MASK, v, 31 - lane);
    s[6] = (float)__popc(__ballot_sync(DG_FULL_MASK, v > 0.0f));
    s[7] = dg_warp_sum(v);
    dsh[at] = dg_warp_sum_d((double)v);
    atomicAdd(&counts[b], 1);
    atomicMax(&counts[n], t);
    atomicAdd(&sums[b], v);
}
"""


def probe_library() -> KernelLibrary:
    common = open(os.path.join(cb.CUDA_DIR, "common.cuh"), encoding="utf-8").read()
    return KernelLibrary.from_source(PROBE.replace('#include "common.cuh"', common.replace("#pragma once", "")))


def test_execution_model_on_a_probe_kernel():
    lib = probe_library()
    ex = sim.Executor(lib)
    grid, block = (3, 2, 1), (16, 2, 2)  # 64 threads: two warps whose lanes span y and z
    nb, nt = 6, 64
    x = np.random.default_rng(0).standard_normal(nb * nt).astype(f32)
    ids = np.zeros((nb, nt, 8), i32)
    shuf = np.zeros((nb, nt, 8), f32)
    counts = np.zeros(nb + 1, i32)
    sums = np.zeros(nb, f32)
    dsh = np.zeros(nb * nt, np.float64)
    launch = gl.Launch("probe", grid, block, (x, ids, shuf, counts, sums, dsh, np.int32(nb)), 4 * nt)
    for schedule in sim.SCHEDULES:
        counts[:] = 0
        sums[:] = 0
        ex.run(launch, schedule, seed=7)
        t = np.arange(nt)
        tx, ty, tz = t % 16, (t // 16) % 2, t // 32
        b = np.arange(nb)
        np.testing.assert_array_equal(ids[:, :, 0], np.broadcast_to(tx, (nb, nt)))
        np.testing.assert_array_equal(ids[:, :, 1], np.broadcast_to(ty, (nb, nt)))
        np.testing.assert_array_equal(ids[:, :, 2], np.broadcast_to(tz, (nb, nt)))
        np.testing.assert_array_equal(ids[:, 0, 3:6], np.stack([b % 3, b // 3, 0 * b], axis=1))
        assert (ids[:, :, 6] == 316).all() and (ids[:, :, 7] == 32).all()
        X = x.reshape(nb, nt)
        np.testing.assert_array_equal(shuf[:, :, 0], X[:, ::-1])
        np.testing.assert_array_equal(shuf[:, :, 1], np.broadcast_to(nt - 1 - t, (nb, nt)).astype(f32))
        W = X.reshape(nb, 2, 32)
        lane = np.arange(32)
        np.testing.assert_array_equal(shuf[:, :, 2].reshape(nb, 2, 32), W[:, :, lane ^ 5])
        up = np.where(lane >= 3, lane - 3, lane)
        np.testing.assert_array_equal(shuf[:, :, 3].reshape(nb, 2, 32), W[:, :, up])
        down = np.where(lane % 8 + 2 < 8, lane + 2, lane)
        np.testing.assert_array_equal(shuf[:, :, 4].reshape(nb, 2, 32), W[:, :, down])
        np.testing.assert_array_equal(shuf[:, :, 5].reshape(nb, 2, 32), W[:, :, 31 - lane])
        np.testing.assert_array_equal(shuf[:, :, 6].reshape(nb, 2, 32)[:, :, 0], (W > 0).sum(-1))
        np.testing.assert_allclose(shuf[:, :, 7].reshape(nb, 2, 32)[:, :, 0], W.sum(-1), rtol=1e-5)
        np.testing.assert_allclose(dsh.reshape(nb, 2, 32)[:, :, 0], W.astype(np.float64).sum(-1), rtol=1e-6)
        assert (counts[:nb] == nt).all() and counts[nb] == nt - 1
        np.testing.assert_allclose(sums, X.sum(-1), rtol=1e-4, atol=1e-5)


def test_launch_bounds_and_shared_limits_are_checked():
    ex = sim.Executor(probe_library())
    args = (np.zeros(256, f32), np.zeros(256 * 8, i32), np.zeros(256 * 8, f32), np.zeros(2, i32), np.zeros(1, f32),
            np.zeros(256, np.float64), np.int32(1))
    with pytest.raises(gl.LaunchRefused, match=r"a block of 256 threads exceeds the 128 this kernel may run with"):
        ex.run(gl.Launch("probe", (1, 1, 1), (256, 1, 1), args, 4 * 256))
    with pytest.raises(gl.LaunchRefused, match="bytes of dynamic shared memory exceed the 101376 bytes a block may "
                                               "use on sm_86"):
        ex.run(gl.Launch("probe", (1, 1, 1), (64, 1, 1), args, sim.MAX_SHARED))
    # over 48 KiB a kernel must be opted in first, as on a GPU; past the target's maximum it cannot be
    with pytest.raises(gl.LaunchRefused, match="exceed the 49152 bytes a block may use on sm_86 without opting in"):
        ex.run(gl.Launch("probe", (1, 1, 1), (64, 1, 1), args, 60000))
    with pytest.raises(gl.LaunchRefused, match="exceed the 101376 bytes"):
        ex.opt_in("probe", 101376)
    ex.opt_in("probe", 60000)
    ex.run(gl.Launch("probe", (1, 1, 1), (64, 1, 1), args, 60000))
    with pytest.raises(KernelCheckError, match="dynamic shared array dg_smem, but the launch gave it 16 bytes"):
        ex.run(gl.Launch("probe", (1, 1, 1), (64, 1, 1), args, 16))


# ------------------------------------------------------------------------------------------------ mutations
def mutated(source: str, old: str, new: str) -> KernelLibrary:
    """The library of ``source`` (a file of fast/gpu/cuda, assembled) with ``old`` replaced once by ``new``."""
    text = cb.assemble(os.path.join(cb.CUDA_DIR, source))
    assert text.count(old) >= 1, f"the mutation no longer applies to {source}: update this test with the kernel"
    return KernelLibrary.from_source(text.replace(old, new, 1))


def passes_unmutated(launch: gl.Launch) -> None:
    """The real kernel runs the same launch through every check and order (so the mutation is what failed)."""
    sim.Executor().run_checked(launch, sim.SCHEDULES)


def rms_launch(dev: SimDevice, rows=3, dim=100):
    x = dev.to_device(np.random.default_rng(1).standard_normal((rows, dim)).astype(f32))
    return gl.rms_norm(x, dev.to_device(np.ones(dim, f32)), dev.empty((rows, dim), f32), 1e-6)


def test_the_real_kernels_pass_every_check_in_every_order():
    dev = SimDevice()
    for schedule in sim.SCHEDULES:
        dev.executor.run(rms_launch(dev), schedule, seed=3)
    dev.executor.run_checked(rms_launch(dev), sim.SCHEDULES)


def test_an_off_by_one_bound_is_caught():
    lib = mutated("norms.cu", "for (int i = threadIdx.x; i < dim; i += blockDim.x) {\n        float v = xr[i] * f;",
                  "for (int i = threadIdx.x; i <= dim; i += blockDim.x) {\n        float v = xr[i] * f;")
    dev = SimDevice(library=lib)
    with pytest.raises(KernelCheckError) as info:
        dev.launch(rms_launch(dev, rows=3, dim=100))
    error = info.value
    assert error.check == "bounds" and error.kernel == "dg_rms_norm"
    text = str(error)
    # the first block's thread 100 reads w[100], one past the end of the weight
    assert "read of 4 bytes outside argument w_opt: index 100 of 100 elements" in text, text
    assert "block (0, 0, 0) thread (100, 0, 0)" in text, text
    assert ".cpp:" in text and "in dg_rms_norm" in text, text  # the source line of the access
    passes_unmutated(rms_launch(dev, rows=3, dim=100))


def test_a_removed_syncthreads_is_caught_as_a_race():
    # the barrier between the tile loads and the scoring in dg_attention
    lib = mutated("attention.cu", "            kreal[t] = real;\n        }\n        __syncthreads();",
                  "            kreal[t] = real;\n        }\n")
    dev = SimDevice(library=lib)
    rng = np.random.default_rng(0)
    N, S, nh, g, d, n_new = 1, 4, 2, 1, 16, 6
    up = lambda a: dev.to_device(a)  # noqa: E731
    launch = gl.attention(up(rng.standard_normal((N, S, nh, d)).astype(f32)), up(np.arange(S, dtype=i64) + 2),
                          None, None, None, 0, None, None, up(rng.standard_normal((N, g, n_new, d)).astype(f32)),
                          up(rng.standard_normal((N, g, n_new, d)).astype(f32)), up(np.arange(n_new, dtype=i64)),
                          up(np.ones((N, n_new), u8)), 0, True, dev.empty((N, S, nh * d), f32))
    with pytest.raises(KernelCheckError) as info:
        dev.launch(launch)
    text = str(info.value)
    assert info.value.check == "race" and info.value.kernel == "dg_attention", text
    assert "shared-memory race on dg_smem byte" in text and "block (0, 0, 0)" in text, text
    assert "in dg_attention" in text, text
    passes_unmutated(launch)


def test_a_removed_syncthreads_in_a_block_reduction_is_caught():
    lib = mutated("norms.cu", "    if (lane == 0) scratch[warp] = v;\n    __syncthreads();",
                  "    if (lane == 0) scratch[warp] = v;\n")
    dev = SimDevice(library=lib)
    with pytest.raises(KernelCheckError, match=r"race on dg_rms_norm::scratch byte \d+: thread \(\d+, 0, 0\) (read|wrote) it and thread "
                                                  r"\(\d+, 0, 0\) (read|wrote) it with no __syncthreads between"):
        dev.launch(rms_launch(dev, rows=2, dim=256))
    passes_unmutated(rms_launch(dev, rows=2, dim=256))


def test_a_shuffle_in_a_divergent_branch_is_caught():
    lib = mutated("moe.cu", "    mx = dg_warp_max(mx);", "    if (lane < 16) mx = dg_warp_max(mx);")
    dev = SimDevice(library=lib)
    N, E, K = 3, 8, 2
    probs = dev.to_device(np.random.default_rng(0).standard_normal((N, E)).astype(f32))
    launch = gl.router(probs, dev.to_device(np.ones(E, f32)), dev.empty((N, K), i64), dev.empty((N, K), f32))
    with pytest.raises(KernelCheckError) as info:
        dev.launch(launch)
    text = str(info.value)
    assert info.value.check == "divergence" and info.value.kernel == "dg_router", text
    # lanes 0-15 wait in the warp maximum, lanes 16-31 went on to the warp sum
    assert "__shfl_xor_sync" in text and "warp 0: lanes 16-31 arrived" in text, text
    assert "is at another call" in text and "in dg_warp_max" in text, text
    assert "inlined into dg_router" in text and "block (0, 0, 0)" in text, text
    passes_unmutated(launch)


def test_a_barrier_not_reached_by_every_thread_is_caught():
    lib = mutated("sampling.cu", "    if (!u_opt) return;\n    __syncthreads();",
                  "    if (!u_opt || threadIdx.x == 7) return;\n    __syncthreads();")
    dev = SimDevice(library=lib)
    R, V = 2, 300
    launch = gl.sample_rows(dev.to_device(np.zeros((R, V), f32)), dev.to_device(np.arange(R, dtype=i32)), 0.0, 0.0,
                            dev.to_device(np.full(R, 0.5)), dev.empty(R, i64), dev.empty(R, f32), dev.empty(R, i64),
                            dev.empty(R, i32))
    with pytest.raises(KernelCheckError, match=r"divergence: __syncthreads at .* reached by threads 0-6, 8-255 of block "
                                               r"\(0, 0, 0\), but threads 7 ended without reaching it"):
        dev.launch(launch)
    passes_unmutated(launch)


def test_an_order_dependent_output_is_caught():
    # every thread of a row writes its value to the row's first element: the last writer wins
    lib = mutated("moe.cu", "d[i] = token < 0 ? 0.0f : s[i];", "d[0] = token < 0 ? 0.0f : s[i];")
    dev = SimDevice(library=lib)
    src = dev.to_device(np.arange(12 * 64, dtype=f32).reshape(12, 64))
    launch = gl.gather_rows(src, dev.to_device(np.array([3, -1, 5], i32)), dev.empty((3, 64), f32))
    with pytest.raises(KernelCheckError) as info:  # the race check names the write
        dev.launch(launch)
    assert info.value.check == "race", str(info.value)
    assert re.search(r"global-memory race on argument dst index 0: block \(0, 0, 0\) thread \(\d+, 0, 0\) wrote "
                     r"it and its thread \(\d+, 0, 0\) wrote it with no __syncthreads between", str(info.value))
    dev.executor.races = False  # without it, the outputs of two thread orders differ
    with pytest.raises(KernelCheckError) as info:
        dev.launch(launch)
    assert info.value.check == "schedule", str(info.value)
    assert "output dst depends on the order of the threads: element 0" in str(info.value)
    passes_unmutated(launch)


def test_an_output_that_depends_on_the_order_of_the_blocks_is_caught():
    # every block writes its row into row 0: no two threads of a block collide, but the last block wins
    lib = mutated("moe.cu", "float* d = dst + (long long)row * dim;", "float* d = dst;")
    dev = SimDevice(library=lib)
    src = dev.to_device(np.arange(12 * 64, dtype=f32).reshape(12, 64))
    launch = gl.gather_rows(src, dev.to_device(np.array([3, 7, 5, 1], i32)), dev.empty((4, 64), f32))
    with pytest.raises(KernelCheckError) as info:
        dev.launch(launch)
    assert info.value.check == "race" and "(the blocks of a launch are not ordered)" in str(info.value)
    assert "global-memory race on argument dst index 0: block (0, 0, 0)" in str(info.value)
    dev.executor.races = False  # without it, the block order decides the output
    with pytest.raises(KernelCheckError) as info:
        dev.launch(launch)
    assert info.value.check == "schedule" and "output dst depends on the order" in str(info.value)
    passes_unmutated(launch)


def test_a_read_of_unwritten_shared_memory_is_caught():
    # warp 0's partial statistics are never stored: thread 0 reads whatever the shared memory held
    lib = mutated("sampling.cu", "if (lane == 0) part[warp] = s;", "if (lane == 0 && warp > 0) part[warp] = s;")
    dev = SimDevice(library=lib)
    R, V = 2, 3000
    z = np.random.default_rng(0).standard_normal((R, V)).astype(f32)
    z[:, 5] = 9.0  # the maximum lies in warp 0's share
    launch = gl.sample_rows(dev.to_device(z), dev.to_device(np.arange(R, dtype=i32)), 0.0, 0.0, None,
                            dev.empty(R, i64), dev.empty(R, f32), dev.empty(R, i64), dev.empty(R, i32))
    with pytest.raises(KernelCheckError) as info:
        dev.launch(launch)
    assert info.value.check == "schedule" and "output flags depends on the order" in str(info.value)
    passes_unmutated(launch)


def test_null_pointer_and_wild_accesses_are_reported():
    lib = mutated("norms.cu", "if (w_opt) v = v * w_opt[i];", "v = v * w_opt[i];")
    dev = SimDevice(library=lib)
    x = dev.to_device(np.ones((2, 64), f32))
    with pytest.raises(KernelCheckError, match="through a NULL pointer"):
        dev.launch(gl.rms_norm(x, None, dev.empty((2, 64), f32), 1e-6))


def test_a_changed_source_is_rebuilt_not_run_stale():
    """KernelLibrary.default() compares the build's hash with the sources; any edit gives another hash."""
    text = sim.codegen.directory_text(gl.CUDA_DIR)
    assert sim.codegen.source_hash(text) != sim.codegen.source_hash(text + "\n// edited")
    lib = KernelLibrary.default()
    assert set(lib.signatures) == set(gl.signatures())
