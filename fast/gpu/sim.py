"""The simulated GPU ("cuda-sim"): the project's CUDA kernels executed on the CPU, with memory, race,
divergence and schedule checks.

The kernel sources of ``fast/gpu/cuda/*.cu`` are compiled unchanged by the host C++ compiler together with
``sim/cuda_sim.h`` (CUDA's execution model: thread and block indices, shared memory, barriers, warp
shuffles, atomics, float32 built-ins), into a library whose memory accesses are all reported to the executor
``sim/runtime.cpp`` (threads of a block as cooperative fibers; see its header comment for the design).
Both are built by ``pip install -e .`` (the ``_sim_runtime`` and ``_sim_kernels`` extensions); when a
kernel source changed after the build, or for a test's mutated copy of a kernel, the library is compiled
at run time with ``g++`` into a cache folder (``$DIFFUSIONGEMMA_SIM_CACHE``, default
``~/.cache/diffusiongemma/cuda-sim``).

* ``KernelLibrary`` — one compiled kernel source: its trampolines and shared-memory layout.
* ``Executor.run(launch)`` — runs a ``launch.Launch`` (the very object ``fast/gpu/launch.py`` builds for
  CuPy: kernel name, grid, block, dynamic shared memory, packed arguments) on NumPy arrays. Raises
  ``KernelCheckError`` for an out-of-bounds access (``check`` "bounds"), a shared-memory race, or a global
  byte written by one block and touched by another or by another thread of its block unsynchronised ("race"), a
  barrier or warp operation not reached by every thread it names ("divergence"), or outputs that depend on
  the order the threads ran in ("schedule"); each message names the kernel, the argument or shared array,
  the block and thread, the index, and the source line. A launch a GPU of the target architecture would
  refuse (block size, shared memory over 48 KiB without an opt-in or over the opt-in maximum) raises
  ``launch.LaunchRefused`` with the text ``CupyDevice`` gives on a GPU.
* ``SimDevice`` — the device interface of the GPU path (``xp`` = NumPy, ``launch``, ``empty``, ``zeros``,
  ``to_device``, ``to_host``, ``synchronize``, ``context``), every launch through the executor, matrix
  products through NumPy in the host code (standing in for cuBLAS).

Numerics: float32 operations are IEEE float32 on the CPU, with no contraction of a*b+c into a fused
multiply-add, as on a GPU, where the kernels are compiled with ``--fmad=false`` (``build.NVRTC_OPTIONS``);
expf, tanhf, powf, exp, log are glibc's (CUDA's are within 1-2 ulp of them: the one source of differing bits).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import glob
import importlib.util
import math
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import launch as gl

SIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sim")
_spec = importlib.util.spec_from_file_location("diffusiongemma_sim_codegen", os.path.join(SIM_DIR, "codegen.py"))
codegen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(codegen)

#: Bytes of every device allocation kept free on each side, so that an access just outside an array lands
#: in no other array (the executor then names the array it missed).
RED_ZONE = 256
#: Largest dynamic + static shared memory of one block on any architecture (sm_90: 227 KiB; the executor's
#: storage), and the static part's limit (ptxas refuses more).
MAX_SHARED = 232448
STATIC_SHARED_LIMIT = 48 * 1024
#: The architecture whose launch limits cuda-sim enforces by default: the supported one with the least shared
#: memory per block (99 KiB opt-in; sm_80 allows 163 KiB, sm_90 227 KiB), so that what passes here passes on each.
DEFAULT_TARGET = "sm_86"
SCHEDULES = ("forward", "reverse", "shuffle")
CHECK_BOUNDS, CHECK_RACES, CHECK_DIVERGENCE = 1, 2, 4

#: Launches per kernel name, over every SimDevice of this process (the tests' coverage check reads it).
LAUNCHED: collections.Counter = collections.Counter()


class KernelCheckError(RuntimeError):
    """A check of the simulated device failed. ``check``: "bounds", "race", "divergence" or "schedule";
    ``kernel``: the kernel's name; the message names the argument or shared array, block, thread and index."""

    def __init__(self, check: str, kernel: str, message: str):
        super().__init__(message)
        self.check = check
        self.kernel = kernel


