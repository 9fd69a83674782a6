"""What every peer adapter shares: the forward inputs, the tolerances, and the three comparisons of a
generation (teacher-forced forward, the sampler on the peer's logits, the free run).

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
whose kernels round differently), with a floor of 1e-6 x max(1, max|logit|). The same rule holds for every
teacher-forced step, every decoder layer and the encoder cache (``teacher_forced``), there with a ceiling of
2e-3 x max(1, max|x|).

bfloat16 (``crosscheck(..., dtype="bfloat16")``, SPEC §10.3): the reference runs upstream's bfloat16 run and
the peer is expected to be one too. Two correct bfloat16 runs make the same roundings almost everywhere, but a
float32 sum taken in another order lands now and then on the other side of a bfloat16 rounding point and the
following layers carry that flip on, so whole calls of two correct runs differ about as much as a misplaced
rounding makes them differ. The forward rows below (tolerance ``BF16_FACTOR`` x the bfloat16 run's own error
against float64, floor one bfloat16 ulp) are therefore information in bfloat16, and the generation's decoder
calls and encodes are compared stage by stage on the peer's own stage inputs against a measured null
distribution instead (``bf16_stages``, ``bf16_null``); the sampler check decides as in float32.

Generation (``PeerRun``: the peer's decoder calls with their exact inputs, the ids it encoded, its cache,
its random draws):

* ``teacher_forced``: every decoder call of the peer is repeated by our model on the peer's own inputs:
  the canvas ids, the self-conditioning input as the peer computed it (floats), and a cache our encoder
  built from the ids the peer encoded (compared with the peer's own cache where the peer exposes it).
  A call beyond tolerance is localised to the decoder input or the first decoder layer that differs.
* ``sampler_check``: our loop, with the variant's semantics, runs on the peer's own logits and draws;
  each step's self-conditioning input and input canvas, each canvas's step count and committed tokens,
  and the output are compared: the first difference names its stage (self-conditioning input, acceptance,
  renoise, stopping, commit, EOS, length).
* ``free_run``: our whole loop on our own logits, with the peer's draws: information only. Float32
  rounding enters the self-conditioning input, which feeds the next step; a random model amplifies it from
  step to step, so two correct implementations may part after a few steps. ``free_run`` reports the step
  where the inputs first drifted (and by how much) and where the tokens parted.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import variants
from .report import Divergence, ForwardRow

STAGES = ("forward input", "forward layer", "forward", "cache/context", "self-conditioning input", "acceptance",
          "renoise", "stopping", "commit", "EOS", "length", "draws")

TOLERANCE_FACTOR = 16.0
BF16_FACTOR = 1.0 / 3.0  # bfloat16 runs: the tolerance is this share of the reference's own bfloat16 error
BF16_ULP = 2.0 ** -8  # bfloat16's relative spacing at 1: the floor of a bfloat16 tolerance, x max(1, max|x|)
CEILING = 2e-3  # teacher-forced steps and caches: the tolerance never exceeds 2e-3 x max(1, max|x|)
TOLERANCE_NOTE = ("16 x the reference's own float32 error on that tensor (measured against a float64 run of "
                  "the reference on the same inputs), floor 1e-6 x max(1, max|logit|)")
BF16_TOLERANCE_NOTE = ("bfloat16 run (SPEC §10): 1/3 x the reference's own bfloat16 error on that tensor (its "
                       "bfloat16 run against a float64 run on the same weights and inputs), floor one bfloat16 "
                       "ulp (2**-8) x max(1, max|logit|)")


def is_bfloat16(model: Any) -> bool:
    """True when ``model`` is the reference's bfloat16 run (``Model(..., dtype="bfloat16")``)."""
    from diffusiongemma.reference.primitives import BFLOAT16

    return getattr(model, "dtype", None) == BFLOAT16


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
class Call:
    """One decoder call of a run, with its exact inputs and output."""

    canvas: int  # canvas index k
    step: int  # 0-based denoising step within the canvas
    ids: np.ndarray  # (1, C) int64 input canvas
    sc: np.ndarray | None  # (1, C, V) float32 self-conditioning input as passed to the decoder, None at step 0
    logits: np.ndarray  # (1, C, V) float32 soft-capped logits
    sc_known: bool = True  # False: the peer used a self-conditioning input the adapter could not see


@dataclass
class PeerRun:
    """What a peer's generation did, as the comparisons need it."""

    tokens: list  # generated ids as the peer reports them (after its own EOS/length rules)
    calls: list = field(default_factory=list)  # [Call] every decoder call, in order
    tape: list = field(default_factory=list)  # [(kind, (1, C) int64)] the peer's random draws, in our order
    steps_per_canvas: list = field(default_factory=list)
    contexts: list = field(default_factory=list)  # [(1, n) int64] the ids the peer encoded, call by call
    caches: dict = field(default_factory=dict)  # {k: [(keys, values) (1, g, T, d) per layer]} before canvas k
    sc_note: str = ""  # how the adapter obtained the self-conditioning inputs (when not directly)

    def canvas_calls(self, k: int) -> list:
        return [c for c in self.calls if c.canvas == k]


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


