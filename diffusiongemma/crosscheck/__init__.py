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
* generation: the peer's sampler against our loop run with that peer's semantics
  (``reference.semantics``), with the peer's random draws replayed into ours, per configuration of the
  peer's samplers; and, for each, where transformers' semantics would part from the peer;
* the adaptations the peer needed (made in a temporary copy or on the loaded object) and the defects seen.

Errors: ``PeerUnavailable`` (not installed, cannot load: the message has the install command) and
``ConfigError`` / ``CheckpointError`` for a bad model directory.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from .common import (CallRecorder, PeerUnavailable, compare_runs, forward_inputs, forward_rows, reference_forward,
                     tolerances)
from .report import Divergence, ForwardRow, GenerationRow, Report

__all__ = ["crosscheck", "PEERS", "PeerUnavailable", "Report", "ForwardRow", "GenerationRow", "Divergence",
           "peer_module"]

PEERS = ("transformers", "mlx-vlm", "diffusers")
TINY_MODEL = "tiny random checkpoint (built in a temporary directory; diffusiongemma.crosscheck.tiny)"


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
    from diffusiongemma.reference.variants import SEMANTICS

    if peer == "mlx-vlm":
        mlx = SEMANTICS["mlx-vlm"]
        return [("mlx-vlm confidence-threshold 0.9 (its default), temperature 0", mlx,
                 {"sampler": "confidence-threshold", "threshold": 0.9}),
                ("mlx-vlm entropy-bound, temperature 0", mlx.replace(name="mlx-vlm", sampler="entropy-bound"),
                 {"sampler": "entropy-bound"})]
    if peer == "diffusers":
        d = SEMANTICS["diffusers"]
        return [("diffusers EntropyBoundScheduler", d, {"scheduler": "entropy-bound"}),
                ("diffusers BlockRefinementScheduler 0.95, temperature 0",
                 d.replace(sampler="block-refinement", temperature="none", sc_temperature="raw", denoiser_draw="argmax",
                           threshold=0.95),
                 {"scheduler": "block-refinement", "threshold": 0.95})]
    return [("transformers generate, entropy-bound, seeded", SEMANTICS["transformers"], {})]


def _settings(model_dir: str, model: Any, canvases: int):
    from diffusiongemma.reference.generation_config import GenerationConfig

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


def _describe_semantics(semantics: Any) -> str:
    from diffusiongemma.reference.variants import SEMANTICS

    base = SEMANTICS.get(semantics.name)
    changed = {k: v for k, v in semantics.switches().items() if base is None or getattr(base, k) != v}
    extra = "" if not changed else " with " + ", ".join(f"{k}={v}" for k, v in changed.items())
    return semantics.name + extra


def _run_ours(model: Any, prompt: np.ndarray, settings: Any, semantics: Any, tape: list,
              calls_out: list | None = None) -> tuple[list, list]:
    """Our loop with ``semantics`` and the peer's draws replayed; returns (output tokens, decoder calls).
    ``calls_out``: a list that receives the decoder calls as they happen (kept when the replay fails)."""
    from diffusiongemma.reference.support.replay import ReplayDraws
    from diffusiongemma.reference.generate import generate

    recorder = CallRecorder(model.denoise)
    if calls_out is not None:
        recorder.calls = calls_out

    class _Canvases:
        def on_canvas(self, info):
            recorder.new_canvas(info.canvas_index + 1)

    result = generate(model, prompt, generation_config=settings, semantics=semantics, random=ReplayDraws(tape),
                      denoiser=recorder, callback=_Canvases())
    new = [int(t) for t in result.sequences[0, prompt.shape[1]:]]
    return semantics.eos.trim(new, settings.eos_token_id, settings.max_new_tokens), recorder.calls


