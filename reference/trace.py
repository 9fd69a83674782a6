"""Golden traces: record every intermediate of a generation run, store it in a versioned file, and find
the first tensor at which two runs part.

A trace is for someone porting DiffusionGemma (llama.cpp, MLX, vLLM, a custom engine): run the same prompt,
settings and random draws through the reference and through the port, write both traces, and
``diffusiongemma compare ref.trace port.trace`` names the first tensor that differs. The file format is
described for writers in other languages in ``docs/TRACE_FORMAT.md``; this module is its reference
implementation (writer, reader, comparison).

What a trace holds, in run order (B rows, C canvas positions, H hidden, V vocabulary; e counts encoder calls,
k canvases, i executed steps of a canvas, l layers)::

    prompt.input_ids                       (B, P) int64      exact
    prompt.attention_mask                  (B, P) int64      exact   (only when one was given)
    encode{e}.layer{l}.keys / .values      (B, g, m, d) f32  the m = min(n, T_l) newest cache entries of layer l
                                                             after encoding n tokens (T_l = entries retained);
                                                             padding positions written as 0
    encode{e}.layer{l}.cached              () int64          T_l, entries layer l retains (sliding: <= W - 1)
    canvas{k}.initial                      (B, C) int64      the canvas denoising starts from
    canvas{k}.step{i}.input_embedding      (B, C, H) f32     decoder input after self-conditioning and outer norm
    canvas{k}.step{i}.layer{l}.output      (B, C, H) f32     decoder layer l's output (optional, ``layers=True``)
    canvas{k}.step{i}.logits               (B, C, V) f32     soft-capped logits, when V is small ("full" mode), or
    canvas{k}.step{i}.logits.topk_values   (B, C, K) f32     ("topk" mode) the K largest logits, descending,
    canvas{k}.step{i}.logits.topk_ids      (B, C, K) int64     their ids (ties: lower id first),
    canvas{k}.step{i}.logits.logsumexp     (B, C) f32          log-sum-exp and entropy (nats) of softmax(logits)
    canvas{k}.step{i}.logits.entropy       (B, C) f32
    canvas{k}.step{i}.temperature          () f32            T_n of this step (absent without a schedule)
    canvas{k}.step{i}.draft                (B, C) int64      argmax of the processed logits
    canvas{k}.step{i}.sampled              (B, C) int64      categorical draws (-1 on frozen rows)
    canvas{k}.step{i}.sampler_entropy      (B, C) f32        entropies of softmax(logits / T) (the sampler's)
    canvas{k}.step{i}.accepted             (B, C) bool       entropy-bound acceptance mask
    canvas{k}.step{i}.canvas               (B, C) int64      the renoised canvas (next step's input)
    canvas{k}.step{i}.finished             (B,) bool         rows whose denoising has stopped after this step
    canvas{k}.committed                    (B, C) int64      the committed canvas after the EOS/pad rules
    canvas{k}.ended                        (B,) bool         rows that have ended (EOS, max length)
    output.sequences                       (B, P + k*C) int64

plus ``draws.{n}`` (B, C) int64, the random draws in the order they were made (when recorded), so another
implementation can replay exactly this run (``draws.ReplayDraws``).

Canonical values (so that legitimate implementation choices do not show up as differences):
* rows that finished denoising in an earlier step of the canvas ("frozen" rows) may be skipped by a fast
  path, so their per-step model tensors (input embedding, layer outputs, logits) are written as 0 and their
  ``sampled`` as -1, and their ``accepted`` as False;
* encoder keys/values of padding positions are written as 0 (upstream computes arbitrary values there that
  nothing ever reads).

How an implementation records a run: the few calls below, in this order (``TraceRecorder`` checks the
order and raises ``TraceError`` on a call out of place). Arrays are copied; the caller may reuse its buffers.

    rec = TraceRecorder(layers=False)                      # decide what to record
    rec.begin_run(model_config, generation_config, input_ids, attention_mask, draws=source)
    draws = rec.record_draws(source)                        # optional: keeps the draw tape in the trace
    for each encoder call:
        rec.begin_encode(ids, mask)
        ... encode ...
        rec.end_encode(cache)                               # or rec.encoder_kv(l, keys, values) per layer, then
                                                            #    rec.end_encode()
    for each canvas k:
        rec.begin_canvas(initial_canvas)
        for each executed step:
            rec.begin_step(live)                            # live: (B,) rows decoded this step (not frozen)
            rec.decoder_input(h, rows=None)                 # inside the decoder, after self-conditioning
            if rec.layers: rec.decoder_layer(l, h, rows=None)   # after each decoder layer
            rec.logits(logits, rows=None)                   # soft-capped decoder output, before sampling
            rec.end_step(temperature=..., draft=..., sampled=..., entropies=..., accepted=..., canvas=...,
                         finished=...)                      # the values ``StepInfo`` reports
        rec.commit(tokens, ended)                           # the canvas appended to the output
    rec.end_run(sequences)
    rec.save(path)

``rows`` lets a path that decodes only some rows pass (len(rows), C, ...) arrays for those rows.
``record_generate`` records any ``generate`` with the reference's interface: it passes ``trace=`` when that
``generate`` accepts it, and otherwise records from the outside through its ``encoder``/``denoiser``/
``callback`` arguments (everything except the decoder's input embedding and layer outputs, which only the
model can report).
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

from .errors import InputError

__all__ = [
    "TraceError", "TraceRecorder", "Trace", "Comparison", "Row", "compare_traces", "format_report",
    "record_generate", "summarize_logits", "config_hash", "write_trace", "layers_by_default",
    "FORMAT_NAME", "FORMAT_VERSION", "METADATA_KEY", "DEFAULT_ATOL", "DEFAULT_RTOL",
]

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


# ================================================================================================ helpers
def config_hash(config: Any) -> str | None:
    """``"sha256:<hex>"`` of the model architecture: SHA-256 of ``json.dumps(config.to_dict(), sort_keys=True,
    separators=(",", ":"))``. None for an object without ``to_dict`` (e.g. a stand-in model in tests).
    Weights are not hashed: a trace pins the architecture, the tensors show the weights."""
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return None
    text = json.dumps(to_dict(), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def layers_by_default(config: Any, batch_size: int = 1) -> bool:
    """Whether decoder layer outputs are recorded by default: when one step's outputs of all layers,
    ``B * C * H * N_L`` float32 values, fit in 16 MiB (the shipped tiny model: yes; the 26B model: no)."""
    size = 4 * batch_size * config.canvas_length * config.hidden_size * config.num_hidden_layers
    return size <= _LAYERS_AUTO_BYTES


def summarize_logits(logits: np.ndarray, top_k: int) -> dict[str, np.ndarray]:
    """The "topk" record of logits (..., V): the K = min(top_k, V) largest values per position in descending
    order with their ids (ties: lower id first), and log-sum-exp and entropy (nats) of softmax(logits).

    Returns ``{"topk_values": (..., K) float32, "topk_ids": (..., K) int64, "logsumexp": (...) float32,
    "entropy": (...) float32}``; the log-sum-exp and entropy are accumulated in float64. Rows are processed in
    chunks to bound memory (a (256, 262144) block in float64 would be 512 MiB).
    """
    z = np.asarray(logits, dtype=np.float32)
    V = z.shape[-1]
    k = max(1, min(int(top_k), V))
    flat = z.reshape(-1, V)  # (R, V)
    R = flat.shape[0]
    values = np.empty((R, k), dtype=np.float32)
    ids = np.empty((R, k), dtype=np.int64)
    lse = np.empty(R, dtype=np.float64)
    entropy = np.empty(R, dtype=np.float64)
    chunk = max(1, _SUMMARY_CHUNK_ELEMENTS // V)
    for start in range(0, R, chunk):
        block = flat[start:start + chunk]  # (r, V)
        key = _descending_key(block)  # (r, V) uint64, unique per row: larger value first, then lower id
        part = np.argpartition(key, V - k, axis=-1)[:, V - k:] if k < V else np.broadcast_to(np.arange(V), key.shape)
        order = np.argsort(np.take_along_axis(key, part, axis=-1), axis=-1)[:, ::-1]
        chosen = np.take_along_axis(part, order, axis=-1)  # (r, k) ids, best first
        ids[start:start + chunk] = chosen
        values[start:start + chunk] = np.take_along_axis(block, chosen, axis=-1)
        wide = block.astype(np.float64)
        peak = wide.max(axis=-1, keepdims=True)
        shifted = np.exp(wide - peak)
        total = shifted.sum(axis=-1, keepdims=True)
        lse[start:start + chunk] = (peak + np.log(total))[:, 0]
        probs = shifted / total
        entropy[start:start + chunk] = lse[start:start + chunk] - (probs * wide).sum(axis=-1)
    lead = z.shape[:-1]
    return {"topk_values": values.reshape(lead + (k,)), "topk_ids": ids.reshape(lead + (k,)),
            "logsumexp": lse.astype(np.float32).reshape(lead), "entropy": entropy.astype(np.float32).reshape(lead)}


def _descending_key(values: np.ndarray) -> np.ndarray:
    """An exact sort key for "value descending, then id ascending" over the last axis of float32 ``values``:
    the float32 bits mapped to an order-preserving uint32 in the high half, ``V - 1 - id`` in the low half.
    Larger key = earlier. (A plain argpartition picks an arbitrary member of a tie at the K-th place.)"""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    flip = np.where(bits >> np.uint32(31), np.uint32(0xFFFFFFFF), np.uint32(0x80000000))  # negatives reversed
    V = values.shape[-1]
    low = (V - 1 - np.arange(V, dtype=np.uint64))  # (V,)
    return ((bits ^ flip).astype(np.uint64) << np.uint64(32)) | low


def _describe_draws(draws: Any) -> dict[str, Any]:
    """Header entry for a draw source: its class name and, for seeded sources, the seed."""
    if draws is None:
        return {"source": None, "seed": None}
    inner = getattr(draws, "source", None)  # RecordingDraws wraps another source
    described = inner if inner is not None and type(draws).__name__ == "RecordingDraws" else draws
    seed = getattr(described, "seed", None)
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        seed = int(seed)
    else:
        seed = None
    return {"source": type(described).__name__, "seed": seed}


def _generation_dict(generation_config: Any) -> dict[str, Any]:
    if generation_config is None:
        return {}
    if isinstance(generation_config, Mapping):
        return dict(generation_config)
    return generation_config.to_dict()


# ================================================================================================ recording
class TraceRecorder:
    """Collects a run's tensors in run order; ``save`` writes them as a trace file.

    layers: record every decoder layer's output per step (``decoder_layer`` is ignored otherwise; callers
        check ``recorder.layers`` first so they skip the work). Off by default: (B, C, H) per layer per step.
    logits: "full" (the whole (B, C, V) logits per step), "topk" (``summarize_logits``), or "auto" (full
        when V <= 8192).
    top_k: K of the "topk" mode.
    tape: store the random draws (``draws.{n}``) so that another implementation can replay the run.
    producer: free text naming the implementation, stored in the header.

    Every method raises ``TraceError`` when called out of the order given in the module docstring, and
    ``InputError`` for arrays of the wrong shape. Memory: everything is kept until ``save``.
    """

    def __init__(self, *, layers: bool = False, logits: str = "auto", top_k: int = DEFAULT_TOP_K,
                 tape: bool = True, producer: str = "diffusiongemma.reference"):
        if logits not in ("auto", "full", "topk"):
            raise InputError(f"logits must be 'auto', 'full' or 'topk', got {logits!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise InputError(f"top_k must be a positive integer, got {top_k!r}")
        self.layers = bool(layers)  # callers test this before computing/copying layer outputs
        self.logits_mode = logits  # resolved to "full"/"topk" by begin_run
        self.top_k = int(top_k)
        self.tape = bool(tape)  # keep the draw tape (record_draws wraps the source)
        self.producer = str(producer)
        self.tensors: dict[str, np.ndarray] = {}
        self.entries: list[dict[str, str]] = []  # run order: {"name", "group", "kind"}
        self.header: dict[str, Any] = {}
        self._state = "new"
        self._encodes = self._canvas = self._step = -1
        self._encode_n = 0
        self._encode_real: np.ndarray | None = None  # (B, n) bool of the current encode call
        self._encode_layers: set[int] = set()
        self._frozen: np.ndarray | None = None  # (B,) bool: rows not decoded in the current step
        self._recording = None  # RecordingDraws from record_draws
        self._B = self._C = self._V = self._H = self._L = 0

    # -------------------------------------------------------------------------------------------- plumbing
    def _expect(self, method: str, *states: str) -> None:
        if self._state == "new" and "new" not in states:
            raise TraceError(f"TraceRecorder.{method} called before begin_run (see the call order in "
                             "reference/trace.py)")
        if self._state not in states:
            raise TraceError(f"TraceRecorder.{method} called while the recorder is in state {self._state!r}; "
                             f"it is valid only in {states} (see the call order in reference/trace.py)")

    def _add(self, name: str, group: str, kind: str, array: Any, copy: bool = True) -> None:
        if name in self.tensors:
            raise TraceError(f"tensor {name!r} recorded twice")
        self.tensors[name] = np.array(array, copy=True, order="C") if copy else np.asarray(array, order="C")
        self.entries.append({"name": name, "group": group, "kind": kind})

    def _full_rows(self, what: str, array: Any, rows: Any, tail: tuple[int, ...]) -> np.ndarray:
        """A (B,) + tail float32 copy of per-row data given for all rows or for ``rows``; frozen rows -> 0."""
        array = np.asarray(array)
        if rows is None:
            if array.shape != (self._B,) + tail:
                raise InputError(f"{what} has shape {array.shape}, expected {(self._B,) + tail}")
            out = np.array(array, dtype=np.float32, copy=True)
        else:
            rows = np.asarray(rows, dtype=np.int64).reshape(-1)
            if array.shape != (len(rows),) + tail:
                raise InputError(f"{what} has shape {array.shape}, expected {(len(rows),) + tail} for rows {rows}")
            out = np.zeros((self._B,) + tail, dtype=np.float32)
            out[rows] = array
        out[self._frozen] = 0.0
        return out

    # -------------------------------------------------------------------------------------------- run
    def begin_run(self, model_config: Any, generation_config: Any, input_ids: np.ndarray,
                  attention_mask: np.ndarray | None = None, *, draws: Any = None) -> None:
        """Start a run. model_config: a ``ModelConfig`` (or any object with vocab_size, canvas_length,
        hidden_size, num_hidden_layers); generation_config: a ``GenerationConfig`` or its ``to_dict()``;
        input_ids: (B, P) int prompt; attention_mask: (B, P) 0/1 or None; draws: the draw source (described
        in the header: class name and seed)."""
        self._expect("begin_run", "new")
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"input_ids must be a 2-D integer array, got shape {ids.shape} dtype {ids.dtype}")
        self._B, self._C = ids.shape[0], int(model_config.canvas_length)
        self._V, self._H = int(model_config.vocab_size), int(model_config.hidden_size)
        self._L = int(model_config.num_hidden_layers)
        if self.logits_mode == "auto":
            self.logits_mode = "full" if self._V <= FULL_LOGITS_MAX_VOCAB else "topk"
        to_dict = getattr(model_config, "to_dict", None)
        self.header = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "producer": self.producer,
            "model": {"config_hash": config_hash(model_config), "vocab_size": self._V, "canvas_length": self._C,
                      "hidden_size": self._H, "num_hidden_layers": self._L,
                      "config": to_dict() if to_dict is not None else None},
            "generation": _generation_dict(generation_config),
            "draws": {**_describe_draws(draws), "tape": None},
            "logits": {"mode": self.logits_mode, "top_k": self.top_k if self.logits_mode == "topk" else None},
            "layers": self.layers,
        }
        self._add("prompt.input_ids", "prompt", "exact", ids.astype(np.int64))
        if attention_mask is not None:
            self._add("prompt.attention_mask", "prompt", "exact", np.asarray(attention_mask).astype(np.int64))
        self._state = "run"

    def record_draws(self, draws: Any) -> Any:
        """The draw source to use: with ``tape`` on, ``draws`` wrapped so that every draw is kept (stored as
        ``draws.{n}``), else ``draws`` itself. Optional: skipping the call only leaves the tape out (a fast
        path that recognises ``SeededDraws`` by type would see the wrapper instead)."""
        self._expect("record_draws", "run")
        if not self.tape:
            return draws
        from .draws import RecordingDraws

        self._recording = RecordingDraws(draws)
        return self._recording

    def end_run(self, sequences: np.ndarray | None = None, tape: Iterable | None = None) -> None:
        """End the run: ``sequences`` (B, P + k*C) int is the output; ``tape`` a list of (kind, ids) draws
        (default: what ``record_draws`` kept)."""
        self._expect("end_run", "run")
        if sequences is not None:
            self._add("output.sequences", "output", "exact", np.asarray(sequences).astype(np.int64))
        if tape is None and self._recording is not None:
            tape = self._recording.tape
        if tape is not None:
            kinds = []
            for n, (kind, ids) in enumerate(tape):
                self.tensors[f"draws.{n}"] = np.array(ids, dtype=np.int64, order="C")
                kinds.append(str(kind))
            self.header["draws"]["tape"] = kinds
        self._state = "done"

    # -------------------------------------------------------------------------------------------- encoder
    def begin_encode(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> None:
        """An encoder call on ``input_ids`` (B, n) with ``attention_mask`` (B, n) 0/1 or None starts."""
        self._expect("begin_encode", "run")
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[0] != self._B:
            raise InputError(f"encoder input has shape {ids.shape}, expected ({self._B}, n)")
        self._encodes += 1
        self._encode_n = ids.shape[1]
        self._encode_real = (np.ones(ids.shape, dtype=bool) if attention_mask is None
                             else np.asarray(attention_mask).astype(bool))
        self._encode_layers = set()
        self._state = "encode"

    def encoder_kv(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Layer ``layer``'s cache after this encoder call: keys, values (B, g, T_l, d), every entry the layer
        retains, oldest first. Records the newest min(n, T_l) entries (padding positions -> 0) and T_l."""
        self._expect("encoder_kv", "encode")
        keys, values = np.asarray(keys), np.asarray(values)
        if keys.ndim != 4 or keys.shape[0] != self._B or values.shape != keys.shape:
            raise InputError(f"layer {layer} cache keys/values have shapes {keys.shape}/{values.shape}, expected "
                             f"equal (B={self._B}, g, T, d)")
        if not 0 <= layer < self._L or layer in self._encode_layers:
            raise TraceError(f"encoder_kv: layer {layer} is out of range or recorded twice in encode call "
                             f"{self._encodes}")
        T = keys.shape[2]
        m = min(self._encode_n, T)
        real = self._encode_real[:, self._encode_n - m:][:, None, :, None]  # (B, 1, m, 1)
        e = self._encodes
        self._add(encode_name(e, layer, "keys"), "encoder_kv", "float",
                  np.where(real, keys[:, :, T - m:], 0.0).astype(np.float32), copy=False)
        self._add(encode_name(e, layer, "values"), "encoder_kv", "float",
                  np.where(real, values[:, :, T - m:], 0.0).astype(np.float32), copy=False)
        self._add(encode_name(e, layer, "cached"), "encoder_kv", "exact", np.array(T, dtype=np.int64))
        self._encode_layers.add(layer)

    def end_encode(self, cache: Any = None) -> None:
        """The encoder call is done. With ``cache`` (a reference ``KVCache``, or any cache with
        ``to_reference()``), records every layer not already given through ``encoder_kv``."""
        self._expect("end_encode", "encode")
        if cache is not None:
            if hasattr(cache, "to_reference"):
                cache = cache.to_reference()
            keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
            if isinstance(keys, list) and isinstance(values, list):
                for layer in range(self._L):
                    if layer not in self._encode_layers:
                        self.encoder_kv(layer, keys[layer], values[layer])
        if self._encode_layers and len(self._encode_layers) != self._L:
            missing = sorted(set(range(self._L)) - self._encode_layers)
            raise TraceError(f"encode call {self._encodes}: keys/values of layers {missing} were not recorded")
        self._state = "run"

    # -------------------------------------------------------------------------------------------- canvas
    def begin_canvas(self, initial_canvas: np.ndarray) -> None:
        """Canvas k starts from ``initial_canvas`` (B, C) int (the random draw or the caller's canvas)."""
        self._expect("begin_canvas", "run")
        canvas = np.asarray(initial_canvas)
        if canvas.shape != (self._B, self._C):
            raise InputError(f"initial canvas has shape {canvas.shape}, expected {(self._B, self._C)}")
        self._canvas += 1
        self._step = -1
        self._add(canvas_name(self._canvas, "initial"), "sampler", "exact", canvas.astype(np.int64))
        self._state = "canvas"

    def begin_step(self, live: np.ndarray | None = None) -> None:
        """A denoising step starts; ``live`` (B,) bool marks rows decoded in it (None: all rows)."""
        self._expect("begin_step", "canvas")
        self._step += 1
        self._frozen = (np.zeros(self._B, dtype=bool) if live is None
                        else ~np.asarray(live, dtype=bool).reshape(self._B))
        self._state = "step"

    def decoder_input(self, h: np.ndarray, rows: np.ndarray | None = None) -> None:
        """The decoder's input (B, C, H) float: embedding + self-conditioning signal, after the outer norm."""
        self._expect("decoder_input", "step")
        self._add(step_name(self._canvas, self._step, "input_embedding"), "input_embedding", "float",
                  self._full_rows("decoder input", h, rows, (self._C, self._H)), copy=False)

    def decoder_layer(self, layer: int, h: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Decoder layer ``layer``'s output (B, C, H) float (ignored unless ``self.layers``)."""
        self._expect("decoder_layer", "step")
        if self.layers:
            self._add(step_name(self._canvas, self._step, f"layer{layer}.output"), "layer_output", "float",
                      self._full_rows(f"decoder layer {layer} output", h, rows, (self._C, self._H)), copy=False)

    def logits(self, logits: np.ndarray, rows: np.ndarray | None = None) -> None:
        """The soft-capped decoder logits (B, C, V) float32, before temperature."""
        self._expect("logits", "step")
        z = self._full_rows("logits", logits, rows, (self._C, self._V))
        base = step_name(self._canvas, self._step, "logits")
        if self.logits_mode == "full":
            self._add(base, "logits", "float", z, copy=False)
            return
        summary = summarize_logits(z, self.top_k)
        for part in TOPK_PARTS:
            value = summary[part]
            if part != "topk_ids":
                value[self._frozen] = 0
            kind = "topk_ids" if part == "topk_ids" else "float"
            self._add(f"{base}.{part}", "logits", kind, value, copy=False)

    def end_step(self, *, temperature: float | None, draft: np.ndarray, sampled: np.ndarray,
                 entropies: np.ndarray, accepted: np.ndarray, canvas: np.ndarray, finished: np.ndarray) -> None:
        """The step's outcome, as ``generate.StepInfo`` reports it: temperature (None without a schedule);
        draft, sampled, canvas (B, C) int; entropies (B, C) float; accepted (B, C) bool; finished (B,) bool."""
        self._expect("end_step", "step")
        k, i, frozen = self._canvas, self._step, self._frozen
        if temperature is not None:
            self._add(step_name(k, i, "temperature"), "sampler", "float", np.array(temperature, dtype=np.float32))
        sampled = np.array(sampled, dtype=np.int64, copy=True)
        sampled[frozen] = -1
        accepted = np.array(accepted, dtype=bool, copy=True)
        accepted[frozen] = False
        self._add(step_name(k, i, "draft"), "sampler", "exact", np.asarray(draft).astype(np.int64))
        self._add(step_name(k, i, "sampled"), "sampler", "exact", sampled, copy=False)
        self._add(step_name(k, i, "sampler_entropy"), "sampler", "float", np.asarray(entropies, dtype=np.float32))
        self._add(step_name(k, i, "accepted"), "sampler", "exact", accepted, copy=False)
        self._add(step_name(k, i, "canvas"), "sampler", "exact", np.asarray(canvas).astype(np.int64))
        self._add(step_name(k, i, "finished"), "sampler", "exact", np.asarray(finished).astype(bool))
        self._state = "canvas"

    def commit(self, tokens: np.ndarray, ended: np.ndarray) -> None:
        """The committed canvas (B, C) int after the EOS/pad rules, and the (B,) bool ended flags."""
        self._expect("commit", "canvas")
        self._add(canvas_name(self._canvas, "committed"), "commit", "exact", np.asarray(tokens).astype(np.int64))
        self._add(canvas_name(self._canvas, "ended"), "commit", "exact", np.asarray(ended).astype(bool))
        self._state = "run"

    # -------------------------------------------------------------------------------------------- output
    def full_header(self, error: str | None = None) -> dict[str, Any]:
        """The JSON header as it will be written (run order included). ``error``: see ``save``."""
        if self._state == "new" or not self.entries:
            raise TraceError("nothing was recorded (begin_run was never called)")
        if self._state != "done" and error is None:
            raise TraceError(f"the run is not finished (recorder state {self._state!r}); call end_run first, or "
                             "save(path, error=...) to keep the part of a run that failed")
        complete = {"complete": True} if error is None else {"complete": False, "error": str(error)}
        return {**self.header, **complete, "tensors": list(self.entries)}

    def save(self, path: str | os.PathLike, error: str | None = None) -> None:
        """Write the trace file (atomically: a partial file never appears under ``path``).

        error: set it to save a run that stopped with an exception (the header then says ``"complete":
        false`` and holds the message); without it an unfinished run raises ``TraceError``.
        """
        write_trace(path, self.full_header(error), self.tensors)


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


# ================================================================================================ comparing
@dataclass
class Row:
    """One line of a comparison: a tensor (or a tensor derived from one) of both traces."""

    name: str
    group: str
    kind: str
    shape: tuple  # shape in trace a (or b when a lacks it)
    ok: bool
    max_abs: float | None = None  # float kinds: max |a - b|
    max_rel: float | None = None  # float kinds: max |a - b| / |a|
    mismatches: int | None = None  # exact kinds: differing elements
    size: int = 0
    detail: str = ""  # where it fails, and how


@dataclass
class Comparison:
    """Everything ``compare_traces`` found; ``format_report`` prints it."""

    path_a: str
    path_b: str
    atol: float
    rtol: float
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # group -> which trace lacks it
    notes: list[str] = field(default_factory=list)
    hint: str = ""  # about the first divergence

    @property
    def first_divergence(self) -> Row | None:
        return next((row for row in self.rows if not row.ok), None)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and self.first_divergence is None


class _Source:
    """The comparable tensors of one trace: its own, plus "topk" records derived from full logits."""

    def __init__(self, trace: Trace, derive_topk: int | None):
        self.trace = trace
        self.names: list[str] = []
        self.entries: dict[str, dict] = {}
        self._derived: dict[str, tuple[str, str]] = {}  # derived name -> (full logits name, part)
        for name in trace.names:
            entry = trace.entries[name]
            if derive_topk is not None and entry["group"] == "logits" and name.endswith(".logits"):
                for part in TOPK_PARTS:
                    derived = f"{name}.{part}"
                    self.names.append(derived)
                    self.entries[derived] = {"name": derived, "group": "logits",
                                             "kind": "topk_ids" if part == "topk_ids" else "float"}
                    self._derived[derived] = (name, part)
            else:
                self.names.append(name)
                self.entries[name] = entry
        self.top_k = derive_topk
        self._cache: dict[str, dict] = {}

    def get(self, name: str) -> np.ndarray:
        if name not in self._derived:
            return self.trace.get(name)
        full, part = self._derived[name]
        if full not in self._cache:
            self._cache = {full: summarize_logits(self.trace.get(full), self.top_k)}  # keep one step only
        return self._cache[full][part]

    def shape(self, name: str) -> tuple:
        if name in self._derived:
            return tuple(self.get(name).shape)
        return tuple(self.trace.shapes[name])


def compare_traces(a: Trace, b: Trace, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL) -> Comparison:
    """Compare two traces tensor by tensor in run order (``a`` is the reference side of ``rtol``).

    Raises ``TraceError`` when the traces cannot describe the same run: different model shapes or config
    hashes, different generation settings, or no tensor in common. Groups recorded by only one trace are
    skipped (``Comparison.skipped``). A tensor present in one trace only is a divergence (the runs took
    different paths). When one trace stores full logits and the other top-k records, the top-k records are
    derived from the full logits (``summarize_logits`` with the other trace's K).
    """
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise TraceError(f"{name} must be a finite number >= 0, got {value!r}")
    out = Comparison(a.path, b.path, float(atol), float(rtol))
    _check_same_run(a, b, out)
    mode_a, mode_b = a.header["logits"]["mode"], b.header["logits"]["mode"]
    k = None
    if mode_a != mode_b:
        k = (b if mode_b == "topk" else a).header["logits"]["top_k"]
        out.notes.append(f"logits: one trace stores full logits, the other the top {k}; the top-{k} records are "
                         "derived from the full logits for the comparison")
    source_a = _Source(a, k if mode_a == "full" else None)
    source_b = _Source(b, k if mode_b == "full" else None)
    common = a.groups & b.groups
    for group in sorted((a.groups | b.groups) - common, key=GROUPS.index):
        out.skipped[group] = f"only in {a.path if group in a.groups else b.path}"
    names = _merge_orders([n for n in source_a.names if source_a.entries[n]["group"] in common],
                          [n for n in source_b.names if source_b.entries[n]["group"] in common])
    if not names:
        raise TraceError(f"{a.path} and {b.path} have no group of tensors in common; nothing to compare")
    for name in names:
        out.rows.append(_compare_one(name, source_a, source_b, out))
    first = out.first_divergence
    if first is not None:
        out.hint = _hint(first, out, source_a)
    return out


def _check_same_run(a: Trace, b: Trace, out: Comparison) -> None:
    """Refuse traces of different models or settings; note softer differences (draw sources, producers)."""
    ma, mb = a.header["model"], b.header["model"]
    for key in ("vocab_size", "canvas_length", "hidden_size", "num_hidden_layers"):
        if ma[key] != mb[key]:
            raise TraceError(f"the traces come from different models: {key} is {ma[key]} in {a.path} but "
                             f"{mb[key]} in {b.path}")
    ha, hb = ma.get("config_hash"), mb.get("config_hash")
    if ha is not None and hb is not None and ha != hb:
        detail = ""
        ca, cb = ma.get("config"), mb.get("config")
        if isinstance(ca, Mapping) and isinstance(cb, Mapping):
            fields = sorted(key for key in set(ca) | set(cb) if ca.get(key) != cb.get(key))
            detail = "; differing fields: " + ", ".join(f"{key} ({ca.get(key)!r} vs {cb.get(key)!r})"
                                                        for key in fields[:6])
        raise TraceError(f"the traces come from different model configurations (config hash {ha} in {a.path}, "
                         f"{hb} in {b.path}){detail}")
    if ha is None or hb is None:
        out.notes.append(f"config hash missing in {a.path if ha is None else b.path}: only the model shapes "
                         "were checked to be the same")
    ga, gb = a.header.get("generation") or {}, b.header.get("generation") or {}
    differing = sorted(key for key in set(ga) & set(gb) if ga[key] != gb[key])
    if differing:
        raise TraceError("the traces were made with different generation settings: " + ", ".join(
            f"{key} = {ga[key]!r} in {a.path} but {gb[key]!r} in {b.path}" for key in differing))
    only = sorted(set(ga) ^ set(gb))
    if only:
        out.notes.append(f"generation settings recorded by one trace only (not checked): {', '.join(only)}")
    for trace in (a, b):
        if trace.header.get("complete") is False:
            out.notes.append(f"{trace.path} is incomplete: its run stopped with an error "
                             f"({trace.header.get('error')}); the tensors it lacks show as missing")
    tape_a, tape_b = a.draw_tape(), b.draw_tape()
    if tape_a is not None and tape_b is not None:
        n = next((n for n, ((ka, xa), (kb, xb)) in enumerate(zip(tape_a, tape_b))
                  if ka != kb or xa.shape != xb.shape or not np.array_equal(xa, xb)), None)
        if n is None and len(tape_a) == len(tape_b):
            out.notes.append(f"both runs used the same {len(tape_a)} random draws")
        elif n is None:
            out.notes.append(f"the runs used the same random draws for {min(len(tape_a), len(tape_b))} draws, then "
                             f"one made more ({len(tape_a)} in {a.path}, {len(tape_b)} in {b.path})")
        else:
            out.notes.append(f"the runs used different random draws from draw {n} on ({tape_a[n][0]} in {a.path}, "
                             f"{tape_b[n][0]} in {b.path})")
        return
    da, db = a.header.get("draws") or {}, b.header.get("draws") or {}
    if (da.get("source"), da.get("seed")) != (db.get("source"), db.get("seed")):
        out.notes.append(f"draw sources differ: {da.get('source')} (seed {da.get('seed')}) in {a.path}, "
                         f"{db.get('source')} (seed {db.get('seed')}) in {b.path}; unless one replays the other's "
                         "draws, the runs part at the first random draw")


def _merge_orders(a: list[str], b: list[str]) -> list[str]:
    """Union of two run orders, following ``a`` and slotting names only ``b`` has where ``b`` puts them."""
    in_a, in_b = set(a), set(b)
    out, seen, i, j = [], set(), 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] in seen:
            i += 1
        elif j < len(b) and b[j] in seen:
            j += 1
        elif i < len(a) and j < len(b) and a[i] == b[j]:
            out.append(a[i]), seen.add(a[i])
            i, j = i + 1, j + 1
        elif i < len(a) and a[i] not in in_b:
            out.append(a[i]), seen.add(a[i])
            i += 1
        elif j < len(b) and b[j] not in in_a:
            out.append(b[j]), seen.add(b[j])
            j += 1
        elif i < len(a):  # a common name out of order: follow a
            out.append(a[i]), seen.add(a[i])
            i += 1
        else:
            out.append(b[j]), seen.add(b[j])
            j += 1
    return out


