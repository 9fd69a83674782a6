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

from diffusiongemma.reference.support.errors import InputError
from diffusiongemma.reference.support.observer import Observer

from .format import (DEFAULT_TOP_K, FORMAT_NAME, FORMAT_VERSION, FULL_LOGITS_MAX_VOCAB, TOPK_PARTS,
                     _LAYERS_AUTO_BYTES, _SUMMARY_CHUNK_ELEMENTS, TraceError, canvas_name, encode_name, json_digest,
                     step_name, write_trace)


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
class TraceRecorder(Observer):
    """Collects a run's tensors in run order; ``save`` writes them as a trace file.

    layers: record every decoder layer's output per step (``decoder_layer`` is ignored otherwise; a backend
        may check ``recorder.layers`` first to skip the work). Off by default: (B, C, H) per layer per step.
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
        self.layers = bool(layers)  # backends may test this before computing/copying layer outputs
        self.records = True  # an observer that keeps what it is given (backends copy device arrays for it)
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
                             "diffusiongemma/trace/recorder.py)")
        if self._state not in states:
            raise TraceError(f"TraceRecorder.{method} called while the recorder is in state {self._state!r}; "
                             f"it is valid only in {states} (see the call order in diffusiongemma/trace/recorder.py)")

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
        self.header["generation_hash"] = json_digest(self.header["generation"])  # compare checks it
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
        from diffusiongemma.reference.support.replay import RecordingDraws

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



# ================================================================================================ any generate
def record_generate(generate_fn: Callable, model: Any, input_ids: np.ndarray, recorder: TraceRecorder, *,
                    attention_mask: np.ndarray | None = None, generation_config: Any = None, random: Any = None,
                    callback: Any = None, **kwargs: Any) -> Any:
    """Run ``generate_fn(model, input_ids, ...)`` (the reference's interface) while ``recorder`` records it.

    When ``generate_fn`` takes a ``trace`` argument it is simply passed. Otherwise the run is recorded from
    the outside: the encoder, the denoiser and the callback are wrapped, so a fast path runs its model through
    ``model.encode`` / ``model.denoise`` and its own sampler; the decoder's input embedding and layer outputs
    are then recorded only if ``model.denoise`` takes an ``observer`` argument. ``kwargs`` are further
    ``generate`` arguments (setting overrides such as ``max_new_tokens``).
    Returns what ``generate_fn`` returns; ``recorder`` is finished (``end_run`` called) and ready to ``save``.
    """
    from diffusiongemma.reference.support.checks import as_draw_source
    from diffusiongemma.reference.support.checks import resolve_config

    if "trace" in inspect.signature(generate_fn).parameters:
        return generate_fn(model, input_ids, attention_mask, generation_config, random=random, trace=recorder,
                           callback=callback, **kwargs)
    config = resolve_config(model, generation_config, kwargs)
    draws = as_draw_source(random)
    recorder.begin_run(model.config, config, input_ids, attention_mask, draws=draws)
    draws = recorder.record_draws(draws)
    hooks = _OutsideHooks(model, recorder, callback)
    result = generate_fn(model, input_ids, attention_mask, config, random=draws, encoder=hooks.encode,
                         denoiser=hooks.denoise, callback=hooks, **kwargs)
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
        takes_observer = "observer" in inspect.signature(model.denoise).parameters
        self._denoise = (lambda c, cache, sc: model.denoise(c, cache, sc, observer=recorder)) if takes_observer \
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