class SimBuildError(RuntimeError):
    """The executor or a kernel source could not be compiled for the CPU (carries the compiler's output)."""


# ------------------------------------------------------------------------------------------------ building
def cache_dir() -> str:
    """Where run-time builds go: ``$DIFFUSIONGEMMA_SIM_CACHE``, else ``$XDG_CACHE_HOME/diffusiongemma/cuda-sim``
    (``XDG_CACHE_HOME`` defaulting to ``~/.cache``), else (no writable home) a folder of the system's temporary
    directory. The tests point it into their own folder (tests/conftest.py)."""
    path = os.environ.get("DIFFUSIONGEMMA_SIM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "diffusiongemma", "cuda-sim")
    try:
        os.makedirs(path, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = os.path.join(tempfile.gettempdir(), f"diffusiongemma-cuda-sim-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise SimBuildError("no C++ compiler found (install g++, or set CXX)")
    return cxx


def _compile(source_path: str, out_path: str, flags: tuple, defines: tuple = ()) -> None:
    """Compile one C++ file to a shared library, atomically (a temporary name, then a rename). Compiled and
    linked in two steps: -fsanitize=thread is a compile option only (its run-time library is never linked;
    the executor answers the instrumentation calls)."""
    tmp = f"{out_path}.{os.getpid()}.{threading.get_ident()}.tmp"
    steps = ([_compiler(), *flags, *defines, "-c", "-o", tmp + ".o", source_path],
             [_compiler(), "-shared", "-o", tmp, tmp + ".o"])
    try:
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SimBuildError(f"building {source_path} for cuda-sim failed:\n{' '.join(cmd)}\n"
                                    f"{proc.stderr[-8000:]}")
        os.replace(tmp, out_path)
    finally:
        for leftover in (tmp + ".o", tmp):
            if os.path.exists(leftover):
                os.remove(leftover)


def _prebuilt(stem: str) -> str | None:
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{stem}*.so")))
    return found[0] if found else None


def _cstring(lib: ctypes.CDLL, name: str) -> str:
    """A ``const char name[]`` of a loaded library."""
    return ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(lib, name))).decode()


def _runtime_hash() -> str:
    with open(codegen.RUNTIME, "rb") as f:
        import hashlib

        return hashlib.sha256(f.read()).hexdigest()[:16]


_RUNTIME = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> ctypes.CDLL:
    """The executor library, loaded once with global symbols (the kernel libraries resolve the
    instrumentation calls against it): the built extension when it matches runtime.cpp, else a cached
    run-time build."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is not None:
            return _RUNTIME
        want = _runtime_hash()
        path = _prebuilt("_sim_runtime")
        lib = None
        if path:  # opened locally first: a stale build's symbols must not become the global ones
            probe = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
            if _cstring(probe, "dg_sim_runtime_hash") == want:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
            # else stale: runtime.cpp changed since `pip install -e .`
        if lib is None:
            path = os.path.join(cache_dir(), f"runtime-{want}.so")
            if not os.path.exists(path):
                _compile(codegen.RUNTIME, path, codegen.RUNTIME_FLAGS, (f'-DDG_SIM_RUNTIME_HASH="{want}"',))
            lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        lib.dg_sim_launch.argtypes = [ctypes.c_void_p]
        lib.dg_sim_launch.restype = ctypes.c_int
        lib.dg_sim_last_error.restype = ctypes.c_char_p
        lib.dg_sim_library_base.argtypes = [ctypes.c_void_p]
        lib.dg_sim_library_base.restype = ctypes.c_uint64
        _RUNTIME = lib
        return lib


# ------------------------------------------------------------------------------------------------ ELF facts
def _tls_layout(path: str) -> tuple[int, list[tuple[str, int, int]]]:
    """(size of the PT_TLS segment, [(symbol, offset, size)] of its symbols) of an ELF64 shared library."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise SimBuildError(f"{path}: not an ELF64 file")
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    tls_size = 0
    for i in range(phnum):
        p_type, = struct.unpack_from("<I", data, phoff + i * phentsize)
        if p_type == 7:  # PT_TLS
            tls_size = struct.unpack_from("<Q", data, phoff + i * phentsize + 40)[0]
    symbols = []
    for i in range(shnum):
        base = shoff + i * shentsize
        sh_type, = struct.unpack_from("<I", data, base + 4)
        if sh_type != 2:  # SHT_SYMTAB
            continue
        offset, size = struct.unpack_from("<QQ", data, base + 24)
        link, = struct.unpack_from("<I", data, base + 40)
        entsize, = struct.unpack_from("<Q", data, base + 56)
        str_off, = struct.unpack_from("<Q", data, shoff + link * shentsize + 24)
        for k in range(size // entsize):
            name_off, info, _other, _shndx, value, sym_size = struct.unpack_from("<IBBHQQ", data, offset + k * entsize)
            if info & 0xF == 6:  # STT_TLS
                end = data.index(b"\0", str_off + name_off)
                symbols.append((data[str_off + name_off:end].decode(), value, sym_size))
    return tls_size, sorted(set(symbols), key=lambda s: s[1])


def _demangle_static(name: str) -> str:
    """``_ZZ11dg_rms_normE7scratch`` -> ``dg_rms_norm::scratch`` (other names unchanged)."""
    m = re.match(r"_ZZ(\d+)", name)
    if not m:
        return name
    n = int(m.group(1))
    rest = name[m.end():]
    function, rest = rest[:n], rest[n:]
    m2 = re.match(r"E(\d+)", rest)
    if not m2:
        return name
    return f"{function}::{rest[m2.end():m2.end() + int(m2.group(1))]}"


# ------------------------------------------------------------------------------------------------ C structures
class _Buffer(ctypes.Structure):
    _fields_ = [("lo", ctypes.c_uint64), ("size", ctypes.c_uint64), ("itemsize", ctypes.c_int),
                ("name", ctypes.c_char_p)]


class _Shared(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("size", ctypes.c_uint64), ("dynamic", ctypes.c_int),
                ("name", ctypes.c_char_p)]


class _Desc(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_char_p), ("tramp", ctypes.c_void_p), ("argv", ctypes.c_void_p),
                ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("dynamic_shared", ctypes.c_uint64),
                ("anchor", ctypes.c_void_p), ("anchor_index", ctypes.c_int), ("shared", ctypes.POINTER(_Shared)),
                ("n_shared", ctypes.c_int), ("tls_size", ctypes.c_uint64), ("buffers", ctypes.POINTER(_Buffer)),
                ("n_buffers", ctypes.c_int), ("checks", ctypes.c_int), ("schedule", ctypes.c_int),
                ("seed", ctypes.c_uint64), ("poison", ctypes.c_int), ("lib_base", ctypes.c_uint64)]


_SCALARS = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
            np.dtype(np.int64): ctypes.c_longlong, np.dtype(np.int32): ctypes.c_int}