def run_forward(x: ForwardInputs, new_cache: Callable, encode: Callable, denoise: Callable,
                teacher: dict | None = None) -> dict[str, np.ndarray]:
    """The check's tensors for one implementation given as three callables: ``new_cache() -> cache``,
    ``encode(cache, ids) -> cache`` and ``denoise(cache, canvas, sc_logits or None) -> (1, C, V)``.
    teacher: another run's tensors (the peer's), whose "prefill" gives the self-conditioning input and whose
    "self-conditioning" argmax is committed (teacher forcing; default: this run's own)."""
    out = {}
    for probe in ((False, True) if x.image_token_id is not None else (False,)):
        cache = encode(new_cache(), x.prompt)
        prefill = np.asarray(denoise(cache, x.canvas, None))
        source = prefill if teacher is None else np.asarray(teacher["prefill"], dtype=np.float32)
        with_sc = np.asarray(denoise(cache, x.canvas, (source / np.float32(x.temperature)).astype(np.float32)))
        commit = with_sc if teacher is None else np.asarray(teacher["self-conditioning"])
        cache = encode(cache, committed_for_check(commit, x.image_token_id, probe))
        after = np.asarray(denoise(cache, x.canvas2, None))
        if probe:
            out["image id in context"] = after
        else:
            out.update({"prefill": prefill, "self-conditioning": with_sc, "after commit": after})
    return out


def reference_forward(model: Any, x: ForwardInputs, teacher: dict | None = None) -> dict[str, np.ndarray]:
    """The reference's logits tensors for ``x`` (see the module notes): {name: (1, C, V)}."""
    def encode(cache, ids):
        model.encode(ids, cache)
        return cache

    return run_forward(x, lambda: model.new_cache(1), encode, lambda cache, c, sc: model.denoise(c, cache, sc),
                       teacher)


def float64_twin(model: Any) -> Any:
    """A copy of a reference ``Model`` whose tensors are float64, so that it computes in float64.

    Returns None when the model does not have the reference's layout (then a fixed tolerance is used).
    """
    try:
        twin = copy.copy(model)
        twin.tensors = {k: np.asarray(v, dtype=np.float64) for k, v in model.tensors.items()}
        twin.layers = [{k: np.asarray(v, dtype=np.float64) for k, v in layer.items()} for layer in model.layers]
        if hasattr(model, "dtype"):  # a bfloat16 model's twin: the same (rounded) weights, computed without rounding
            twin.dtype = np.dtype(np.float64)
        return twin
    except AttributeError:
        return None


def tolerances(model: Any, x: ForwardInputs, ours: dict[str, np.ndarray],
               teacher: dict | None = None) -> tuple[dict[str, float], str]:
    """Per-tensor tolerance {name: float} and the sentence that justifies it. teacher: the tensors ``ours``
    was teacher-forced with (``reference_forward``), None for none."""
    twin = float64_twin(model)
    exact = None
    if twin is not None:
        try:
            exact = _reference_forward_like(twin, x, ours, is_bfloat16(model), teacher)
        except Exception:  # a model that cannot run in float64: fall back below
            exact = None
    out, bf16 = {}, is_bfloat16(model)
    for name, logits in ours.items():
        floor = 1e-6 * max(1.0, float(np.max(np.abs(logits))))
        if bf16:
            out[name] = _bound(logits, None if exact is None else exact[name], bf16=True)
        elif exact is None:
            out[name] = 1e-4 * max(1.0, float(np.max(np.abs(logits))))
        else:
            error = float(np.max(np.abs(logits.astype(np.float64) - exact[name])))
            out[name] = max(TOLERANCE_FACTOR * error, floor)
    note = TOLERANCE_NOTE if exact is not None else "1e-4 x max(1, max|logit|) (no float64 run was possible)"
    return out, (BF16_TOLERANCE_NOTE if bf16 else note)


