"""Launch configuration of the GPU kernels, checked on the host (no GPU, no CuPy).

* the kernels' parameter lists are parsed from the CUDA sources and every argument is type-checked;
* each launch builder refuses operands of the wrong shape, dtype or layout, naming them;
* the attention plan and the MoE buffer bound hold for every size (hypothesis);
* ``fast.gpu.CupyDevice`` is driven through a fake ``cupy`` module whose RawKernel records grid, block,
  shared memory and arguments: NULL pointers, the shared-memory opt-in and the compile-at-load step.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusiongemma.fast import gpu
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.sim import SimDevice

f32, i64, i32, u8 = np.float32, np.int64, np.int32, np.uint8


def z(*shape, dtype=f32):
    return np.zeros(shape, dtype=dtype)


# ------------------------------------------------------------------------------------------------ signatures
def test_signatures_come_from_the_sources():
    sigs = gl.signatures()
    assert {"dg_rms_norm", "dg_attention", "dg_sample_rows", "dg_accept_renoise", "dg_grouped_gemm_nt"} <= set(sigs)
    att = {p.name: p for p in sigs["dg_attention"]}
    assert att["q"].dtype == np.float32 and att["q"].kind == "ptr" and att["q"].const
    assert att["window"].dtype == np.int64 and att["window"].kind == "scalar"
    assert att["cache_k_opt"].nullable and not att["q"].nullable
    assert [p.name for p in sigs["dg_softcap"]] == ["x", "n", "cap"]


def test_parse_rejects_types_it_cannot_pass():
    with pytest.raises(gl.LaunchError, match="half"):
        gl.parse_signatures('extern "C" __global__ void k(const half* x, int n) {}')
    parsed = gl.parse_signatures('extern "C" __global__ void __launch_bounds__(128) k(const float* __restrict__ a,'
                                 ' long long n, unsigned char* f_opt) {}')
    assert [(p.name, p.kind, str(p.dtype)) for p in parsed["k"]] == [
        ("a", "ptr", "float32"), ("n", "scalar", "int64"), ("f_opt", "ptr", "uint8")]


def test_constants_are_read_from_the_header():
    c = gl.constants()
    assert c["DG_GEMM_TM"] > 0 and c["DG_ATT_THREADS"] % 32 == 0 and c["DG_MAX_HEAD_DIM"] >= 512


# ------------------------------------------------------------------------------------------------ pack_args
def test_pack_args_types_and_errors():
    x, w, out = z(4, 8), z(8), z(4, 8)
    packed = gl.pack_args("dg_rms_norm", (x, w, 1.0, out, 4, 8, 1e-6, 0))
    assert type(packed[2]) is np.float32 and type(packed[4]) is np.int32 and packed[0] is x
    assert gl.pack_args("dg_rms_norm", (x, None, 1.0, out, 4, 8, 1e-6, 0))[1] is None
    with pytest.raises(gl.LaunchError, match="takes 8 arguments"):
        gl.pack_args("dg_rms_norm", (x, w))
    with pytest.raises(gl.LaunchError, match="x must be float32, got float64"):
        gl.pack_args("dg_rms_norm", (x.astype(np.float64), w, 1.0, out, 4, 8, 1e-6, 0))
    with pytest.raises(gl.LaunchError, match="C-contiguous"):
        gl.pack_args("dg_rms_norm", (z(8, 4).T, w, 1.0, out, 4, 8, 1e-6, 0))
    with pytest.raises(gl.LaunchError, match="out must not be NULL"):
        gl.pack_args("dg_rms_norm", (x, w, 1.0, None, 4, 8, 1e-6, 0))
    with pytest.raises(gl.LaunchError, match="does not fit"):
        gl.pack_args("dg_rms_norm", (x, w, 1.0, out, 2**31, 8, 1e-6, 0))
    with pytest.raises(gl.LaunchError, match="must be an integer"):
        gl.pack_args("dg_rms_norm", (x, w, 1.0, out, 4.5, 8, 1e-6, 0))
    with pytest.raises(gl.LaunchError, match="NaN"):
        gl.pack_args("dg_rms_norm", (x, w, float("nan"), out, 4, 8, 1e-6, 0))
    with pytest.raises(gl.LaunchError, match="no kernel"):
        gl.pack_args("dg_nothing", ())


# ------------------------------------------------------------------------------------------------ builders
def test_row_kernels_check_shapes():
    launch = gl.rms_norm(z(5, 300), z(300), z(5, 300), 1e-6)
    assert launch.grid == (5, 1, 1) and launch.block[0] % 32 == 0 and launch.block[0] <= 256
    with pytest.raises(gl.LaunchError, match=r"out has shape \(5, 299\)"):
        gl.rms_norm(z(5, 300), z(300), z(5, 299), 1e-6)
    with pytest.raises(gl.LaunchError, match="weight"):
        gl.residual_norm(z(5, 300), z(5, 300), z(30), 1.0, 1e-6)
    with pytest.raises(gl.LaunchError, match="odd width"):
        gl.gated_gelu(z(3, 7), z(3, 3))
    with pytest.raises(gl.LaunchError, match="ids"):
        gl.embed(z(2, 2, dtype=i64), z(10, 4), 2.0, None, True, z(2, 4), 1e-6)
    assert gl.embed(z(3, dtype=i64), z(10, 4), 2.0, None, True, z(3, 4), 1e-6).args[4] == 1


def test_qkv_heads_checks():
    B, S, nh, g, d = 2, 3, 4, 2, 16
    ok = dict(proj=z(B * S, (nh + 2 * g) * d), q_norm=z(d), k_norm=z(d), cos=z(S, d // 2), sin=z(S, d // 2),
              q_out=z(B, S, nh, d), k_out=z(B, g, S, d), v_out=z(B, g, S, d))
    launch = gl.qkv_heads(batch=B, S=S, n_heads=nh, n_kv=g, d=d, has_v=True, eps=1e-6, **ok)
    assert launch.grid == (B * S, nh + g, 1)
    with pytest.raises(gl.LaunchError, match="proj"):
        gl.qkv_heads(batch=B, S=S, n_heads=nh, n_kv=g, d=d, has_v=False, eps=1e-6, **ok)
    with pytest.raises(gl.LaunchError, match="head dim"):
        gl.qkv_heads(batch=B, S=S, n_heads=nh, n_kv=g, d=1024, has_v=True, eps=1e-6, **ok)
    with pytest.raises(gl.LaunchError, match="do not divide"):
        gl.qkv_heads(batch=B, S=S, n_heads=nh, n_kv=3, d=d, has_v=True, eps=1e-6, **ok)


def _attention_args(N=2, S=5, nh=4, g=2, d=16, slots=7, n_cache=4, n_new=5, P=9):
    return dict(q=z(N, S, nh, d), q_pos=z(S, dtype=i64), cache_k=z(N, g, slots, d), cache_v=z(N, g, slots, d),
                cache_rows=None, n_cache=n_cache, slot_pos=z(slots, dtype=i64), cache_real=z(N, P, dtype=u8),
                new_k=z(N, g, n_new, d), new_v=z(N, g, n_new, d), new_pos=z(n_new, dtype=i64),
                new_real=z(N, n_new, dtype=u8), window=8, causal=True, out=z(N, S, nh * d))


def test_attention_launch_and_checks():
    launch = gl.attention(**_attention_args())
    names = [p.name for p in gl.signatures()["dg_attention"]]
    args = dict(zip(names, launch.args))
    assert args["n_cache"] == 4 and args["slots"] == 7 and args["real_stride"] == 9 and args["n_new"] == 5
    assert args["causal"] == 1 and args["window"] == 8 and args["cache_rows_opt"] is None
    assert launch.grid == (-(-5 // int(args["q_block"])), 2, 2)
    assert launch.shared_mem == gl.attention_shared_bytes(int(args["q_block"]), 2, 16, int(args["key_tile"]))
    decoder = gl.attention(**{**_attention_args(), "n_cache": 0, "cache_k": None, "cache_v": None, "slot_pos": None,
                              "cache_real": None, "causal": False, "window": 0})
    assert dict(zip(names, decoder.args))["cache_k_opt"] is None
    with pytest.raises(gl.LaunchError, match="exceeds the 7 cache slots"):
        gl.attention(**{**_attention_args(), "n_cache": 8})
    with pytest.raises(gl.LaunchError, match=r"new_k has shape \(2, 2, 5, 32\)"):
        gl.attention(**{**_attention_args(), "new_k": z(2, 2, 5, 32), "new_v": z(2, 2, 5, 32)})
    with pytest.raises(gl.LaunchError, match="cache head dim 32"):
        gl.attention(**{**_attention_args(), "cache_k": z(2, 2, 7, 32), "cache_v": z(2, 2, 7, 32)})
    with pytest.raises(gl.LaunchError, match="cache rows"):
        gl.attention(**_attention_args(N=3) | {"cache_k": z(2, 2, 7, 16), "cache_v": z(2, 2, 7, 16),
                                               "cache_real": z(2, 9, dtype=u8)})
    with pytest.raises(gl.LaunchError, match="no keys"):
        gl.attention(**{**_attention_args(), "n_cache": 0, "new_k": None})
    with pytest.raises(gl.LaunchError, match="rows of a block"):
        gl.attention(**_attention_args(nh=64, g=2))


@settings(max_examples=150, deadline=None)
@given(S=st.integers(1, 600), r=st.sampled_from([1, 2, 4, 8, 16]), half=st.integers(1, 256))
def test_attention_plan_invariants(S, r, half):
    d = 2 * half
    q_block, key_tile, smem = gl.attention_plan(S, r, d)
    rows_cap = (gl.const("DG_ATT_THREADS") // 32) * gl.const("DG_ATT_ROWS_PER_WARP")
    assert 1 <= q_block <= S and q_block * r <= rows_cap
    assert key_tile in (1, 2, 4, 8, 16, 32) and d % (32 // key_tile) == 0
    assert smem == gl.attention_shared_bytes(q_block, r, d, key_tile) <= gl.ATTENTION_SHARED_BUDGET


def test_attention_plan_for_the_26b_layers():
    # sliding: d 256, 16 query heads over 8 KV heads; full: d 512 over 2 KV heads (SPEC §1)
    assert gl.attention_plan(256, 2, 256)[1] == 32
    q_block, key_tile, smem = gl.attention_plan(256, 8, 512)
    assert key_tile >= 8 and smem <= gl.ATTENTION_SHARED_BUDGET and smem > gl.DEFAULT_SHARED_LIMIT


SIM = SimDevice()


@settings(max_examples=40, deadline=None)
@given(N=st.integers(1, 70), E=st.integers(1, 20), data=st.data())
def test_moe_buffers_hold_any_routing(N, E, data):
    K = data.draw(st.integers(1, min(E, 8)))
    rng = np.random.default_rng(N * 31 + E)
    skew = data.draw(st.booleans())
    indices = np.stack([rng.permutation(E)[:K] if not skew else np.arange(K) for _ in range(N)]).astype(i64)
    tiles, rows = gl.moe_rows(N, K, E)
    offsets, row_token = z(E + 1, dtype=i32), z(rows, dtype=i32)
    choice_row, tile_expert = z(N, K, dtype=i32), z(tiles, dtype=i32)
    launch = gl.group_experts(indices, E, offsets, row_token, choice_row, tile_expert)
    assert launch.grid == (1, 1, 1)
    SIM.launch(launch)  # the real kernel, on the CPU executor with its checks
    tm = gl.const("DG_GEMM_TM")
    assert offsets[-1] <= rows and (offsets % tm == 0).all()
    assert sorted(row_token[row_token >= 0].tolist()) == sorted(np.repeat(np.arange(N), K).tolist())
    assert (row_token[choice_row.reshape(-1)] == np.repeat(np.arange(N), K)).all()


def test_moe_and_sampling_builders_check_shapes():
    with pytest.raises(gl.LaunchError, match="top_k"):
        gl.router(z(4, 3), z(3), z(4, 4, dtype=i64), z(4, 4))
    with pytest.raises(gl.LaunchError, match="x has shape"):
        gl.grouped_gemm_nt(z(10, 8), z(3, 6, 8), z(2, dtype=i32), z(32, 6))
    launch = gl.grouped_gemm_nt(z(32, 8), z(3, 70, 8), z(2, dtype=i32), z(32, 70))
    assert launch.grid == (2, 2, 1) and launch.block == (gl.const("DG_GEMM_THREADS"), 1, 1)
    with pytest.raises(gl.LaunchError, match="exceeds 32"):
        gl.combine_experts(z(8, 4), z(2, 33, dtype=i64), z(2, 33, dtype=i32), z(2, 33), z(2, 4))
    R, V = 6, 3000
    launch = gl.sample_rows(z(10, V), z(R, dtype=i32), 30.0, 0.8, z(R, dtype=np.float64), z(R, dtype=i64), z(R),
                            z(R, dtype=i64), z(R, dtype=i32))
    assert launch.grid == (R, 1, 1) and launch.shared_mem == 8 * 3
    with pytest.raises(gl.LaunchError, match="uniforms_opt must be float64"):
        gl.sample_rows(z(10, V), z(R, dtype=i32), 30.0, 0.8, z(R), z(R, dtype=i64), z(R), z(R, dtype=i64),
                       z(R, dtype=i32))
    with pytest.raises(gl.LaunchError, match=">= 0"):
        gl.sample_rows(z(10, V), z(R, dtype=i32), -1.0, 0.8, None, z(R, dtype=i64), z(R), z(R, dtype=i64),
                       z(R, dtype=i32))
    assert gl.accept_renoise(z(2, 256), z(2, 256, dtype=i64), z(2, 256, dtype=i64), 0.1, z(2, 256, dtype=u8),
                             z(2, 256, dtype=i64)).shared_mem == 9 * 256
    with pytest.raises(gl.LaunchError, match="canvas length"):
        gl.accept_renoise(z(1, 6000), z(1, 6000, dtype=i64), z(1, 6000, dtype=i64), 0.1, z(1, 6000, dtype=u8),
                          z(1, 6000, dtype=i64))


# ------------------------------------------------------------------------------------------------ CupyDevice, mocked
class FakeRawKernel:
    """Stands in for cupy.RawKernel: records every launch."""

    calls: list = []
    compiled: list = []

    def __init__(self, code, name, options=()):
        self.code, self.name, self.options = code, name, options
        self.max_dynamic_shared_size_bytes = 0
        self.shared_size_bytes = 288 if name == "dg_sample_rows" else 0  # static shared memory (ptxas)
        self.max_threads_per_block = 1024

    def compile(self):
        FakeRawKernel.compiled.append(self.name)

    def __call__(self, grid, block, args, shared_mem=0):
        FakeRawKernel.calls.append(dict(name=self.name, grid=grid, block=block, args=args, shared_mem=shared_mem,
                                        opt_in=self.max_dynamic_shared_size_bytes))


def fake_cupy(device_count=1):
    runtime = types.SimpleNamespace(getDeviceCount=lambda: device_count)

    class Device:
        compute_capability = "86"
        attributes = {"MaxSharedMemoryPerBlockOptin": 101376}

        def __init__(self, index):
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    module = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=Device), RawKernel=FakeRawKernel,
                                   asarray=np.asarray, asnumpy=np.asarray)
    return module


def test_cupy_device_launches_through_raw_kernels(monkeypatch):
    FakeRawKernel.calls.clear()
    FakeRawKernel.compiled.clear()
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    dev = gpu.CupyDevice("cuda:0")
    assert set(FakeRawKernel.compiled) == set(gl.signatures())  # everything compiled at load
    x = z(3, 64)
    dev.launch(gl.rms_norm(x, None, x, 1e-6))
    call = FakeRawKernel.calls[-1]
    assert call["name"] == "dg_rms_norm" and call["grid"] == (3, 1, 1) and call["block"] == (64, 1, 1)
    assert type(call["args"][1]) is np.uint64 and call["args"][1] == 0  # NULL, not None
    assert call["args"][0] is x and type(call["args"][5]) is np.int32
    big = gl.attention(**_attention_args(nh=16, g=2, d=512, S=4, n_new=4, slots=8))
    assert big.needs_shared_opt_in
    dev.launch(big)
    call = FakeRawKernel.calls[-1]
    assert call["shared_mem"] == big.shared_mem and call["opt_in"] == big.shared_mem
    assert FakeRawKernel.calls[-1]["name"] == "dg_attention"
    # the kernels are compiled in the one documented mode: no fused multiply-add contraction
    assert all(k.options == ("--std=c++14", "--fmad=false") for k in dev._kernels.values())
    # static + dynamic shared memory over 48 KiB needs the opt-in, even with dynamic alone under it
    V = (48 * 1024 - 200) // 8 * gl.const("DG_SAMPLE_CHUNK")
    R = 1
    i32, i64 = np.int32, np.int64
    sample = gl.Launch("dg_sample_rows", (1, 1, 1), (256, 1, 1),
                       gl.pack_args("dg_sample_rows", (z(1, 8), z(R, dtype=i32), R, V, 0.0, 0.0, None, z(R, dtype=i64),
                                                       z(R), z(R, dtype=i64), z(R, dtype=i32))), 48 * 1024 - 200)
    assert not sample.needs_shared_opt_in
    dev.launch(sample)
    assert FakeRawKernel.calls[-1]["opt_in"] == 48 * 1024 - 200
    # over the device's opt-in maximum: refused before the driver sees it, with cuda-sim's text
    huge = gl.Launch("dg_sample_rows", (1, 1, 1), (256, 1, 1), sample.args, 101376)
    n_calls = len(FakeRawKernel.calls)
    with pytest.raises(gl.LaunchRefused, match="288 bytes of static and 101376 bytes of dynamic shared memory exceed "
                                               "the 101376 bytes a block may use on sm_86"):
        dev.launch(huge)
    assert len(FakeRawKernel.calls) == n_calls


def test_cupy_device_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(device_count=1))
    with pytest.raises(RuntimeError, match="asked for GPU 3"):
        gpu.CupyDevice("cuda:3")
    with pytest.raises(ValueError, match="cuda"):
        gpu.CupyDevice("tpu")

    def no_driver():
        raise OSError("CUDA driver version is insufficient")

    broken = fake_cupy()
    broken.cuda.runtime.getDeviceCount = no_driver
    monkeypatch.setitem(sys.modules, "cupy", broken)
    with pytest.raises(RuntimeError, match="no usable CUDA GPU.*insufficient"):
        gpu.CupyDevice("cuda")