# ------------------------------------------------------------------------------------------------ libraries
class KernelLibrary:
    """One kernel source compiled for the executor.

    ``KernelLibrary.default()``: the sources of ``fast/gpu/cuda`` (the built ``_sim_kernels`` extension when
    its hash matches the sources, else a cached run-time build). ``KernelLibrary.from_source(text)``: any
    assembled source text (no ``#include``), e.g. a test's copy of a kernel with one line changed.
    """

    _cache: dict[str, "KernelLibrary"] = {}
    _lock = threading.Lock()

    def __init__(self, path: str, source_text: str):
        runtime()  # global symbols first
        self.path = path
        self.signatures = gl.parse_signatures(source_text)
        self.launch_bounds = _launch_bounds(source_text)
        self.lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        self.tls_size, symbols = _tls_layout(path)
        dynamic = _cstring(self.lib, "dg_sim_dynamic_names").split(",")
        entries = []
        self.static_shared: dict[str, int] = collections.defaultdict(int)  # kernel -> bytes of static shared
        for name, offset, size in symbols:
            is_dynamic = name in dynamic
            pretty = name if is_dynamic else _demangle_static(name)
            if not is_dynamic:
                self.static_shared[pretty.split("::")[0]] += size
            entries.append((offset, size, int(is_dynamic), pretty))
        self._names = [e[3].encode() for e in entries]
        self.shared = (_Shared * max(1, len(entries)))(*[_Shared(o, s, d, n) for (o, s, d, _), n in
                                                          zip(entries, self._names)])
        self.n_shared = len(entries)
        self.anchor_index = next(i for i, e in enumerate(entries) if e[3] == dynamic[0])
        self.anchor = ctypes.cast(self.lib.dg_sim_anchor, ctypes.c_void_p).value
        self.base = runtime().dg_sim_library_base(self.anchor)
        self.tramps = {k: ctypes.cast(getattr(self.lib, f"dg_sim_tramp_{k}"), ctypes.c_void_p).value
                       for k in self.signatures}
        self._sites: dict[int, str] = {}

    @classmethod
    def default(cls) -> "KernelLibrary":
        text = codegen.directory_text(gl.CUDA_DIR)
        digest = codegen.source_hash(text)
        with cls._lock:
            if digest in cls._cache:
                return cls._cache[digest]
            path = _prebuilt("_sim_kernels")
            if path:
                probe = ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL) if runtime() else None
                if _cstring(probe, "dg_sim_source_hash") != digest:
                    path = None  # the sources changed since the build
            if path is None:
                path = os.path.join(cache_dir(), f"kernels-{digest}.so")
                if not os.path.exists(path):
                    with tempfile.TemporaryDirectory(prefix="dg_sim_") as tmp:
                        src = os.path.join(tmp, "kernels_sim.cpp")
                        with open(src, "w", encoding="utf-8") as f:
                            f.write(codegen.directory_unit(gl.CUDA_DIR, gl.signatures()))
                        _compile(src, path, codegen.KERNEL_FLAGS)
            lib = cls(path, _assembled_default())
            cls._cache[digest] = lib
            return lib

    @classmethod
    def from_source(cls, text: str) -> "KernelLibrary":
        digest = codegen.source_hash(text)
        with cls._lock:
            if digest in cls._cache:
                return cls._cache[digest]
            path = os.path.join(cache_dir(), f"kernels-{digest}.so")
            if not os.path.exists(path):
                src = os.path.join(cache_dir(), f"kernels-{digest}.cpp")
                with open(src, "w", encoding="utf-8") as f:
                    f.write(codegen.translation_unit(text, gl.parse_signatures(text)))
                _compile(src, path, codegen.KERNEL_FLAGS)
            lib = cls(path, text)
            cls._cache[digest] = lib
            return lib

    def describe_site(self, offset: int) -> str:
        """``file:line (function)`` of a code offset in this library (addr2line), or the hex offset."""
        if offset not in self._sites:
            text = f"+0x{offset:x}"
            tool = shutil.which("addr2line")
            if tool:
                proc = subprocess.run([tool, "-e", self.path, "-f", "-i", "-C", hex(offset)], capture_output=True,
                                      text=True)
                lines = [s for s in proc.stdout.splitlines() if s.strip()]
                if len(lines) >= 2 and not lines[1].startswith("??"):
                    frames = [f"{os.path.basename(lines[i + 1])} in {lines[i]}" for i in range(0, len(lines) - 1, 2)]
                    text = "at " + frames[0] + (f" (inlined into {lines[-2]})" if len(frames) > 1 else "")
            self._sites[offset] = text
        return self._sites[offset]


