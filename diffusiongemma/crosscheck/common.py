"""What every peer adapter shares: the forward inputs, the tolerance, the reference's side of each check,
and the comparison of two generation runs.

Forward check (same weights, same inputs, three logits tensors):

    prompt (1, P) with P = W + 3 (longer than the window, so sliding layers drop prompt keys)
    prefill            logits of a random canvas after encoding the prompt, no self-conditioning
    self-conditioning  the same canvas with SC input = prefill logits / T (T = t_max, the first step's)
    after commit       argmax of the SC logits committed (encoded), then a second random canvas

Tolerance: a float32 implementation is off the exact result by rounding; two correct ones differ by at
most the sum of their errors. The reference's own error is measured on the spot by running it a second
time in float64 on the same inputs; each tensor's tolerance is 16 x that error (4 bits of slack for a peer
whose kernels round differently), with a floor of 1e-6 x max(1, max|logit|).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .report import Divergence, ForwardRow

TOLERANCE_FACTOR = 16.0
TOLERANCE_NOTE = ("16 x the reference's own float32 error on that tensor (measured against a float64 run of "
                  "the reference on the same inputs), floor 1e-6 x max(1, max|logit|)")


class PeerUnavailable(RuntimeError):
    """The peer (or what it needs) is not installed or cannot load the model: a setup error (exit 2)."""


@dataclass
class ForwardInputs:
    """The inputs of the forward check (all int64 / float32 NumPy)."""

    prompt: np.ndarray  # (1, P)
    canvas: np.ndarray  # (1, C)
    canvas2: np.ndarray  # (1, C) the canvas denoised after the commit
    temperature: float  # T used to scale the SC input


@dataclass
class PeerRun:
    """What a peer's generation did, as the comparison needs it."""

    tokens: list  # generated ids as the peer reports them (after its own EOS/length rules)
    calls: list = field(default_factory=list)  # per decoder call (canvas index, step index, input canvas (1, C), raw logits (1, C, V))
    tape: list = field(default_factory=list)  # [(kind, (1, C) int64)] the peer's random draws, in our order
    steps_per_canvas: list = field(default_factory=list)


def forward_inputs(config: Any, seed: int = 0, t_max: float = 0.8) -> ForwardInputs:
    """Random prompt and canvases for a model config (see the module notes)."""
    rng = np.random.default_rng(seed)
    V, C, W = int(config.vocab_size), int(config.canvas_length), int(config.sliding_window)
    P = W + 3
    return ForwardInputs(prompt=rng.integers(3, V, (1, P), dtype=np.int64),
                         canvas=rng.integers(0, V, (1, C), dtype=np.int64),
                         canvas2=rng.integers(0, V, (1, C), dtype=np.int64), temperature=float(t_max))


def reference_forward(model: Any, x: ForwardInputs) -> dict[str, np.ndarray]:
    """The reference's three logits tensors for ``x`` (see the module notes): {name: (1, C, V)}."""
    cache = model.new_cache(1)
    model.encode(x.prompt, cache)
    prefill = np.asarray(model.denoise(x.canvas, cache, None))
    sc_in = (prefill / np.float32(x.temperature)).astype(prefill.dtype)
    with_sc = np.asarray(model.denoise(x.canvas, cache, sc_in))
    model.encode(np.argmax(with_sc, axis=-1).astype(np.int64), cache)
    after = np.asarray(model.denoise(x.canvas2, cache, None))
    return {"prefill": prefill, "self-conditioning": with_sc, "after commit": after}


def float64_twin(model: Any) -> Any:
    """A copy of a reference ``Model`` whose tensors are float64, so that it computes in float64.

    Returns None when the model does not have the reference's layout (then a fixed tolerance is used).
    """
    try:
        twin = copy.copy(model)
        twin.tensors = {k: np.asarray(v, dtype=np.float64) for k, v in model.tensors.items()}
        twin.layers = [{k: np.asarray(v, dtype=np.float64) for k, v in layer.items()} for layer in model.layers]
        return twin
    except AttributeError:
        return None


