"""Compile the CUDA kernel sources of the GPU fast path, without a GPU: nvcc, or NVRTC as a fallback.

The kernels in ``fast/gpu/cuda/*.cu`` are compiled at run time by CuPy (``RawModule``, i.e. NVRTC) on the
GPU machine. This module lets a machine with no GPU check them ahead of time:

* ``assemble(path)`` produces the exact single translation unit that ``fast.gpu`` hands to CuPy
  (``#include "x.cuh"`` lines inlined, each header once), so the check and the run compile the same text;
* ``compile_source(text, arch)`` compiles it for a real architecture (``sm_80``, ``sm_90``) to a cubin with
  ptxas in verbose mode, using ``nvcc`` when one is found and otherwise NVRTC (``libnvrtc`` from the CUDA
  toolkit or from the ``nvidia-cuda-nvrtc`` pip package), and parses what ptxas reports per kernel:
  registers, spill stores/loads, stack frame, static shared memory;
* ``check_all()`` does that for every source and architecture; ``python -m diffusiongemma.fast.gpu.build``
  prints the table.

Nothing here imports CuPy, and nothing needs a GPU or a driver: NVRTC is a plain shared library (the test
extra installs it as the ``nvidia-cuda-nvrtc-cu12`` wheel on Linux x86_64 and aarch64), loaded with ctypes, so
the compile checks run on a machine without the CUDA toolkit. Errors: ``CompilerNotFound`` when neither
compiler can be found (callers decide whether that is a failure; the tests treat it as one where the test
extra installs the NVRTC wheel, unless ``DIFFUSIONGEMMA_SKIP_CUDA_COMPILE=1``, and skip with the reason printed
elsewhere), ``CompileError`` (a ``RuntimeError``) carrying the compiler's log when a source does not compile.
Environment: ``DIFFUSIONGEMMA_NVCC`` (path of nvcc; ``none`` hides every nvcc, as on a machine without the
toolkit: ``.ci/run`` sets it), ``DIFFUSIONGEMMA_NVRTC`` (path of libnvrtc.so), ``CUDA_HOME`` / ``CUDA_PATH``.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
DEFAULT_ARCHS = ("sm_80", "sm_90")
#: The one compile mode of the kernels, for the run (``CupyDevice``: NVRTC through CuPy) and for the compile
#: checks here (nvcc and NVRTC alike). ``--fmad=false``: no contraction of a * b + c into a fused multiply-add,
#: so every float32 operation is the separately rounded one the kernels' comments and the reference's order
#: describe, as in cuda-sim (g++ -ffp-contract=off: fast/gpu/sim/codegen.py KERNEL_FLAGS). What may still differ
#: between a GPU and cuda-sim is stated in tests/test_gpu_limits.py: the last bits of expf / tanhf / powf / exp /
#: log (CUDA's libdevice against glibc, within 2 ulp) and what is computed from them; sums, products,
#: divisions, comparisons and the sampler's ids follow the same IEEE operations.
FMAD_OPTION = "--fmad=false"
NVRTC_OPTIONS = ("--std=c++14", FMAD_OPTION)
NVCC_OPTIONS = ("-std=c++14", FMAD_OPTION)
SKIP_ENV = "DIFFUSIONGEMMA_SKIP_CUDA_COMPILE"
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_ARCH = re.compile(r"^sm_[0-9]{2,3}a?$")


class CompileError(RuntimeError):
    """A CUDA source failed to compile; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message + (f"\n{log}" if log else ""))
        self.log = log


class CompilerNotFound(RuntimeError):
    """Neither nvcc nor an NVRTC library could be found."""


@dataclass
class KernelReport:
    """What ptxas reported for one kernel (entry function) on one architecture."""

    name: str  # the kernel's (extern "C") name
    registers: int = -1  # registers per thread (-1: not reported)
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack_frame: int = 0  # bytes
    shared_memory: int = 0  # static shared memory, bytes

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass
class CompileResult:
    """One source compiled for one architecture."""

    source: str  # file name (or "<text>")
    arch: str  # e.g. "sm_90"
    compiler: str  # "nvcc" or "nvrtc"
    log: str  # the compiler's complete output
    kernels: dict = field(default_factory=dict)  # kernel name -> KernelReport (empty if ptxas said nothing)


