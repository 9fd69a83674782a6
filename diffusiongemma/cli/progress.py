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
    """tqdm bars for canvases (total: the run's planned canvases) and the current canvas's steps (total N)."""

    def __init__(self, planned_canvases: int, max_steps: int, stream=None):
        from tqdm import tqdm

        stream = stream or sys.stderr
        self.canvases = tqdm(total=planned_canvases, desc="canvases", unit="canvas", leave=False, file=stream)
        self.steps = tqdm(total=max_steps, desc="denoising", unit="step", leave=False, file=stream)
        self._canvas = 0

    def on_step(self, info) -> None:
        if info.canvas_index != self._canvas:
            self._canvas = info.canvas_index
            self.steps.reset(total=self.steps.total)
        self.steps.update(1)

    def on_canvas(self, info) -> None:
        self.canvases.update(1)
        self.steps.reset(total=self.steps.total)
        self._canvas = info.canvas_index + 1

    def on_end(self, result) -> None:
        self.close()

    def close(self) -> None:
        self.steps.close()
        self.canvases.close()


def without_library_progress(generate_fn: Callable) -> dict:
    """``{"progress": False}`` for a ``generate`` that still takes ``progress=`` (older loops drew their own
    bars), else ``{}``: the command line draws the bars itself, from the callback."""
    try:
        parameters = inspect.signature(generate_fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return {}
    return {"progress": False} if "progress" in parameters else {}