def _reference_forward_like(twin: Any, x: ForwardInputs, ours: dict[str, np.ndarray],
                            bf16: bool = False, teacher: dict | None = None) -> dict[str, np.ndarray]:
    """The float64 twin on the same inputs. Its own argmax commits are used; where they differ from the
    float32 run's (a near tie) the row's error is not meaningful, so such runs fall back (None)."""
    if bf16:  # bfloat16 and float64 part on near ties: the twin commits our tokens
        exact = reference_forward(twin, x, teacher if teacher is not None else
                                  {"prefill": ours["prefill"], "self-conditioning": ours["self-conditioning"]})
        return {k: np.asarray(v, dtype=np.float64) for k, v in exact.items()}
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
    """Wraps a denoiser ``(canvas, cache, sc) -> logits`` and keeps every call as a ``Call``, with its
    exact inputs. ``new_canvas(k)`` starts canvas k (the recorder counts steps itself)."""

    def __init__(self, denoise: Callable):
        self.denoise = denoise
        self.calls: list = []
        self.canvas_index = 0
        self.step_index = 0

    def new_canvas(self, k: int) -> None:
        self.canvas_index, self.step_index = k, 0

    def __call__(self, canvas, cache, sc_logits):
        logits = self.denoise(canvas, cache, sc_logits)
        self.calls.append(Call(self.canvas_index, self.step_index, np.array(canvas, copy=True),
                               None if sc_logits is None else np.array(sc_logits, dtype=np.float32, copy=True),
                               np.array(logits, copy=True)))
        self.step_index += 1
        return logits


def torch_cache_arrays(cache: Any) -> list | None:
    """Per layer (keys, values) float32 (B, g, T, d) of a transformers cache, None if it has another form."""
    try:
        return [(layer.keys.detach().float().numpy().copy(), layer.values.detach().float().numpy().copy())
                for layer in cache.layers]
    except (AttributeError, TypeError):
        return None


class TorchDrawRecorder:
    """Records a torch-based peer's random draws, encoder inputs and decoder calls into a ``PeerRun``.

    Use as a context manager around the peer's generate: ``torch.randint`` / ``torch.multinomial``,
    ``model.forward`` and ``model.model.encoder.forward`` are wrapped for the duration and restored after. A
    ``randint`` right after a decoder call or a categorical draw is the step's renoise draw; any other
    ``randint`` starts a canvas (its initial ids). ``multinomial`` results are kept as (B, C) categorical
    draws; every decoder call as a ``Call`` (its canvas, self-conditioning input and float32 logits); the
    cache the first call of each canvas reads is copied (the peer's cache contents).
    """

    def __init__(self, model: Any, run: PeerRun, batch_size: int, canvas_length: int):
        self.model, self.run, self.B, self.C = model, run, batch_size, canvas_length
        self.previous: str | None = None
        self.canvas, self.step = -1, 0

    def __enter__(self) -> "TorchDrawRecorder":
        import torch

        self._torch = torch
        self._randint, self._multinomial, forward = torch.randint, torch.multinomial, self.model.forward
        encoder = self.model.model.encoder
        encode = encoder.forward
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

        def recording_encode(*args, **kw):
            ids = kw.get("input_ids", args[0] if args else None)
            if ids is not None:
                run.contexts.append(ids.numpy().astype(np.int64).copy())
            return encode(*args, **kw)

        def recording_forward(*args, **kw):
            out = forward(*args, **kw)
            sc = kw.get("self_conditioning_logits")
            if self.step == 0:
                arrays = torch_cache_arrays(kw.get("cache", kw.get("past_key_values")))
                if arrays is not None:
                    run.caches[self.canvas] = arrays
            run.calls.append(Call(self.canvas, self.step, kw["decoder_input_ids"].numpy().astype(np.int64).copy(),
                                  None if sc is None else sc.detach().float().numpy().copy(),
                                  out.logits.detach().float().numpy().copy()))
            self.step += 1
            run.steps_per_canvas[-1] += 1
            self.previous = "call"
            return out

        torch.randint, torch.multinomial = randint, multinomial
        self.model.forward = recording_forward  # generate() binds self.forward as its decoder
        encoder.forward = recording_encode
        return self

    def __exit__(self, *exc: Any) -> None:
        self._torch.randint, self._torch.multinomial = self._randint, self._multinomial
        del self.model.forward
        del self.model.model.encoder.forward


# ================================================================================ teacher-forced forward
class _LayerRecorder:
    """An observer for ``Model.denoise``: keeps the decoder input and every decoder layer's output."""

    def __init__(self):
        self.out: list = []

    def decoder_input(self, h, rows=None):
        self.out.append(np.array(h, dtype=np.float64))

    def decoder_layer(self, layer, h, rows=None):
        self.out.append(np.array(h, dtype=np.float64))

    def __getattr__(self, name):  # every other observer point: nothing to keep
        return lambda *args, **kwargs: None


