"""Pictures of the denoising of one run: what every step of every canvas did, drawn with matplotlib.

The data (``DenoisingRecord``) comes from a run of ``generate``: ``DenoisingLog`` is a generation callback
that keeps row 0 of every step (``diffusiongemma generate --json`` stores it under ``"denoising"``), or from
a golden trace (``diffusiongemma trace``; its ``canvas{k}.step{i}.*`` sampler tensors hold the same values).

Figures (each returns a ``matplotlib.figure.Figure``; the arrays drawn are exactly the record's):

* ``entropy_heatmap``: per-position entropy (nats) of the processed logits, canvas position (k*C + i, rows)
  by denoising step (columns); steps a canvas did not run are blank.
* ``acceptance_heatmap``: the same grid, 1 where the position's draw was accepted under the entropy bound.
* ``commit_order``: per canvas and position, the step from which the draft held the committed token to the
  end of the canvas (the step at which the position settled), so the order in which positions committed.
* ``accepted_per_step``: positions accepted at each step, steps of all canvases in run order.
* ``temperature_schedule``: the temperature of each executed step.
* ``summary``: all five in one figure. ``animation_html``: a self-contained HTML page that plays the canvas
  step by step (no matplotlib needed).

matplotlib is an optional dependency (``pip install -e ".[plot]"``); it is imported only by the figure
functions, and a missing matplotlib raises ``ImportError`` saying how to install it.
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from diffusiongemma.reference.support.errors import InputError

__all__ = ["CanvasRecord", "DenoisingRecord", "DenoisingLog", "load_record", "entropy_heatmap",
           "acceptance_heatmap", "commit_order", "accepted_per_step", "temperature_schedule", "summary",
           "animation_html", "FIGURES", "save_figure"]


# ================================================================================================ the data
@dataclass
class CanvasRecord:
    """The denoising of one canvas (row 0). S = steps executed, C = canvas length."""

    entropies: np.ndarray  # (S, C) float32 entropy (nats) of each step's processed logits
    accepted: np.ndarray  # (S, C) bool: positions accepted at each step
    drafts: np.ndarray  # (S, C) int64 argmax draft after each step
    temperatures: np.ndarray  # (S,) float32 temperature of each step; NaN without a schedule
    committed: np.ndarray | None = None  # (C,) int64 the committed tokens (after EOS/pad), if known

    @property
    def steps(self) -> int:
        return int(self.entropies.shape[0])

    def settled_steps(self) -> np.ndarray:
        """(C,) int64: for each position, the first step s (0-based) such that the draft equals the final
        draft from step s to the last step; the order in which the positions committed."""
        final = self.drafts[-1]
        same = self.drafts == final[None, :]  # (S, C)
        # the last step at which the draft differed from the final one, plus one (0 when it never differed)
        differed = ~same
        last_diff = np.where(differed.any(axis=0), self.steps - 1 - np.argmax(differed[::-1], axis=0), -1)
        return (last_diff + 1).astype(np.int64)


@dataclass
class DenoisingRecord:
    """Every step of every canvas of a run (row 0)."""

    canvas_length: int  # C
    max_steps: int  # N
    canvases: list[CanvasRecord] = field(default_factory=list)

    def grid(self, what: str) -> np.ndarray:
        """(K*C, S_max) float64 position-by-step grid of ``what`` ("entropies" or "accepted"), NaN where a
        canvas ran fewer steps."""
        s_max = max((c.steps for c in self.canvases), default=0)
        C = self.canvas_length
        out = np.full((len(self.canvases) * C, s_max), np.nan)
        for k, canvas in enumerate(self.canvases):
            out[k * C:(k + 1) * C, :canvas.steps] = np.asarray(getattr(canvas, what), dtype=np.float64).T
        return out

    def per_step(self, what: str) -> np.ndarray:
        """Steps of all canvases in run order: "accepted" -> (total steps,) accepted counts; "temperature"
        -> (total steps,) temperatures."""
        if what == "accepted":
            parts = [c.accepted.sum(axis=1) for c in self.canvases]
        elif what == "temperature":
            parts = [c.temperatures for c in self.canvases]
        else:
            raise ValueError(f"per_step: unknown quantity {what!r}")
        return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)

    # -------------------------------------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        """The JSON layout of ``generate --json``'s ``"denoising"`` entry."""
        return {"canvas_length": self.canvas_length, "max_steps": self.max_steps, "canvases": [
            {"entropy": np.round(c.entropies.astype(np.float64), 6).tolist(),
             "accepted": c.accepted.astype(int).tolist(), "draft": c.drafts.tolist(),
             "temperature": [None if math.isnan(t) else float(t) for t in c.temperatures.tolist()],
             "committed": None if c.committed is None else c.committed.tolist()} for c in self.canvases]}

    @classmethod
    def from_json(cls, data: Any, where: str = "the run") -> "DenoisingRecord":
        """Read ``to_json``'s layout (or a whole ``generate --json`` object holding it under "denoising").
        Raises ``InputError`` naming the missing or malformed field."""
        if isinstance(data, Mapping) and "denoising" in data:
            data = data["denoising"]
            where = f"{where}: field 'denoising'"
        if not isinstance(data, Mapping) or not isinstance(data.get("canvases"), list):
            raise InputError(f"{where} holds no per-step data (expected an object with 'canvases'; write it with "
                             "diffusiongemma generate --json)")
        if "canvas_length" not in data or "max_steps" not in data:
            missing = "canvas_length" if "canvas_length" not in data else "max_steps"
            raise InputError(f"{where}: malformed per-step data (no field {missing!r})")
        C = _count(data["canvas_length"], "canvas_length", where)
        N = _count(data["max_steps"], "max_steps", where)
        try:
            canvases = []
            for k, c in enumerate(data["canvases"]):
                entropies = np.asarray(c["entropy"], dtype=np.float32).reshape(-1, C)
                S = entropies.shape[0]
                temps = np.array([np.nan if t is None else t for t in c["temperature"]], dtype=np.float32)
                accepted = np.asarray(c["accepted"])
                if accepted.size and not (accepted.dtype.kind in "biu" and np.isin(accepted, (0, 1)).all()):
                    raise InputError(f"{where}: canvas {k}'s 'accepted' holds {_first_not_flag(accepted)!r}; "
                                     "each entry is 0 (renoised) or 1 (accepted)")
                canvases.append(CanvasRecord(
                    entropies=entropies, accepted=accepted.astype(bool).reshape(S, C),
                    drafts=np.asarray(c["draft"], dtype=np.int64).reshape(S, C), temperatures=temps.reshape(S),
                    committed=None if c.get("committed") is None else np.asarray(c["committed"], dtype=np.int64)))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise InputError(f"{where}: malformed per-step data ({type(exc).__name__}: {exc})") from None
        for k, canvas in enumerate(canvases):
            _check_canvas(canvas, k, C, where)
        return cls(C, N, canvases)

    @classmethod
    def from_trace(cls, trace: Any) -> "DenoisingRecord":
        """Row 0 of an open ``diffusiongemma.trace.Trace`` (its sampler and commit tensors)."""
        C = int(trace.header["model"]["canvas_length"])
        N = int((trace.header.get("generation") or {}).get("max_denoising_steps") or 0)
        names = set(trace.names)
        canvases = []
        k = 0
        while f"canvas{k}.step0.draft" in names:
            rows = {"draft": [], "sampler_entropy": [], "accepted": [], "temperature": []}
            i = 0
            while f"canvas{k}.step{i}.draft" in names:
                for what in ("draft", "sampler_entropy", "accepted"):
                    rows[what].append(np.asarray(trace.get(f"canvas{k}.step{i}.{what}"))[0])
                t_name = f"canvas{k}.step{i}.temperature"
                rows["temperature"].append(float(trace.get(t_name)) if t_name in names else np.nan)
                i += 1
            committed = (np.asarray(trace.get(f"canvas{k}.committed"))[0].astype(np.int64)
                         if f"canvas{k}.committed" in names else None)
            accepted = np.stack(rows["accepted"])
            if accepted.size and not (accepted.dtype.kind in "biu" and np.isin(accepted, (0, 1)).all()):
                raise InputError(f"{trace.path}: canvas {k}'s 'accepted' holds {_first_not_flag(accepted)!r}; each "
                                 "entry is 0 (renoised) or 1 (accepted)")
            canvases.append(CanvasRecord(
                entropies=np.stack(rows["sampler_entropy"]).astype(np.float32),
                accepted=accepted.astype(bool), drafts=np.stack(rows["draft"]).astype(np.int64),
                temperatures=np.array(rows["temperature"], dtype=np.float32), committed=committed))
            k += 1
        if not canvases:
            raise InputError(f"{trace.path}: the trace holds no denoising steps (canvas0.step0.draft)")
        for k, canvas in enumerate(canvases):
            _check_canvas(canvas, k, C, trace.path)
        return cls(C, N or max(c.steps for c in canvases), canvases)