# ------------------------------------------------------------------------------------------------ sources
def kernel_sources(directory: str = CUDA_DIR) -> list[str]:
    """Paths of the ``*.cu`` files (sorted). Headers (``*.cuh``) are pulled in by ``assemble``."""
    return sorted(glob.glob(os.path.join(directory, "*.cu")))


def assemble(path: str, _seen: set | None = None) -> str:
    """The source of ``path`` with every ``#include "name"`` replaced by that file's text (recursively,
    each file once, resolved relative to the including file). System includes (``<...>``) are left alone
    (the kernels use none: NVRTC has no system headers). Raises ``FileNotFoundError`` for a missing header.
    """
    seen = set() if _seen is None else _seen

    def expand(file: str) -> str:
        file = os.path.abspath(file)
        if file in seen:
            return ""
        seen.add(file)
        with open(file, encoding="utf-8") as f:
            text = f.read()
        text = re.sub(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", "", text, flags=re.MULTILINE)

        def include(match: re.Match) -> str:
            target = os.path.join(os.path.dirname(file), match.group(1))
            if not os.path.isfile(target):
                raise FileNotFoundError(f"{file}: included file {match.group(1)!r} not found")
            return f"// ---- {match.group(1)}\n{expand(target)}"

        return _INCLUDE.sub(include, text)

    return expand(path)


def assemble_all(directory: str = CUDA_DIR) -> str:
    """Every kernel source of ``directory`` as one translation unit, each header once (what ``fast.gpu``
    hands to CuPy)."""
    seen: set = set()
    return "\n".join(f"// ==== {os.path.basename(p)}\n{assemble(p, seen)}" for p in kernel_sources(directory))


# ------------------------------------------------------------------------------------------------ compilers
def find_nvcc() -> str | None:
    """Path of nvcc: ``$DIFFUSIONGEMMA_NVCC`` (``none``: no nvcc at all), then ``PATH``, then ``$CUDA_HOME/bin``,
    ``/usr/local/cuda/bin``; None when there is none."""
    explicit = os.environ.get("DIFFUSIONGEMMA_NVCC")
    if explicit:
        if explicit.lower() == "none":
            return None
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def nvrtc_candidates() -> list[str]:
    """Files that may be libnvrtc: ``$DIFFUSIONGEMMA_NVRTC``, the ``nvidia-cuda-nvrtc`` pip packages
    (``nvidia/cuda_nvrtc/lib`` for CUDA 12, ``nvidia/cu13/lib`` for CUDA 13) on ``sys.path``, the CUDA
    toolkit's lib64, and the system loader's ``libnvrtc.so``."""
    out = []
    explicit = os.environ.get("DIFFUSIONGEMMA_NVRTC")
    if explicit:
        out.append(explicit)
    for entry in sys.path:
        for pattern in ("nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/cu1*/lib/libnvrtc.so*",
                        "nvidia/*/lib/libnvrtc.so*"):
            out.extend(sorted(glob.glob(os.path.join(entry, pattern))))
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            out.extend(sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*"))))
    out.append("libnvrtc.so")
    # drop the builtins helper library and duplicates, keep order
    seen, result = set(), []
    for path in out:
        if "builtins" in os.path.basename(path) or path in seen:
            continue
        seen.add(path)
        result.append(path)
    return result


def load_nvrtc() -> ctypes.CDLL | None:
    """The first loadable NVRTC library among ``nvrtc_candidates()``, or None."""
    for path in nvrtc_candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.nvrtcVersion  # noqa: B018 (attribute check: a real NVRTC)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def available_compilers() -> list[str]:
    """Which of "nvcc", "nvrtc" can be used here (in preference order)."""
    found = []
    if find_nvcc():
        found.append("nvcc")
    if load_nvrtc() is not None:
        found.append("nvrtc")
    return found


def _check_arch(arch: str) -> None:
    if not _ARCH.match(arch):
        raise ValueError(f"architecture must look like 'sm_80' or 'sm_90a', got {arch!r}")


def compile_with_nvcc(text: str, arch: str, nvcc: str | None = None, name: str = "<text>",
                      extra_options: tuple = ()) -> CompileResult:
    """Compile ``text`` to a cubin for ``arch`` with ``nvcc -cubin -Xptxas -v``; raise ``CompileError``."""
    _check_arch(arch)
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CompilerNotFound("nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, $DIFFUSIONGEMMA_NVCC)")
    with tempfile.TemporaryDirectory(prefix="dg_nvcc_") as tmp:
        src = os.path.join(tmp, "kernels.cu")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", os.path.join(tmp, "kernels.cubin"),
               *NVCC_OPTIONS, *extra_options, src]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed on {name} for {arch} (exit {proc.returncode})", log)
    return CompileResult(name, arch, "nvcc", log, parse_ptxas_report(log))


def compile_with_nvrtc(text: str, arch: str, lib: ctypes.CDLL | None = None, name: str = "<text>",
                       extra_options: tuple = ()) -> CompileResult:
    """Compile ``text`` to a cubin for ``arch`` with NVRTC (``--gpu-architecture=sm_XX``, ptxas verbose when
    this NVRTC accepts ``--ptxas-options=-v``); raise ``CompileError`` with the program log."""
    _check_arch(arch)
    lib = _nvrtc_library(lib)
    base = [f"--gpu-architecture={arch}", *NVRTC_OPTIONS, *extra_options]
    log, status = _nvrtc_run(lib, text, name, base + ["--ptxas-options=-v"])
    if status != 0 and "ptxas-options" in log:  # an NVRTC that does not know the option: compile without it
        log, status = _nvrtc_run(lib, text, name, base)
    if status != 0:
        reason = lib.nvrtcGetErrorString(status).decode(errors="replace")
        raise CompileError(f"NVRTC failed on {name} for {arch} ({reason})", log)
    return CompileResult(name, arch, "nvrtc", log, parse_ptxas_report(log))


def _nvrtc_library(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    """``lib``, else the NVRTC library found here (``load_nvrtc``); ``CompilerNotFound`` when there is none."""
    lib = lib or load_nvrtc()
    if lib is None:
        raise CompilerNotFound("no NVRTC library was found (pip install nvidia-cuda-nvrtc-cu12, or set "
                               "DIFFUSIONGEMMA_NVRTC to the path of libnvrtc.so)")
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _nvrtc_run(lib: ctypes.CDLL, text: str, name: str, options: list[str]) -> tuple[str, int]:
    """nvrtcCreateProgram + nvrtcCompileProgram; returns (program log, status of the compile call)."""
    with _nvrtc_program(lib, text, name, options) as (_, status, log):
        return log, status


@contextlib.contextmanager
def _nvrtc_program(lib: ctypes.CDLL, text: str, name: str, options: list[str]):
    """The program NVRTC compiles from ``text`` under ``options``, destroyed on exit: yields (program, status
    of the compile call, program log); a program NVRTC could not create yields (None, its status, a line
    saying so)."""
    prog = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), os.path.basename(name).encode() or b"k.cu",
                                    0, None, None)
    if status != 0:
        yield None, status, f"nvrtcCreateProgram failed with status {status}"
        return
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(max(size.value, 1))
        lib.nvrtcGetProgramLog(prog, buf)
        yield prog, status, buf.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_ptx(text: str, arch: str = "sm_80", options: tuple = NVRTC_OPTIONS, lib: ctypes.CDLL | None = None,
              name: str = "<text>") -> str:
    """The PTX NVRTC makes of ``text`` for the virtual architecture of ``arch`` (``sm_80`` -> ``compute_80``)
    under ``options`` (default: the run's, ``NVRTC_OPTIONS``). Lets a machine without nvcc read the
    instructions a compile mode produces (tests/test_gpu_compile.py: no fused multiply-add under
    ``--fmad=false``). Raises ``CompilerNotFound`` / ``CompileError`` as ``compile_with_nvrtc``."""
    _check_arch(arch)
    lib = _nvrtc_library(lib)
    flags = [f"--gpu-architecture=compute_{arch[3:].rstrip('a')}", *options]
    with _nvrtc_program(lib, text, name, flags) as (prog, status, log):
        if prog is None:
            raise CompileError(f"NVRTC could not create a program for {name} (status {status})")
        if status != 0:
            reason = lib.nvrtcGetErrorString(status).decode(errors="replace")
            raise CompileError(f"NVRTC failed on {name} for {arch} ({reason})", log)
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(max(size.value, 1))
        lib.nvrtcGetPTX(prog, buf)
        return buf.value.decode(errors="replace")