def tolerances(model: Any, x: ForwardInputs, ours: dict[str, np.ndarray]) -> tuple[dict[str, float], str]:
    """Per-tensor tolerance {name: float} and the sentence that justifies it."""
    twin = float64_twin(model)
    exact = None
    if twin is not None:
        try:
            exact = _reference_forward_like(twin, x, ours)
        except Exception:  # a model that cannot run in float64: fall back below
            exact = None
    out = {}
    for name, logits in ours.items():
        floor = 1e-6 * max(1.0, float(np.max(np.abs(logits))))
        if exact is None:
            out[name] = 1e-4 * max(1.0, float(np.max(np.abs(logits))))
        else:
            error = float(np.max(np.abs(logits.astype(np.float64) - exact[name])))
            out[name] = max(TOLERANCE_FACTOR * error, floor)
    note = TOLERANCE_NOTE if exact is not None else "1e-4 x max(1, max|logit|) (no float64 run was possible)"
    return out, note


def _reference_forward_like(twin: Any, x: ForwardInputs, ours: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 twin on the same inputs, committing the *float32* run's argmax (same commit in both)."""
    cache = twin.new_cache(1)
    twin.encode(x.prompt, cache)
    prefill = np.asarray(twin.denoise(x.canvas, cache, None), dtype=np.float64)
    sc_in = (ours["prefill"] / np.float32(x.temperature)).astype(np.float32)
    with_sc = np.asarray(twin.denoise(x.canvas, cache, sc_in), dtype=np.float64)
    twin.encode(np.argmax(ours["self-conditioning"], axis=-1).astype(np.int64), cache)
    after = np.asarray(twin.denoise(x.canvas2, cache, None), dtype=np.float64)
    return {"prefill": prefill, "self-conditioning": with_sc, "after commit": after}


def forward_rows(ours: dict[str, np.ndarray], peer: dict[str, np.ndarray], tol: dict[str, float]) -> list[ForwardRow]:
    """One ``ForwardRow`` per tensor."""
    rows = []
    for name, mine in ours.items():
        theirs = np.asarray(peer[name], dtype=np.float32)
        if theirs.shape != mine.shape:
            rows.append(ForwardRow(name, tuple(theirs.shape), float("inf"), float(np.max(np.abs(mine))), tol[name], 0.0))
            continue
        diff = float(np.max(np.abs(theirs.astype(np.float64) - mine)))
        agree = float(np.mean(np.argmax(theirs, -1) == np.argmax(mine, -1)))
        rows.append(ForwardRow(name, tuple(mine.shape), diff, float(np.max(np.abs(mine))), tol[name], agree))
    return rows


class CallRecorder:
    """Wraps a denoiser ``(canvas, cache, sc) -> logits`` and keeps every call with its canvas/step index.

    ``canvas_of`` is a callable giving the current canvas index (the recorder counts steps itself).
    """

    def __init__(self, denoise: Callable):
        self.denoise = denoise
        self.calls: list = []
        self.canvas_index = 0
        self.step_index = 0

    def new_canvas(self, k: int) -> None:
        self.canvas_index, self.step_index = k, 0

    def __call__(self, canvas, cache, sc_logits):
        logits = self.denoise(canvas, cache, sc_logits)
        self.calls.append((self.canvas_index, self.step_index, np.array(canvas, copy=True),
                           np.array(logits, copy=True)))
        self.step_index += 1
        return logits


def compare_runs(peer: PeerRun, ours_calls: list, our_tokens: list, canvas_length: int,
                 logit_tolerance: float) -> tuple[list[dict], Divergence | None]:
    """Per-canvas agreement and the first divergence between a peer run and ours.

    Walks the decoder calls in order. The first call whose input canvas differs means the previous step
    decided differently; its cause is read off that previous step: logits beyond ``logit_tolerance``, an
    argmax near tie (top-2 gap below the logits' difference), or a sampler decision (acceptance, draw,
    reveal) taken on logits that agree, i.e. a semantic difference. A different number of steps is a
    stopping difference; equal inputs everywhere but different tokens point at the commit or EOS rule.
    """
    rows = []
    n_canvases = max(len(peer.steps_per_canvas), _canvases(ours_calls), 1)
    our_steps = [sum(1 for c in ours_calls if c[0] == k) for k in range(n_canvases)]
    for k in range(n_canvases):
        a = peer.tokens[k * canvas_length:(k + 1) * canvas_length]
        b = our_tokens[k * canvas_length:(k + 1) * canvas_length]
        if not a and not b:
            continue
        rows.append({"agree": sum(int(x == y) for x, y in zip(a, b)), "of": max(len(a), len(b)),
                     "steps_peer": peer.steps_per_canvas[k] if k < len(peer.steps_per_canvas) else 0,
                     "steps_ours": our_steps[k]})
    divergence = None
    previous = None
    for theirs, mine in zip(peer.calls, ours_calls):
        (kp, sp, cp, lp), (ko, so, co, lo) = theirs, mine
        if (kp, sp) != (ko, so):
            prev = f"canvas {previous[0][0]} step {previous[0][1]}" if previous else "the start"
            divergence = Divergence(ko, so, 0, -1, -1, f"stopping: after {prev} the peer went on to canvas {kp} "
                                                        f"step {sp} but ours to canvas {ko} step {so}")
            break
        if not np.array_equal(cp, co):
            pos = int(np.argmax((np.asarray(cp) != np.asarray(co)).ravel()))
            cause = _cause(previous, pos, logit_tolerance)
            divergence = Divergence(kp, sp, pos, int(np.asarray(cp).ravel()[pos]), int(np.asarray(co).ravel()[pos]),
                                    cause)
            break
        previous = (theirs, mine)
    else:
        if len(peer.calls) != len(ours_calls):
            last = min(len(peer.calls), len(ours_calls))
            k, s = (ours_calls[last][:2] if len(ours_calls) > last else peer.calls[last][:2])
            divergence = Divergence(k, s, 0, -1, -1, f"stopping: the peer made {len(peer.calls)} decoder calls, "
                                                     f"ours {len(ours_calls)}")
    if divergence is None and peer.tokens != our_tokens:
        pos = next((i for i, (x, y) in enumerate(zip(peer.tokens, our_tokens)) if x != y),
                   min(len(peer.tokens), len(our_tokens)))
        k = pos // canvas_length
        cause = ("commit rule or end-token handling: every step had the same input canvas"
                 if pos < min(len(peer.tokens), len(our_tokens)) else
                 f"output length: peer {len(peer.tokens)} tokens, ours {len(our_tokens)} (EOS / length rule)")
        divergence = Divergence(k, -1, pos % canvas_length,
                                peer.tokens[pos] if pos < len(peer.tokens) else -1,
                                our_tokens[pos] if pos < len(our_tokens) else -1, cause)
    return rows, divergence


def _canvases(calls: list) -> int:
    return (max(c[0] for c in calls) + 1) if calls else 0


def _cause(previous, pos: int, tol: float) -> str:
    if previous is None:
        return "the initial canvas differs (the draw replay does not line up)"
    (k, s, _, lp), (_, _, _, lo) = previous
    lp, lo = np.asarray(lp, dtype=np.float64)[0], np.asarray(lo, dtype=np.float64)[0]  # (C, V)
    worst = float(np.max(np.abs(lp - lo)))
    if worst > tol:
        return (f"logits differ beyond tolerance at canvas {k} step {s} (max |d| {worst:.2e} > {tol:.2e}) "
                "with identical inputs")
    top2 = np.sort(lo[pos])[-2:]
    gap = float(top2[1] - top2[0])
    here = float(np.max(np.abs(lp[pos] - lo[pos])))
    if gap <= 2 * here:
        return (f"near tie at canvas {k} step {s}: top-2 logit gap {gap:.2e} <= 2 x the position's logit "
                f"difference {here:.2e}")
    return (f"sampler decision at canvas {k} step {s}: logits agree (max |d| {worst:.2e}) but position {pos} "
            "was accepted, drawn or renoised differently (a semantic difference)")