def _assembled_default() -> str:
    from .build import assemble_all

    return assemble_all()


def _launch_bounds(text: str) -> dict[str, int]:
    """Kernel name -> its ``__launch_bounds__`` maximum threads (DG_* constants resolved)."""
    defines = {k: int(v) for k, v in re.findall(r"^#define\s+(\w+)\s+(\d+)\s*$", text, re.MULTILINE)}
    out = {}
    for bound, name in re.findall(r'extern\s+"C"\s+__global__\s+void\s+__launch_bounds__\s*\(\s*(\w+)[^)]*\)\s*(\w+)',
                                  text):
        out[name] = int(bound) if bound.isdigit() else defines[bound]
    return out


# ------------------------------------------------------------------------------------------------ executor
@dataclass
class Executor:
    """Runs ``Launch`` objects on NumPy arrays through one ``KernelLibrary``.

    checks: which of bounds, races, divergence are on (all by default). ``run(launch, schedule, seed,
    poison)`` runs once in the given thread order; ``run_checked(launch, schedules)`` runs the launch in
    every order of ``schedules`` from the same inputs (poisoning shared memory differently each time) and
    raises ``KernelCheckError("schedule", ...)`` when the outputs differ.
    """

    library: KernelLibrary = field(default_factory=KernelLibrary.default)
    bounds: bool = True  # every global and shared access inside an argument / shared array
    races: bool = True  # no two threads touch one shared byte between barriers, one writing
    divergence: bool = True  # every barrier / warp operation reached by all the threads it names
    target: str = DEFAULT_TARGET  # the architecture whose launch limits are enforced (launch.SHARED_OPT_IN_LIMITS)
    #: kernel -> dynamic shared memory it is opted in to (cudaFuncAttributeMaxDynamicSharedMemorySize; 0 unless
    #: ``opt_in`` raised it, as on a GPU)
    opted_in: dict = field(default_factory=dict)

    def opt_in_limit(self) -> int:
        return gl.SHARED_OPT_IN_LIMITS[self.target]

    def opt_in(self, kernel: str, dynamic_bytes: int) -> None:
        """Raise the kernel's dynamic shared-memory limit, as cudaFuncSetAttribute does (and refuse what a GPU
        refuses: more than the device's opt-in maximum less the kernel's static shared memory)."""
        static = self.library.static_shared.get(kernel, 0)
        if static + dynamic_bytes > self.opt_in_limit():
            raise gl.LaunchRefused(f"{kernel}: {static} bytes of static and {dynamic_bytes} bytes of dynamic shared "
                                   f"memory exceed the {self.opt_in_limit()} bytes a block may use on {self.target}")
        self.opted_in[kernel] = max(self.opted_in.get(kernel, 0), int(dynamic_bytes))

    def resources(self, launch: gl.Launch, opted_in: int = -1) -> int:
        """``launch.check_resources`` with this library's static shared memory and launch bounds and the target's
        limits: the opt-in the launch needs (raises ``launch.LaunchRefused`` as a GPU run does)."""
        bound = self.library.launch_bounds.get(launch.kernel, gl.MAX_BLOCK_THREADS)
        return gl.check_resources(launch, self.library.static_shared.get(launch.kernel, 0), bound,
                                  self.opt_in_limit(), self.target, opted_in)

    def _describe(self, message: str) -> str:
        return re.sub(r"\{site:0x([0-9a-f]+)\}", lambda m: self.library.describe_site(int(m.group(1), 16)), message)

    def check_geometry(self, launch: gl.Launch) -> None:
        """Refuse what a GPU of the target architecture refuses (``launch.LaunchRefused``: block size over the
        kernel's ``__launch_bounds__`` or 1024, static + dynamic shared memory over 48 KiB without an opt-in or
        over the target's opt-in maximum), and static shared memory ptxas would not compile."""
        static = self.library.static_shared.get(launch.kernel, 0)
        if static > STATIC_SHARED_LIMIT:
            raise KernelCheckError("bounds", launch.kernel, f"{launch.kernel}: {static} bytes of static shared memory "
                                                            f"(> {STATIC_SHARED_LIMIT})")
        self.resources(launch, self.opted_in.get(launch.kernel, 0))

    def run(self, launch: gl.Launch, schedule: str = "forward", seed: int = 0, poison: int = 0xFF) -> None:
        lib = self.library
        sig = lib.signatures.get(launch.kernel)
        if sig is None:
            raise KeyError(f"no kernel named {launch.kernel!r} in {lib.path}")
        if len(sig) != len(launch.args):
            raise ValueError(f"{launch.kernel}: {len(launch.args)} arguments for {len(sig)} parameters")
        self.check_geometry(launch)
        keep, buffers = [], []
        for p, a in zip(sig, launch.args):
            if p.kind == "ptr":
                if a is None:
                    keep.append(ctypes.c_void_p(0))
                    continue
                if not isinstance(a, np.ndarray):
                    raise TypeError(f"{launch.kernel}: {p.name} must be a NumPy array on cuda-sim, got {type(a)}")
                keep.append(ctypes.c_void_p(a.ctypes.data))
                buffers.append(_Buffer(a.ctypes.data, a.nbytes, a.itemsize, p.name.encode()))
            else:
                keep.append(_SCALARS[p.dtype](a))
        argv = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.addressof(k) for k in keep])
        table = (_Buffer * max(1, len(buffers)))(*buffers)
        desc = _Desc(kernel=launch.kernel.encode(), tramp=lib.tramps[launch.kernel],
                     argv=ctypes.cast(argv, ctypes.c_void_p), grid=(ctypes.c_uint * 3)(*launch.grid),
                     block=(ctypes.c_uint * 3)(*launch.block), dynamic_shared=launch.shared_mem, anchor=lib.anchor,
                     anchor_index=lib.anchor_index, shared=lib.shared, n_shared=lib.n_shared, tls_size=lib.tls_size,
                     buffers=table, n_buffers=len(buffers),
                     checks=(CHECK_BOUNDS if self.bounds else 0) | (CHECK_RACES if self.races else 0)
                     | (CHECK_DIVERGENCE if self.divergence else 0),
                     schedule=SCHEDULES.index(schedule), seed=seed, poison=poison, lib_base=lib.base)
        if runtime().dg_sim_launch(ctypes.byref(desc)) != 0:
            message = runtime().dg_sim_last_error().decode(errors="replace")
            check, _, rest = message.partition(": ")
            raise KernelCheckError(check, launch.kernel, self._describe(rest) + f" [{schedule} order]")

    def run_checked(self, launch: gl.Launch, schedules: tuple = ("forward", "reverse"), seed: int = 0) -> None:
        """Run in each order of ``schedules`` from the same inputs; the outputs must be bitwise equal."""
        sig = self.library.signatures[launch.kernel]
        written = [(p.name, a) for p, a in zip(sig, launch.args) if p.kind == "ptr" and not p.const and a is not None]
        if len(schedules) < 2 or not written:
            self.run(launch, schedules[0], seed)
            return
        before = [a.copy() for _, a in written]
        first = None
        for k, schedule in enumerate(schedules):
            if k:
                for (_, a), saved in zip(written, before):
                    a[...] = saved
            if k == 0:
                self.run(launch, schedule, seed + k, poison=0xFF)
            else:  # the other checks do not depend on the order: only the outputs are compared
                Executor(self.library, False, False, False, self.target, self.opted_in).run(
                    launch, schedule, seed + k, poison=0xFF if k % 2 == 0 else 0x7F)
            outputs = [a.copy() for _, a in written]
            if first is None:
                first = outputs
                continue
            for (name, _), x, y in zip(written, first, outputs):
                bx, by = x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)
                diff = np.flatnonzero(bx != by)
                if diff.size:
                    index = int(diff[0]) // x.itemsize
                    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
                    raise KernelCheckError(
                        "schedule", launch.kernel,
                        f"{launch.kernel}: output {name} depends on the order of the threads: element {index} "
                        f"(of {x.size}; {int(np.count_nonzero(bx != by))} bytes differ) is {flat_x[index].item()!r} in "
                        f"{schedules[0]} order and {flat_y[index].item()!r} in {schedule} order (grid {launch.grid}, "
                        f"block {launch.block})")