def _compare_one(name: str, a: _Source, b: _Source, out: Comparison) -> Row:
    in_a, in_b = name in a.entries, name in b.entries
    entry = a.entries[name] if in_a else b.entries[name]
    if not (in_a and in_b):
        missing, present = (b.trace.path, a) if in_a else (a.trace.path, b)
        return Row(name, entry["group"], entry["kind"], present.shape(name), False,
                   detail=f"missing in {missing}: the runs took different paths (other numbers of steps, canvases "
                          "or encoder calls)")
    kind_a, kind_b = a.entries[name]["kind"], b.entries[name]["kind"]
    if kind_a != kind_b:
        return Row(name, entry["group"], kind_a, a.shape(name), False,
                   detail=f"declared {kind_a} in {a.trace.path} but {kind_b} in {b.trace.path}")
    x, y = a.get(name), b.get(name)
    row = Row(name, entry["group"], kind_a, tuple(x.shape), True, size=int(x.size))
    if x.shape != y.shape:
        row.ok = False
        row.detail = f"shape {tuple(x.shape)} vs {tuple(y.shape)}"
        return row
    if kind_a == "float":
        _compare_float(row, x, y, out.atol, out.rtol)
    elif kind_a == "exact":
        _compare_exact(row, x, y)
    else:
        sibling = name[: -len("topk_ids")] + "topk_values"
        if sibling not in a.entries or sibling not in b.entries:
            row.ok, row.detail = False, f"{sibling} (needed to judge ties) is missing"
        else:
            _compare_topk_ids(row, x, y, a.get(sibling), b.get(sibling), out.atol, out.rtol)
    return row