def compile_source(text: str, arch: str, compiler: str | None = None, name: str = "<text>") -> CompileResult:
    """Compile with ``compiler`` ("nvcc" / "nvrtc"), or the first available one. Raises ``CompilerNotFound``
    when none is available and ``CompileError`` when the source does not compile."""
    _check_arch(arch)
    choice = compiler or next(iter(available_compilers()), None)
    if choice == "nvcc":
        return compile_with_nvcc(text, arch, name=name)
    if choice == "nvrtc":
        return compile_with_nvrtc(text, arch, name=name)
    if choice is None:
        raise CompilerNotFound("no CUDA compiler here: install the CUDA toolkit (nvcc) or the "
                               "nvidia-cuda-nvrtc pip package")
    raise ValueError(f"compiler must be 'nvcc' or 'nvrtc', got {compiler!r}")


# ------------------------------------------------------------------------------------------------ ptxas report
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> dict[str, KernelReport]:
    """Per-kernel facts from ptxas ``-v`` output (nvcc's stderr or NVRTC's log).

    Recognised lines: ``Compiling entry function 'K' for 'sm_XX'``, ``Function properties for K`` followed
    by ``N bytes stack frame, N bytes spill stores, N bytes spill loads``, and ``Used N registers, ...
    N bytes smem``. Device functions that are not entries are ignored.
    """
    kernels: dict[str, KernelReport] = {}
    current = None  # the entry the next "Used ..." line belongs to
    props = None  # the function the next stack-frame line belongs to
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = kernels.setdefault(m.group(1), KernelReport(m.group(1)))
            continue
        m = _PROPS.search(line)
        if m:
            props = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and props is not None:
            if props in kernels:
                k = kernels[props]
                k.stack_frame, k.spill_stores, k.spill_loads = (int(g) for g in m.groups())
            elif current is not None and props == current.name:
                current.stack_frame, current.spill_stores, current.spill_loads = (int(g) for g in m.groups())
            props = None
            continue
        m = _USED.search(line)
        if m and current is not None:
            current.registers = int(m.group(1))
            current.shared_memory = int(m.group(2) or 0)
    return kernels


