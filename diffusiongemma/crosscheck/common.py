"""What every peer adapter shares: the forward inputs, the tolerance, the reference's side of each check,
and the comparison of two generation runs.

Forward check (same weights, same inputs, three logits tensors):

    prompt (1, P) with P = W + 3 (longer than the window, so sliding layers drop prompt keys)
    prefill            logits of a random canvas after encoding the prompt, no self-conditioning
    self-conditioning  the same canvas with SC input = prefill logits / T (T = t_max, the first step's)
    after commit       argmax of the SC logits committed (encoded), then a second random canvas
    image id in context  (probe) the same, with the image placeholder id at the committed canvas's first
                       position: an implementation may treat that id specially without an image

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
    image_token_id: int | None = None  # the checkpoint's image placeholder id (the probe row), None: no probe


@dataclass
class PeerRun:
    """What a peer's generation did, as the comparison needs it."""

    tokens: list  # generated ids as the peer reports them (after its own EOS/length rules)
    calls: list = field(default_factory=list)  # per decoder call (canvas index, step index, input canvas (1, C), raw logits (1, C, V))
    tape: list = field(default_factory=list)  # [(kind, (1, C) int64)] the peer's random draws, in our order
    steps_per_canvas: list = field(default_factory=list)


def forward_inputs(config: Any, seed: int = 0, t_max: float = 0.8, image_token_id: int | None = None) -> ForwardInputs:
    """Random prompt and canvases for a model config (see the module notes). The prompt avoids ids 0-2
    (pad, eos, bos) and the image id."""
    rng = np.random.default_rng(seed)
    V, C, W = int(config.vocab_size), int(config.canvas_length), int(config.sliding_window)
    P = W + 3
    prompt = rng.integers(3, V, (1, P), dtype=np.int64)
    if image_token_id is not None:
        prompt[prompt == image_token_id] = 3
    return ForwardInputs(prompt=prompt, canvas=rng.integers(0, V, (1, C), dtype=np.int64),
                         canvas2=rng.integers(0, V, (1, C), dtype=np.int64), temperature=float(t_max),
                         image_token_id=image_token_id)


def committed_for_check(with_sc: np.ndarray, image_token_id: int | None, probe: bool = False) -> np.ndarray:
    """The canvas the forward check commits: the argmax of the SC logits, never the image id except at
    position 0 of the probe."""
    z = np.array(with_sc, dtype=np.float32, copy=True)
    if image_token_id is not None:
        z[..., image_token_id] = -np.inf
    tokens = np.argmax(z, axis=-1).astype(np.int64)
    if probe:
        tokens[:, 0] = image_token_id
    return tokens


def run_forward(x: ForwardInputs, new_cache: Callable, encode: Callable, denoise: Callable) -> dict[str, np.ndarray]:
    """The check's tensors for one implementation given as three callables: ``new_cache() -> cache``,
    ``encode(cache, ids) -> cache`` and ``denoise(cache, canvas, sc_logits or None) -> (1, C, V)``."""
    out = {}
    for probe in ((False, True) if x.image_token_id is not None else (False,)):
        cache = encode(new_cache(), x.prompt)
        prefill = np.asarray(denoise(cache, x.canvas, None))
        with_sc = np.asarray(denoise(cache, x.canvas, (prefill / np.float32(x.temperature)).astype(np.float32)))
        cache = encode(cache, committed_for_check(with_sc, x.image_token_id, probe))
        after = np.asarray(denoise(cache, x.canvas2, None))
        if probe:
            out["image id in context"] = after
        else:
            out.update({"prefill": prefill, "self-conditioning": with_sc, "after commit": after})
    return out


def reference_forward(model: Any, x: ForwardInputs) -> dict[str, np.ndarray]:
    """The reference's logits tensors for ``x`` (see the module notes): {name: (1, C, V)}."""
    def encode(cache, ids):
        model.encode(ids, cache)
        return cache

    return run_forward(x, lambda: model.new_cache(1), encode, lambda cache, c, sc: model.denoise(c, cache, sc))


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
    """The float64 twin on the same inputs. Its own argmax commits are used; where they differ from the
    float32 run's (a near tie) the row's error is not meaningful, so such runs fall back (None)."""
    exact = reference_forward(twin, x)
    for name in ("self-conditioning",):
        z64, z32 = exact[name].copy(), ours[name].copy()
        if not np.array_equal(committed_for_check(z64, x.image_token_id), committed_for_check(z32, x.image_token_id)):
            raise ArithmeticError("float64 and float32 commit different tokens")
    return {k: np.asarray(v, dtype=np.float64) for k, v in exact.items()}