def _compare_float(row: Row, x: np.ndarray, y: np.ndarray, atol: float, rtol: float) -> None:
    x, y = x.astype(np.float64), y.astype(np.float64)
    nan = np.isnan(x) | np.isnan(y)
    same_inf = np.isinf(x) & (x == y)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - y))
        diff = np.where(nan, np.inf, diff)
        allowed = atol + rtol * np.abs(np.where(np.isfinite(x), x, 0.0))
        rel = np.where(diff == 0, 0.0, diff / np.where(np.abs(x) > 0, np.abs(x), 0.0))
    bad = ~(diff <= allowed)
    row.max_abs = float(diff.max()) if diff.size else 0.0
    row.max_rel = float(np.nan_to_num(rel, nan=np.inf).max()) if rel.size else 0.0
    row.mismatches = int(bad.sum())
    if bad.any():
        row.ok = False
        with np.errstate(invalid="ignore", divide="ignore"):
            excess = np.where(bad, diff / np.maximum(allowed, 1e-300), -1.0)
        at = np.unravel_index(int(np.argmax(excess)), x.shape)
        what = "NaN" if nan.any() else f"|diff| {diff[at]:.3e}"
        row.detail = (f"{row.mismatches}/{x.size} elements out of tolerance; worst {what} at {_index(at)}: "
                      f"a={x[at]:.7g} b={y[at]:.7g}")