def _bound(ours: np.ndarray, exact: np.ndarray | None, bf16: bool = False) -> float:
    """The tolerance of one tensor: 16 x our float32 error against float64, floor 1e-6 x max(1, max|x|),
    ceiling ``CEILING`` x max(1, max|x|) (a float32 error larger than that is no rounding to excuse).
    bf16: our bfloat16 run's tensor; ``BF16_FACTOR`` x its error against float64, floor ``BF16_ULP`` x
    max(1, max|x|), no ceiling (module notes)."""
    scale = max(1.0, float(np.max(np.abs(ours))) if ours.size else 1.0)
    if exact is None:
        return (BF16_FACTOR if bf16 else 1e-4) * scale
    error = float(np.max(np.abs(ours.astype(np.float64) - exact))) if ours.size else 0.0
    if bf16:
        return max(BF16_FACTOR * error, BF16_ULP * scale)
    return min(max(TOLERANCE_FACTOR * error, 1e-6 * scale), CEILING * scale)


def _first_beyond(diff: np.ndarray, bound: float) -> int:
    """The first canvas position whose |difference| exceeds ``bound`` (diff (1, C, ...))."""
    per_position = np.max(np.abs(diff).reshape(diff.shape[0], diff.shape[1], -1), axis=-1)[0]
    return int(np.argmax(per_position > bound))


def _contexts(run: PeerRun, prompt: np.ndarray, canvas_length: int) -> tuple[list, str]:
    """The ids encoded before each canvas: what the peer encoded, or (when the adapter could not see its
    encoder) the prompt and the peer's reported tokens."""
    if run.contexts:
        return list(run.contexts), "the ids the peer encoded"
    out = [np.asarray(prompt, dtype=np.int64)]
    for k in range(1, len(run.steps_per_canvas)):
        chunk = run.tokens[(k - 1) * canvas_length:k * canvas_length]
        out.append(np.asarray([chunk], dtype=np.int64))
    return out, "the prompt and the peer's reported tokens (the adapter cannot see its encoder)"


def teacher_forced(model: Any, run: PeerRun, prompt: np.ndarray, peer_layers: Callable | None = None,
                   twin: Any = None, context_map: Callable | None = None) -> tuple[dict, Divergence | None]:
    """Repeat every decoder call of the peer with our model on the peer's exact inputs (module notes).

    peer_layers: ``(contexts, canvas, sc) -> [decoder input, layer 0 output, ...]`` (the peer's), used to
    localise a call whose logits differ. twin: our model in float64 (``float64_twin``) for the tolerances.
    context_map: ``ids -> (ids, note or None)``, a peer's documented rewrite of the ids it encodes (mlx-vlm
    encodes the image placeholder id as padding), applied before our encoder sees them.
    Returns (summary, first divergence or None).
    """
    C = int(model.config.canvas_length)
    twin = twin if twin is not None else float64_twin(model)
    contexts, source = _contexts(run, prompt, C)
    summary = {"calls": 0, "context": source, "max_abs_diff": 0.0, "worst_ratio": 0.0, "worst_at": None,
               "caches_compared": 0, "context_notes": []}
    ours, exact = model.new_cache(1), (twin.new_cache(1) if twin is not None else None)
    encoded = 0  # contexts encoded so far
    for k in range(len(run.steps_per_canvas)):
        calls = run.canvas_calls(k)
        while encoded <= k and encoded < len(contexts):  # what the peer encoded before canvas k
            ids = np.asarray(contexts[encoded], dtype=np.int64)
            if context_map is not None:
                ids, note = context_map(ids)
                if note:
                    summary["context_notes"].append(f"before canvas {encoded}: {note}")
            model.encode(ids, ours)
            if exact is not None:
                twin.encode(ids, exact)
            encoded += 1
        if k in run.caches:
            summary["caches_compared"] += 1
            found = _compare_cache(ours, exact, run.caches[k], k, is_bfloat16(model))
            if found is not None:
                return summary, found
        for call in calls:
            if not call.sc_known:
                summary["skipped"] = summary.get("skipped", 0) + 1
                continue
            mine = np.asarray(model.denoise(call.ids, ours, call.sc), dtype=np.float32)
            ref64 = None if exact is None else np.asarray(twin.denoise(call.ids, exact, call.sc), dtype=np.float64)
            bound = _bound(mine, ref64, is_bfloat16(model))
            diff = np.asarray(call.logits, dtype=np.float64) - mine
            worst = float(np.max(np.abs(diff)))
            summary["calls"] += 1
            summary["max_abs_diff"] = max(summary["max_abs_diff"], worst)
            if worst / bound > summary["worst_ratio"]:
                summary["worst_ratio"], summary["worst_at"] = worst / bound, [k, call.step]
            if worst > bound and is_bfloat16(model):  # information only in bfloat16 (module notes)
                summary.setdefault("bf16_beyond", []).append([k, call.step, round(worst / bound, 2)])
                continue
            if worst > bound:
                pos = _first_beyond(diff, bound)
                where = _localise(model, twin, ours, exact, call, contexts[:k + 1], peer_layers)
                stage, detail = where if where is not None else ("forward", "")
                inputs = ("canvas ids and self-conditioning input the peer's own (floats included), cache encoded "
                          f"from {source}")
                own = None if ref64 is None else float(np.max(np.abs(mine.astype(np.float64) - ref64)))
                capped = ("" if own is None or TOLERANCE_FACTOR * own <= bound else
                          f"; the tolerance is at its ceiling: our own float32 error on this call is {own:.2e}, "
                          "so part of the difference may be ours")
                return summary, Divergence(
                    stage, k, call.step, pos, -1, -1,
                    f"teacher-forced: the logits of canvas {k} step {call.step} differ at position {pos} (max |d| "
                    f"{worst:.2e} > tolerance {bound:.2e}) with identical inputs ({inputs}){detail}{capped}",
                    {"max_abs_diff": worst, "tolerance": bound, "our_float32_error": own})
    return summary, None


