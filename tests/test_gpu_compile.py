"""The GPU kernels compile for sm_80 and sm_90 without a GPU, with no register spills.

Uses nvcc when it is found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin), else NVRTC: the CUDA toolkit's
libnvrtc or the one of the ``nvidia-cuda-nvrtc-cu12`` wheel that the test extra installs on Linux x86_64 and
aarch64, so ``pip install -e ".[test]" && pytest`` compiles the kernels on a machine with no CUDA toolkit, no
driver and no GPU (``.ci/run`` hides nvcc to prove it). Where the test extra installs that wheel and still no
compiler loads, the compile tests FAIL (a broken install must not pass silently); on other platforms they
skip with the reason printed. DIFFUSIONGEMMA_SKIP_CUDA_COMPILE=1 skips them on purpose.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest

from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl

ARCHS = ("sm_80", "sm_90")
# kernels that run once per layer or per step on big operands: a spill there costs real time
HOT_KERNELS = ("dg_attention", "dg_attention_bf16", "dg_grouped_gemm_nt", "dg_sample_rows", "dg_qkv_heads",
               "dg_rms_norm", "dg_ffn_tail", "dg_gated_gelu", "dg_router", "dg_combine_experts")
#: the NVRTC wheel of the test extra (setup.py) and where it has wheels
NVRTC_WHEEL = "nvidia-cuda-nvrtc-cu12"


def _test_extra_installs_nvrtc() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


def _compiler_or_skip() -> str:
    found = cb.available_compilers()
    if found:
        return found[0]
    if os.environ.get(cb.SKIP_ENV) == "1":
        reason = f"no CUDA compiler (neither nvcc nor libnvrtc); {cb.SKIP_ENV}=1"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    if _test_extra_installs_nvrtc():
        pytest.fail(f"no CUDA compiler: neither nvcc nor libnvrtc loads, though the test extra installs "
                    f"{NVRTC_WHEEL} here (pip install -e \".[test]\"). Set {cb.SKIP_ENV}=1 to skip the CUDA "
                    f"compile checks on purpose.")
    reason = (f"no CUDA compiler: neither nvcc nor libnvrtc, and {NVRTC_WHEEL} has no wheel for "
              f"{sys.platform}/{platform.machine()}")
    print(f"skipping: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request) -> cb.CompileResult:
    compiler = _compiler_or_skip()
    return cb.compile_source(cb.assemble_all(), request.param, compiler=compiler, name="all kernels")


@pytest.mark.slow
def test_every_kernel_compiles_and_is_reported(compiled):
    declared = set(gl.signatures())
    assert declared, "no kernels parsed from fast/cuda"
    missing = declared - set(compiled.kernels)
    assert not missing, f"ptxas reported nothing for {sorted(missing)} on {compiled.arch}:\n{compiled.log}"
    for name in declared:
        assert compiled.kernels[name].registers > 0, f"{name}: no register count in the ptxas report"


def test_no_register_spills(compiled):
    spilling = {k.name: (k.spill_stores, k.spill_loads) for k in compiled.kernels.values() if k.spills}
    hot = {name: v for name, v in spilling.items() if name in HOT_KERNELS}
    assert not hot, f"register spills on {compiled.arch} (bytes stored, loaded): {hot}\n" + cb.format_table([compiled])
    assert set(HOT_KERNELS) <= set(compiled.kernels)


def test_static_shared_memory_fits_without_opt_in(compiled):
    for k in compiled.kernels.values():
        assert k.shared_memory <= gl.DEFAULT_SHARED_LIMIT, (k.name, k.shared_memory)


@pytest.mark.slow
def test_each_source_compiles_on_its_own():
    from concurrent.futures import ThreadPoolExecutor

    compiler = _compiler_or_skip()
    paths = cb.kernel_sources()
    with ThreadPoolExecutor(max_workers=2) as pool:  # each compile is a separate nvcc process
        results = list(pool.map(lambda p: cb.compile_source(cb.assemble(p), "sm_90", compiler=compiler,
                                                            name=os.path.basename(p)), paths))
    for path, result in zip(paths, results):
        assert result.kernels, f"{path}: no kernel reported"


def test_a_broken_kernel_is_reported_as_a_failure():
    compiler = _compiler_or_skip()
    text = cb.assemble(os.path.join(cb.CUDA_DIR, "attention.cu"))
    broken = text.replace("const float m_new = fmaxf(m[ri], tile_max);", "const float m_new = fmaxf(m[ri] tile_max);")
    assert broken != text, "the mutation did not apply: update this test with the kernel"
    with pytest.raises(cb.CompileError) as info:
        cb.compile_source(broken, "sm_80", compiler=compiler, name="broken.cu")
    assert "error" in info.value.log.lower()
    with pytest.raises(cb.CompileError):  # a kernel using an undefined name
        cb.compile_source('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }', "sm_90",
                          compiler=compiler)


def test_nvrtc_fallback_compiles_the_kernels():
    """The NVRTC path (used when nvcc is absent), also where nvcc is present. Fails where the test extra
    installs the NVRTC wheel and no libnvrtc loads; skips with the reason printed elsewhere."""
    if cb.load_nvrtc() is None:
        if _test_extra_installs_nvrtc() and os.environ.get(cb.SKIP_ENV) != "1":
            pytest.fail(f"no libnvrtc loads, though the test extra installs {NVRTC_WHEEL} here")
        reason = f"no libnvrtc here (pip install {NVRTC_WHEEL}, or set DIFFUSIONGEMMA_NVRTC)"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    result = cb.compile_source(cb.assemble_all(), "sm_80", compiler="nvrtc", name="all kernels")
    missing = set(gl.signatures()) - set(result.kernels)
    assert not missing, f"NVRTC compiled, but its ptxas report names no {sorted(missing)}:\n{result.log}"
    with pytest.raises(cb.CompileError):
        cb.compile_source("extern \"C\" __global__ void k(float* x) { x[0] = ; }", "sm_80", compiler="nvrtc")


def test_nvrtc_with_the_options_emits_no_contracted_multiply_add():
    """The compile mode's check that needs no nvcc (tests/test_gpu_limits.py has the nvcc one): a*b + c becomes
    mul + add under the project's NVRTC options, fma without --fmad=false."""
    if cb.load_nvrtc() is None:
        if _test_extra_installs_nvrtc() and os.environ.get(cb.SKIP_ENV) != "1":
            pytest.fail(f"no libnvrtc loads, though the test extra installs {NVRTC_WHEEL} here")
        print("skipping: no libnvrtc here")
        pytest.skip("no libnvrtc here")
    src = 'extern "C" __global__ void k(const float* a, float* o) { o[0] = a[0] * a[1] + a[2]; }\n'
    project = cb.nvrtc_ptx(src, "sm_80")
    default = cb.nvrtc_ptx(src, "sm_80", options=("--std=c++14",))
    assert re.search(r"\bfma\.rn\.f32", default), default
    assert not re.search(r"\bfma\.rn\.f32", project) and re.search(r"\bmul\.rn\.f32", project), project
    with pytest.raises(cb.CompileError):
        cb.nvrtc_ptx('extern "C" __global__ void k(float* x) { x[0] = ; }')