def _compare_exact(row: Row, x: np.ndarray, y: np.ndarray) -> None:
    bad = x.astype(np.int64) != y.astype(np.int64)
    row.mismatches = int(bad.sum())
    if row.mismatches:
        row.ok = False
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        row.detail = (f"{row.mismatches}/{x.size} elements differ; first at {_index(at)}: "
                      f"a={_scalar(x[at])} b={_scalar(y[at])}")


def _compare_topk_ids(row: Row, ids_a: np.ndarray, ids_b: np.ndarray, val_a: np.ndarray, val_b: np.ndarray,
                      atol: float, rtol: float) -> None:
    """Top-k ids agree up to ties: an id in both lists must carry the same value (within tolerance) in both;
    an id in one list only must be tied with the other list's K-th value (within tolerance), i.e. it could
    have been cut off by rounding. Ranks may swap among near-equal values."""
    K = ids_a.shape[-1]
    ia, ib = ids_a.reshape(-1, K).astype(np.int64), ids_b.reshape(-1, K).astype(np.int64)
    va, vb = val_a.reshape(-1, K).astype(np.float64), val_b.reshape(-1, K).astype(np.float64)
    same = ia[:, :, None] == ib[:, None, :]  # (P, K, K): a's rank r holds b's rank s's id
    tol = lambda v: atol + rtol * np.abs(v)  # noqa: E731
    value_of_a_in_b = np.where(same, vb[:, None, :], -np.inf).max(axis=-1)  # -inf when absent
    found_a = same.any(axis=-1)
    found_b = same.any(axis=-2)
    ok_a = np.where(found_a, np.abs(va - value_of_a_in_b) <= tol(va), va <= vb[:, -1:] + tol(vb[:, -1:]))
    ok_b = np.where(found_b, True, vb <= va[:, -1:] + tol(va[:, -1:]))
    bad = ~(ok_a & ok_b)
    row.mismatches = int(bad.sum())
    if row.mismatches:
        row.ok = False
        p, r = (int(i) for i in np.argwhere(bad)[0])
        at = np.unravel_index(p, ids_a.shape[:-1])
        row.detail = (f"{row.mismatches}/{ia.size} entries disagree beyond ties; first at position {_index(at)} "
                      f"rank {r}: a has id {ia[p, r]} ({va[p, r]:.7g}), b has id {ib[p, r]} ({vb[p, r]:.7g})")


