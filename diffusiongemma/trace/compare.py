"""Comparing two traces: the first tensor at which two runs part, and a report of it."""

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

from .format import (DEFAULT_ATOL, DEFAULT_RTOL, GROUPS, TOPK_PARTS, Trace, TraceError,
                     check_recorded_configuration, step_name)
from .recorder import summarize_logits


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


# ``compare --only``: the groups a port running one part of the model checks (docs/TRACE_FORMAT.md, "Golden
# traces"). The prompt is in both: it is an input, copied by either kind of port.
ONLY_GROUPS = {
    "forward": ("prompt", "encoder_kv", "input_embedding", "layer_output", "logits"),
    "sampler": ("prompt", "sampler", "commit", "output"),
    "all": GROUPS,
}


def compare_traces(a: Trace, b: Trace, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
                   only: str = "all") -> Comparison:
    """Compare two traces tensor by tensor in run order (``a`` is the reference side of ``rtol``).

    ``only``: "forward" compares the model's tensors (encoder K/V, decoder input, layer outputs, logits),
    "sampler" the loop's (temperature, draft, draws, entropies, acceptance, canvases, stopping, commits,
    output), "all" (default) everything; the groups left out are listed in ``Comparison.skipped``.

    Raises ``TraceError`` when the traces cannot describe the same run: different model shapes or config
    hashes, different generation settings, or no tensor in common. Groups recorded by only one trace are
    skipped (``Comparison.skipped``). A tensor present in one trace only is a divergence (the runs took
    different paths). When one trace stores full logits and the other top-k records, the top-k records are
    derived from the full logits (``summarize_logits`` with the other trace's K).
    """
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise TraceError(f"{name} must be a finite number >= 0, got {value!r}")
    if only not in ONLY_GROUPS:
        raise TraceError(f"only must be one of {sorted(ONLY_GROUPS)}, got {only!r}")
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
    allowed = set(ONLY_GROUPS[only])
    common = a.groups & b.groups & allowed
    for group in sorted((a.groups | b.groups) - common, key=GROUPS.index):
        out.skipped[group] = (f"left out by --only {only}" if group not in allowed
                              else f"only in {a.path if group in a.groups else b.path}")
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
    for trace in (a, b):  # the same settings on both sides, but does each trace still hold what it recorded?
        check_recorded_configuration(trace)
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
SHORT_CONTEXT = 2  # short report: agreeing tensors shown before the first divergence
SHORT_FAILING = 8  # short report: differing tensors shown at most


def format_report(comparison: Comparison, table: "bool | str" = "full") -> str:
    """The per-tensor table in run order and a plain statement of the result.

    table: ``"full"`` (or True) every compared tensor; ``"short"`` only the first differing tensors, with
    the few agreeing ones just before the first divergence (nothing when all agree); ``"none"`` (or False)
    only the result."""
    c = comparison
    mode = {True: "full", False: "none"}.get(table, table)
    if mode not in ("full", "short", "none"):
        raise ValueError(f"table must be 'full', 'short' or 'none', got {table!r}")
    lines = []
    shown: list[int] = []
    if mode == "full":
        shown = list(range(len(c.rows)))
    elif mode == "short" and c.first_divergence is not None:
        first = c.rows.index(c.first_divergence)
        failing = [n for n, row in enumerate(c.rows) if not row.ok][:SHORT_FAILING]
        shown = sorted(set(range(max(0, first - SHORT_CONTEXT), first)) | set(failing))
    if shown:
        width = max([len(c.rows[n].name) for n in shown] + [6])
        lines.append(f"{'#':>5}  {'tensor':<{width}}  {'shape':<18} {'kind':<8} {'max|diff|':>10} {'max rel':>10} "
                     f"{'mismatch':>9}  result")
        previous = None
        for n in shown:
            row = c.rows[n]
            if previous is not None and n != previous + 1:
                lines.append(f"{'...':>5}")
            previous = n
            floats = row.kind == "float" and row.max_abs is not None
            diff = f"{row.max_abs:10.3e}" if floats else f"{'-':>10}"
            rel = f"{row.max_rel:10.3e}" if floats else f"{'-':>10}"
            count = f"{row.mismatches:>9d}" if row.mismatches is not None else f"{'-':>9}"
            result = "OK" if row.ok else "NOT OK"
            lines.append(f"{n:>5}  {row.name:<{width}}  {str(row.shape):<18} {row.kind:<8} {diff} {rel} {count}  "
                         f"{result}")
            if not row.ok and row.detail:
                lines.append(f"{'':>5}  {'':<{width}}  -> {row.detail}")
        if mode == "short":
            hidden = sum(not row.ok for row in c.rows) - sum(not c.rows[n].ok for n in shown)
            more = f"; {hidden} more differing tensor(s) not shown" if hidden else ""
            lines.append(f"(short report: {len(shown)} of {len(c.rows)} tensors{more}; --full lists every tensor)")
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