# ------------------------------------------------------------------------------------------------ device
class SimDevice:
    """The GPU path's device interface on the CPU: NumPy arrays, every kernel through the executor.

    checks: True runs every launch with the bounds, race and divergence checks and twice, in forward order
    and then in an alternative order (reverse, or a seeded shuffle at every barrier, in turn), from the same
    inputs and with different shared-memory poison; the outputs must agree bit for bit. False runs each
    launch once, forward, unchecked (faster). record: keep ``launches`` (every ``Launch``) and
    ``allocations`` ((shape, dtype) of every ``empty``/``zeros``). Arrays come from ``empty``/``zeros``/
    ``to_device`` with red zones around them; ``empty`` fills floats with NaN and integers with -7777 (77
    for bytes; all ones for uint16, the bits of a bfloat16 NaN), as uninitialised GPU memory would hold garbage. Raises ``KernelCheckError`` from ``launch``.
    """

    xp = np
    name = "cuda-sim"

    def __init__(self, checks: bool = True, record: bool = False, library: KernelLibrary | None = None,
                 alternatives: tuple = ("reverse", "shuffle"), target: str = DEFAULT_TARGET):
        if target not in gl.SHARED_OPT_IN_LIMITS:
            raise ValueError(f"cuda-sim target must be one of {sorted(gl.SHARED_OPT_IN_LIMITS)}, got {target!r}")
        self.executor = Executor(library or KernelLibrary.default(), checks, checks, checks, target)
        self.target = target
        self.checks = checks
        self.alternatives = alternatives
        self.record = record
        self.launches: list[gl.Launch] = []
        self.allocations: list[tuple[tuple, np.dtype]] = []
        self.launched: collections.Counter = collections.Counter()
        self._count = 0

    def context(self):
        return contextlib.nullcontext()

    def launch(self, launch: gl.Launch) -> None:
        if not isinstance(launch, gl.Launch):
            raise TypeError(f"launch must be a launch.Launch, got {type(launch).__name__}")
        if self.record:
            self.launches.append(launch)
        need = self.executor.resources(launch)  # as CupyDevice.launch: refuse, or opt in, before the launch
        if need > self.executor.opted_in.get(launch.kernel, 0):
            self.executor.opt_in(launch.kernel, need)
        self.launched[launch.kernel] += 1
        LAUNCHED[launch.kernel] += 1
        self._count += 1
        if self.checks:
            alternative = self.alternatives[self._count % len(self.alternatives)]
            self.executor.run_checked(launch, ("forward", alternative), seed=self._count)
        else:
            self.executor.run(launch)

    def _allocate(self, shape, dtype, record: bool = True) -> np.ndarray:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dtype = np.dtype(dtype)
        if self.record and record:
            self.allocations.append((shape, dtype))
        nbytes = math.prod(shape) * dtype.itemsize
        raw = np.empty(nbytes + 2 * RED_ZONE + 64, dtype=np.uint8)
        start = RED_ZONE + (-(raw.ctypes.data + RED_ZONE)) % 64
        return raw[start:start + nbytes].view(dtype).reshape(shape)

    def empty(self, shape, dtype):
        out = self._allocate(shape, dtype)
        if out.dtype.kind == "u" and out.dtype.itemsize > 1:
            out.fill(np.iinfo(out.dtype).max)  # uint16: 0xFFFF, a bfloat16 NaN
        else:
            out.fill(np.nan if out.dtype.kind == "f" else (-7777 if out.dtype.itemsize > 1 else 77))
        return out

    def zeros(self, shape, dtype):
        out = self._allocate(shape, dtype)
        out.fill(0)
        return out

    def to_device(self, array) -> np.ndarray:
        array = np.asarray(array)
        out = self._allocate(array.shape, array.dtype, record=False)
        out[...] = array
        return out

    def to_host(self, array) -> np.ndarray:
        return np.array(array, copy=True)

    def available_memory(self) -> int | None:
        """The simulated device's memory is the host's."""
        from diffusiongemma.reference.support.checks import available_memory
        return available_memory()

    def synchronize(self) -> None:
        pass

    def replay(self, plan: Any) -> None:
        """Run a recorded pass (``graph.Plan``) again: each launch through the executor, with its checks."""
        plan.run(self)