def _index(at: tuple) -> str:
    return "(" + ", ".join(str(int(i)) for i in at) + ")" if len(at) else "()"


def _scalar(value: Any) -> str:
    value = np.asarray(value)
    return str(bool(value)) if value.dtype == bool else str(int(value))


# ------------------------------------------------------------------------------------------------ hints
_STEP = re.compile(r"canvas(\d+)\.step(\d+)\.(.+)$")
_ENCODE = re.compile(r"encode(\d+)\.layer(\d+)\.(keys|values|cached)$")

_SAMPLER_HINTS = {
    "temperature": "the linear schedule T = t_min + (t_max - t_min) * n / N with n counting down from N at the "
                   "first step (SPEC trap T12), in float32",
    "draft": "the draft is argmax(logits / T), first index on ties",
    "sampled": "the categorical draw: are both runs using the same draws (replay the other trace's draws.*)?",
    "sampler_entropy": "the sampler's entropies are those of softmax(logits / T), in nats",
    "accepted": "entropy-bound acceptance: sort the entropies ascending and accept the k-th while "
                "(sum of the first k) - H_k <= entropy_bound",
    "canvas": "renoising: accepted positions take the sampled token, every other position a fresh uniform id "
              "(a full (B, C) draw every step)",
    "finished": "adaptive stopping: the draft must repeat over stability_threshold + 1 steps and the mean "
                "entropy must be < confidence_threshold (strict); finished rows stay frozen",
}


