"""Launches at the limits: zero sizes, the device's shared-memory and block-size limits, NaN entropies, and the
one GPU compile mode.

* Zero sizes: every ``extern "C" __global__`` kernel is launched through its builder with each of its counts
  set to 0 on cuda-sim with every check on. Each launch is either clean (no out-of-bounds access, race or
  divergence, outputs the same in every thread order) or refused by the builder with a ``LaunchError`` that
  names the kernel. A kernel that launches at least one block for a count of 0 (grids are never empty) must
  take that count and return in the blocks past it; removing such a guard is caught (mutation test).
* Limits: cuda-sim refuses, with the text ``CupyDevice`` gives on a GPU (``launch.LaunchRefused``), a block
  larger than a kernel's ``__launch_bounds__``, static + dynamic shared memory over 48 KiB without an opt-in,
  and over the target architecture's opt-in maximum. On a GPU (``-m gpu``, run by benchmarks/gpu_check.sh) the
  device's own limits are compared with the table cuda-sim uses, and the over-limit launch gives the same error.
* A NaN entropy reaching ``dg_accept_renoise`` ranks after every number (no two threads share a sorted slot:
  no race) and the result is the reference's ``entropy_bound_accept`` on the same entropies.
* Compile mode: NVRTC and nvcc compile the kernels with ``--fmad=false`` (no fused multiply-add contraction),
  as cuda-sim is compiled (-ffp-contract=off). The bits that may then still differ between a GPU and cuda-sim
  are those of the transcendental built-ins (expf, tanhf, powf, exp, log: CUDA's libdevice against glibc,
  within 2 ulp) and whatever is computed from them; the test below shows on this CPU that contraction alone
  changes float32 results, which is why it is off on both sides.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from diffusiongemma.fast import gpu
from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu import sim
from diffusiongemma.fast.gpu.sim import KernelCheckError, KernelLibrary, SimDevice
from diffusiongemma.reference.sampling import entropy_bound_accept, renoise

f32, f64, i64, i32, u8 = np.float32, np.float64, np.int64, np.int32, np.uint8
GPU_OK, GPU_REASON = gpu.gpu_available()


@pytest.fixture(scope="module")
def dev():
    return SimDevice(checks=True)


def _z(dev, *shape, dtype=f32):
    return dev.zeros(shape, dtype)


# ------------------------------------------------------------------------------------------------ zero sizes
def zero_size_cases(dev):
    """(kernel, count set to 0, builder call) for every kernel and each of its counts."""
    z = lambda *s, dtype=f32: _z(dev, *s, dtype=dtype)  # noqa: E731
    cases = []
    for rows, dim in ((0, 64), (3, 0)):
        cases += [
            ("dg_rms_norm", f"rows={rows} dim={dim}", lambda r=rows, d=dim: gl.rms_norm(z(r, d), z(d), z(r, d), 1e-6)),
            ("dg_residual_norm", f"rows={rows} dim={dim}",
             lambda r=rows, d=dim: gl.residual_norm(z(r, d), z(r, d), z(d), 1.0, 1e-6)),
            ("dg_ffn_tail", f"rows={rows} dim={dim}",
             lambda r=rows, d=dim: gl.ffn_tail(z(r, d), z(r, d), z(r, d), z(d), z(d), z(d), 1.0, 1e-6)),
            ("dg_embed", f"rows={rows} dim={dim}",
             lambda r=rows, d=dim: gl.embed(z(r, dtype=i64), z(5, d), 1.0, None, True, z(r, d), 1e-6)),
            ("dg_gated_gelu", f"rows={rows} inner={dim}", lambda r=rows, d=dim: gl.gated_gelu(z(r, 2 * d), z(r, d))),
            ("dg_gather_rows", f"rows={rows} dim={dim}",
             lambda r=rows, d=dim: gl.gather_rows(z(4, d), z(r, dtype=i32), z(r, d))),
        ]
    cases.append(("dg_softcap", "n=0", lambda: gl.softcap(z(0), 30.0)))
    cases.append(("dg_round_bf16", "n=0", lambda: gl.round_bf16(z(0))))

    def qkv(batch=2, S=3, n_heads=4, n_kv=2, d=8):
        width = (n_heads + 2 * n_kv) * d
        return gl.qkv_heads(z(batch * S, width), batch, S, n_heads, n_kv, d, True, z(d), z(d), z(S, d // 2),
                            z(S, d // 2), z(batch, S, n_heads, d), z(batch, n_kv, S, d), z(batch, n_kv, S, d), 1e-6)

    cases += [("dg_qkv_heads", "batch=0", lambda: qkv(batch=0)), ("dg_qkv_heads", "S=0", lambda: qkv(S=0)),
              ("dg_qkv_heads", "d=0", lambda: qkv(d=0)), ("dg_qkv_heads", "n_kv=0", lambda: qkv(n_kv=0)),
              ("dg_qkv_heads", "n_heads=0", lambda: qkv(n_heads=0))]

    def attention(N=2, S=3, nh=4, g=2, d=8, slots=5, n_cache=3, n_new=4, P=9, build=gl.attention):
        return build(z(N, S, nh, d), z(S, dtype=i64), z(N, g, slots, d), z(N, g, slots, d), None, n_cache,
                     z(slots, dtype=i64), z(N, P, dtype=u8), z(N, g, n_new, d), z(N, g, n_new, d),
                     z(n_new, dtype=i64), z(N, n_new, dtype=u8), 0, False, z(N, S, nh * d))

    cases += [(kernel, f"{k}=0", lambda k=k, b=build: attention(**{k: 0}, build=b))
              for kernel, build in (("dg_attention", gl.attention), ("dg_attention_bf16", gl.attention_bf16))
              for k in ("N", "S", "nh", "g", "d", "slots", "n_cache", "n_new", "P")]

    def router(N=3, E=4, K=2):
        return gl.router(z(N, E), z(E), z(N, K, dtype=i64), z(N, K))

    cases += [("dg_router", f"{k}=0", lambda k=k: router(**{k: 0})) for k in ("N", "E", "K")]

    def group(N=3, K=2, E=4):
        tiles, rows = gl.moe_rows(N, K, E)
        return gl.group_experts(z(N, K, dtype=i64), E, z(E + 1, dtype=i32), z(rows, dtype=i32), z(N, K, dtype=i32),
                                z(tiles, dtype=i32))

    cases += [("dg_group_experts", f"{k}=0", lambda k=k: group(**{k: 0})) for k in ("N", "K", "E")]

    def gemm(tiles=2, G=2, n_out=5, K=7):
        tm = gl.const("DG_GEMM_TM")
        return gl.grouped_gemm_nt(z(tiles * tm, K), z(G, n_out, K), z(tiles, dtype=i32), z(tiles * tm, n_out))

    cases += [("dg_grouped_gemm_nt", f"{k}=0", lambda k=k: gemm(**{k: 0})) for k in ("tiles", "G", "n_out", "K")]

    def gemm_bf16_grouped(tiles=2, G=2, n_out=5, K=7):
        tm = gl.const("DG_GEMM_TM")
        return gl.grouped_gemm_bf16(z(tiles * tm, K), z(G, n_out, K, dtype=np.uint16), z(tiles, dtype=i32),
                                    z(tiles * tm, n_out), z(tiles * tm, n_out))

    cases += [("dg_grouped_gemm_bf16", f"{k}=0", lambda k=k: gemm_bf16_grouped(**{k: 0}))
              for k in ("tiles", "G", "n_out", "K")]

    def combine(N=3, K=2, H=6, R=5):
        return gl.combine_experts(z(R, H), z(N, K, dtype=i64), z(N, K, dtype=i32), z(N, K), z(N, H))

    cases += [("dg_combine_experts", f"{k}=0", lambda k=k: combine(**{k: 0})) for k in ("N", "K", "H")]

    def sample(R_all=3, R=2, V=50, draw=True):
        return gl.sample_rows(z(R_all, V), z(R, dtype=i32), 0.0, 1.0, z(R, dtype=f64) if draw else None,
                              z(R, dtype=i64), z(R), z(R, dtype=i64), z(R, dtype=i32))

    cases += [("dg_sample_rows", "rows=0", lambda: sample(R=0)), ("dg_sample_rows", "vocab=0", lambda: sample(V=0)),
              ("dg_sample_rows", "vocab=0, no draw", lambda: sample(V=0, draw=False)),
              ("dg_sample_rows", "logits rows=0", lambda: sample(R_all=0, R=0))]

    def accept(B=2, C=5):
        return gl.accept_renoise(z(B, C), z(B, C, dtype=i64), z(B, C, dtype=i64), 0.5, z(B, C, dtype=u8),
                                 z(B, C, dtype=i64))

    cases += [("dg_accept_renoise", "B=0", lambda: accept(B=0)), ("dg_accept_renoise", "C=0", lambda: accept(C=0))]

    def sample_step(B=2, C=3, R=4, V=50, N=2):  # the captured step's kernels, at step 0
        n = B * C
        return gl.sample_step(z(n, V), dev.to_device(np.arange(R, dtype=i32)), 0.0, z(N), z(1, dtype=i32),
                              z(N, n, dtype=f64), z(n, dtype=i64), z(n), z(n, dtype=i64), z(N, n, dtype=i32))

    cases += [("dg_sample_step", "rows=0", lambda: sample_step(R=0)),
              ("dg_sample_step", "vocab=0", lambda: sample_step(V=0)),
              ("dg_sample_step", "canvas rows=0", lambda: sample_step(B=0, R=0))]

    def update(B=2, C=5, N=2, s=1):
        return gl.step_update(z(B * C, dtype=i64), z(B * C), z(B * C, dtype=i64), z(N, B, C, dtype=i64),
                              z(1, dtype=i32), 0.5, True, s, 0.1, z(B, C, dtype=i64), z(B, C, dtype=i64), z(B, C),
                              z(B, dtype=u8), z(B, dtype=i32), z(max(s, 1), B, C, dtype=i64))

    cases += [("dg_step_update", f"{k}=0", lambda k=k: update(**{k: 0})) for k in ("B", "C", "s")]

    def end(N=2, n=6, B=2):
        return gl.step_end(z(N, n, dtype=i32), z(B, dtype=i32), z(N + B, dtype=i32), z(1, dtype=i32))

    cases += [("dg_step_end", f"{k}=0", lambda k=k: end(**{k: 0})) for k in ("n", "B")]

    def gemm_bf16(M=3, N=5, K=6):
        u16 = np.uint16
        return gl.gemm_bf16(z(M, K, dtype=u16), z(N, K, dtype=u16), z(M, N), z(M, N, dtype=u16))

    cases += [("dg_gemm_bf16", f"{k}=0", lambda k=k: gemm_bf16(**{k: 0})) for k in ("M", "N", "K")]
    return cases


def test_every_kernel_launches_cleanly_or_is_refused_with_each_count_zero(dev):
    cases = zero_size_cases(dev)
    assert {k for k, _, _ in cases} == set(gl.signatures()), "a kernel has no zero-size case here"
    outcome = {}
    for kernel, what, build in cases:
        try:
            launch = build()
        except gl.LaunchError as error:
            assert kernel in str(error), f"{kernel} {what}: the refusal does not name the kernel: {error}"
            outcome[(kernel, what)] = "refused"
            continue
        assert launch.kernel == kernel
        dev.launch(launch)  # KernelCheckError (bounds, race, divergence, schedule) fails the test
        outcome[(kernel, what)] = "clean"
    print("\n".join(f"{k:20} {w:18} {o}" for (k, w), o in sorted(outcome.items())))
    # the counts the issue found unguarded now launch, and are guarded in the kernels
    for key in (("dg_attention", "N=0"), ("dg_accept_renoise", "B=0"), ("dg_sample_rows", "rows=0"),
                ("dg_rms_norm", "rows=0 dim=64")):
        assert outcome[key] == "clean", key


@pytest.mark.parametrize("source, guard, launch_of", [
    ("attention.cu", "    if (n >= N || q0 >= S) return;", "attention_N0"),
    ("sampling.cu", "    if (b >= B) return;                             // uniform for the block", "accept_B0"),
])
def test_removing_a_zero_size_guard_is_caught(dev, source, guard, launch_of):
    text = cb.assemble(os.path.join(cb.CUDA_DIR, source))
    assert guard in text, f"the guard is no longer in {source}: update this test with the kernel"
    broken = KernelLibrary.from_source(text.replace(guard, "", 1))
    cases = {(k, w): b for k, w, b in zero_size_cases(dev)}
    launch = cases[("dg_attention", "N=0")]() if launch_of == "attention_N0" else cases[("dg_accept_renoise", "B=0")]()
    with pytest.raises(KernelCheckError) as info:
        sim.Executor(broken).run(launch)
    assert info.value.check == "bounds"


# ------------------------------------------------------------------------------------------------ limits
def _sample_args(V=64, R=1):
    return gl.pack_args("dg_sample_rows", (np.zeros((1, V), f32), np.zeros(R, i32), R, V, 0.0, 0.0, None,
                                           np.zeros(R, i64), np.zeros(R, f32), np.zeros(R, i64), np.zeros(R, i32)))


def test_static_shared_memory_of_the_sampler_is_what_the_builder_assumes():
    lib = KernelLibrary.default()
    assert lib.static_shared["dg_sample_rows"] == gl.sample_static_shared()
    assert lib.static_shared["dg_sample_step"] == gl.sample_static_shared()
    # the builder refuses a vocabulary whose chunk sums and static shared memory together pass 48 KiB
    chunk = gl.const("DG_SAMPLE_CHUNK")
    fits = (gl.DEFAULT_SHARED_LIMIT - gl.sample_static_shared()) // 8 * chunk
    z = np.zeros
    gl.sample_rows(z((1, fits), f32), z(1, i32), 0.0, 0.0, None, z(1, i64), z(1, f32), z(1, i64), z(1, i32))
    with pytest.raises(gl.LaunchError, match="static shared memory"):
        gl.sample_rows(z((1, fits + chunk), f32), z(1, i32), 0.0, 0.0, None, z(1, i64), z(1, f32), z(1, i64),
                       z(1, i32))


def test_cuda_sim_refuses_what_a_gpu_refuses():
    static = gl.sample_static_shared()
    # 1. a block larger than the kernel's __launch_bounds__(DG_SAMPLE_THREADS)
    dev = SimDevice(checks=False)
    with pytest.raises(gl.LaunchRefused, match=r"dg_sample_rows: a block of 512 threads exceeds the 256 this kernel "
                                               r"may run with on sm_86"):
        dev.launch(gl.Launch("dg_sample_rows", (1, 1, 1), (512, 1, 1), _sample_args(), 8))
    # 2. static + dynamic over 48 KiB: the executor refuses unless the kernel was opted in, as a GPU does;
    #    the device opts in, as CupyDevice does
    near = gl.DEFAULT_SHARED_LIMIT - static + 8  # dynamic alone is under 48 KiB, with the static part it is over
    launch = gl.Launch("dg_sample_rows", (1, 1, 1), (256, 1, 1), _sample_args(), near)
    assert not launch.needs_shared_opt_in
    with pytest.raises(gl.LaunchRefused, match=f"{static} bytes of static and {near} bytes of dynamic shared memory "
                                               f"exceed the 49152 bytes a block may use on sm_86 without opting in"):
        sim.Executor(KernelLibrary.default()).run(launch)
    dev.launch(launch)
    assert dev.executor.opted_in["dg_sample_rows"] == near
    # 3. over the target's opt-in maximum (sm_86: 99 KiB; sm_90: 227 KiB)
    over = gl.Launch("dg_sample_rows", (1, 1, 1), (256, 1, 1), _sample_args(), 101376 - static + 8)
    with pytest.raises(gl.LaunchRefused, match=f"exceed the 101376 bytes a block may use on sm_86"):
        dev.launch(over)
    SimDevice(checks=False, target="sm_90").launch(over)  # an H100 / H200 takes it
    # 4. an attention plan with a budget above the target's maximum is refused the same way
    q = np.zeros((1, 4, 8, 512), f32)
    big = gl.attention(q, np.zeros(4, i64), None, None, None, 0, None, None, np.zeros((1, 1, 8, 512), f32),
                       np.zeros((1, 1, 8, 512), f32), np.zeros(8, i64), np.zeros((1, 8), u8), 0, False,
                       np.zeros((1, 4, 8 * 512), f32), budget=200 * 1024)
    assert big.shared_mem > 101376
    with pytest.raises(gl.LaunchRefused, match="dg_attention: 0 bytes of static and .* exceed the 101376 bytes"):
        dev.launch(big)
    with pytest.raises(ValueError, match="cuda-sim target"):
        SimDevice(target="sm_99")


def _on_the_real_device_limits():
    """On a GPU: its opt-in maximum and block limit are the table's, and an over-limit launch is refused
    with the text cuda-sim gives (and the driver itself refuses it too, when our check is bypassed)."""
    import cupy

    device = gpu.CupyDevice("cuda")
    assert device.arch in gl.SHARED_OPT_IN_LIMITS, f"add {device.arch} to launch.SHARED_OPT_IN_LIMITS"
    assert device.opt_in_limit == gl.SHARED_OPT_IN_LIMITS[device.arch]
    assert cupy.cuda.Device(0).attributes["MaxThreadsPerBlock"] == gl.MAX_BLOCK_THREADS
    kernel = device._kernel("dg_sample_rows")
    assert kernel.shared_size_bytes == gl.sample_static_shared()
    static = gl.sample_static_shared()
    logits = cupy.zeros((1, 64), cupy.float32)
    args = (logits, cupy.zeros(1, cupy.int32), 1, 64, 0.0, 0.0, None, cupy.zeros(1, cupy.int64),
            cupy.zeros(1, cupy.float32), cupy.zeros(1, cupy.int64), cupy.zeros(1, cupy.int32))
    over = gl.Launch("dg_sample_rows", (1, 1, 1), (256, 1, 1), gl.pack_args("dg_sample_rows", args),
                     device.opt_in_limit - static + 8)
    with pytest.raises(gl.LaunchRefused) as on_gpu:
        device.launch(over)
    with pytest.raises(gl.LaunchRefused) as on_sim:
        SimDevice(checks=False, target=device.arch).launch(
            gl.Launch("dg_sample_rows", (1, 1, 1), (256, 1, 1), _sample_args(), over.shared_mem))
    assert str(on_gpu.value) == str(on_sim.value)
    with pytest.raises(Exception):  # the driver refuses it as well (cudaFuncSetAttribute or the launch)
        kernel.max_dynamic_shared_size_bytes = over.shared_mem
        kernel((1,), (256,), tuple(np.uint64(0) if a is None else a for a in over.args), shared_mem=over.shared_mem)
        cupy.cuda.Device().synchronize()


if GPU_OK:  # collected only where a GPU is (as tests/test_gpu_equivalence.py): never a skip elsewhere
    test_the_real_device_has_the_limits_cuda_sim_models = pytest.mark.gpu(_on_the_real_device_limits)
else:
    print(f"the real-device limit check is not collected: {GPU_REASON}")


# ------------------------------------------------------------------------------------------------ NaN entropy
def test_a_nan_entropy_does_not_race_and_matches_the_reference(dev):
    rng = np.random.default_rng(2)
    B, C = 3, 37
    H = (rng.random((B, C)) * 0.1).astype(f32)
    H[0, 5] = np.nan
    H[1, ::4] = np.nan
    H[2] = np.nan
    sampled, noise = rng.integers(0, 100, (B, C)), rng.integers(100, 200, (B, C))
    for bound in (0.0, 0.3, 10.0):
        acc, nxt = dev.empty((B, C), u8), dev.empty((B, C), i64)
        dev.launch(gl.accept_renoise(dev.to_device(H), dev.to_device(sampled), dev.to_device(noise), bound, acc, nxt))
        expected = entropy_bound_accept(H, bound)
        np.testing.assert_array_equal(dev.to_host(acc).astype(bool), expected)
        np.testing.assert_array_equal(dev.to_host(nxt), renoise(sampled, expected, noise))


def test_the_old_nan_ranking_races():
    """The ranking without the NaN order gives two NaN positions one sorted slot: cuda-sim reports the race."""
    text = cb.assemble(os.path.join(cb.CUDA_DIR, "sampling.cu"))
    new = "            r += dg_sorts_before(o, i, h, j);"
    assert new in text
    broken = KernelLibrary.from_source(text.replace(new, "            r += (o < h) || (o == h && i < j);", 1))
    H = np.full((1, 40), np.nan, f32)
    launch = gl.accept_renoise(H, np.zeros((1, 40), i64), np.zeros((1, 40), i64), 0.5, np.zeros((1, 40), u8),
                               np.zeros((1, 40), i64))
    with pytest.raises(KernelCheckError) as info:
        sim.Executor(broken).run(launch)
    assert info.value.check == "race"


# ------------------------------------------------------------------------------------------------ compile mode
def test_one_compile_mode_without_contraction():
    assert "--fmad=false" in cb.NVRTC_OPTIONS and "--fmad=false" in cb.NVCC_OPTIONS
    assert "-ffp-contract=off" in sim.codegen.KERNEL_FLAGS and "-ffast-math" not in sim.codegen.KERNEL_FLAGS
    from diffusiongemma.fast.gpu import device

    assert device.NVRTC_OPTIONS is cb.NVRTC_OPTIONS


def test_nvcc_with_the_options_emits_no_contracted_multiply_add():
    """With nvcc here: a*b + c compiles to mul + add under the project's options, to fma without them."""
    nvcc = cb.find_nvcc()
    if nvcc is None:
        print("skipping: no nvcc (the option itself is checked above)")
        pytest.skip("no nvcc here")
    src = 'extern "C" __global__ void k(const float* a, float* o) { o[0] = a[0] * a[1] + a[2]; }\n'
    ptx = {}
    for name, options in (("project", cb.NVCC_OPTIONS), ("default", ())):
        out = subprocess.run([nvcc, "-arch=sm_80", "-ptx", *options, "-x", "cu", "-", "-o", "-"], input=src,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        ptx[name] = out.stdout
    assert re.search(r"\bfma\.rn\.f32", ptx["default"])
    assert not re.search(r"\bfma\.rn\.f32", ptx["project"]) and re.search(r"\bmul\.rn\.f32", ptx["project"])


def test_contraction_changes_the_bits_of_a_norm_kernel():
    """Why the mode matters: the same dg_residual_norm source compiled for cuda-sim with contraction on (as a
    GPU would without --fmad=false) gives different float32 outputs on ordinary inputs."""
    if "fma" not in open("/proc/cpuinfo").read().split():
        pytest.skip("this CPU has no FMA instructions")
    text = cb.assemble_all()
    flags = sim.codegen.KERNEL_FLAGS
    fused_flags = tuple(f for f in flags if f != "-ffp-contract=off") + ("-ffp-contract=fast", "-mfma")
    digest = sim.codegen.source_hash(text)
    path = os.path.join(sim.cache_dir(), f"kernels-{digest}-fused.so")
    if not os.path.exists(path):
        src = os.path.join(sim.cache_dir(), f"kernels-{digest}-fused.cpp")
        with open(src, "w", encoding="utf-8") as f:
            f.write(sim.codegen.translation_unit(text, gl.parse_signatures(text)))
        sim._compile(src, path, fused_flags)
    fused = KernelLibrary(path, text)
    rng = np.random.default_rng(0)
    h0 = rng.standard_normal((16, 384)).astype(f32)
    y = rng.standard_normal((16, 384)).astype(f32)
    w = rng.standard_normal(384).astype(f32)
    outs = []
    for library in (KernelLibrary.default(), fused):
        h = h0.copy()
        sim.Executor(library, False, False, False).run(gl.residual_norm(h, y, w, 0.7, 1e-6))
        outs.append(h)
    differ = int(np.count_nonzero(outs[0] != outs[1]))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    assert differ > 0, "contraction changed nothing: this test no longer shows why --fmad=false is needed"
    print(f"contraction changes {differ} of {outs[0].size} dg_residual_norm outputs (within 1e-6)")