def _compare_cache(ours: Any, exact: Any, theirs: list, k: int, bf16: bool = False) -> Divergence | None:
    """The peer's encoder cache before canvas k against ours (built from the same ids)."""
    for l, (pk, pv) in enumerate(theirs):
        for what, mine, peer, ref in (("keys", ours.keys[l], pk, None if exact is None else exact.keys[l]),
                                      ("values", ours.values[l], pv, None if exact is None else exact.values[l])):
            mine, peer = np.asarray(mine), np.asarray(peer, dtype=np.float64)
            if mine.shape[:2] != peer.shape[:2] or mine.shape[3] != peer.shape[3]:
                return Divergence("cache/context", k, -1, 0, -1, -1,
                                  f"the peer's cache before canvas {k} has layer {l} {what} of shape "
                                  f"{tuple(peer.shape)}, ours {tuple(mine.shape)}", {})
            T = min(mine.shape[2], peer.shape[2])  # a sliding layer may retain more than the window needs
            if T == 0:
                continue
            a, b = mine[:, :, -T:], peer[:, :, -T:]
            r = None if ref is None else np.asarray(ref, dtype=np.float64)[:, :, -T:]
            bound = _bound(a, r, bf16)
            diff = b - a
            worst = float(np.max(np.abs(diff)))
            if worst > bound:
                t = int(np.argmax(np.max(np.abs(diff), axis=(0, 1, 3)) > bound))
                return Divergence("cache/context", k, -1, t, -1, -1,
                                  f"the encoder cache before canvas {k} differs at layer {l} {what}, entry {t} of "
                                  f"the last {T} (max |d| {worst:.2e} > tolerance {bound:.2e}); ours was encoded "
                                  f"from the peer's own ids, so the encoder (layer {l} or an earlier one) or the "
                                  "positions differ", {"max_abs_diff": worst, "tolerance": bound, "layer": l})
    return None


def _localise(model, twin, ours, exact, call: Call, contexts: list, peer_layers: Callable | None):
    """(stage, sentence) for the first decoder tensor that differs, or None when the peer gives no layers."""
    if peer_layers is None:
        return None
    try:
        theirs = peer_layers(contexts, call.ids, call.sc)
    except Exception as exc:  # localisation is a help, never a crash
        return "forward", f"; the peer's layer outputs could not be read ({exc})"
    mine, ref = _LayerRecorder(), _LayerRecorder()
    model.denoise(call.ids, ours, call.sc, observer=mine)
    if twin is not None:
        twin.denoise(call.ids, exact, call.sc, observer=ref)
    for i, (a, b) in enumerate(zip(mine.out, theirs)):
        r = ref.out[i] if i < len(ref.out) else None
        bound = _bound(a.astype(np.float32), r, is_bfloat16(model))
        worst = float(np.max(np.abs(np.asarray(b, dtype=np.float64) - a)))
        if worst > bound:
            if i == 0:
                what = ("self-conditioning embedding and MLP" if call.sc is not None else "canvas embedding")
                return "forward input", (f"; the first tensor that differs is the decoder input (canvas embedding + "
                                         f"self-conditioning, max |d| {worst:.2e} > {bound:.2e}): look at the {what}")
            return f"forward layer {i - 1}", (f"; the first tensor that differs is the output of decoder layer "
                                              f"{i - 1} (max |d| {worst:.2e} > {bound:.2e}), its input agreed")
    return "forward", "; every decoder layer's output agrees: look at the final norm, output projection or soft-cap"


# ================================================================================ the sampler on the peer's logits
class _Stop(Exception):
    """Ends our loop at the first difference (carried in ``found``)."""