def _hint(row: Row, out: Comparison, a: _Source) -> str:
    """A plain-language pointer to what the first divergent tensor computes."""
    name = row.name
    if row.detail.startswith("missing in"):
        return "One run has a tensor the other lacks: the runs took different paths before any value differed."
    match = _ENCODE.match(name)
    if match:
        e, l, what = (int(match.group(1)), int(match.group(2)), match.group(3))
        if what == "cached":
            return (f"Layer {l} retains a different number of cache entries after encoder call {e}: full layers "
                    "keep every token, sliding layers only the last sliding_window - 1 (SPEC traps T5/T6).")
        earlier = ("" if l == 0 else f", or in the feed-forward / residual of encoder layer {l - 1} (encoder "
                   "hidden states are not traced)")
        source = ("the committed canvas fed to the encoder (its tokens or positions)" if e > 0 else "the prompt")
        return (f"The first cached {what} to differ are layer {l}'s after encoder call {e}. Look at layer {l}'s "
                f"K/V path (input norm, k_proj/v_proj, k_norm and RoPE for keys, the weightless value norm; full "
                f"layers take V from the raw key projection){earlier}; the input was {source}.")
    match = _STEP.match(name)
    if match:
        k, i, what = int(match.group(1)), int(match.group(2)), match.group(3)
        if what == "input_embedding":
            if i == 0:
                return ("The decoder input of the first step differs: embedding * sqrt(H) of the canvas, then the "
                        "weightless outer RMSNorm (there is no self-conditioning at step 0; SPEC trap T10).")
            return ("The decoder input differs while the previous step agreed: self-conditioning "
                    "(softmax of the previous step's temperature-scaled logits @ E * sqrt(H), pre-norm, gated MLP, "
                    "added to the canvas embedding, outer norm; SPEC trap T11).")
        if what.startswith("layer"):
            l = int(what[len("layer"):].split(".")[0])
            before = "the input embedding" if l == 0 else f"layer {l - 1}'s output"
            return (f"Decoder layer {l}'s output differs while {before} agrees: this layer (attention over the "
                    "cached keys plus the canvas, bidirectional; dense MLP and experts) or the cache it reads. If "
                    "the difference is small and its input differs at all, it may also be float noise flipping a "
                    "near-tied router choice (two experts of almost equal probability; SPEC trap T20).")
        if what.startswith("logits"):
            layers = "layer_output" in a.trace.groups and "layer_output" not in out.skipped
            where = "" if layers else " (decoder layer outputs were not compared, so also any decoder layer)"
            return ("The logits differ while the decoder input agrees: final norm, the tied output projection "
                    f"(embed_tokens^T) or the soft-cap c * tanh(z / c){where}.")
        text = _SAMPLER_HINTS.get(what, "")
        floats_ok = all(r.ok for r in out.rows if r.kind != "exact" and _STEP.match(r.name)
                        and _STEP.match(r.name).group(1, 2) == (str(k), str(i)))
        if row.kind == "exact" and floats_ok:
            text += (". Every float tensor of this step agrees within tolerance, so either the rule differs or "
                     "float noise decided a near-tie (SPEC trap T20)")
            if what == "draft":
                text += _draft_margin(row, a, k, i)
        return text[:1].upper() + text[1:] + "."
    if name.endswith(".initial"):
        return ("The initial canvas differs: a different draw source or seed (or a different starting canvas). "
                "Replay the other trace's draws (its draws.* tensors) to compare the rest.")
    if name.endswith(".committed") or name.endswith(".ended"):
        return ("The committed canvas differs while every step agreed: commit the draft (not the sampled canvas), "
                "then the EOS/pad rules (whole canvas scanned, pad after the first EOS, rows ended earlier all pad).")
    if name.startswith("prompt."):
        return "The prompts differ: these traces are not of the same run."
    return ""


