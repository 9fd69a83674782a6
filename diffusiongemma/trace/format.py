"""The trace file: naming of its tensors, its JSON header, the writer and the reader (``Trace``).

The format is described for writers in other languages in ``docs/TRACE_FORMAT.md``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from diffusiongemma.reference.support.errors import InputError

FORMAT_NAME = "diffusiongemma-trace"
FORMAT_VERSION = 1
METADATA_KEY = "diffusiongemma.trace"  # the safetensors metadata entry holding the JSON header

# How a tensor is compared. "float": |a - b| <= atol + rtol * |a| elementwise, NaN never passes; "exact": equal
# values (ids, masks, counts; integer widths and bool vs 0/1 do not matter); "topk_ids": equal up to ties
# within tolerance (see ``_compare_topk_ids``).
KINDS = ("float", "exact", "topk_ids")
# Which part of the run a tensor belongs to. A group recorded by only one of two traces is skipped (and said so).
GROUPS = ("prompt", "encoder_kv", "input_embedding", "layer_output", "logits", "sampler", "commit", "output")

# Default tolerances, for two float32 implementations of the same math. Summation order alone makes float32
# results differ by ~1e-5..1e-4 absolute on the values traced here (magnitudes O(1)-O(30); measured against a
# float64 evaluation in tests/test_model_parity.py::test_float32_noise_floor), and a semantic mistake moves
# them by O(0.1)-O(1). atol = 2e-4 sits above the first and far below the second; rtol = 1e-4 keeps large
# values (residual streams of deep models reach O(100)-O(1000), where float32 rounding alone is ~1e-4
# relative after a few dozen layers) from failing on rounding. bfloat16 ports need looser values.
DEFAULT_ATOL = 2e-4
DEFAULT_RTOL = 1e-4

FULL_LOGITS_MAX_VOCAB = 8192  # "auto" logits mode: full logits up to this vocabulary size, top-k beyond
DEFAULT_TOP_K = 32  # ids kept per position in "topk" mode
_LAYERS_AUTO_BYTES = 16 * 2**20  # layers_by_default: per-step layer outputs up to this size
_SUMMARY_CHUNK_ELEMENTS = 1 << 22  # rows of logits summarised at once in float64 (memory bound only)


class TraceError(InputError):
    """A trace file that cannot be read or trusted (corrupt, truncated, wrong version, inconsistent header),
    two traces that cannot be compared (different models or settings), or recorder calls out of order."""



# ================================================================================================ naming
def encode_name(e: int, layer: int, what: str) -> str:
    """``encode{e}.layer{l}.{what}`` (what: keys, values, cached)."""
    return f"encode{e}.layer{layer}.{what}"


def canvas_name(k: int, what: str) -> str:
    """``canvas{k}.{what}`` (what: initial, committed, ended)."""
    return f"canvas{k}.{what}"


def step_name(k: int, i: int, what: str) -> str:
    """``canvas{k}.step{i}.{what}`` (i counts executed steps from 0; transformers' cur_step is N - i)."""
    return f"canvas{k}.step{i}.{what}"


TOPK_PARTS = ("topk_values", "topk_ids", "logsumexp", "entropy")  # suffixes of a "topk" mode logits record



# ================================================================================================ the file
def write_trace(path: str | os.PathLike, header: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``tensors`` as safetensors with the JSON ``header`` under metadata key ``diffusiongemma.trace``.

    The header and the tensors are checked exactly as ``Trace`` checks them when reading (so nothing is
    written that cannot be read back); ``TraceError`` otherwise. The file appears atomically (written
    beside ``path`` and renamed); no partial file is left behind on error.
    """
    from safetensors.numpy import save_file

    header = dict(header)
    _check_header(header, str(path))
    _check_tensor_set(header, {name: (np.asarray(t).dtype, np.shape(t)) for name, t in tensors.items()}, str(path))
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    fd, temporary = tempfile.mkstemp(prefix=".trace-", dir=directory)
    os.close(fd)
    try:
        save_file({name: np.asarray(t, order="C") for name, t in tensors.items()}, temporary,
                  metadata={METADATA_KEY: json.dumps(header, sort_keys=False)})
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _check_header(header: Any, where: str) -> None:
    """Validate a header dict (format, version, model, logits, run order); ``TraceError`` naming the problem."""
    if not isinstance(header, Mapping):
        raise TraceError(f"{where}: the trace header must be a JSON object, got {type(header).__name__}")
    if header.get("format") != FORMAT_NAME:
        raise TraceError(f"{where}: header 'format' is {header.get('format')!r}, expected {FORMAT_NAME!r}")
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TraceError(f"{where}: header 'version' must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise TraceError(f"{where}: written in trace format version {version}; this diffusiongemma reads "
                         f"version {FORMAT_VERSION} only (upgrade diffusiongemma)")
    if version != FORMAT_VERSION:
        raise TraceError(f"{where}: trace format version {version} is not supported (this reader: {FORMAT_VERSION})")
    model = header.get("model")
    if not isinstance(model, Mapping):
        raise TraceError(f"{where}: header 'model' must be an object")
    for key in ("vocab_size", "canvas_length", "hidden_size", "num_hidden_layers"):
        value = model.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TraceError(f"{where}: header model.{key} must be a positive integer, got {value!r}")
    digest = model.get("config_hash")
    if digest is not None and not (isinstance(digest, str) and digest.startswith("sha256:")):
        raise TraceError(f"{where}: header model.config_hash must be null or 'sha256:<hex>', got {digest!r}")
    if not isinstance(header.get("generation", {}), Mapping):
        raise TraceError(f"{where}: header 'generation' must be an object")
    digest = header.get("generation_hash")
    if digest is not None and not (isinstance(digest, str) and digest.startswith("sha256:")):
        raise TraceError(f"{where}: header generation_hash must be null or 'sha256:<hex>', got {digest!r}")
    logits = header.get("logits")
    if not isinstance(logits, Mapping) or logits.get("mode") not in ("full", "topk"):
        raise TraceError(f"{where}: header logits.mode must be 'full' or 'topk', got {logits!r}")
    draws = header.get("draws", {})
    tape = draws.get("tape") if isinstance(draws, Mapping) else None
    if not isinstance(draws, Mapping) or not (tape is None or (isinstance(tape, list) and all(
            kind in ("canvas", "categorical", "renoise") for kind in tape))):
        raise TraceError(f"{where}: header draws.tape must be null or a list of 'canvas'/'categorical'/'renoise'")
    entries = header.get("tensors")
    if not isinstance(entries, list) or not entries:
        raise TraceError(f"{where}: header 'tensors' (the run order) must be a non-empty list")
    seen = set()
    for n, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise TraceError(f"{where}: run order entry {n} must be an object with a 'name', got {entry!r}")
        name = entry["name"]
        if name in seen:
            raise TraceError(f"{where}: tensor {name!r} appears twice in the run order")
        seen.add(name)
        if entry.get("group") not in GROUPS:
            raise TraceError(f"{where}: tensor {name!r} has group {entry.get('group')!r}; expected one of {GROUPS}")
        if entry.get("kind") not in KINDS:
            raise TraceError(f"{where}: tensor {name!r} has kind {entry.get('kind')!r}; expected one of {KINDS}")
        if name.startswith("draws."):
            raise TraceError(f"{where}: 'draws.*' names are reserved for the draw tape, found {name!r} in the "
                             "run order")


def json_digest(value: Any) -> str:
    """``"sha256:<hex>"`` of ``json.dumps(value, sort_keys=True, separators=(",", ":"))``: the digest of a
    header's recorded configuration (``model.config_hash`` of ``model.config``, ``generation_hash`` of
    ``generation``)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


_STEP_NAME = re.compile(r"canvas(\d+)\.step(\d+)\.draft")


def check_recorded_configuration(trace: "Trace") -> None:
    """Refuse (``TraceError`` naming the header field) a trace whose recorded configuration was altered after
    recording: ``model.config`` that no longer has the digest ``model.config_hash``, ``generation`` that no
    longer has the digest ``generation_hash`` (both checked when recorded), a model shape that disagrees
    with ``model.config`` or with the stored tensors (canvas width, vocabulary of full logits), or
    ``generation.max_denoising_steps`` below the steps a canvas ran."""
    header, where = trace.header, trace.path
    model = header["model"]
    config, digest = model.get("config"), model.get("config_hash")
    if isinstance(config, Mapping):
        if digest is not None and json_digest(config) != digest:
            raise TraceError(f"{where}: header model.config does not match model.config_hash: the recorded model "
                             "configuration was altered after recording")
        for key in ("vocab_size", "canvas_length", "hidden_size", "num_hidden_layers"):
            if key in config and config[key] != model[key]:
                raise TraceError(f"{where}: header model.{key} is {model[key]!r} but model.config.{key} is "
                                 f"{config[key]!r}: the recorded configuration was altered after recording")
    generation = header.get("generation") or {}
    digest = header.get("generation_hash")
    if digest is not None and json_digest(generation) != digest:
        raise TraceError(f"{where}: header generation does not match generation_hash: the recorded generation "
                         "settings were altered after recording")
    C, V = model["canvas_length"], model["vocab_size"]
    logits_full = header["logits"]["mode"] == "full"
    steps: dict[int, int] = {}
    for name, shape in trace.shapes.items():
        if re.fullmatch(r"canvas\d+\.(initial|committed)|canvas\d+\.step\d+\.(draft|canvas)", name):
            if not shape or shape[-1] != C:
                raise TraceError(f"{where}: tensor {name!r} has shape {tuple(shape)} but header model.canvas_length "
                                 f"is {C}")
        elif logits_full and re.fullmatch(r"canvas\d+\.step\d+\.logits", name) and (not shape or shape[-1] != V):
            raise TraceError(f"{where}: tensor {name!r} has shape {tuple(shape)} but header model.vocab_size is {V}")
        match = _STEP_NAME.fullmatch(name)
        if match:
            k = int(match.group(1))
            steps[k] = max(steps.get(k, 0), int(match.group(2)) + 1)
    limit = generation.get("max_denoising_steps")
    if isinstance(limit, int) and not isinstance(limit, bool) and steps and max(steps.values()) > limit:
        k = max(steps, key=steps.get)
        raise TraceError(f"{where}: header generation.max_denoising_steps is {limit} but canvas {k} ran {steps[k]} "
                         "steps: the recorded settings were altered after recording")


def _check_tensor_set(header: Mapping[str, Any], stored: Mapping[str, tuple], where: str) -> None:
    """The run order and the stored tensors must match one to one (draw tape aside), with sensible dtypes."""
    ordered = {entry["name"]: entry["kind"] for entry in header["tensors"]}
    missing = [name for name in ordered if name not in stored]
    if missing:
        raise TraceError(f"{where}: {len(missing)} tensor(s) of the run order are missing from the file, first "
                         f"{missing[0]!r}")
    tape = header.get("draws", {}).get("tape") or []
    draws = {f"draws.{n}" for n in range(len(tape))}
    extra = sorted(name for name in stored if name not in ordered and name not in draws)
    if extra:
        raise TraceError(f"{where}: the file holds tensor(s) that are neither in the run order nor the draw tape, "
                         f"first {extra[0]!r}")
    absent = sorted(name for name in draws if name not in stored)
    if absent:
        raise TraceError(f"{where}: the draw tape lists {len(tape)} draws but {absent[0]!r} is missing")
    for name, kind in ordered.items():
        dtype = np.dtype(stored[name][0])
        if kind == "float" and dtype.kind != "f":
            raise TraceError(f"{where}: tensor {name!r} is declared float but stored as {dtype}")
        if kind in ("exact", "topk_ids") and dtype.kind not in "biu":
            raise TraceError(f"{where}: tensor {name!r} is declared {kind} (integers or booleans) but stored as "
                             f"{dtype}")


class Trace:
    """A trace file opened for reading; the header and the tensor list are validated on open.

    ``Trace(path)`` raises ``TraceError`` for a missing file, a file that is not safetensors or is truncated,
    a safetensors file without a trace header, a header of another format version, or a run order that does
    not match the stored tensors. Tensors are read lazily (``get``); use it as a context manager or ``close``.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import SafetensorError, safe_open

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise TraceError(f"trace file {self.path!r} does not exist")
        try:
            self._file = safe_open(self.path, framework="np")
        except (SafetensorError, OSError, ValueError) as exc:
            raise TraceError(f"{self.path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None
        try:
            metadata = self._file.metadata() or {}
            if METADATA_KEY not in metadata:
                raise TraceError(f"{self.path}: no {METADATA_KEY!r} entry in the safetensors metadata; this is not a "
                                 "diffusiongemma trace (see docs/TRACE_FORMAT.md)")
            try:
                header = json.loads(metadata[METADATA_KEY])
            except json.JSONDecodeError as exc:
                raise TraceError(f"{self.path}: the trace header is not valid JSON: {exc}") from None
            _check_header(header, self.path)
            stored = {}
            for name in self._file.keys():
                view = self._file.get_slice(name)
                stored[name] = (_safetensors_dtype(view.get_dtype(), name, self.path), tuple(view.get_shape()))
            _check_tensor_set(header, stored, self.path)
        except BaseException:
            self.close()
            raise
        self.header: dict[str, Any] = header
        self.shapes = {name: shape for name, (_, shape) in stored.items()}
        self.names: list[str] = [entry["name"] for entry in header["tensors"]]  # run order
        self.entries: dict[str, dict] = {entry["name"]: entry for entry in header["tensors"]}

    @property
    def groups(self) -> set[str]:
        """Groups with at least one recorded tensor."""
        return {entry["group"] for entry in self.entries.values()}

    def get(self, name: str) -> np.ndarray:
        """The stored tensor ``name`` as a NumPy array."""
        if name not in self.shapes:
            raise TraceError(f"{self.path}: no tensor {name!r}")
        return self._file.get_tensor(name)

    def draw_tape(self) -> list[tuple[str, np.ndarray]] | None:
        """The recorded draws as a ``ReplayDraws`` tape, or None when the trace has none."""
        kinds = self.header.get("draws", {}).get("tape")
        if kinds is None:
            return None
        return [(kind, self.get(f"draws.{n}")) for n, kind in enumerate(kinds)]

    def close(self) -> None:
        file, self._file = getattr(self, "_file", None), None
        if file is not None and hasattr(file, "__exit__"):
            file.__exit__(None, None, None)

    def __enter__(self) -> "Trace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                       "U64": "uint64", "BOOL": "bool"}


def _safetensors_dtype(code: str, name: str, where: str) -> np.dtype:
    if code not in _SAFETENSORS_DTYPES:  # e.g. BF16, which NumPy cannot hold: write float32 traces
        raise TraceError(f"{where}: tensor {name!r} has dtype {code}; traces hold float16/32/64, integers or bool")
    return np.dtype(_SAFETENSORS_DTYPES[code])


