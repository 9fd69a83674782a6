"""A terminal view of the canvas being denoised, updated in place after every denoising step.

Committed text is printed normally; the current canvas's draft follows it, accepted positions in bold,
still-noisy positions dimmed (in the spirit of ``llama-diffusion-cli --diffusion-visual``). Only the first
row of a batch is shown. The view redraws its own lines with ANSI cursor movement, so it is used only
when the output stream is a terminal.
"""

from __future__ import annotations

import shutil
import sys

_BOLD, _DIM, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"
_UP, _CLEAR_BELOW = "\x1b[{}A", "\x1b[J"


class LiveCanvasView:
    """A generation callback (``on_step`` / ``on_canvas``) drawing row 0 in place on ``stream``."""

    def __init__(self, text_side, prompt_text: str, stream=None):
        self.text = text_side
        self.stream = stream or sys.stdout
        self.committed = prompt_text
        self._lines_drawn = 0

    def _draw(self, body: str, status: str) -> None:
        width = max(shutil.get_terminal_size((80, 24)).columns, 20)
        visible = body.replace("\x1b[1m", "").replace("\x1b[2m", "").replace("\x1b[0m", "")
        lines = sum(max(1, -(-len(part) // width)) for part in (visible + "\n" + status).split("\n"))
        out = []
        if self._lines_drawn:
            out.append("\r" + _UP.format(self._lines_drawn - 1) if self._lines_drawn > 1 else "\r")
            out.append(_CLEAR_BELOW)
        out.append(body + "\n" + status)
        self.stream.write("".join(out))
        self.stream.flush()
        self._lines_drawn = lines

    def on_step(self, info) -> None:
        pieces = []
        for token, accepted in zip(info.draft[0], info.accepted[0]):
            word = self.text.decode([token], skip_special_tokens=False)
            pieces.append(f"{_BOLD}{word}{_RESET}" if accepted else f"{_DIM}{word}{_RESET}")
        status = (f"{_DIM}canvas {info.canvas_index + 1} step {info.step_index + 1} "
                  f"T={info.temperature if info.temperature is not None else float('nan'):.3f} "
                  f"accepted {int(info.accepted[0].sum())}/{info.accepted.shape[1]}{_RESET}")
        self._draw(self.committed + "".join(pieces), status)

    def on_canvas(self, info) -> None:
        self.committed += self.text.decode(info.tokens[0])
        self._draw(self.committed, f"{_DIM}canvas {info.canvas_index + 1} committed after {info.steps} steps{_RESET}")

    def close(self) -> None:
        """Erase the view (the caller prints the final text)."""
        if self._lines_drawn:
            self.stream.write(("\r" + _UP.format(self._lines_drawn - 1) if self._lines_drawn > 1 else "\r")
                              + _CLEAR_BELOW)
            self.stream.flush()
            self._lines_drawn = 0