def _count(value: Any, name: str, where: str) -> int:
    """``value`` as an integer >= 1 (a JSON integer, not a bool, a fraction or text); ``InputError`` naming
    ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InputError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return int(value)


def _first_not_flag(values: np.ndarray) -> Any:
    """The first entry of ``values`` that is neither 0 nor 1 (as read, for the message)."""
    flat = values.ravel()
    if flat.dtype.kind in "biuf":
        return flat[~np.isin(flat, (0, 1))][0].item()
    return flat[0].item()


def _check_canvas(canvas: CanvasRecord, k: int, C: int, where: str) -> None:
    """``InputError`` naming the field for what no run can record: a canvas without steps, an entropy that is
    NaN, infinite or negative, a temperature that is infinite or negative (NaN means no schedule), a
    committed list longer than the canvas (or not a flat list), a negative token id."""
    if canvas.steps == 0:
        raise InputError(f"{where}: canvas {k} holds no denoising steps")
    bad = ~np.isfinite(canvas.entropies) | (canvas.entropies < -1e-6)  # -sum p log p >= 0 (rounding aside)
    if bad.any():
        s, i = np.argwhere(bad)[0]
        raise InputError(f"{where}: canvas {k}'s 'entropy' holds {float(canvas.entropies[s, i])!r} at step {s} "
                         f"position {i}; an entropy is a finite number >= 0 (nats)")
    temps = canvas.temperatures
    bad_t = np.flatnonzero(~np.isnan(temps) & (~np.isfinite(temps) | (temps < 0)))
    if bad_t.size:
        raise InputError(f"{where}: canvas {k}'s 'temperature' holds {float(temps[bad_t[0]])!r} at step "
                         f"{int(bad_t[0])}; a temperature is a finite number >= 0 (null: no schedule)")
    if canvas.committed is not None and (canvas.committed.ndim != 1 or canvas.committed.size > C):
        raise InputError(f"{where}: canvas {k}'s 'committed' holds {canvas.committed.size} token ids "
                         f"(shape {canvas.committed.shape}) for canvas_length={C} positions")
    for what, ids in (("draft", canvas.drafts), ("committed", canvas.committed)):
        if ids is not None and ids.size and int(ids.min()) < 0:
            at = np.unravel_index(int(np.argmin(ids)), ids.shape)
            place = f"step {at[0]} position {at[1]}" if ids.ndim == 2 else f"position {at[0]}"
            raise InputError(f"{where}: canvas {k}'s '{what}' holds token id {int(ids.min())} at {place}; token "
                             "ids are >= 0")


def check_token_ids(record: "DenoisingRecord", vocab_size: int, where: str) -> None:
    """``InputError`` naming the first draft or committed id outside ``0 .. vocab_size - 1`` (the tokenizer
    that decodes the animation would fail on it)."""
    for k, canvas in enumerate(record.canvases):
        for what, ids in (("draft", canvas.drafts), ("committed", canvas.committed)):
            if ids is None or not ids.size:
                continue
            bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
            if bad.size:
                at = np.unravel_index(int(bad[0]), ids.shape)
                place = f"step {at[0]} position {at[1]}" if ids.ndim == 2 else f"position {at[0]}"
                raise InputError(f"{where}: canvas {k}'s '{what}' holds token id {int(ids[at])} at {place}, outside "
                                 f"the tokenizer's vocabulary (0..{vocab_size - 1})")


class DenoisingLog:
    """A generation callback that keeps row 0 of every step; ``record()`` / ``to_json()`` give the run."""

    def __init__(self):
        self._steps: list[list[tuple]] = []  # per canvas: (entropy, accepted, draft, temperature) per step
        self._committed: list[np.ndarray] = []
        self.canvas_length = 0
        self.max_steps = 0

    def on_step(self, info) -> None:
        while len(self._steps) <= info.canvas_index:
            self._steps.append([])
        self.canvas_length = int(info.draft.shape[1])
        self.max_steps = max(self.max_steps, int(getattr(info, "max_steps", 0) or 0), int(info.step))
        self._steps[info.canvas_index].append((
            np.array(info.entropies[0], dtype=np.float32), np.array(info.accepted[0], dtype=bool),
            np.array(info.draft[0], dtype=np.int64), np.nan if info.temperature is None else info.temperature))

    def on_canvas(self, info) -> None:
        self._committed.append(np.array(info.tokens[0], dtype=np.int64))

    def record(self) -> DenoisingRecord:
        canvases = []
        for k, steps in enumerate(self._steps):
            if not steps:
                continue
            e, a, d, t = zip(*steps)
            canvases.append(CanvasRecord(np.stack(e), np.stack(a), np.stack(d), np.array(t, dtype=np.float32),
                                         self._committed[k] if k < len(self._committed) else None))
        return DenoisingRecord(self.canvas_length, self.max_steps, canvases)

    def to_json(self) -> dict:
        return self.record().to_json()


def load_record(path: str) -> DenoisingRecord:
    """A ``DenoisingRecord`` from a ``generate --json`` file or a trace file (told apart by content).
    Raises ``InputError`` naming the file when it is neither or holds no per-step data."""
    with open(path, "rb") as f:
        head = f.read(9)
    # a safetensors file starts with its header's byte length (8 bytes, little-endian), then the JSON header
    looks_like_trace = (len(head) == 9 and head[8:9] == b"{"
                        and int.from_bytes(head[:8], "little") + 8 <= os.path.getsize(path))
    if not looks_like_trace:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{path}: not a valid JSON run record ({exc})") from None
        return DenoisingRecord.from_json(data, where=path)
    from diffusiongemma.trace import Trace

    with Trace(path) as trace:
        return DenoisingRecord.from_trace(trace)


# ================================================================================================ figures
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never opens a window
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("diffusiongemma plot needs matplotlib: pip install -e \".[plot]\" (or pip install "
                          "matplotlib)") from exc
    return plt


def _canvas_ticks(ax, record: DenoisingRecord) -> None:
    C = record.canvas_length
    if len(record.canvases) == 1:  # positions as they are
        ax.set_ylabel("position in canvas")
        return
    for k in range(1, len(record.canvases)):
        ax.axhline(k * C - 0.5, color="white", linewidth=1.2)
    ax.set_yticks([(k + 0.5) * C - 0.5 for k in range(len(record.canvases))])
    ax.set_yticklabels([f"canvas {k + 1}" for k in range(len(record.canvases))])


def _heatmap(ax, record: DenoisingRecord, what: str, title: str, cmap: str, label: str, vmin=None, vmax=None):
    grid = record.grid(what)
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=vmin, vmax=vmax, origin="upper")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("canvas position")
    ax.set_title(title)
    _canvas_ticks(ax, record)
    ax.figure.colorbar(image, ax=ax, label=label)
    return image


def _draw_entropy(ax, record):
    _heatmap(ax, record, "entropies", "entropy per position and step", "viridis", "entropy (nats)")


def _draw_acceptance(ax, record):
    from matplotlib.colors import ListedColormap

    image = _heatmap(ax, record, "accepted", "accepted under the entropy bound (green) or renoised (grey)",
                     ListedColormap(["#d9d9d9", "#1a7f37"]), "accepted", vmin=0, vmax=1)
    image.colorbar.set_ticks([0.25, 0.75], labels=["renoised", "accepted"])


def _draw_commit_order(ax, record):
    settled = np.stack([c.settled_steps() for c in record.canvases]).astype(np.float64)  # (K, C)
    image = ax.imshow(settled, aspect="auto", interpolation="nearest", cmap="magma_r")
    ax.set_xlabel("position in canvas")
    ax.set_ylabel("canvas")
    ax.set_yticks(range(len(record.canvases)))
    ax.set_yticklabels([str(k + 1) for k in range(len(record.canvases))])
    ax.set_title("step at which each position settled on its committed token")
    ax.figure.colorbar(image, ax=ax, label="step")


def _step_axis(ax, record):
    start = 0
    for c in record.canvases[:-1]:
        start += c.steps
        ax.axvline(start - 0.5, color="0.8", linewidth=0.8)
    ax.set_xlabel("denoising step of the run (canvas boundaries in grey)")


def _draw_accepted(ax, record):
    counts = record.per_step("accepted")
    ax.bar(np.arange(len(counts)), counts, width=0.9, color="tab:blue")
    ax.set_ylim(0, record.canvas_length)
    ax.set_ylabel(f"accepted positions (of {record.canvas_length})")
    ax.set_title("tokens accepted per step")
    _step_axis(ax, record)


def _draw_temperature(ax, record):
    temps = record.per_step("temperature")
    start = 0
    for canvas in record.canvases:  # one line per canvas: the schedule restarts at t_max
        x = np.arange(start, start + canvas.steps)
        ax.plot(x, temps[start:start + canvas.steps], marker=".", color="tab:red")
        start += canvas.steps
    ax.set_ylabel("temperature")
    ax.set_title("temperature schedule" + (" (none: no schedule)" if np.isnan(temps).all() else ""))
    _step_axis(ax, record)


_DRAWERS = {"entropy": _draw_entropy, "acceptance": _draw_acceptance, "commit-order": _draw_commit_order,
            "accepted": _draw_accepted, "temperature": _draw_temperature}
FIGURES = (*_DRAWERS, "summary")  # names accepted by ``figure`` and ``diffusiongemma plot --figure``


def figure(record: DenoisingRecord, name: str = "summary"):
    """The figure ``name`` (one of ``FIGURES``) of ``record``."""
    if not record.canvases:
        raise InputError("the run holds no denoising steps to plot")
    plt = _pyplot()
    if name == "summary":
        fig, axes = plt.subplots(5, 1, figsize=(10, 17), gridspec_kw={"height_ratios": [3, 3, 1.5, 1.5, 1.5]})
        for ax, draw in zip(axes, _DRAWERS.values()):
            draw(ax, record)
        fig.suptitle(f"denoising of {len(record.canvases)} canvas(es) of {record.canvas_length} tokens, "
                     f"at most {record.max_steps} steps each", fontsize=13)
        fig.tight_layout(rect=(0, 0, 1, 0.98))
        return fig
    if name not in _DRAWERS:
        raise InputError(f"unknown figure {name!r}; known: {', '.join(FIGURES)}")
    fig, ax = plt.subplots(figsize=(10, 6 if name in ("entropy", "acceptance") else 4))
    _DRAWERS[name](ax, record)
    fig.tight_layout()
    return fig


def entropy_heatmap(record):
    return figure(record, "entropy")


def acceptance_heatmap(record):
    return figure(record, "acceptance")


def commit_order(record):
    return figure(record, "commit-order")


def accepted_per_step(record):
    return figure(record, "accepted")


def temperature_schedule(record):
    return figure(record, "temperature")


def summary(record):
    return figure(record, "summary")


def save_figure(fig, path: str) -> None:
    """Write ``fig`` to ``path``; the format follows the extension (.png, .svg, .pdf). The figure is closed
    whether or not the write succeeds."""
    try:
        fig.savefig(path, dpi=110)
    finally:
        _pyplot().close(fig)


# ================================================================================================ animation
def animation_html(record: DenoisingRecord, decode, title: str = "diffusiongemma: denoising") -> str:
    """A self-contained HTML page that plays the run step by step: committed text, then the current canvas's
    draft with accepted positions in bold and the rest faded, and the ``canvas k/n · step s/N · accepted a/C
    · T=...`` header. ``decode``: token id -> text. No external files or scripts."""
    frames = []
    committed = ""
    n = len(record.canvases)
    for k, canvas in enumerate(record.canvases):
        for s in range(canvas.steps):
            pieces = [[decode(int(t)), bool(a)] for t, a in zip(canvas.drafts[s], canvas.accepted[s])]
            temp = canvas.temperatures[s]
            header = (f"canvas {k + 1}/{n} · step {s + 1}/{record.max_steps} · accepted "
                      f"{int(canvas.accepted[s].sum())}/{record.canvas_length} · "
                      f"T={'none' if np.isnan(temp) else f'{float(temp):.3f}'}")
            frames.append({"header": header, "committed": committed, "draft": pieces})
        tokens = canvas.committed if canvas.committed is not None else canvas.drafts[-1]
        committed += "".join(decode(int(t)) for t in tokens)
    frames.append({"header": f"{n} canvas(es) committed", "committed": committed, "draft": []})
    data = json.dumps(frames, ensure_ascii=False).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
#text {{ font-family: monospace; white-space: pre-wrap; font-size: 1.1em; line-height: 1.5; }}
#header {{ color: #555; margin: 0.5em 0; font-family: monospace; }}
.ok {{ font-weight: bold; background: #dfd; }} .noisy {{ color: #aaa; }}
</style></head><body>
<h2>{html.escape(title)}</h2>
<div><button id="play">pause</button> <input id="pos" type="range" min="0" value="0" style="width:30em">
 frame time <input id="ms" type="number" value="150" min="10" style="width:5em"> ms</div>
<div id="header"></div><div id="text"></div>
<script>
const frames = {data};
const pos = document.getElementById("pos"), text = document.getElementById("text");
pos.max = frames.length - 1;
let i = 0, playing = true;
function esc(s) {{ return s.replace(/[&<>]/g, c => ({{"&": "&amp;", "<": "&lt;", ">": "&gt;"}})[c]); }}
function show(n) {{
  const f = frames[n]; i = n; pos.value = n;
  document.getElementById("header").textContent = f.header;
  text.innerHTML = esc(f.committed) + f.draft.map(p => '<span class="' + (p[1] ? 'ok' : 'noisy') + '">' +
    esc(p[0]) + '</span>').join("");
}}
function tick() {{
  if (playing && i < frames.length - 1) show(i + 1);
  setTimeout(tick, Math.max(10, +document.getElementById("ms").value));
}}
document.getElementById("play").onclick = e => {{ playing = !playing; e.target.textContent = playing ? "pause" : "play";
  if (playing && i == frames.length - 1) show(0); }};
pos.oninput = () => {{ playing = false; document.getElementById("play").textContent = "play"; show(+pos.value); }};
show(0); setTimeout(tick, 150);
</script></body></html>
"""