def _draft_margin(row: Row, a: _Source, k: int, i: int) -> str:
    """For a differing draft: the gap between the two largest logits at the first differing position (in a)."""
    at = re.search(r"first at \(([\d, ]+)\)", row.detail)
    if not at:
        return ""
    b_, c_ = (int(v) for v in at.group(1).split(","))
    base = step_name(k, i, "logits")
    try:
        if base in a.entries:
            top = np.sort(a.get(base)[b_, c_])[-2:]
            gap = float(top[1] - top[0])
        elif f"{base}.topk_values" in a.entries:
            values = a.get(f"{base}.topk_values")[b_, c_]
            gap = float(values[0] - values[1]) if values.size > 1 else float("nan")
        else:
            return ""
    except (IndexError, ValueError):
        return ""
    return f"; at ({b_}, {c_}) the two largest logits of the first trace differ by {gap:.3g}"


# ------------------------------------------------------------------------------------------------ report
def format_report(comparison: Comparison, table: bool = True) -> str:
    """The per-tensor table in run order (unless ``table`` is False) and a plain statement of the result."""
    c = comparison
    lines = []
    if table:
        width = max([len(row.name) for row in c.rows] + [6])
        lines.append(f"{'#':>5}  {'tensor':<{width}}  {'shape':<18} {'kind':<8} {'max|diff|':>10} {'max rel':>10} "
                     f"{'mismatch':>9}  result")
        for n, row in enumerate(c.rows):
            floats = row.kind == "float" and row.max_abs is not None
            diff = f"{row.max_abs:10.3e}" if floats else f"{'-':>10}"
            rel = f"{row.max_rel:10.3e}" if floats else f"{'-':>10}"
            count = f"{row.mismatches:>9d}" if row.mismatches is not None else f"{'-':>9}"
            result = "OK" if row.ok else "NOT OK"
            lines.append(f"{n:>5}  {row.name:<{width}}  {str(row.shape):<18} {row.kind:<8} {diff} {rel} {count}  "
                         f"{result}")
            if not row.ok and row.detail:
                lines.append(f"{'':>5}  {'':<{width}}  -> {row.detail}")
        lines.append("")
    for group, where in c.skipped.items():
        lines.append(f"not compared: {group} ({where})")
    for note in c.notes:
        lines.append(f"note: {note}")
    first = c.first_divergence
    tolerance = f"atol={c.atol:g}, rtol={c.rtol:g} (|a-b| <= atol + rtol*|a|; ids and masks exactly)"
    if first is None:
        lines.append(f"RESULT: OK. All {len(c.rows)} compared tensors of {c.path_b} agree with {c.path_a} within "
                     f"{tolerance}.")
    else:
        n = c.rows.index(first)
        failing = sum(not row.ok for row in c.rows)
        lines.append(f"RESULT: NOT OK. First divergence: {first.name} (#{n} in run order, group {first.group}): "
                     f"{first.detail}. The {n} tensor(s) before it agree within {tolerance}; {failing} of "
                     f"{len(c.rows)} compared tensors differ in all.")
        if c.hint:
            lines.append(f"hint: {c.hint}")
    return "\n".join(lines)