def crosscheck(peer: str, model_dir: str | os.PathLike | None = None, *, seed: int = 0, canvases: int = 2,
               workdir: str | None = None) -> Report:
    """Run ``peer`` and the reference side by side; return the ``Report`` (see the module notes).

    model_dir: a transformers-layout checkpoint directory; None builds the tiny random one. seed: seeds the
    inputs and the peer's random stream. canvases: canvases generated per configuration.
    Raises ``PeerUnavailable`` when the peer is missing or cannot load the model, ``ValueError`` for an
    unknown peer, ``CheckpointError`` / ``ConfigError`` for a bad checkpoint.
    """
    module = peer_module(peer)
    peer_version = module.version()
    from diffusiongemma.reference.model import Model

    with tempfile.TemporaryDirectory(prefix="diffusiongemma-crosscheck-", dir=workdir) as tmp:
        if model_dir is None:
            from .tiny import TinySettings, write_tiny_checkpoint

            model_dir, label = write_tiny_checkpoint(os.path.join(tmp, "tiny"), TinySettings()), TINY_MODEL
        else:
            model_dir, label = os.fspath(model_dir), os.fspath(model_dir)
            if not os.path.isfile(os.path.join(model_dir, "config.json")):
                raise PeerUnavailable(f"{model_dir!r} is not a transformers-layout checkpoint (no config.json); "
                                      "the peers read only that layout")
        ours_model = Model.from_pretrained(model_dir)
        adapter = module.Peer(model_dir, tmp)
        settings = _settings(model_dir, ours_model, canvases)
        x = forward_inputs(ours_model.config, seed, settings.t_max if settings.t_max is not None else 1.0,
                           _image_token_id(model_dir, ours_model.config.vocab_size))
        ours = reference_forward(ours_model, x)
        tol, note = tolerances(ours_model, x, ours)
        report = Report(peer=peer, peer_version=peer_version, model=label, tolerance_note=note,
                        forward=forward_rows(ours, adapter.forward(x), tol))
        logit_tol = max(tol.values())
        C = int(ours_model.config.canvas_length)
        from diffusiongemma.reference.variants import SEMANTICS

        # A second run per configuration with loose stopping (stability 0, confidence 1.5 nats), so that rows
        # stop early and the stopping rules (and diffusers' reading of stability 0 as 1) are compared too.
        early = settings.replace(confidence_threshold=max(1.5, settings.confidence_threshold or 0.0),
                                 stability_threshold=0)
        runs = [(label_k, semantics, options, settings) for label_k, semantics, options in _configurations(peer)]
        runs += [(label_k + f"; early stopping (stability 0, confidence {early.confidence_threshold})", semantics,
                  options, early) for label_k, semantics, options in _configurations(peer)]
        for label_k, semantics, options, settings in runs:
            run = adapter.generate(x.prompt, settings, seed, options)
            row = GenerationRow(label=label_k, semantics=_describe_semantics(semantics), draws="replayed",
                                peer_tokens=run.tokens)
            try:
                row.our_tokens, calls = _run_ours(ours_model, x.prompt, settings, semantics, run.tape)
                row.canvases, row.divergence = compare_runs(run, calls, row.our_tokens, C, logit_tol)
            except Exception as exc:  # a replay that does not fit is a finding, not a crash
                row.divergence = Divergence(-1, -1, -1, -1, -1, f"our run could not replay the peer's draws: {exc}")
            report.generation.append(row)
            if semantics.name != "transformers" or not semantics.runs_on_any_backend:
                report.defects.extend(_versus_transformers(ours_model, x.prompt, settings, run, label_k, C,
                                                           logit_tol, SEMANTICS["transformers"]))
        probe = next((r for r in report.forward if r.probe), None)
        if probe is not None and not probe.ok:
            report.defects.append(f"the image placeholder id {x.image_token_id} in a text-only context is encoded "
                                  f"differently from transformers (max |d| {probe.max_abs_diff:.2e} on the next "
                                  "canvas's logits): the peer treats it as an image slot without an image")
        report.adaptations = list(adapter.adaptations)
        report.defects = list(adapter.defects) + report.defects
        return report


def _versus_transformers(model, prompt, settings, run, label, C, tol, semantics) -> list[str]:
    """Where transformers' semantics would part from the peer on the same draws (a known difference)."""
    if not any(kind == "categorical" for kind, _ in run.tape):
        return [f"{label}: differs from transformers by construction: its proposals are argmaxes (temperature 0), "
                "transformers draws them from the tempered distribution"]
    calls: list = []
    try:
        tokens, calls = _run_ours(model, prompt, settings, semantics, run.tape, calls)
    except Exception as exc:  # the draws stop lining up: the runs took different paths before that
        _, divergence = compare_runs(run, calls, [], C, tol)
        if divergence is None or divergence.cause.startswith("output length"):
            return [f"{label} vs transformers semantics: the peer's draws stop lining up ({exc})"]
        tokens = None
    if tokens is not None:
        _, divergence = compare_runs(run, calls, tokens, C, tol)
    if divergence is None:
        return [f"{label}: identical to transformers semantics on this run"]
    d = divergence
    where = "the committed canvas" if d.step < 0 else f"step {d.step}"
    return [f"{label} vs transformers semantics: first difference at canvas {d.canvas}, {where}, "
            f"position {d.position}: {d.cause}"]