class _PeerLogits:
    """A denoiser that hands our loop the peer's logits, call by call, and checks every input our loop
    produced (canvas, self-conditioning input) and every decision it reports (steps, commits)."""

    def __init__(self, run: PeerRun, variant: Any, bound: float, eos_ids, pad_id, dtype: Any = None):
        self.run, self.variant, self.bound, self.eos, self.pad = run, variant, bound, set(eos_ids), pad_id
        self.dtype = dtype  # the model's dtype: a bfloat16 peer's generate casts its SC input to it
        self.k, self.s = 0, 0
        self.last_step = None  # our StepInfo of the previous step
        self.found: Divergence | None = None
        self.steps_checked = 0
        self.commits: list = []  # our committed canvases (after the EOS rule)
        self.ties: list = []  # acceptance flips explained by a float32 tie at the bound

    def _stop(self, divergence: Divergence):
        self.found = divergence
        raise _Stop

    def __call__(self, canvas, cache, sc_logits):
        calls = self.run.canvas_calls(self.k)
        if self.k >= len(self.run.steps_per_canvas):
            self._stop(Divergence("EOS", self.k, 0, 0, -1, -1,
                                  f"on the peer's logits our loop went on to canvas {self.k}; the peer ended after "
                                  f"canvas {self.k - 1} (an end token or the length budget)", {}))
        if self.s >= len(calls):
            self._stop(Divergence("stopping", self.k, self.s, 0, -1, -1,
                                  f"on the peer's logits our loop went on to step {self.s} of canvas {self.k}; the "
                                  f"peer stopped that canvas after {len(calls)} step(s)", {}))
        call = calls[self.s]
        mine = np.asarray(canvas)
        if not np.array_equal(mine, call.ids):
            self._stop(self._canvas_difference(call, mine))
        if call.sc_known:
            self._check_sc(call, sc_logits)
        self.s += 1
        self.steps_checked += 1
        return np.asarray(call.logits, dtype=np.float32)

    def _check_sc(self, call: Call, sc) -> None:
        where = f"canvas {self.k} step {self.s}"
        if (sc is None) != (call.sc is None):
            self._stop(Divergence("self-conditioning input", self.k, self.s, 0, -1, -1,
                                  f"at {where} our loop gives the decoder {'no' if sc is None else 'a'} "
                                  f"self-conditioning input, the peer {'none' if call.sc is None else 'one'}", {}))
        if sc is None:
            return
        from diffusiongemma.reference.primitives import round_to

        sc = np.asarray(round_to(sc, self.dtype), dtype=np.float64)  # as upstream's generate casts it
        if sc.shape != call.sc.shape:
            self._stop(Divergence("self-conditioning input", self.k, self.s, 0, -1, -1,
                                  f"at {where} our self-conditioning input has shape {sc.shape}, the peer's "
                                  f"{call.sc.shape}", {}))
        diff = sc - call.sc
        worst = float(np.max(np.abs(np.where(np.isfinite(diff), diff, 0.0))))
        bound = 1e-6 * max(1.0, float(np.max(np.abs(call.sc[np.isfinite(call.sc)]), initial=0.0)))
        if worst > bound or not np.array_equal(np.isfinite(sc), np.isfinite(call.sc)):
            pos = _first_beyond(np.where(np.isfinite(diff), diff, np.inf), bound)
            self._stop(Divergence("self-conditioning input", self.k, self.s, pos, -1, -1,
                                  f"at {where} the self-conditioning input our loop computed from the peer's "
                                  f"previous logits differs from the peer's (max |d| {worst:.2e} > {bound:.2e}, "
                                  "first at that position): a different scaling (temperature), freeze or source "
                                  "of the self-conditioning logits", {"max_abs_diff": worst, "tolerance": bound}))

    def _canvas_difference(self, call: Call, mine: np.ndarray) -> Divergence:
        theirs = np.asarray(call.ids)
        pos = int(np.argmax((theirs != mine).ravel()))
        peer_id, our_id = int(theirs.ravel()[pos]), int(mine.ravel()[pos])
        if self.s == 0 or self.last_step is None:
            return Divergence("draws", self.k, self.s, pos, peer_id, our_id,
                              f"the initial canvas of canvas {self.k} differs: the peer's draws do not replay "
                              "into our order", {})
        info, prev = self.last_step, self.s - 1
        sampled = int(np.asarray(info.sampled).ravel()[pos])
        accepted = bool(np.asarray(info.accepted).ravel()[pos])
        entropy = float(np.asarray(info.entropies).ravel()[pos])
        at = f"canvas {self.k} step {prev}, position {pos}"
        if accepted and peer_id != sampled:
            stage, cause = "acceptance", (f"at {at} our loop accepted the proposal {sampled} (entropy {entropy:.4g} "
                                          f"nats), the peer did not (it has {peer_id} there)")
        elif not accepted and peer_id == sampled:
            stage, cause = "acceptance", (f"at {at} the peer accepted the proposal {sampled}; our loop did not "
                                          f"(entropy {entropy:.4g} nats) and renoised it to {our_id}")
        else:
            stage, cause = "renoise", (f"at {at} the position was not accepted by either side but the next canvas "
                                       f"holds {peer_id} (peer) and {our_id} (ours): the renoising rule differs")
        if stage == "acceptance" and variants.entropy_bound(self.variant):
            margin = _bound_margin(np.asarray(info.entropies, dtype=np.float32)[0], pos, self.bound)
            cause += f"; its sum of lower entropies is {margin:+.3e} from the bound {self.bound}"
            if abs(margin) <= 4 * np.finfo(np.float32).eps * max(1.0, self.bound):
                self.ties.append(f"canvas {self.k} step {prev} position {pos}: acceptance on a float32 tie at the "
                                 f"entropy bound (margin {margin:+.1e}); the sampler check stops there")
                return Divergence("tie", self.k, prev, pos, peer_id, our_id, cause, {"margin": margin})
        return Divergence(stage, self.k, prev, pos, peer_id, our_id, cause, {})

    # ------------------------------------------------------------------ callback
    def on_step(self, info) -> None:
        self.last_step = info

    def on_canvas(self, info) -> None:
        calls = self.run.canvas_calls(self.k)
        if self.s < len(calls):
            self._stop(Divergence("stopping", self.k, self.s - 1, 0, -1, -1,
                                  f"on the peer's logits our loop stopped canvas {self.k} after {self.s} step(s); "
                                  f"the peer went on to {len(calls)}", {}))
        tokens = [int(t) for t in np.asarray(info.tokens)[0]]
        self.commits.append(tokens)
        theirs = self._peer_committed(self.k)
        if theirs is not None and theirs != tokens[:len(theirs)]:
            pos = next(i for i, (a, b) in enumerate(zip(theirs, tokens)) if a != b)
            stage = "EOS" if self._eos_related(theirs, tokens, pos) else "commit"
            self._stop(Divergence(stage, self.k, -1, pos, theirs[pos], tokens[pos],
                                  f"canvas {self.k} was committed differently at position {pos} (peer {theirs[pos]}, "
                                  f"ours {tokens[pos]}) although every step had the same inputs and logits"
                                  + (": the end-token rule differs" if stage == "EOS" else
                                     ": the commit rule (what a finished canvas keeps) differs"), {}))
        self.k, self.s, self.last_step = self.k + 1, 0, None

    def _peer_committed(self, k: int) -> list | None:
        if self.run.contexts and len(self.run.contexts) > k + 1:
            return [int(t) for t in np.asarray(self.run.contexts[k + 1])[0]]
        C = len(self.run.calls[0].ids[0]) if self.run.calls else 0
        chunk = self.run.tokens[k * C:(k + 1) * C]
        return [int(t) for t in chunk] if len(chunk) == C else None

    def _eos_related(self, a: list, b: list, pos: int) -> bool:
        ends = self.eos | ({self.pad} if self.pad is not None else set())
        return a[pos] in ends or b[pos] in ends or any(t in self.eos for t in a[:pos] + b[:pos])