def _without_a_toolkit() -> dict:
    """The environment of a machine without the CUDA toolkit: no nvcc on PATH (every folder holding one is
    dropped), no CUDA_HOME / CUDA_PATH, and DIFFUSIONGEMMA_NVCC=none for the toolkit's fixed place."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "DIFFUSIONGEMMA_NVRTC")}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not os.path.exists(os.path.join(d, "nvcc")))
    env["DIFFUSIONGEMMA_NVCC"] = "none"
    return env


def test_the_kernels_compile_without_a_cuda_toolkit():
    """What `pip install -e ".[test]" && pytest` meets on a machine with no nvcc: NVRTC from the test extra's
    wheel (loaded with ctypes; no driver, no GPU) compiles every kernel with the ptxas report the checks read."""
    if not _test_extra_installs_nvrtc():
        reason = f"the test extra installs no NVRTC wheel on {sys.platform}/{platform.machine()}"
        print(f"skipping: {reason}")
        pytest.skip(reason)
    script = (
        "import os\n"
        "from diffusiongemma.fast.gpu import build as cb, launch as gl\n"
        "assert cb.find_nvcc() is None, cb.find_nvcc()\n"
        "print('compilers', cb.available_compilers())\n"
        "r = cb.compile_source(cb.assemble_all(), 'sm_90', name='all kernels')\n"
        "print('kernels', len(r.kernels), 'missing', sorted(set(gl.signatures()) - set(r.kernels)))\n"
        "print('lib', cb.load_nvrtc()._name)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=_without_a_toolkit(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "compilers ['nvrtc']" in out.stdout, out.stdout
    assert "missing []" in out.stdout, out.stdout
    lib = out.stdout.split("lib ", 1)[1].strip()
    assert os.path.join("nvidia", "cuda_nvrtc", "lib") in lib, f"libnvrtc came from {lib}, not {NVRTC_WHEEL}"


def test_nvcc_none_hides_every_nvcc(monkeypatch, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.delenv("DIFFUSIONGEMMA_NVCC", raising=False)
    assert cb.find_nvcc() == str(fake)
    monkeypatch.setenv("DIFFUSIONGEMMA_NVCC", "none")
    assert cb.find_nvcc() is None


def test_missing_compilers_are_reported(monkeypatch):
    monkeypatch.setattr(cb, "find_nvcc", lambda: None)
    monkeypatch.setattr(cb, "load_nvrtc", lambda: None)
    assert cb.available_compilers() == []
    with pytest.raises(cb.CompilerNotFound):
        cb.compile_source("", "sm_80")
    with pytest.raises(ValueError):
        cb.compile_source("", "80")


def test_ptxas_report_parsing_finds_spills():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dg_a' for 'sm_80'
ptxas info    : Function properties for dg_a
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 2176 bytes smem, 444 bytes cmem[0]
ptxas info    : Function properties for helper
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'dg_b' for 'sm_80'
ptxas info    : Function properties for dg_b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 372 bytes cmem[0]
"""
    report = cb.parse_ptxas_report(log)
    assert set(report) == {"dg_a", "dg_b"}
    a, b = report["dg_a"], report["dg_b"]
    assert (a.registers, a.spill_stores, a.spill_loads, a.stack_frame, a.shared_memory) == (255, 12, 16, 8, 2176)
    assert a.spills and not b.spills and b.registers == 32


def test_assemble_inlines_each_header_once():
    text = cb.assemble_all()
    assert "#include" not in text
    assert len(re.findall(r"#define DG_MAX_HEAD_DIM", text)) == 1
    for name in gl.signatures():
        assert f" {name}(" in text or f"\n{name}(" in text