def forward_rows(ours: dict[str, np.ndarray], peer: dict[str, np.ndarray], tol: dict[str, float]) -> list[ForwardRow]:
    """One ``ForwardRow`` per tensor; the image-id row is a probe."""
    rows = []
    for name, mine in ours.items():
        theirs = np.asarray(peer[name], dtype=np.float32)
        probe = name == "image id in context"
        if theirs.shape != mine.shape:
            rows.append(ForwardRow(name, tuple(theirs.shape), float("inf"), float(np.max(np.abs(mine))), tol[name], 0.0,
                                   probe))
            continue
        diff = float(np.max(np.abs(theirs.astype(np.float64) - mine)))
        agree = float(np.mean(np.argmax(theirs, -1) == np.argmax(mine, -1)))
        rows.append(ForwardRow(name, tuple(mine.shape), diff, float(np.max(np.abs(mine))), tol[name], agree, probe))
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


class TorchDrawRecorder:
    """Records a torch-based peer's random draws and decoder calls into a ``PeerRun`` while it generates.

    Use as a context manager around the peer's generate: ``torch.randint`` / ``torch.multinomial`` and
    ``model.forward`` are wrapped for the duration and restored after. A ``randint`` right after a decoder
    call or a categorical draw is the step's renoise draw; any other ``randint`` starts a canvas (its
    initial ids). ``multinomial`` results are kept as (B, C) categorical draws; every decoder call is kept as
    (canvas, step, decoder_input_ids, float32 logits).
    """

    def __init__(self, model: Any, run: PeerRun, batch_size: int, canvas_length: int):
        self.model, self.run, self.B, self.C = model, run, batch_size, canvas_length
        self.previous: str | None = None
        self.canvas, self.step = -1, 0

    def __enter__(self) -> "TorchDrawRecorder":
        import torch

        self._torch = torch
        self._randint, self._multinomial, forward = torch.randint, torch.multinomial, self.model.forward
        run = self.run

        def randint(*args, **kw):
            out = self._randint(*args, **kw)
            kind = "renoise" if self.previous in ("call", "categorical") else "canvas"
            if kind == "canvas":
                self.canvas, self.step = self.canvas + 1, 0
                run.steps_per_canvas.append(0)
            run.tape.append((kind, out.numpy().astype(np.int64)))
            self.previous = kind
            return out

        def multinomial(probs, num_samples, *args, **kw):
            out = self._multinomial(probs, num_samples, *args, **kw)
            run.tape.append(("categorical", out.view(self.B, self.C).numpy().astype(np.int64)))
            self.previous = "categorical"
            return out

        def recording_forward(*args, **kw):
            out = forward(*args, **kw)
            run.calls.append((self.canvas, self.step, kw["decoder_input_ids"].numpy().copy(),
                              out.logits.detach().float().numpy().copy()))
            self.step += 1
            run.steps_per_canvas[-1] += 1
            self.previous = "call"
            return out

        torch.randint, torch.multinomial = randint, multinomial
        self.model.forward = recording_forward  # generate() binds self.forward as its decoder
        return self

    def __exit__(self, *exc: Any) -> None:
        self._torch.randint, self._torch.multinomial = self._randint, self._multinomial
        del self.model.forward


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
        if sp == 0 and kp > 0:
            a = peer.tokens[(kp - 1) * canvas_length:kp * canvas_length]
            b = our_tokens[(kp - 1) * canvas_length:kp * canvas_length]
            if a != b:  # the contexts differ from here on: the committed canvas is the cause
                pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                divergence = Divergence(kp - 1, -1, pos, a[pos] if pos < len(a) else -1, b[pos] if pos < len(b) else -1,
                                        f"commit rule: canvas {kp - 1} was committed differently although every "
                                        "step had the same input canvas")
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
