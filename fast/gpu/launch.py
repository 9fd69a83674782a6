"""Launch configuration of the GPU kernels: grids, blocks, shared memory, and argument checks.

Pure Python, no CuPy import: everything here works on anything that looks like an array (``shape``,
``dtype``, ``flags.c_contiguous``), so NumPy arrays stand in for CuPy arrays in the host tests.

* The kernels' parameter lists are read from the CUDA sources themselves (``signatures()`` parses every
  ``extern "C" __global__`` function of ``fast/cuda/*.cu``), and the tuning constants (``DG_*``) from
  ``fast/cuda/common.cuh``: each fact is written once, in the CUDA code.
* One builder per kernel (``rms_norm``, ``attention``, ``sample_rows``...) checks the shapes and dtypes
  of its operands against each other, chooses the launch geometry, and returns a ``Launch``: the kernel
  name, grid, block, dynamic shared memory and the packed argument tuple. ``pack_args`` converts Python
  numbers into NumPy scalars of the exact C type (CuPy passes a scalar by its NumPy type), checks every
  array's dtype and C-contiguity (kernels index raw memory, so a strided view would be read wrongly), and
  keeps ``None`` for a nullable (``*_opt``) pointer; ``fast.gpu`` passes that as a 64-bit zero (CuPy
  turns a ``None`` argument into an invalid address, not NULL).

Errors: ``LaunchError`` (a ``ValueError``) naming the kernel, the operand and the offending shape, dtype
or value. Upstream behaviour is not reproduced here; see each kernel's source for that.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
#: Dynamic shared memory a block may use without opting in (every architecture since sm_70).
DEFAULT_SHARED_LIMIT = 48 * 1024
#: Budget for the attention kernel's dynamic shared memory (opt-in above 48 KiB; sm_80/86/89/90 all allow
#: at least 99 KiB per block).
ATTENTION_SHARED_BUDGET = 96 * 1024


#: Shared memory (static + dynamic) one block may opt in to, by architecture: the CUDA attribute
#: cudaDevAttrMaxSharedMemoryPerBlockOptin (CUDA C++ Programming Guide, technical specifications per compute
#: capability). Above DEFAULT_SHARED_LIMIT a kernel must first raise its cudaFuncAttributeMaxDynamicSharedMemorySize.
SHARED_OPT_IN_LIMITS = {"sm_70": 98304, "sm_72": 98304, "sm_75": 65536, "sm_80": 166912, "sm_86": 101376,
                        "sm_87": 166912, "sm_89": 101376, "sm_90": 232448, "sm_100": 232448, "sm_120": 101376}
#: Threads of one block on every architecture since sm_30 (and at most 64 along z).
MAX_BLOCK_THREADS = 1024


class LaunchError(ValueError):
    """A kernel was asked to run on operands of the wrong shape, dtype or layout, or out of its limits."""


class LaunchRefused(LaunchError):
    """A launch the device would refuse (CUDA_ERROR_INVALID_VALUE / "too many resources requested"): more
    threads than the kernel may run with, or more shared memory than a block may use. Raised before the
    launch, with one text, by both devices: ``fast.gpu.CupyDevice`` on a GPU and cuda-sim."""


def check_resources(launch: "Launch", static_shared: int, max_threads: int, opt_in_limit: int, arch: str,
                    opted_in: int = -1) -> int:
    """What a GPU requires of ``launch``: returns the dynamic shared memory the kernel must be opted in to
    (0: none; a launch whose static + dynamic shared memory is at most DEFAULT_SHARED_LIMIT needs none).

    static_shared: the kernel's static shared memory in bytes (ptxas; CuPy ``RawKernel.shared_size_bytes``);
    max_threads: the most threads a block of this kernel may have (``__launch_bounds__``, registers; CuPy
    ``RawKernel.max_threads_per_block``); opt_in_limit: the device's cudaDevAttrMaxSharedMemoryPerBlockOptin;
    arch: "sm_XY", named in the message; opted_in: the kernel's current opt-in, or -1 when the caller opts
    in as needed (both devices do). Raises ``LaunchRefused``."""
    threads = math.prod(launch.block)
    if threads > min(max_threads, MAX_BLOCK_THREADS):
        raise LaunchRefused(f"{launch.kernel}: a block of {threads} threads exceeds the {min(max_threads, MAX_BLOCK_THREADS)} "
                            f"this kernel may run with on {arch}")
    total = static_shared + launch.shared_mem
    if total > opt_in_limit:
        raise LaunchRefused(f"{launch.kernel}: {static_shared} bytes of static and {launch.shared_mem} bytes of dynamic "
                            f"shared memory exceed the {opt_in_limit} bytes a block may use on {arch}")
    need = launch.shared_mem if total > DEFAULT_SHARED_LIMIT else 0
    if 0 <= opted_in < need:
        raise LaunchRefused(f"{launch.kernel}: {static_shared} bytes of static and {launch.shared_mem} bytes of dynamic "
                            f"shared memory exceed the {DEFAULT_SHARED_LIMIT} bytes a block may use on {arch} without "
                            f"opting in (the kernel is opted in to {opted_in} bytes of dynamic shared memory)")
    return need


# ------------------------------------------------------------------------------------------------ source facts
_C_TYPES = {  # C parameter type -> (kind, numpy dtype)
    "float*": ("ptr", np.float32), "double*": ("ptr", np.float64), "long long*": ("ptr", np.int64),
    "int*": ("ptr", np.int32), "unsigned char*": ("ptr", np.uint8),
    "unsigned short*": ("ptr", np.uint16),  # bfloat16 bits (fast/gpu/cuda/bf16.cuh)
    "float": ("scalar", np.float32), "double": ("scalar", np.float64), "long long": ("scalar", np.int64),
    "int": ("scalar", np.int32),
}
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)',
                     re.DOTALL)
_DEFINE = re.compile(r"^#define\s+(DG_\w+)\s+(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Param:
    """One kernel parameter as declared in the CUDA source."""

    name: str  # the C parameter name; a name ending in "_opt" may be NULL
    kind: str  # "ptr" or "scalar"
    dtype: Any  # numpy dtype of the pointee (ptr) or of the value (scalar)
    const: bool  # declared const (read only)

    @property
    def nullable(self) -> bool:
        return self.name.endswith("_opt")


def parse_signatures(source: str) -> dict[str, tuple[Param, ...]]:
    """``{kernel name: parameters}`` of every ``extern "C" __global__`` function in ``source``.

    Raises ``LaunchError`` for a parameter type this module cannot pass (so a new kernel cannot silently
    get arguments of the wrong width)."""
    out = {}
    for name, params in _KERNEL.findall(source):
        parsed = []
        for raw in params.split(","):
            text = " ".join(raw.replace("*", " * ").split())
            if not text:
                continue
            const = text.startswith("const ")
            text = text[6:] if const else text
            text = text.replace("__restrict__", "").strip()
            ctype, _, pname = text.rpartition(" ")
            ctype = ctype.replace(" *", "*").strip()
            if ctype not in _C_TYPES:
                raise LaunchError(f"kernel {name}: parameter {raw.strip()!r} has a type the launcher cannot pass")
            kind, dtype = _C_TYPES[ctype]
            parsed.append(Param(pname, kind, np.dtype(dtype), const))
        out[name] = tuple(parsed)
    return out


@functools.lru_cache(maxsize=None)
def signatures(directory: str = CUDA_DIR) -> dict[str, tuple[Param, ...]]:
    """Parameters of every kernel in ``directory/*.cu`` (parsed once)."""
    out: dict[str, tuple[Param, ...]] = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".cu"):
            with open(os.path.join(directory, file), encoding="utf-8") as f:
                for name, params in parse_signatures(f.read()).items():
                    if name in out:
                        raise LaunchError(f"kernel {name} is defined twice (second time in {file})")
                    out[name] = params
    return out


@functools.lru_cache(maxsize=None)
def constants(directory: str = CUDA_DIR) -> dict[str, int]:
    """The ``#define DG_NAME integer`` constants of ``common.cuh``."""
    with open(os.path.join(directory, "common.cuh"), encoding="utf-8") as f:
        return {k: int(v) for k, v in _DEFINE.findall(f.read())}


def const(name: str) -> int:
    """One constant of ``common.cuh`` (``KeyError`` if absent)."""
    return constants()[name]


# ------------------------------------------------------------------------------------------------ launches
@dataclass(frozen=True)
class Launch:
    """Everything needed to launch one kernel: ``function(grid, block, args, shared_mem=shared_mem)``."""

    kernel: str  # extern "C" name
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple  # packed: arrays, numpy scalars of the exact C type, None for a NULL pointer
    shared_mem: int = 0  # dynamic shared memory, bytes

    @property
    def needs_shared_opt_in(self) -> bool:
        """True when the dynamic shared memory alone exceeds the 48 KiB a block gets without opting in (with
        the kernel's static shared memory the threshold is lower: ``check_resources`` decides)."""
        return self.shared_mem > DEFAULT_SHARED_LIMIT


def _dims(value: int | Sequence[int], what: str, kernel: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    dims = tuple(int(v) for v in dims) + (1,) * (3 - len(dims))
    if len(dims) != 3 or any(v < 1 for v in dims):
        raise LaunchError(f"{kernel}: {what} {dims} must be 1 to 3 positive sizes")
    limits = (2**31 - 1, 65535, 65535) if what == "grid" else (1024, 1024, 64)
    if any(v > lim for v, lim in zip(dims, limits)) or (what == "block" and math.prod(dims) > 1024):
        raise LaunchError(f"{kernel}: {what} {dims} exceeds the CUDA limits {limits}")
    return dims


def pack_args(kernel: str, values: Sequence[Any]) -> tuple:
    """Check ``values`` against the kernel's declared parameters and convert scalars to exact C types.

    Arrays must have the pointee's dtype and be C-contiguous; ``None`` is accepted only for ``*_opt``
    parameters. Integers must fit their C type. Raises ``LaunchError`` naming the parameter.
    """
    sig = signatures().get(kernel)
    if sig is None:
        raise LaunchError(f"no kernel named {kernel!r} in the CUDA sources")
    if len(values) != len(sig):
        raise LaunchError(f"{kernel} takes {len(sig)} arguments ({', '.join(p.name for p in sig)}), "
                          f"got {len(values)}")
    packed = []
    for p, v in zip(sig, values):
        if p.kind == "ptr":
            if v is None:
                if not p.nullable:
                    raise LaunchError(f"{kernel}: {p.name} must not be NULL")
                packed.append(None)
                continue
            dtype = getattr(v, "dtype", None)
            if dtype is None or not hasattr(v, "shape"):
                raise LaunchError(f"{kernel}: {p.name} must be an array, got {type(v).__name__}")
            if np.dtype(dtype) != p.dtype:
                raise LaunchError(f"{kernel}: {p.name} must be {p.dtype}, got {np.dtype(dtype)}")
            if not v.flags.c_contiguous:
                raise LaunchError(f"{kernel}: {p.name} must be C-contiguous (shape {tuple(v.shape)})")
            packed.append(v)
        else:
            if hasattr(v, "shape") and getattr(v, "ndim", 0) != 0:
                raise LaunchError(f"{kernel}: {p.name} must be a scalar, got an array of shape {tuple(v.shape)}")
            if p.dtype.kind == "i":
                if isinstance(v, (bool, np.bool_)) or not float(v).is_integer():
                    raise LaunchError(f"{kernel}: {p.name} must be an integer, got {v!r}")
                info = np.iinfo(p.dtype)
                if not info.min <= int(v) <= info.max:
                    raise LaunchError(f"{kernel}: {p.name}={int(v)} does not fit in {p.dtype}")
                packed.append(p.dtype.type(int(v)))
            else:
                value = float(v)
                if math.isnan(value):
                    raise LaunchError(f"{kernel}: {p.name} is NaN")
                packed.append(p.dtype.type(value))
    return tuple(packed)


def _launch(kernel: str, grid, block, values: Sequence[Any], shared_mem: int = 0) -> Launch:
    return Launch(kernel, _dims(grid, "grid", kernel), _dims(block, "block", kernel), pack_args(kernel, values),
                  int(shared_mem))


# ------------------------------------------------------------------------------------------------ shape checks
def _shape(kernel: str, name: str, array: Any, shape: tuple, dtype=None) -> None:
    if array is None:
        return
    if tuple(array.shape) != tuple(shape):
        raise LaunchError(f"{kernel}: {name} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    if dtype is not None and np.dtype(array.dtype) != np.dtype(dtype):
        raise LaunchError(f"{kernel}: {name} must be {np.dtype(dtype)}, got {np.dtype(array.dtype)}")


def _ndim(kernel: str, name: str, array: Any, ndim: int) -> None:
    if len(array.shape) != ndim:
        raise LaunchError(f"{kernel}: {name} must be {ndim}-D, got shape {tuple(array.shape)}")


def _row_threads(dim: int) -> int:
    """Threads for a row of ``dim`` values: a multiple of 32, at most DG_ROW_THREADS."""
    return int(min(const("DG_ROW_THREADS"), max(32, -(-dim // 32) * 32)))


# ------------------------------------------------------------------------------------------------ norms.cu
def rms_norm(x, weight, out, eps: float, post: float = 1.0, bf16: int = 0) -> Launch:
    """``out = rms_norm(x) * weight * post`` row-wise; x, out (rows, dim) float32, weight (dim,) or None.
    bf16: 0 float32; 1 a bfloat16 run's norm (rounded after the weight and after ``post``); 2 the router's input
    (the weightless norm rounded before the weight too), see ``dg_rms_norm``."""
    k = "dg_rms_norm"
    _ndim(k, "x", x, 2)
    rows, dim = x.shape
    _shape(k, "out", out, (rows, dim))
    _shape(k, "weight", weight, (dim,))
    if int(bf16) not in (0, 1, 2):
        raise LaunchError(f"{k}: bf16={bf16!r} must be 0, 1 or 2")
    return _launch(k, max(rows, 1), _row_threads(dim), (x, weight, post, out, rows, dim, eps, int(bf16)))


def residual_norm(h, y, weight, scalar: float, eps: float, bf16: bool = False) -> Launch:
    """``h = (h + rms_norm(y) * weight) * scalar``; h, y (rows, dim), weight (dim,); bf16: each result rounded."""
    k = "dg_residual_norm"
    _ndim(k, "h", h, 2)
    rows, dim = h.shape
    _shape(k, "y", y, (rows, dim))
    _shape(k, "weight", weight, (dim,))
    return _launch(k, max(rows, 1), _row_threads(dim), (h, y, weight, scalar, rows, dim, eps, int(bool(bf16))))


def ffn_tail(h, dense, moe, w_dense, w_moe, w_out, scalar: float, eps: float, bf16: bool = False) -> Launch:
    """End of a block; see ``dg_ffn_tail``. h, dense, moe (rows, dim); weights (dim,); bf16: a bfloat16 run's."""
    k = "dg_ffn_tail"
    _ndim(k, "h", h, 2)
    rows, dim = h.shape
    for name, a in (("dense", dense), ("moe", moe)):
        _shape(k, name, a, (rows, dim))
    for name, a in (("w_dense", w_dense), ("w_moe", w_moe), ("w_out", w_out)):
        _shape(k, name, a, (dim,))
    return _launch(k, max(rows, 1), _row_threads(dim), (h, dense, moe, w_dense, w_moe, w_out, scalar, rows, dim, eps,
                                                        int(bool(bf16))))


def embed(ids, table, scale: float, add, normalize: bool, out, eps: float, bf16: bool = False) -> Launch:
    """``out = table[ids] * scale (+ add)``, then optionally a weightless RMSNorm. ids (rows,) int64;
    table (V, H) float32, or uint16 (bfloat16 bits); add, out (rows, H). bf16: a bfloat16 run's (the scale
    rounded to bfloat16 first, every result rounded; see ``dg_embed``)."""
    k = "dg_embed"
    _ndim(k, "ids", ids, 1)
    _ndim(k, "table", table, 2)
    rows, dim = ids.shape[0], table.shape[1]
    _shape(k, "out", out, (rows, dim))
    _shape(k, "add", add, (rows, dim))
    bits = np.dtype(table.dtype) == np.uint16
    return _launch(k, max(rows, 1), _row_threads(dim), (ids, None if bits else table, scale, add, int(bool(normalize)),
                                                        out, rows, dim, eps, table if bits else None, int(bool(bf16))))


def softcap(x, cap: float) -> Launch:
    """``x = cap * tanh(x / cap)`` in place over every element of x (any shape, contiguous)."""
    n = int(math.prod(x.shape))
    threads = 256
    blocks = max(1, min(-(-n // threads), 65535 * 16))
    return _launch("dg_softcap", blocks, threads, (x, n, cap))


# ------------------------------------------------------------------------------------------------ mlp.cu, rope.cu
def gated_gelu(gu, out, bf16: bool = False) -> Launch:
    """``out = gelu(gu[:, :I]) * gu[:, I:]``; gu (rows, 2I), out (rows, I). bf16: a bfloat16 run's (gu holds
    bfloat16 values): the float32 GELU rounded to bfloat16, and its product with the up half rounded too, as
    ``reference.primitives.gated_mlp`` with dtype bfloat16 (out then holds bfloat16 values)."""
    k = "dg_gated_gelu"
    _ndim(k, "gu", gu, 2)
    rows, width = gu.shape
    if width % 2:
        raise LaunchError(f"{k}: gu has an odd width {width}; expected gate and up halves")
    _shape(k, "out", out, (rows, width // 2))
    threads = 256
    blocks = max(1, min(-(-(rows * width // 2) // threads), 65535 * 16))
    return _launch(k, blocks, threads, (gu, out, rows, width // 2, int(bool(bf16))))


def qkv_heads(proj, batch: int, S: int, n_heads: int, n_kv: int, d: int, has_v: bool, q_norm, k_norm, cos, sin,
              q_out, k_out, v_out, eps: float, bf16: bool = False) -> Launch:
    """Split a fused q/k(/v) projection into normed, rotated heads (see ``dg_qkv_heads``); bf16: a bfloat16
    run's (every norm and each of the rotation's three operations rounded; cos and sin bf16-valued).

    proj (batch*S, (n_heads + (2 if has_v else 1) * n_kv) * d); cos, sin (S, d/2); q_out (batch, S, n_heads, d);
    k_out, v_out (batch, n_kv, S, d)."""
    k = "dg_qkv_heads"
    if d % 2 or d > const("DG_MAX_HEAD_DIM") or d <= 0:
        raise LaunchError(f"{k}: head dim {d} must be even and at most {const('DG_MAX_HEAD_DIM')}")
    if n_kv <= 0 or n_heads % n_kv:
        raise LaunchError(f"{k}: {n_kv} KV heads do not divide {n_heads} query heads")
    tokens = batch * S
    _shape(k, "proj", proj, (tokens, (n_heads + (2 if has_v else 1) * n_kv) * d))
    _shape(k, "q_norm", q_norm, (d,))
    _shape(k, "k_norm", k_norm, (d,))
    _shape(k, "cos", cos, (S, d // 2))
    _shape(k, "sin", sin, (S, d // 2))
    _shape(k, "q_out", q_out, (batch, S, n_heads, d))
    _shape(k, "k_out", k_out, (batch, n_kv, S, d))
    _shape(k, "v_out", v_out, (batch, n_kv, S, d))
    return _launch(k, (max(tokens, 1), n_heads + n_kv), _row_threads(d),
                   (proj, tokens, S, n_heads, n_kv, d, int(bool(has_v)), q_norm, k_norm, cos, sin, q_out, k_out,
                    v_out, eps, int(bool(bf16))))


# ------------------------------------------------------------------------------------------------ attention.cu
def attention_shared_bytes(q_block: int, r: int, d: int, key_tile: int) -> int:
    """Dynamic shared memory of ``dg_attention``: key positions (int64) and flags (int32), the block's
    queries, a padded key tile and a value tile (float32)."""
    split = 32 // key_tile
    return key_tile * 12 + 4 * (q_block * r * d + key_tile * (2 * d + split))


def attention_plan(S: int, r: int, d: int, budget: int = ATTENTION_SHARED_BUDGET) -> tuple[int, int, int]:
    """(q_block, key_tile, shared bytes) for S queries, group size r, head dim d.

    A block holds q_block * r (query, head) rows, at most warps * DG_ATT_ROWS_PER_WARP; the key tile is the
    largest of 32, 16, 8, 4, 2, 1 keys whose tiles fit ``budget`` (with 32 / key_tile dividing d); below 8
    keys the block takes fewer queries instead. Raises ``LaunchError`` when nothing fits."""
    rows_cap = (const("DG_ATT_THREADS") // 32) * const("DG_ATT_ROWS_PER_WARP")
    if d <= 0 or d % 2 or d > const("DG_MAX_HEAD_DIM"):
        raise LaunchError(f"dg_attention: head dim {d} must be even and at most {const('DG_MAX_HEAD_DIM')}")
    if r < 1 or r > rows_cap:
        raise LaunchError(f"dg_attention: {r} query heads per KV head exceed the {rows_cap} rows of a block")
    q_block = max(1, min(S, rows_cap // r))
    while True:
        for key_tile in (32, 16, 8, 4, 2, 1):
            if d % (32 // key_tile):
                continue
            smem = attention_shared_bytes(q_block, r, d, key_tile)
            if smem <= budget and (key_tile >= 8 or q_block == 1):
                return q_block, key_tile, smem
        if q_block == 1:
            raise LaunchError(f"dg_attention: head dim {d} with {r} heads per KV head does not fit "
                              f"{budget} bytes of shared memory")
        q_block = max(1, q_block // 2)


def attention(q, q_pos, cache_k, cache_v, cache_rows, n_cache: int, slot_pos, cache_real, new_k, new_v, new_pos,
              new_real, window: int, causal: bool, out, budget: int = ATTENTION_SHARED_BUDGET) -> Launch:
    """Grouped-query attention over [cache slots ++ new keys] (see ``dg_attention``).

    q (N, S, n_h, d) float32; q_pos (S,) int64; cache_k, cache_v (B_c, g, slots, d) or None (no cache);
    cache_rows (N,) int32 or None (row n reads cache row n); n_cache <= slots: leading slots to scan;
    slot_pos (slots,) int64; cache_real (B_c, P) uint8; new_k, new_v (N, g, n_new, d) or None; new_pos
    (n_new,) int64; new_real (N, n_new) uint8; out (N, S, n_h * d)."""
    k = "dg_attention"
    N, S, n_h, d, g, values = _attention_operands(k, q, q_pos, cache_k, cache_v, cache_rows, n_cache, slot_pos,
                                                  cache_real, new_k, new_v, new_pos, new_real, window, causal, out)
    q_block, key_tile, smem = attention_plan(S, n_h // g, d, budget)
    grid = (max(1, -(-S // q_block)), g, max(N, 1))
    return _launch(k, grid, const("DG_ATT_THREADS"), values + (q_block, key_tile, out), smem)


def _attention_operands(k: str, q, q_pos, cache_k, cache_v, cache_rows, n_cache: int, slot_pos, cache_real, new_k,
                        new_v, new_pos, new_real, window: int, causal: bool, out) -> tuple:
    """The operand checks shared by ``attention`` and ``attention_bf16`` (errors name kernel ``k``): returns
    (N, S, n_h, d, g, the kernel's arguments up to ``causal``)."""
    _ndim(k, "q", q, 4)
    N, S, n_h, d = q.shape
    _shape(k, "q_pos", q_pos, (S,))
    _shape(k, "out", out, (N, S, n_h * d))
    g = None
    if n_cache > 0:
        if cache_k is None or cache_v is None or slot_pos is None or cache_real is None:
            raise LaunchError(f"{k}: n_cache={n_cache} but the cache arrays are missing")
        _ndim(k, "cache_k", cache_k, 4)
        B_c, g, slots, dk = cache_k.shape
        if dk != d:
            raise LaunchError(f"{k}: cache head dim {dk} != query head dim {d}")
        if n_cache > slots:
            raise LaunchError(f"{k}: n_cache={n_cache} exceeds the {slots} cache slots")
        _shape(k, "cache_v", cache_v, cache_k.shape)
        _shape(k, "slot_pos", slot_pos, (slots,))
        _ndim(k, "cache_real", cache_real, 2)
        if cache_real.shape[0] != B_c:
            raise LaunchError(f"{k}: cache_real has {cache_real.shape[0]} rows, the cache {B_c}")
        if cache_rows is None and N > B_c:
            raise LaunchError(f"{k}: {N} query rows but only {B_c} cache rows")
        _shape(k, "cache_rows", cache_rows, (N,))
        real_stride = cache_real.shape[1]
    else:
        cache_k = cache_v = slot_pos = cache_real = cache_rows = None
        slots, real_stride = 0, 0
    n_new = 0
    if new_k is not None:
        _ndim(k, "new_k", new_k, 4)
        if new_k.shape[0] != N or new_k.shape[3] != d:
            raise LaunchError(f"{k}: new_k has shape {tuple(new_k.shape)}, expected ({N}, g, n_new, {d})")
        if g is not None and new_k.shape[1] != g:
            raise LaunchError(f"{k}: new_k has {new_k.shape[1]} KV heads, the cache {g}")
        g, n_new = new_k.shape[1], new_k.shape[2]
        _shape(k, "new_v", new_v, new_k.shape)
        _shape(k, "new_pos", new_pos, (n_new,))
        _shape(k, "new_real", new_real, (N, n_new))
    else:
        new_v = new_pos = new_real = None
    if g is None:
        raise LaunchError(f"{k}: no keys at all (no cache entries and no new keys)")
    if g <= 0 or n_h % g:
        raise LaunchError(f"{k}: {g} KV heads do not divide {n_h} query heads")
    return N, S, n_h, d, g, (q, q_pos, N, S, n_h, d, cache_k, cache_v, cache_rows, n_cache, slots, slot_pos,
                             cache_real, real_stride, new_k, new_v, n_new, new_pos, new_real, g, int(window or 0),
                             int(bool(causal)))


# ------------------------------------------------------------------------------------------------ attention_bf16.cu
@functools.lru_cache(maxsize=None)
def _attention_bf16_constants(directory: str = CUDA_DIR) -> dict[str, int]:
    """The ``#define DG_ATTB_*`` constants of attention_bf16.cu (kept with that kernel rather than in common.cuh)."""
    with open(os.path.join(directory, "attention_bf16.cu"), encoding="utf-8") as f:
        return {k: int(v) for k, v in _DEFINE.findall(f.read()) if k.startswith("DG_ATTB_")}


def attention_bf16_shared_bytes(row_tiles: int, d: int) -> int:
    """Dynamic shared memory of ``dg_attention_bf16`` for blocks of R = 16 * row_tiles (query, head) rows and head
    dim d (d16: d rounded up to 16; K = DG_ATTB_KEYS keys per tile): the tile's key positions and the rows' query
    positions (int64), the key flags and the rows' maxima and sums (4 bytes each), then 32-bit bf16 pairs: the
    rows' queries (rows of d16 / 2 + 4 pairs), the tile's keys (the same rows) or, in their place, its values
    transposed (d16 rows of K / 2 + 4 pairs), and the tile's float32 scores (R rows of K + 1; the weights' pairs
    reuse them)."""
    K = _attention_bf16_constants()["DG_ATTB_KEYS"]
    R, d16 = 16 * row_tiles, -(-d // 16) * 16
    return 8 * (K + R) + 4 * (K + 2 * R) + 4 * (R * (d16 // 2 + 4) + max(K * (d16 // 2 + 4), d16 * (K // 2 + 4))
                                                + R * (K + 1))


def attention_bf16_plan(S: int, r: int, d: int, budget: int = ATTENTION_SHARED_BUDGET) -> tuple[int, int]:
    """(row_tiles, shared bytes) of ``dg_attention_bf16`` for S queries, r query heads per KV head, head dim d.

    A block holds R = 16 * row_tiles of the S * r (query, head) rows of one KV head: the largest power of two
    row_tiles <= DG_ATTB_MAX_ROW_TILES whose R x d16 outputs (d16 = d rounded up to 16) fit the warps' registers
    (row_tiles * d16 / 8 output tiles of 16 x 8, at most DG_ATTB_OUT_TILES per warp), halved while half as many
    rows cover S * r, and whose shared memory fits ``budget``: head dims 512, 256 and <= 128 get 32, 64 and 128
    rows (79,360, 64,128 and 64,384 bytes for d = 512, 256, 128). Raises ``LaunchError`` for a head dim outside
    1..DG_MAX_HEAD_DIM or when one row tile does not fit ``budget``."""
    c, k = _attention_bf16_constants(), "dg_attention_bf16"
    if d <= 0 or d > const("DG_MAX_HEAD_DIM"):
        raise LaunchError(f"{k}: head dim {d} must be 1 to {const('DG_MAX_HEAD_DIM')}")
    if r < 1:
        raise LaunchError(f"{k}: {r} query heads per KV head (at least 1)")
    d16 = -(-d // 16) * 16
    out_tiles = c["DG_ATTB_THREADS"] // 32 * c["DG_ATTB_OUT_TILES"]
    row_tiles = c["DG_ATTB_MAX_ROW_TILES"]
    while row_tiles > 1 and (row_tiles * d16 // 8 > out_tiles or 8 * row_tiles >= S * r):
        row_tiles //= 2
    while attention_bf16_shared_bytes(row_tiles, d) > budget:
        if row_tiles == 1:
            raise LaunchError(f"{k}: head dim {d} does not fit {budget} bytes of shared memory "
                              f"({attention_bf16_shared_bytes(1, d)} needed)")
        row_tiles //= 2
    return row_tiles, attention_bf16_shared_bytes(row_tiles, d)


def attention_bf16(q, q_pos, cache_k, cache_v, cache_rows, n_cache: int, slot_pos, cache_real, new_k, new_v, new_pos,
                   new_real, window: int, causal: bool, out, budget: int = ATTENTION_SHARED_BUDGET) -> Launch:
    """The attention of a bfloat16 run (see ``dg_attention_bf16``), on tensor cores from sm_80: the parameters,
    shapes and checks of ``attention`` (the float32 arrays holding bfloat16 values), the semantics of
    ``reference.layers.attend(..., dtype=BFLOAT16)`` (scores and normalised weights rounded to bfloat16, a
    float32 softmax, the output rounded to bfloat16; out receives bfloat16 values as float32). The launch plan
    is ``attention_bf16_plan``'s; grid (ceil(S * r / R), g, N). Raises ``LaunchError``."""
    k = "dg_attention_bf16"
    N, S, n_h, d, g, values = _attention_operands(k, q, q_pos, cache_k, cache_v, cache_rows, n_cache, slot_pos,
                                                  cache_real, new_k, new_v, new_pos, new_real, window, causal, out)
    row_tiles, smem = attention_bf16_plan(S, n_h // g, d, budget)
    grid = (max(1, -(-(S * (n_h // g)) // (16 * row_tiles))), g, max(N, 1))
    return _launch(k, grid, _attention_bf16_constants()["DG_ATTB_THREADS"], values + (row_tiles, out), smem)


# ------------------------------------------------------------------------------------------------ moe.cu
def moe_rows(n_tokens: int, top_k: int, n_experts: int) -> tuple[int, int]:
    """(tiles, rows) of the grouped expert buffers: every expert's group padded to whole tiles of
    DG_GEMM_TM rows, for any routing of n_tokens * top_k choices."""
    tm = const("DG_GEMM_TM")
    rows = n_tokens * top_k + n_experts * (tm - 1)
    tiles = max(1, -(-rows // tm))
    return tiles, tiles * tm


def router(probs, per_expert_scale, indices, weights) -> Launch:
    """Softmax, top-K and weights of the router; probs (N, E) float32 (overwritten), indices (N, K) int64,
    weights (N, K) float32, per_expert_scale (E,)."""
    k = "dg_router"
    _ndim(k, "probs", probs, 2)
    N, E = probs.shape
    _ndim(k, "indices", indices, 2)
    K = indices.shape[1]
    if not 1 <= K <= min(E, 32):
        raise LaunchError(f"{k}: top_k={K} must be in [1, min(experts={E}, 32)]")
    _shape(k, "indices", indices, (N, K))
    _shape(k, "weights", weights, (N, K))
    _shape(k, "per_expert_scale", per_expert_scale, (E,))
    threads = 128
    return _launch(k, max(1, -(-N // (threads // 32))), threads, (probs, per_expert_scale, indices, weights, N, E, K))


def group_experts(indices, n_experts: int, offsets, row_token, choice_row, tile_expert) -> Launch:
    """Counting sort of the choices by expert (one block). indices (N, K) int64; offsets (E+1,) int32;
    row_token (tiles * TM,) int32; choice_row (N, K) int32; tile_expert (tiles,) int32."""
    k = "dg_group_experts"
    _ndim(k, "indices", indices, 2)
    N, K = indices.shape
    tiles, rows = moe_rows(N, K, n_experts)
    _shape(k, "offsets", offsets, (n_experts + 1,))
    _shape(k, "row_token", row_token, (rows,))
    _shape(k, "choice_row", choice_row, (N, K))
    _shape(k, "tile_expert", tile_expert, (tiles,))
    return _launch(k, 1, const("DG_ROW_THREADS"),
                   (indices, N, K, n_experts, offsets, row_token, choice_row, tile_expert, tiles))


def gather_rows(src, row_token, dst) -> Launch:
    """``dst[r] = src[row_token[r]]`` (zero rows for -1). src (N, H); row_token (R,) int32; dst (R, H)."""
    k = "dg_gather_rows"
    _ndim(k, "src", src, 2)
    R = row_token.shape[0]
    _shape(k, "dst", dst, (R, src.shape[1]))
    return _launch(k, max(R, 1), _row_threads(src.shape[1]), (src, row_token, dst, R, src.shape[1]))


def grouped_gemm_nt(x, w, tile_group, y) -> Launch:
    """Per row tile m of TM rows: ``y[tile] = x[tile] @ w[tile_group[m]].T``. x (tiles*TM, K); w (G, n_out, K);
    tile_group (tiles,) int32; y (tiles*TM, n_out)."""
    k = "dg_grouped_gemm_nt"
    tiles, n_out, K = _grouped_operands(k, x, w, tile_group, y)
    return _launch(k, (max(1, -(-n_out // const("DG_GEMM_TN"))), max(tiles, 1)), const("DG_GEMM_THREADS"),
                   (x, w, tile_group, y, tiles, n_out, K))


def _grouped_operands(k: str, x, w, tile_group, y, y_acc=None) -> tuple[int, int, int]:
    """(tiles, n_out, K) of a grouped product's operands, checked (both grouped GEMMs: TM-row tiles, each
    naming one of G matrices of w (G, n_out, K))."""
    tm = const("DG_GEMM_TM")
    _ndim(k, "w", w, 3)
    _ndim(k, "tile_group", tile_group, 1)
    G, n_out, K = w.shape
    if G == 0:
        raise LaunchError(f"{k}: w holds no group (shape {tuple(w.shape)}); every tile names one")
    tiles = tile_group.shape[0]
    _shape(k, "x", x, (tiles * tm, K))
    _shape(k, "y", y, (tiles * tm, n_out))
    _shape(k, "y_acc", y_acc, (tiles * tm, n_out))
    if tiles > 65535:
        raise LaunchError(f"{k}: {tiles} row tiles exceed the grid's y limit 65535")
    return tiles, n_out, K


def grouped_gemm_bf16(x, w, tile_group, y, y_acc=None) -> Launch:
    """The bfloat16 ``grouped_gemm_nt`` on tensor cores (see ``dg_grouped_gemm_bf16``): per row tile m of TM rows,
    ``y[tile] = bf16(x[tile] @ w[tile_group[m]].T)`` with float32 sums. x (tiles*TM, K) float32 holding bfloat16
    values; w (G, n_out, K) uint16 bfloat16 bits (each expert's (out, in) matrix); tile_group (tiles,) int32;
    y (tiles*TM, n_out) float32, the outputs rounded to bfloat16; y_acc: None or (tiles*TM, n_out) float32, the
    float32 accumulator as it is."""
    k = "dg_grouped_gemm_bf16"
    tiles, n_out, K = _grouped_operands(k, x, w, tile_group, y, y_acc)
    return _launch(k, (max(1, -(-n_out // const("DG_MOE_BF16_TN"))), max(tiles, 1)), const("DG_MOE_BF16_THREADS"),
                   (x, w, tile_group, y, y_acc, tiles, n_out, K))


def combine_experts(expert_out, indices, choice_row, weights, out, bf16: bool = False) -> Launch:
    """``out[t] = sum_k weights[t, k] * expert_out[choice_row[t, k]]`` in ascending expert order, float32.
    expert_out (R, H); indices (N, K) int64; choice_row (N, K) int32; weights (N, K) float32; out (N, H).
    bf16: a bfloat16 run's (SPEC §10.1 B6): expert_out holds bfloat16 values and the float32 sum is rounded once
    to bfloat16."""
    k = "dg_combine_experts"
    _ndim(k, "indices", indices, 2)
    N, K = indices.shape
    if K > 32:
        raise LaunchError(f"{k}: top_k={K} exceeds 32")
    _ndim(k, "expert_out", expert_out, 2)
    H = expert_out.shape[1]
    _shape(k, "choice_row", choice_row, (N, K))
    _shape(k, "weights", weights, (N, K))
    _shape(k, "out", out, (N, H))
    return _launch(k, max(N, 1), _row_threads(H), (expert_out, indices, choice_row, weights, out, N, K, H,
                                                   int(bool(bf16))))


# ------------------------------------------------------------------------------------------------ sampling.cu
def sample_static_shared() -> int:
    """Static shared memory of dg_sample_rows, bytes: DG_SAMPLE_THREADS / 32 + 1 DgStats of 32 bytes (cuda-sim's
    layout and the ptxas report are checked against it in tests/test_gpu_limits.py)."""
    return 32 * (const("DG_SAMPLE_THREADS") // 32 + 1)


def sample_rows(logits, rows, cap: float, temp: float, uniforms, argmax, entropy, sampled, flags) -> Launch:
    """The per-row sampling pass (see ``dg_sample_rows``). logits (R_all, V) float32; rows (R,) int32 row
    indices; cap > 0 soft-caps first (0: none); temp > 0 divides (0: none); uniforms (R,) float64 or None
    (no draw); argmax, sampled (R,) int64; entropy (R,) float32; flags (R,) int32."""
    k = "dg_sample_rows"
    _ndim(k, "logits", logits, 2)
    R_all, V = logits.shape
    _ndim(k, "rows", rows, 1)
    R = rows.shape[0]
    for name, a in (("uniforms", uniforms), ("argmax", argmax), ("entropy", entropy), ("sampled", sampled),
                    ("flags", flags)):
        _shape(k, name, a, (R,))
    if not (cap >= 0 and temp >= 0):
        raise LaunchError(f"{k}: cap ({cap}) and temp ({temp}) must be >= 0 (0 = not applied)")
    chunks = -(-V // const("DG_SAMPLE_CHUNK"))
    smem = 8 * chunks
    if smem + sample_static_shared() > DEFAULT_SHARED_LIMIT:
        raise LaunchError(f"{k}: vocabulary {V} needs {smem} bytes of chunk sums, and the kernel's static shared "
                          f"memory {sample_static_shared()} more (> {DEFAULT_SHARED_LIMIT})")
    return _launch(k, max(R, 1), const("DG_SAMPLE_THREADS"),
                   (logits, rows, R, V, cap, temp, uniforms, argmax, entropy, sampled, flags), smem)


def accept_renoise(entropy, sampled, noise, bound: float, accepted, next_canvas) -> Launch:
    """Entropy-bound acceptance and renoising, one block per batch row. entropy (B, C) float32; sampled,
    noise, next_canvas (B, C) int64; accepted (B, C) uint8."""
    k = "dg_accept_renoise"
    _ndim(k, "entropy", entropy, 2)
    B, C = entropy.shape
    for name, a in (("sampled", sampled), ("noise", noise), ("accepted", accepted), ("next_canvas", next_canvas)):
        _shape(k, name, a, (B, C))
    smem = 9 * C
    if smem > DEFAULT_SHARED_LIMIT:
        raise LaunchError(f"{k}: canvas length {C} needs {smem} bytes of shared memory (> {DEFAULT_SHARED_LIMIT})")
    return _launch(k, max(B, 1), const("DG_ACCEPT_THREADS"), (entropy, sampled, noise, B, C, bound, accepted,
                                                             next_canvas),
                   smem)


def sample_step(logits, rows, cap: float, temps, step, uniforms, argmax, entropy, sampled, flags,
                bf16_sc=None) -> Launch:
    """The sampling pass of one step of a captured canvas loop (see ``dg_sample_step``): the same launch at
    every step, the step index read from ``step`` (1,) int32. logits (B*C, V) float32; rows (R,) int32 flat
    rows b*C + c; temps (N,) float32 (0: no temperature); uniforms and flags (N, B*C) float64 / int32;
    argmax, sampled (B*C,) int64; entropy (B*C,) float32. bf16_sc: None (the float32 run), or the bf16 flag
    of a bfloat16 model's run: a (B*C, V) float32 array whose rows ``rows`` receive the next step's
    self-conditioning probabilities, the float32 softmax of the processed logits rounded to bfloat16 (SPEC B8)."""
    k = "dg_sample_step"
    _ndim(k, "logits", logits, 2)
    n, V = logits.shape
    _ndim(k, "rows", rows, 1)
    _ndim(k, "temps", temps, 1)
    N = temps.shape[0]
    _shape(k, "step", step, (1,))
    for name, a in (("uniforms", uniforms), ("flags", flags)):
        _shape(k, name, a, (N, n))
    for name, a in (("argmax", argmax), ("entropy", entropy), ("sampled", sampled)):
        _shape(k, name, a, (n,))
    _shape(k, "bf16_sc", bf16_sc, (n, V))
    if not cap >= 0:
        raise LaunchError(f"{k}: cap ({cap}) must be >= 0 (0 = not applied)")
    smem = 8 * -(-V // const("DG_SAMPLE_CHUNK"))
    if smem + sample_static_shared() > DEFAULT_SHARED_LIMIT:
        raise LaunchError(f"{k}: vocabulary {V} needs {smem} bytes of chunk sums, and the kernel's static shared "
                          f"memory {sample_static_shared()} more (> {DEFAULT_SHARED_LIMIT})")
    R = rows.shape[0]
    return _launch(k, max(R, 1), const("DG_SAMPLE_THREADS"),
                   (logits, rows, R, V, cap, temps, step, uniforms, n, argmax, entropy, sampled, flags, bf16_sc),
                   smem)


def step_update(argmax, entropy, sampled, noise, step, bound: float, stop_rule: bool, stability: int,
                gamma: float, canvas, draft, entropies, finished, finish_step, history, records=None) -> Launch:
    """Acceptance, renoising, freezing and the stopping rule of one captured step (see ``dg_step_update``).
    argmax, sampled (B*C,) int64 and entropy (B*C,) float32 (``sample_step``'s outputs); noise (N, B, C) int64;
    step (1,) int32; canvas, draft (B, C) int64; entropies (B, C) float32; finished (B,) uint8; finish_step (B,)
    int32; history (max(stability, 1), B, C) int64; records: None or (draft, sampled, canvas, entropies,
    accepted, finished) of shapes (N, B, C) and (N, B)."""
    k = "dg_step_update"
    _ndim(k, "canvas", canvas, 2)
    B, C = canvas.shape
    _ndim(k, "noise", noise, 3)
    N = noise.shape[0]
    _shape(k, "noise", noise, (N, B, C))
    for name, a in (("argmax", argmax), ("entropy", entropy), ("sampled", sampled)):
        _shape(k, name, a, (B * C,))
    _shape(k, "step", step, (1,))
    for name, a in (("draft", draft), ("entropies", entropies)):
        _shape(k, name, a, (B, C))
    for name, a in (("finished", finished), ("finish_step", finish_step)):
        _shape(k, name, a, (B,))
    if stability < 0:
        raise LaunchError(f"{k}: stability {stability} must be >= 0")
    _shape(k, "history", history, (max(stability, 1), B, C))
    if records is None:
        records = (None,) * 6
    else:
        for name, a in zip(("rec_draft", "rec_sampled", "rec_canvas", "rec_entropies", "rec_accepted"), records[:5]):
            _shape(k, name, a, (N, B, C))
        _shape(k, "rec_finished", records[5], (N, B))
    smem = 9 * C
    if smem > DEFAULT_SHARED_LIMIT:
        raise LaunchError(f"{k}: canvas length {C} needs {smem} bytes of shared memory (> {DEFAULT_SHARED_LIMIT})")
    return _launch(k, max(B, 1), const("DG_ACCEPT_THREADS"),
                   (argmax, entropy, sampled, noise, step, B, C, bound, int(bool(stop_rule)), stability,
                    gamma, canvas, draft, entropies, finished, finish_step, history, *records), smem)


def step_end(flags, finish_step, status, step) -> Launch:
    """The end of one captured step (see ``dg_step_end``): flags (N, n) int32; finish_step (B,) int32; status
    (N + B,) int32; step (1,) int32, advanced by one."""
    k = "dg_step_end"
    _ndim(k, "flags", flags, 2)
    N, n = flags.shape
    _ndim(k, "finish_step", finish_step, 1)
    B = finish_step.shape[0]
    _shape(k, "status", status, (N + B,))
    _shape(k, "step", step, (1,))
    return _launch(k, 1, const("DG_ACCEPT_THREADS"), (flags, n, finish_step, B, status, step))


# ------------------------------------------------------------------------------------------------ gemm_bf16.cu
def gemm_bf16(a, b, c=None, c_bf16=None, *, a_f32=None, b_kn: bool = False, round_c: bool = False) -> Launch:
    """``a @ b.T`` of bfloat16 matrices with float32 accumulation (see ``dg_gemm_bf16``), on tensor cores from
    sm_80. a (M, K) and b (N, K) uint16: bfloat16 bits (``x.astype(ml_dtypes.bfloat16).view(np.uint16)``);
    c (M, N) float32: the float32 accumulator; c_bf16 (M, N) uint16: it rounded to bfloat16, nearest, ties to
    even (the reference's ``linear(..., dtype=bfloat16)``). Either output may be None, not both.
    a_f32 (M, K) float32 instead of a (a is then None): rounded to bfloat16 as it is loaded (exact for the
    bf16-valued activations of a bfloat16 run). b_kn: b is (K, N) and the product is ``a @ b`` (the
    self-conditioning ``probs @ E`` with the table as stored). round_c: c receives the accumulator rounded to
    bfloat16, widened to float32 (a bfloat16 run's activation)."""
    k = "dg_gemm_bf16"
    if (a is None) == (a_f32 is None):
        raise LaunchError(f"{k}: give exactly one of a (bfloat16 bits) and a_f32 (float32)")
    if a is not None and np.dtype(a.dtype) != np.uint16:
        raise LaunchError(f"{k}: a must be uint16, got {np.dtype(a.dtype)}")
    if a_f32 is not None and np.dtype(a_f32.dtype) != np.float32:
        raise LaunchError(f"{k}: a_f32 must be float32, got {np.dtype(a_f32.dtype)}")
    _ndim(k, "a" if a is not None else "a_f32", a if a is not None else a_f32, 2)
    _ndim(k, "b", b, 2)
    M, K = (a if a is not None else a_f32).shape
    N = b.shape[1] if b_kn else b.shape[0]
    if (b.shape[0] if b_kn else b.shape[1]) != K:
        expected = (K, N) if b_kn else (N, K)
        raise LaunchError(f"{k}: b has shape {tuple(b.shape)}, expected {expected} (the inner dimension of a)")
    if c is None and c_bf16 is None:
        raise LaunchError(f"{k}: no output (c and c_bf16 are both None)")
    _shape(k, "c", c, (M, N))
    _shape(k, "c_bf16", c_bf16, (M, N))
    tm, tn = const("DG_BF16_TM"), const("DG_BF16_TN")
    grid = (max(1, -(-N // tn)), max(1, -(-M // tm)))
    if grid[1] > 65535:
        raise LaunchError(f"{k}: {M} rows need {grid[1]} row tiles, over the grid's y limit 65535")
    return _launch(k, grid, const("DG_BF16_THREADS"), (a, b, c, c_bf16, M, N, K, a_f32, int(bool(b_kn)),
                                                       int(bool(round_c))))


# ------------------------------------------------------------------------------------------------ round_bf16.cu
def round_bf16(x) -> Launch:
    """``x = float32(bfloat16(x))`` in place over every element of x (float32, any shape, contiguous): the
    reference's ``round_to(x, BFLOAT16)`` (nearest, ties to even; NaN and infinities kept), see ``dg_round_bf16``."""
    n = int(math.prod(x.shape))
    threads = 256
    blocks = max(1, min(-(-n // threads), 65535 * 16))
    return _launch("dg_round_bf16", blocks, threads, (x, n))
