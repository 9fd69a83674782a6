"""Watching a generation run: the callback a user passes, and the observer a recorder plugs in.

Two kinds of watcher, called by the loop (``generate.py``) at fixed, named points:

* a **callback** (``GenerationCallback``, or any object with some of its methods) sees what a user wants to
  show: the prompt, every denoising step (``StepInfo``), every committed canvas (``CanvasInfo``), the result.
  The command line draws its progress bars and live canvas from these; the library prints nothing itself.
* an **observer** (``Observer``) sees the run's internals in order, down to the decoder's input embedding and
  layer outputs, so that a golden trace can be recorded (``diffusiongemma.trace.TraceRecorder`` is one).
  ``NULL_OBSERVER`` does nothing; the loop and the models call it unconditionally, so the specification
  holds no ``if trace`` branches.

Every array handed to a watcher is a read-only view: watchers must not change the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["StepInfo", "CanvasInfo", "GenerationCallback", "Observer", "NULL_OBSERVER", "notify", "readonly"]


# ================================================================================================ callbacks
@dataclass(frozen=True)
class StepInfo:
    """What one denoising step did (passed to ``GenerationCallback.on_step``). Arrays are read-only.

    Frozen rows (finished denoising before this step) report their frozen draft, canvas and entropies and
    an all-False ``accepted`` row.
    """

    canvas_index: int  # k: which canvas (0-based)
    step: int  # transformers' cur_step: N at the first step, counting down
    step_index: int  # 0-based count of steps executed in this canvas (N - step)
    temperature: float | None  # T of this step (float32 value), None without a schedule
    draft: np.ndarray  # (B, C) int64 argmax of the processed logits: what would be committed now
    sampled: np.ndarray  # (B, C) int64 categorical draws
    accepted: np.ndarray  # (B, C) bool: positions whose draw entered the next canvas
    canvas: np.ndarray  # (B, C) int64 the next canvas (accepted draws, fresh noise elsewhere)
    entropies: np.ndarray  # (B, C) float32 per-position entropy (nats) of the processed logits
    finished: np.ndarray  # (B,) bool: rows whose denoising has stopped after this step
    max_steps: int = 0  # N: the most steps this canvas may take
    n_canvases: int = 0  # how many canvases the run may make (the token budget in canvases)


@dataclass(frozen=True)
class CanvasInfo:
    """A committed canvas (passed to ``GenerationCallback.on_canvas``). Arrays are read-only."""

    canvas_index: int  # k
    tokens: np.ndarray  # (B, C) int64 as appended to the output (after the EOS/pad rules)
    finished: np.ndarray  # (B,) bool: rows that have ended (EOS seen, or the max-length rule)
    steps: int  # denoising steps executed for this canvas
    n_canvases: int = 0  # how many canvases the run may make


class GenerationCallback:
    """Observer of a generation run for users (transformers' streamer idea: a draft per step, a block per
    canvas).

    Subclass and override what you need; ``generate`` also accepts any object that has some of these
    methods (missing ones are skipped). Callbacks must not modify the arrays they receive (they are
    read-only views).
    """

    def on_prompt(self, input_ids: np.ndarray) -> None:
        """Called once with the prompt (B, P) before anything runs."""

    def on_step(self, info: StepInfo) -> None:
        """Called after every executed denoising step."""

    def on_canvas(self, info: CanvasInfo) -> None:
        """Called after every committed canvas."""

    def on_end(self, result: Any) -> None:
        """Called once with the ``GenerationResult``."""


CALLBACK_METHODS = ("on_prompt", "on_step", "on_canvas", "on_end")


def check_callback(callback: Any) -> Any:
    """Refuse a ``callback`` that ``generate`` would never call (an int, a plain function: none of the
    ``GenerationCallback`` methods) or whose method is not callable; ``InputError`` naming it."""
    if callback is None:
        return callback
    from .errors import InputError

    present = [name for name in CALLBACK_METHODS if getattr(callback, name, None) is not None]
    if not present:
        raise InputError(f"callback must be None or an object with some of the methods {', '.join(CALLBACK_METHODS)} "
                         f"(a GenerationCallback), got {type(callback).__name__} {callback!r:.60}")
    for name in present:
        if not callable(getattr(callback, name)):
            raise InputError(f"callback.{name} is {type(getattr(callback, name)).__name__}, not a method")
    return callback


def notify(callback: Any, method: str, argument: Any) -> None:
    """Call ``callback.<method>(argument)`` if the callback exists and has that method (duck typing)."""
    handler = getattr(callback, method, None) if callback is not None else None
    if handler is not None:
        handler(argument)


def readonly(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (what callbacks, denoisers and encoders receive)."""
    view = array.view()
    view.flags.writeable = False
    return view


# ================================================================================================ observer
class Observer:
    """The named points of a run, in the order the loop reaches them; every method here does nothing.

    ``records``: False for an observer that records nothing, so that a backend can skip copying device
    arrays to the host for it. ``layers``: True when the observer wants every decoder layer's output.

        begin_run(model_config, generation_config, input_ids, attention_mask, draws)
        record_draws(draws) -> draws                 the draw source the run uses from here on
        per encoder call:  begin_encode(ids, mask), [encoder_kv(l, keys, values)], end_encode(cache)
        per canvas:        begin_canvas(initial canvas (B, C))
          per step:        begin_step(live (B,) bool)
                           decoder_input(h (B, C, H)), decoder_layer(l, h)   (inside the model's denoise)
                           logits(logits (B, C, V), rows=None)
                           end_step(temperature=, draft=, sampled=, entropies=, accepted=, canvas=, finished=)
                           commit(tokens (B, C), ended (B,))
        end_run(sequences (B, T))
    """

    records = False
    layers = False

    def begin_run(self, model_config: Any, generation_config: Any, input_ids: np.ndarray,
                  attention_mask: np.ndarray | None = None, draws: Any = None) -> None:
        pass

    def record_draws(self, draws: Any) -> Any:
        return draws

    def begin_encode(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> None:
        pass

    def encoder_kv(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        pass

    def end_encode(self, cache: Any = None) -> None:
        pass

    def begin_canvas(self, initial_canvas: np.ndarray) -> None:
        pass

    def begin_step(self, live: np.ndarray | None = None) -> None:
        pass

    def decoder_input(self, h: np.ndarray, rows: np.ndarray | None = None) -> None:
        pass

    def decoder_layer(self, layer: int, h: np.ndarray, rows: np.ndarray | None = None) -> None:
        pass

    def logits(self, logits: np.ndarray, rows: np.ndarray | None = None) -> None:
        pass

    def end_step(self, **step: Any) -> None:
        pass

    def commit(self, tokens: np.ndarray, ended: np.ndarray) -> None:
        pass

    def end_run(self, sequences: np.ndarray | None = None) -> None:
        pass


NULL_OBSERVER = Observer()
