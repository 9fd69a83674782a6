"""Cross-check another DiffusionGemma implementation against the reference, side by side.

    from diffusiongemma.crosscheck import crosscheck
    report = crosscheck("mlx-vlm")            # tiny random checkpoint built in a temporary directory
    report = crosscheck("diffusers", "DIR")   # any transformers-layout checkpoint
    print(report.to_text()); report.exit_code  # 0 agree, 1 differ

Peers: ``transformers`` (ground truth), ``mlx-vlm`` (``pip install -e ".[mlx]"``), ``diffusers``
(``pip install -e ".[diffusers]"``). One module per peer (``*_peer.py``); ``common.py`` holds the inputs,
the tolerance and the run comparison; ``report.py`` the report. What is compared:

* forward: three logits tensors on the same weights and inputs (``common``), against a tolerance measured
  from the reference's own float32 error;
* generation, per configuration of the peer's samplers, with the peer's random draws replayed into ours:
  teacher-forced forward (every decoder call of the peer repeated by our model on the peer's exact inputs:
  canvas, self-conditioning input, cache built from the ids the peer encoded), our loop with the peer's
  semantics run on the peer's own logits (every acceptance, renoise, stopping, commit and end-token
  decision), and, as information, our free-running loop; and where transformers' semantics would part
  from the peer on the same logits and draws;
* the adaptations the peer needed (made in a temporary copy or on the loaded object) and the defects seen.

bfloat16 (``dtype="bfloat16"``, SPEC §10.3): whole calls are information; every stage of the peer's
generation (encoder input and layers with the cache entries they add, decoder input and layers, output) is
repeated on the peer's own input to it and judged against the null distribution of a correct bfloat16 run,
the reference with its float32 sums in another order (``bf16_stages``, ``bf16_null``); the report's header
states the rule.

An exact tie among router probabilities at the K-th place leaves the experts kept to the implementation's
sort (undefined upstream, SPEC trap T25): a forward row or teacher-forced run that differs only there, and
agrees once our router uses torch's CPU order (``reference.variants.router.torch_cpu_top_k``), is reported
as "undefined upstream" instead of a difference.

Errors: ``PeerUnavailable`` (not installed, cannot load: the message has the install command) and
``ConfigError`` / ``CheckpointError`` for a bad model directory.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import numpy as np

from . import variants
from .common import (CallRecorder, PeerUnavailable, float64_twin, forward_inputs, forward_rows, free_run,
                     is_bfloat16, reference_forward, sampler_check, teacher_forced, tolerances)
from .report import Divergence, ForwardRow, GenerationRow, Report

__all__ = ["crosscheck", "PEERS", "PeerUnavailable", "Report", "ForwardRow", "GenerationRow", "Divergence",
           "peer_module"]

PEERS = ("transformers", "mlx-vlm", "diffusers")
BF16_PEERS = ("transformers", "diffusers")  # the peers whose bfloat16 run the stage-forced check can tap
TINY_MODEL = "tiny random checkpoint (built in a temporary directory; diffusiongemma.crosscheck.tiny)"
# what the bfloat16 rule's false alarms measured to be (benchmarks/RESULTS_bf16.md), printed in the report's header
BF16_FALSE_ALARMS = ("; measured: no false alarm on 56 correct runs (transformers' own bfloat16 run, shipped "
                     "model and six randomised configs), no miss on 80 single-rounding mutations "
                     "(benchmarks/RESULTS_bf16.md §3)")
LOOSE_CONFIDENCE = 1.5  # nats: the second run per configuration stops early with this (and stability 0)


def peer_module(peer: str):
    """The adapter module of ``peer``; ``ValueError`` for an unknown name."""
    if peer == "transformers":
        from . import transformers_peer as module
    elif peer == "mlx-vlm":
        from . import mlx_vlm_peer as module
    elif peer == "diffusers":
        from . import diffusers_peer as module
    else:
        raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    return module


def _configurations(peer: str) -> list[tuple[str, Any, dict]]:
    """(label, our semantics, peer options) for each sampler configuration compared."""
    if peer == "mlx-vlm":
        return [("mlx-vlm confidence-threshold 0.9 (its default), temperature 0", variants.semantics("mlx-vlm"),
                 {"sampler": "confidence-threshold", "threshold": 0.9}),
                ("mlx-vlm entropy-bound, temperature 0", variants.semantics("mlx-vlm", sampler="entropy-bound"),
                 {"sampler": "entropy-bound"})]
    if peer == "diffusers":
        return [("diffusers EntropyBoundScheduler", variants.semantics("diffusers"), {"scheduler": "entropy-bound"}),
                ("diffusers BlockRefinementScheduler 0.95, temperature 0",
                 variants.semantics("diffusers", sampler="block-refinement", temperature="none", sc_temperature="raw",
                                    denoiser_draw="argmax", threshold=0.95),
                 {"scheduler": "block-refinement", "threshold": 0.95})]
    return [("transformers generate, entropy-bound, seeded", variants.semantics("transformers"), {})]


def _settings(model_dir: str, model: Any, canvases: int):
    from diffusiongemma.reference import GenerationConfig

    try:
        settings = GenerationConfig.from_pretrained(model_dir)
    except FileNotFoundError:
        settings = GenerationConfig(eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
    return settings.replace(max_new_tokens=canvases * int(model.config.canvas_length), max_length=None)


def _image_token_id(model_dir: str, vocab_size: int) -> int | None:
    import json

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            value = json.load(f).get("image_token_id")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and 0 <= value < vocab_size else None


def _run_ours(model: Any, prompt: np.ndarray, settings: Any, semantics: Any, tape: list,
              calls_out: list | None = None) -> tuple[list, list]:
    """Our free-running loop with ``semantics`` and the peer's draws replayed; returns (output tokens, decoder
    calls). ``calls_out``: a list that receives the decoder calls as they happen (kept when the replay fails)."""
    from diffusiongemma.reference import ReplayDraws, generate

    recorder = CallRecorder(model.denoise)
    if calls_out is not None:
        recorder.calls = calls_out

    class _Canvases:
        def on_canvas(self, info):
            recorder.new_canvas(info.canvas_index + 1)

    result = generate(model, prompt, generation_config=settings, semantics=semantics, random=ReplayDraws(tape),
                      denoiser=recorder, callback=_Canvases())
    new = [int(t) for t in result.sequences[0, prompt.shape[1]:]]
    return variants.trim_output(semantics, new, settings.eos_token_id, settings.max_new_tokens), recorder.calls


def compare_generation(model: Any, prompt: np.ndarray, settings: Any, semantics: Any, run: Any, label: str,
                       peer_layers: Any = None, twin: Any = None, context_map: Any = None,
                       taps: Any = None) -> GenerationRow:
    """The three comparisons of one peer run (``common``): teacher-forced forward and the sampler on the
    peer's logits decide; the free run is information. taps: the peer's stage inputs (``bf16_stages.Taps``)
    of a bfloat16 run, whose stage-forced comparison against the null then replaces the teacher-forced one."""
    row = GenerationRow(label=label, semantics=variants.describe(semantics), draws="replayed",
                        peer_tokens=list(run.tokens))
    if taps is not None and is_bfloat16(model):
        from .bf16_stages import staged_run
        from .common import _contexts

        contexts, source = _contexts(run, prompt, int(model.config.canvas_length))
        summary, forward, _ = staged_run(model, run, taps, contexts)
        row.teacher_forced = dict(summary, context=source)
        from diffusiongemma.reference.primitives import round_to

        wide = sum(1 for c in run.calls if c.sc is not None and not np.array_equal(c.sc, round_to(c.sc, model.dtype)))
        if wide:
            row.notes.append(f"bfloat16: on {wide} decoder call(s) the peer's self-conditioning input holds values "
                             "that are no bfloat16 numbers; transformers' generate casts the processed logits to "
                             "bfloat16 before the decoder's softmax (SPEC §10.1 B8)")
    else:
        row.teacher_forced, forward = teacher_forced(model, run, prompt, peer_layers, twin, context_map)
    beyond = row.teacher_forced.pop("bf16_beyond", [])
    if beyond:
        row.notes.append(f"bfloat16: {len(beyond)} decoder call(s) beyond the tolerance on the peer's inputs, "
                         f"information only (rounding flips amplified by the self-conditioning feedback; the "
                         f"forward check and the caches decide): [canvas, step, x tolerance] {beyond}")
    row.notes.extend(f"teacher forcing, context {n} (a known difference, see the probe row)"
                     for n in row.teacher_forced.pop("context_notes", []))
    row.sampler, decision = sampler_check(model, prompt, settings, semantics, run)
    row.sampler.pop("our_tokens", None)
    if decision is not None and decision.stage == "tie":
        row.notes.append(f"the sampler check stopped at a float32 tie: {decision.cause}")
        decision = None
    if run.sc_note:
        row.notes.append(run.sc_note)
    row.divergence = forward or decision
    calls: list = []
    try:
        row.our_tokens, calls = _run_ours(model, prompt, settings, semantics, run.tape, calls)
        replay = None
    except Exception as exc:  # our free run took another path, and the peer's draws no longer fit it
        replay = str(exc)
    if is_bfloat16(model):  # a bfloat16 peer records its SC input as its generate casts it; so do we
        from diffusiongemma.reference.primitives import round_to

        for call in calls:
            call.sc = None if call.sc is None else round_to(call.sc, model.dtype)
    row.free_run = free_run(run, calls, row.our_tokens, int(model.config.canvas_length))
    if replay is not None:
        row.free_run["replay"] = f"our free run stopped: the peer's draws no longer fit its path ({replay})"
    row.canvases = row.free_run.pop("canvases")
    if row.divergence is None and (not row.free_run["agree"] or replay is not None):
        drift = row.free_run.get("first_drift")
        parted = row.free_run.get("parted") or {}
        row.notes.append(
            "the free run parted from the peer's"
            + (f" at canvas {parted['canvas']} step {parted['step']}" if parted.get("canvas", -1) >= 0 else "")
            + ", while every decoder call on the peer's inputs and every sampler decision on its logits agreed: "
            + ("bfloat16" if is_bfloat16(model) else "float32") + " rounding amplified through the "
            "self-conditioning feedback"
            + (f" (the inputs first drifted at canvas {drift['canvas']} step {drift['step']}, "
               f"{drift['input']} max |d| {drift['max_abs_diff']:.1e})" if drift else ""))
    return row


class _TieWatch:
    """The reference's router rule (ties to the lower expert index) that counts the token rows whose K-th
    and (K+1)-th router probabilities are exactly equal: rows where the rule decides which experts run."""

    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, probs: np.ndarray, k: int) -> np.ndarray:
        from diffusiongemma.reference.layers import lower_index_top_k
        from diffusiongemma.reference.variants.router import boundary_ties

        self.rows += int(np.count_nonzero(boundary_ties(probs, k)))
        return lower_index_top_k(probs, k)


def _with_router(model: Any, top_k: Any) -> Any:
    """A shallow copy of the reference ``model`` whose router selects with ``top_k``."""
    other = copy.copy(model)
    other.router_top_k = top_k
    return other


TIE_NOTE = ("exact ties among router probabilities at the K-th place ({rows} token routings): torch.topk's "
            "order among equal values is not defined (trap T25); with torch's CPU order instead of the lower "
            "expert index our result is within tolerance{detail}")


def _forward_router_ties(rows: list, watch: _TieWatch, model: Any, x: Any, peer_out: dict,
                         teacher: dict | None = None) -> None:
    """Mark the forward rows beyond tolerance that an exact router tie explains (``undefined_upstream``)."""
    if not watch.rows or all(r.ok or r.probe for r in rows):
        return
    from diffusiongemma.reference.variants.router import torch_cpu_top_k

    other = reference_forward(_with_router(model, torch_cpu_top_k), x, teacher)
    for r in rows:
        if r.ok or r.probe:
            continue
        diff = float(np.max(np.abs(np.asarray(peer_out[r.name], dtype=np.float64) - other[r.name])))
        if diff <= r.tolerance:
            r.undefined_upstream = TIE_NOTE.format(rows=watch.rows, detail=f" (max |d| {diff:.2e})")


def crosscheck(peer: str, model_dir: str | os.PathLike | None = None, *, seed: int = 0, canvases: int = 2,
               workdir: str | None = None, dtype: str = "float32") -> Report:
    """Run ``peer`` and the reference side by side; return the ``Report`` (see the module notes).

    model_dir: a transformers-layout checkpoint directory (or its ``config.json``, which stands for the
    directory); None builds the tiny random one. seed: seeds the
    inputs and the peer's random stream. canvases: canvases generated per configuration.
    dtype: "float32", or "bfloat16" (``BF16_PEERS``): the peer loaded with ``dtype=torch.bfloat16`` against the
    reference's bfloat16 run, decided stage by stage against the null distribution (module notes); the tiny
    checkpoint is then ``tiny.BF16_SPEC``.
    Raises ``PeerUnavailable`` when the peer is missing or cannot load the model, ``ValueError`` for an
    unknown peer, ``CheckpointError`` / ``ConfigError`` for a bad checkpoint.
    """
    module = peer_module(peer)
    from diffusiongemma.reference import Model
    from diffusiongemma.reference.primitives import BFLOAT16, compute_dtype

    bf16 = compute_dtype(dtype) == BFLOAT16
    if bf16 and peer not in BF16_PEERS:
        raise PeerUnavailable(f"--dtype bfloat16 is defined for the {' and '.join(BF16_PEERS)} peers only (not "
                              f"{peer}): the reference's bfloat16 run is transformers' (SPEC §10), and only these "
                              "run on transformers' bfloat16 model here")
    peer_version = module.version()

    with tempfile.TemporaryDirectory(prefix="diffusiongemma-crosscheck-", dir=workdir) as tmp:
        if model_dir is None:
            from .tiny import BF16_SPEC, write_tiny_checkpoint

            model_dir, label = (write_tiny_checkpoint(os.path.join(tmp, "tiny"), BF16_SPEC if bf16 else None),
                                TINY_MODEL + (" (bfloat16 shape, tiny.BF16_SPEC)" if bf16 else ""))
        else:
            model_dir = os.fspath(model_dir)
            if os.path.isfile(model_dir) and os.path.basename(model_dir) == "config.json":
                model_dir = os.path.dirname(os.path.abspath(model_dir))  # the checkpoint that file belongs to
            elif os.path.isfile(model_dir):
                raise PeerUnavailable(f"{model_dir!r} is a file; the peers need a transformers-layout checkpoint "
                                      "directory (the one holding config.json)")
            label = model_dir
            if not os.path.isfile(os.path.join(model_dir, "config.json")):
                raise PeerUnavailable(f"{model_dir!r} is not a transformers-layout checkpoint (no config.json); "
                                      "the peers read only that layout")
        ours_model = Model.from_pretrained(model_dir, dtype="bfloat16") if bf16 else Model.from_pretrained(model_dir)
        twin = float64_twin(ours_model)
        adapter = module.Peer(model_dir, tmp, dtype="bfloat16") if bf16 else module.Peer(model_dir, tmp)
        settings = _settings(model_dir, ours_model, canvases)
        x = forward_inputs(ours_model.config, seed, settings.t_max if settings.t_max is not None else 1.0,
                           _image_token_id(model_dir, ours_model.config.vocab_size))
        tol_model, watch = ours_model, _TieWatch()
        ours_model = _with_router(ours_model, watch)  # counts exact router ties as it runs (trap T25)
        # bfloat16: two correct runs part by a rounding flip now and then, so the forward check is teacher-forced:
        # our self-conditioning input is the peer's prefill / T and we commit the peer's argmax; float32 runs
        # use their own, which must agree
        peer_out = adapter.forward(x) if bf16 else None
        teacher = peer_out if bf16 else None
        ours = reference_forward(ours_model, x, teacher)
        tol, note = tolerances(tol_model, x, ours, teacher)
        peer_out = peer_out if bf16 else adapter.forward(x)
        report = Report(peer=peer, peer_version=peer_version, model=label, tolerance_note=note,
                        forward=forward_rows(ours, peer_out, tol))
        if bf16:  # whole calls are information; the stage-forced comparison against the null decides
            from .bf16_stages import RULE

            report.rule = RULE + BF16_FALSE_ALARMS
            for r in report.forward:
                r.probe = True
        _forward_router_ties(report.forward, watch, ours_model, x, peer_out, teacher)
        if watch.rows and not all(r.ok or r.probe for r in report.forward):
            report.defects.append(f"exact ties among router probabilities at the K-th place ({watch.rows} token "
                                  "routings) in the forward inputs; the peer's order among equal values is its "
                                  "own (trap T25), and torch's CPU order did not explain the difference")
        # A second run per configuration with loose stopping (stability 0, confidence 1.5 nats), so that rows
        # stop early and the stopping rules (and diffusers' reading of stability 0 as 1) are compared too.
        early = settings.replace(confidence_threshold=max(LOOSE_CONFIDENCE, settings.confidence_threshold or 0.0),
                                 stability_threshold=0)
        runs = [(label_k, semantics, options, settings) for label_k, semantics, options in _configurations(peer)]
        runs += [(label_k + f"; early stopping (stability 0, confidence {early.confidence_threshold})", semantics,
                  options, early) for label_k, semantics, options in _configurations(peer)]
        peer_layers = getattr(adapter, "layer_outputs", None)
        probe = next((r for r in report.forward if r.probe), None)
        context_map = None
        if probe is not None and not probe.ok and hasattr(adapter, "context_map"):  # the peer's own encoding rule
            context_map = adapter.context_map(x.image_token_id, getattr(ours_model.config, "pad_token_id", None))
        for label_k, semantics, options, run_settings in runs:
            taps = None
            if bf16 and hasattr(adapter, "model"):
                from .bf16_stages import Taps

                with Taps(adapter.model) as taps:
                    run = adapter.generate(x.prompt, run_settings, seed, options)
            else:
                run = adapter.generate(x.prompt, run_settings, seed, options)
            watch.rows = 0
            row = compare_generation(ours_model, x.prompt, run_settings, semantics, run, label_k, peer_layers, twin,
                                     context_map, taps)
            _generation_router_ties(row, watch, ours_model, x.prompt, run, peer_layers, twin, context_map)
            report.generation.append(row)
            if not variants.is_transformers(semantics):
                report.defects.append(_versus_transformers(ours_model, x.prompt, run_settings, run, label_k))
        if probe is not None and not probe.ok:
            report.defects.append(f"the image placeholder id {x.image_token_id} in a text-only context is encoded "
                                  f"differently from transformers (max |d| {probe.max_abs_diff:.2e} on the next "
                                  "canvas's logits): the peer treats it as an image slot without an image")
        report.adaptations = list(adapter.adaptations)
        report.defects = list(adapter.defects) + report.defects
        return report


def _generation_router_ties(row: GenerationRow, watch: _TieWatch, model: Any, prompt: np.ndarray, run: Any,
                            peer_layers: Any, twin: Any, context_map: Any) -> None:
    """A teacher-forced difference that an exact router tie explains becomes a note (undefined upstream)."""
    d = row.divergence
    if d is None or not watch.rows or not d.stage.startswith(("forward", "cache")):
        return
    from diffusiongemma.reference.variants.router import torch_cpu_top_k

    summary, again = teacher_forced(_with_router(model, torch_cpu_top_k), run, prompt, peer_layers,
                                    None if twin is None else _with_router(twin, torch_cpu_top_k), context_map)
    if again is None:
        where = "the cache before it" if d.step < 0 else f"step {d.step}"
        row.notes.append("undefined upstream: " + TIE_NOTE.format(
            rows=watch.rows, detail=f" on every decoder call and cache (with the lower-index rule the first "
                                    f"difference was at canvas {d.canvas}, {where}, stage {d.stage})"))
        summary.pop("context_notes", None)
        row.teacher_forced, row.divergence = summary, None
    else:
        row.notes.append(f"exact ties among router probabilities at the K-th place ({watch.rows} token routings) "
                         "were seen in this run; torch's CPU order did not explain the difference (trap T25)")


def _versus_transformers(model, prompt, settings, run, label) -> str:
    """Where transformers' semantics would part from the peer on the peer's own logits and draws."""
    if not any(kind == "categorical" for kind, _ in run.tape):
        return (f"{label}: differs from transformers by construction: its proposals are argmaxes (temperature 0), "
                "transformers draws them from the tempered distribution")
    _, d = sampler_check(model, prompt, settings, variants.semantics("transformers"), run)
    if d is None:
        return f"{label}: identical to transformers semantics on this run"
    where = "the committed canvas" if d.step < 0 else f"step {d.step}"
    return (f"{label} vs transformers semantics: first difference at canvas {d.canvas}, {where}, "
            f"position {d.position}, stage {d.stage}: {d.cause}")