def _bound_margin(entropies: np.ndarray, pos: int, bound: float) -> float:
    """(sum of the entropies below position ``pos``'s in the ascending order) - bound, in float32."""
    order = np.argsort(entropies, kind="stable")
    sorted_h = entropies[order]
    lhs = np.cumsum(sorted_h, dtype=np.float64).astype(np.float32) - sorted_h
    k = int(np.flatnonzero(order == pos)[0])
    return float(np.float32(lhs[k]) - np.float32(bound))


def sampler_check(model: Any, prompt: np.ndarray, settings: Any, variant: Any, run: PeerRun) -> tuple[dict, Divergence | None]:
    """Our loop with ``variant`` on the peer's own logits and draws (module notes).

    Returns (summary, first difference or None). A difference of stage ``tie`` (an acceptance decided by a
    float32 tie at the entropy bound) is rounding, not semantics: the caller treats it as agreement up to
    that step.
    """
    from diffusiongemma.reference import ReplayDraws, generate

    eos = list(settings.eos_token_id or ())
    peer = _PeerLogits(run, variant, float(settings.entropy_bound), eos, settings.pad_token_id,
                       getattr(model, "dtype", None))
    summary = {"steps": 0, "canvases": 0, "ties": peer.ties}
    try:
        result = generate(model, prompt, generation_config=settings, semantics=variant, random=ReplayDraws(run.tape),
                          denoiser=peer, callback=peer)
    except _Stop:
        result = None
    except Exception as exc:  # e.g. the draws stop lining up: our loop asked for a draw the peer did not make
        if peer.found is None:
            peer.found = Divergence("draws", peer.k, peer.s, 0, -1, -1,
                                    f"our loop on the peer's logits stopped at canvas {peer.k} step {peer.s}: {exc}",
                                    {})
        result = None
    summary["steps"], summary["canvases"] = peer.steps_checked, len(peer.commits)
    if peer.found is not None:
        return summary, peer.found
    new = [int(t) for t in result.sequences[0, prompt.shape[1]:]]
    ours = variants.trim_output(variant, new, eos, settings.max_new_tokens)
    summary["our_tokens"] = ours
    if len(peer.commits) < len(run.steps_per_canvas):
        k = len(peer.commits) - 1
        return summary, Divergence("EOS", k, -1, 0, -1, -1,
                                   f"our loop ended after canvas {k} (an end token or the length budget); the peer "
                                   f"went on to canvas {k + 1}", {})
    if ours != run.tokens:
        pos = next((i for i, (a, b) in enumerate(zip(run.tokens, ours)) if a != b), min(len(ours), len(run.tokens)))
        C = int(model.config.canvas_length)
        stage = "length" if pos == min(len(ours), len(run.tokens)) else "EOS"
        return summary, Divergence(stage, pos // C, -1, pos % C,
                                   run.tokens[pos] if pos < len(run.tokens) else -1,
                                   ours[pos] if pos < len(ours) else -1,
                                   f"every canvas was committed alike, but the reported output differs: peer "
                                   f"{len(run.tokens)} tokens, ours {len(ours)}, first at token {pos} (the "
                                   "output's end-token / length rule)", {})
    return summary, None