# ------------------------------------------------------------------------------------------------ whole check
def check_all(archs: tuple = DEFAULT_ARCHS, compiler: str | None = None,
              directory: str = CUDA_DIR) -> list[CompileResult]:
    """Compile every ``*.cu`` of ``directory`` for every architecture; raise on the first failure."""
    results = []
    for path in kernel_sources(directory):
        text = assemble(path)
        for arch in archs:
            results.append(compile_source(text, arch, compiler=compiler, name=os.path.basename(path)))
    return results


def format_table(results: list[CompileResult]) -> str:
    """One line per (source, arch, kernel): registers, spills, stack, static shared memory."""
    lines = [f"{'source':<14}{'arch':<7}{'compiler':<9}{'kernel':<22}{'regs':>5}{'spill st':>9}{'spill ld':>9}"
             f"{'stack':>6}{'smem':>7}"]
    for res in results:
        for k in sorted(res.kernels.values(), key=lambda k: k.name):
            lines.append(f"{res.source:<14}{res.arch:<7}{res.compiler:<9}{k.name:<22}{k.registers:>5}"
                         f"{k.spill_stores:>9}{k.spill_loads:>9}{k.stack_frame:>6}{k.shared_memory:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Compile the GPU kernels for the given architectures "
                                                 "and report registers and spills (no GPU needed).")
    parser.add_argument("--arch", action="append", help="architecture (repeatable), default sm_80 and sm_90")
    parser.add_argument("--compiler", choices=("nvcc", "nvrtc"), help="default: nvcc if found, else NVRTC")
    args = parser.parse_args(argv)
    try:
        results = check_all(tuple(args.arch or DEFAULT_ARCHS), args.compiler)
    except (CompileError, CompilerNotFound) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(format_table(results))
    spilling = [(r.source, r.arch, k.name) for r in results for k in r.kernels.values() if k.spills]
    if spilling:
        print(f"register spills in: {spilling}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
