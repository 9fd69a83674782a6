"""Progress bars of the command line, drawn from the generation callback (the library prints nothing).

``ProgressBars`` is a ``GenerationCallback``: a "canvases" bar advanced by ``on_canvas`` and a "denoising"
bar advanced by ``on_step`` and reset for every canvas, both on stderr (tqdm). ``Fanout`` passes every
callback event to several callbacks, in order, so the bars, the live view, a recorder and a streamer can
watch one run together.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

EVENTS = ("on_prompt", "on_step", "on_canvas", "on_end")


class Fanout:
    """One callback that forwards each event to every callback in ``callbacks`` that has the method."""

    def __init__(self, *callbacks: Any):
        self.callbacks = [c for c in callbacks if c is not None]

    def __getattr__(self, name: str) -> Callable:
        if name not in EVENTS:
            raise AttributeError(name)
        handlers = [getattr(c, name) for c in self.callbacks if hasattr(c, name)]

        def forward(argument):
            for handler in handlers:
                handler(argument)
        return forward


class ProgressBars:
    """tqdm bars for canvases (total: the run's planned canvases) and the current canvas's steps (total N),
    drawn from the first step on (before it, the prompt's encode runs: ``PrefillProgress``)."""

    def __init__(self, planned_canvases: int, max_steps: int, stream=None):
        self.stream = stream or sys.stderr
        self.planned_canvases, self.max_steps = planned_canvases, max_steps
        self.canvases = self.steps = None
        self._canvas = 0

    def _open(self) -> None:
        from tqdm import tqdm

        if self.canvases is None:
            self.canvases = tqdm(total=self.planned_canvases, desc="canvases", unit="canvas", leave=False,
                                 file=self.stream)
            self.steps = tqdm(total=self.max_steps, desc="denoising", unit="step", leave=False, file=self.stream)

    def on_step(self, info) -> None:
        self._open()
        if info.canvas_index != self._canvas:
            self._canvas = info.canvas_index
            self.steps.reset(total=self.steps.total)
        self.steps.update(1)

    def on_canvas(self, info) -> None:
        self._open()
        self.canvases.update(1)
        self.steps.reset(total=self.steps.total)
        self._canvas = info.canvas_index + 1

    def on_end(self, result) -> None:
        self.close()

    def close(self) -> None:
        if self.canvases is not None:
            self.steps.close()
            self.canvases.close()


class PrefillProgress:
    """A status line on ``stream`` (a terminal) while the prompt is encoded, before the first denoising step:
    ``encoding the prompt: 120,002 tokens ... 35 s``, redrawn every ``interval`` seconds from ``delay`` on (a
    short prompt shows nothing), erased at the first step. The encode itself cannot report its progress
    without being split, and splitting it would change the float32 rounding of the cache (and so, at
    times, the tokens of a seed), so the line tells that the encode runs and for how long, not how far."""

    def __init__(self, stream=None, delay: float = 1.0, interval: float = 0.5):
        import threading

        self.stream = stream or sys.stderr
        self.delay, self.interval = delay, interval
        self._stop = threading.Event()
        self._thread = None
        self._drawn = False
        self._lock = threading.Lock()

    def on_prompt(self, input_ids) -> None:
        import threading
        import time

        if self._thread is not None:
            return
        tokens, start = int(input_ids.shape[-1]), time.monotonic()

        def draw():
            if self._stop.wait(self.delay):
                return
            while True:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self.stream.write(f"\r\x1b[Kencoding the prompt: {tokens:,} tokens ... "
                                      f"{time.monotonic() - start:.0f} s")
                    self.stream.flush()
                    self._drawn = True
                if self._stop.wait(self.interval):
                    return

        self._thread = threading.Thread(target=draw, name="prefill-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop drawing and erase the line (idempotent)."""
        with self._lock:
            self._stop.set()
            if self._drawn:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._drawn = False
        if self._thread is not None:
            self._thread.join()

    def on_step(self, info) -> None:
        self.close()

    def on_canvas(self, info) -> None:
        self.close()

    def on_end(self, result) -> None:
        self.close()


class CommittedText:
    """Collects row 0 of every committed canvas, so that an interrupted run can still print what it committed
    (``text()``: those tokens decoded with ``decode``)."""

    def __init__(self, decode: Callable):
        self.decode = decode
        self.tokens: list[int] = []

    def on_canvas(self, info) -> None:
        self.tokens.extend(int(t) for t in info.tokens[0])

    def text(self) -> str:
        return self.decode(self.tokens) if self.tokens else ""


def without_library_progress(generate_fn: Callable) -> dict:
    """``{"progress": False}`` for a ``generate`` that still takes ``progress=`` (older loops drew their own
    bars), else ``{}``: the command line draws the bars itself, from the callback."""
    try:
        parameters = inspect.signature(generate_fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return {}
    return {"progress": False} if "progress" in parameters else {}