# ================================================================================ the free run (information)
def free_run(run: PeerRun, ours_calls: list, our_tokens: list, canvas_length: int) -> dict:
    """Where our free-running loop (our own logits, the peer's draws) parted from the peer's run.

    Returns {"agree": bool, "canvases": [per canvas {"agree", "of", "steps_peer", "steps_ours"}],
    "first_drift": {canvas, step, input, max_abs_diff} (the first call whose inputs were not bit-identical),
    "drift": [[canvas, step, max |d| of the SC input]] up to the parting, "parted": {canvas, step, position}
    or None}.
    """
    n = max(len(run.steps_per_canvas), max((c.canvas for c in ours_calls), default=-1) + 1, 1)
    rows = []
    for k in range(n):
        a = run.tokens[k * canvas_length:(k + 1) * canvas_length]
        b = our_tokens[k * canvas_length:(k + 1) * canvas_length]
        rows.append({"agree": sum(int(x == y) for x, y in zip(a, b)), "of": max(len(a), len(b)),
                     "steps_peer": run.steps_per_canvas[k] if k < len(run.steps_per_canvas) else 0,
                     "steps_ours": sum(1 for c in ours_calls if c.canvas == k)})
    out = {"agree": run.tokens == our_tokens, "canvases": rows, "first_drift": None, "drift": [], "parted": None}
    for theirs, mine in zip(run.calls, ours_calls):
        if (theirs.canvas, theirs.step) != (mine.canvas, mine.step):
            out["parted"] = {"canvas": mine.canvas, "step": mine.step, "position": -1,
                             "what": f"step counts: the peer went on to canvas {theirs.canvas} step {theirs.step}"}
            break
        if not np.array_equal(theirs.ids, mine.ids):
            pos = int(np.argmax((np.asarray(theirs.ids) != np.asarray(mine.ids)).ravel()))
            out["parted"] = {"canvas": mine.canvas, "step": mine.step, "position": pos, "what": "input canvas"}
            break
        sc_diff = 0.0
        if (theirs.sc is None) != (mine.sc is None):
            sc_diff = float("inf")
        elif theirs.sc is not None:
            d = np.asarray(theirs.sc, dtype=np.float64) - mine.sc
            sc_diff = float(np.max(np.abs(np.where(np.isfinite(d), d, 0.0))))
        if sc_diff > 0 and out["first_drift"] is None:
            out["first_drift"] = {"canvas": mine.canvas, "step": mine.step, "input": "self-conditioning input",
                                  "max_abs_diff": sc_diff}
        if theirs.sc is not None or mine.sc is not None:
            out["drift"].append([mine.canvas, mine.step, sc_diff])
    if out["parted"] is None and len(run.calls) != len(ours_calls):
        out["parted"] = {"canvas": -1, "step": -1, "position": -1,
                         "what": f"call counts: peer {len(run.calls)}, ours {len(ours_calls)}"}
    if out["parted"] is None and not out["agree"]:
        out["parted"] = {"canvas": -1, "step": -1, "position": -1, "what": "committed or reported tokens"}
    return out
