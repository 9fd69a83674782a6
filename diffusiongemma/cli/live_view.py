"""A terminal view of the canvas being denoised, redrawn in place, paced for a person to watch.

Every frame shows a header line and the text::

    canvas 2/8 · step 5/16 · accepted 9/32 · T=0.675
    And God said, Let there be light: and there was light. And God saw the ...

Committed text is printed normally; the current canvas's draft follows it: positions accepted at this step
in bold, the others dimmed (in the spirit of ``llama-diffusion-cli --diffusion-visual``). Special tokens are
drawn as marks, not as their literal names: EOS ``¶``, pad ``·``, any other special token ``¤``. Only row 0
of a batch is shown. A frame never takes more lines than the terminal has: when the committed text is too
long, its tail is shown after ``…`` (the whole text is printed at the end).

Pacing: a frame stays on screen for at least ``frame_time`` seconds. Steps that arrive sooner are dropped
(not queued), so a fast run shows fewer frames and is never slowed down; a committed canvas is always
drawn. With ``wait=True`` no step is dropped: the view sleeps out the rest of the frame time instead, so a
person sees every step (the run takes at least steps x frame_time). ``close`` erases the view, or, after Ctrl-C
(``close(interrupted=True)``), leaves the text committed so far; either way it resets the terminal's
attributes and shows the cursor again.

The view moves the cursor with ANSI codes, so it is used only on a terminal (``stream.isatty()``), or when
the user asks for it (``--view live``).
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from typing import Callable, Iterable

BOLD, DIM, RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
UP, CLEAR_BELOW = "\x1b[{}A", "\x1b[J"
EOS_MARK, PAD_MARK, SPECIAL_MARK = "¶", "·", "¤"  # how special tokens are drawn in a draft
DEFAULT_FRAME_TIME = 0.08  # seconds a frame stays on screen at least (about 12 frames per second)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class LiveCanvasView:
    """A generation callback (``on_step`` / ``on_canvas`` / ``on_end``) drawing row 0 in place on ``stream``.

    text_side: ``checkpoint.TextSide`` (decodes ids). prompt_text: what the committed text starts with.
    planned_canvases: n of the header (the token budget in canvases); max_steps: N. eos_ids / pad_id: the
    run's special ids (drawn as marks, besides every token the tokenizer calls special). frame_time: seconds
    per frame at least (0: draw every step). wait: sleep instead of dropping frames. clock, sleep: a monotonic
    clock and its sleep (tests pass fake ones).
    """

    def __init__(self, text_side, prompt_text: str, stream=None, *, planned_canvases: int = 0, max_steps: int = 0,
                 eos_ids: Iterable[int] = (), pad_id: int | None = None, frame_time: float = DEFAULT_FRAME_TIME,
                 wait: bool = False, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.text = text_side
        self.stream = stream or sys.stdout
        self.committed = prompt_text
        self.planned_canvases = planned_canvases
        self.max_steps = max_steps
        self.frame_time = frame_time
        self.wait = wait
        self.clock = clock
        self.sleep = sleep
        self.frames = 0  # frames drawn
        self.dropped = 0  # steps not drawn because they came within frame_time of the previous frame
        self._marks = self._special_marks(set(int(i) for i in eos_ids), pad_id)
        self._pieces: dict[int, str] = {}  # token id -> decoded text (memo)
        self._lines_drawn = 0
        self._last_draw: float | None = None

    # ------------------------------------------------------------------------------------------ callback
    def on_step(self, info) -> None:
        now = self.clock()
        if self._last_draw is not None and now - self._last_draw < self.frame_time:
            if not self.wait:
                self.dropped += 1
                return
            self.sleep(self.frame_time - (now - self._last_draw))
            now = self.clock()
        draft, accepted = info.draft[0], info.accepted[0]
        body = "".join((BOLD if ok else DIM) + self.piece(int(token)) + RESET for token, ok in zip(draft, accepted))
        n = self.planned_canvases or getattr(info, "n_canvases", 0) or "?"
        N = self.max_steps or getattr(info, "max_steps", 0) or "?"
        temp = "none" if info.temperature is None else f"{info.temperature:.3f}"
        header = (f"canvas {info.canvas_index + 1}/{n} · step {info.step_index + 1}/{N} · "
                  f"accepted {int(accepted.sum())}/{accepted.shape[0]} · T={temp}")
        self._draw(header, self.committed, body, now)

    def on_canvas(self, info) -> None:
        self.committed += self.text.decode(info.tokens[0])
        n = self.planned_canvases or getattr(info, "n_canvases", 0) or "?"
        self._draw(f"canvas {info.canvas_index + 1}/{n} committed after {info.steps} steps", self.committed, "",
                   self.clock())

    def on_end(self, result) -> None:
        """Nothing to draw: the caller prints the final text after ``close``."""

    # ------------------------------------------------------------------------------------------ drawing
    def piece(self, token: int) -> str:
        """How one draft token is drawn: its text, or a mark for a special token."""
        if token not in self._pieces:
            mark = self._marks.get(token)
            if mark is None and self._is_special(token):
                mark = SPECIAL_MARK
            self._pieces[token] = mark if mark is not None else self.text.decode([token], skip_special_tokens=False)
        return self._pieces[token]

    def _special_marks(self, eos_ids: set[int], pad_id: int | None) -> dict[int, str]:
        marks = {token: EOS_MARK for token in eos_ids}
        if pad_id is not None:
            marks.setdefault(pad_id, PAD_MARK)
        return marks

    def _is_special(self, token: int) -> bool:
        decoder = getattr(getattr(self.text, "tokenizer", None), "get_added_tokens_decoder", None)
        if decoder is None:
            return False
        if not hasattr(self, "_special_ids"):
            self._special_ids = {int(i) for i, added in decoder().items() if getattr(added, "special", False)}
        return token in self._special_ids

    def _draw(self, header: str, committed: str, draft: str, now: float) -> None:
        size = shutil.get_terminal_size((80, 24))
        width, rows = max(size.columns, 20), max(size.lines, 3)
        committed = self._fit(header, committed, _ANSI.sub("", draft), width, rows - 1)
        out = [self._erase_codes(), HIDE_CURSOR if self.frames == 0 else ""]
        out.append(f"{DIM}{header}{RESET}\n{committed}{draft}")
        # the state first: a Ctrl-C arriving during the write must still find what to erase in close()
        self._lines_drawn = _lines(header + "\n" + committed + _ANSI.sub("", draft), width)
        self._last_draw = now
        self.frames += 1
        self.stream.write("".join(out))
        self.stream.flush()

    @staticmethod
    def _fit(header: str, committed: str, draft: str, width: int, rows: int) -> str:
        """``committed``, or its tail after an ellipsis, so that the frame fits in ``rows`` lines (cursor
        movement cannot reach lines that scrolled off the screen, so a taller frame could not be erased)."""
        if _lines(header + "\n" + committed + draft, width) <= rows:
            return committed
        lo, hi = 0, len(committed)  # the longest tail that fits: binary search on its length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _lines(header + "\n…" + committed[len(committed) - mid:] + draft, width) <= rows:
                lo = mid
            else:
                hi = mid - 1
        return "…" + committed[len(committed) - lo:]

    def _erase_codes(self) -> str:
        if not self._lines_drawn:
            return ""
        return ("\r" + UP.format(self._lines_drawn - 1) if self._lines_drawn > 1 else "\r") + CLEAR_BELOW

    def close(self, interrupted: bool = False) -> None:
        """Erase the view (the caller prints the final text) or, when ``interrupted``, replace it with the
        text committed so far; always reset the attributes and show the cursor."""
        out = [self._erase_codes(), RESET]
        if interrupted and self.frames:
            out.append(self.committed + "\n")
        out.append(SHOW_CURSOR)
        if self.frames or interrupted:
            self.stream.write("".join(out))
            self.stream.flush()
        self._lines_drawn = 0


def _lines(text: str, width: int) -> int:
    """Terminal lines ``text`` (no ANSI codes) takes at ``width`` columns."""
    return sum(max(1, -(-len(line) // width)) for line in text.split("\n"))