# ================================================================================================ any generate
def record_generate(generate_fn: Callable, model: Any, input_ids: np.ndarray, recorder: TraceRecorder, *,
                    attention_mask: np.ndarray | None = None, generation_config: Any = None, random: Any = None,
                    callback: Any = None, **kwargs: Any) -> Any:
    """Run ``generate_fn(model, input_ids, ...)`` (the reference's interface) while ``recorder`` records it.

    When ``generate_fn`` takes a ``trace`` argument it is simply passed. Otherwise the run is recorded from
    the outside: the encoder, the denoiser and the callback are wrapped, so a fast path runs its model through
    ``model.encode`` / ``model.denoise`` and its own sampler; the decoder's input embedding and layer outputs
    are then recorded only if ``model.denoise`` takes a ``trace`` argument. ``kwargs`` are further
    ``generate`` arguments (``progress``, setting overrides such as ``max_new_tokens``).
    Returns what ``generate_fn`` returns; ``recorder`` is finished (``end_run`` called) and ready to ``save``.
    """
    from .draws import as_draw_source
    from .generate import resolve_config

    if "trace" in inspect.signature(generate_fn).parameters:
        return generate_fn(model, input_ids, attention_mask, generation_config, random=random, trace=recorder,
                           callback=callback, **kwargs)
    progress = kwargs.pop("progress", False)
    config = resolve_config(model, generation_config, kwargs)
    draws = as_draw_source(random)
    recorder.begin_run(model.config, config, input_ids, attention_mask, draws=draws)
    draws = recorder.record_draws(draws)
    hooks = _OutsideHooks(model, recorder, callback)
    result = generate_fn(model, input_ids, attention_mask, config, random=draws, encoder=hooks.encode,
                         denoiser=hooks.denoise, callback=hooks, progress=progress)
    recorder.end_run(result.sequences)
    return result


class _OutsideHooks:
    """Encoder/denoiser wrappers and a callback that drive a ``TraceRecorder`` around an unmodified
    ``generate``: canvas and step boundaries are inferred from the call sequence (one encode per canvas,
    then one decoder call per step, then ``on_step``; ``on_canvas`` commits)."""

    def __init__(self, model: Any, recorder: TraceRecorder, callback: Any):
        self.model, self.recorder, self.callback = model, recorder, callback
        self.new_canvas = False
        self.finished: np.ndarray | None = None
        takes_trace = "trace" in inspect.signature(model.denoise).parameters
        self._denoise = (lambda c, cache, sc: model.denoise(c, cache, sc, trace=recorder)) if takes_trace \
            else model.denoise

    def encode(self, ids, cache, mask):
        self.recorder.begin_encode(ids, mask)
        out = self.model.encode(ids, cache, mask)
        self.recorder.end_encode(cache)
        self.new_canvas = True
        return out

    def denoise(self, canvas, cache, sc_logits):
        if self.new_canvas:
            self.recorder.begin_canvas(canvas)
            self.new_canvas = False
            self.finished = np.zeros(canvas.shape[0], dtype=bool)
        self.recorder.begin_step(~self.finished)
        logits = self._denoise(canvas, cache, sc_logits)
        self.recorder.logits(logits)
        return logits

    def on_prompt(self, input_ids):
        _forward(self.callback, "on_prompt", input_ids)

    def on_step(self, info):
        self.recorder.end_step(temperature=info.temperature, draft=info.draft, sampled=info.sampled,
                               entropies=info.entropies, accepted=info.accepted, canvas=info.canvas,
                               finished=info.finished)
        self.finished = np.array(info.finished, dtype=bool)
        _forward(self.callback, "on_step", info)

    def on_canvas(self, info):
        self.recorder.commit(info.tokens, info.finished)
        _forward(self.callback, "on_canvas", info)

    def on_end(self, result):
        _forward(self.callback, "on_end", result)


def _forward(callback: Any, method: str, argument: Any) -> None:
    handler = getattr(callback, method, None) if callback is not None else None
    if handler is not None:
        handler(argument)
