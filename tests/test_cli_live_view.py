"""The live view: header, marks for special tokens, pacing (frames dropped, or waited for), the terminal
restored after Ctrl-C, and --json output that never holds terminal codes."""

from __future__ import annotations

import io
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from diffusiongemma.checkpoint import default_model_dir, load_text_side
from diffusiongemma.cli import live_view
from diffusiongemma.cli.live_view import LiveCanvasView
from diffusiongemma.cli.main import main

SMALL = ["--steps", "6", "--no-progress", "-n", "64", "--seed", "2"]


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


@pytest.fixture(scope="module")
def side():
    return load_text_side(default_model_dir())


def step(k=0, i=0, draft=(300, 391), accepted=(True, False), temperature=0.8):
    return SimpleNamespace(canvas_index=k, step_index=i, step=16 - i, temperature=temperature,
                           draft=np.array([draft]), accepted=np.array([accepted]), n_canvases=3, max_steps=16)


def test_header_and_marks(side):
    out = io.StringIO()
    view = LiveCanvasView(side, "And", out, planned_canvases=3, max_steps=16, eos_ids=[1], pad_id=0, frame_time=0)
    view.on_step(step(k=1, i=4, draft=(391, 1, 0, 2), accepted=(True, True, False, False), temperature=0.675))
    text = out.getvalue()
    assert "canvas 2/3 · step 5/16 · accepted 2/4 · T=0.675" in text
    body = text.split("\n", 1)[1]
    assert body == ("And" + live_view.BOLD + " God" + live_view.RESET + live_view.BOLD + "¶" + live_view.RESET
                    + live_view.DIM + "·" + live_view.RESET + live_view.DIM + "¤" + live_view.RESET)
    assert "<eos>" not in text and "<pad>" not in text and "<bos>" not in text


def test_a_frame_fits_the_terminal(side, monkeypatch):
    import os

    monkeypatch.setattr(live_view.shutil, "get_terminal_size", lambda fallback=None: os.terminal_size((40, 8)))
    out = io.StringIO()
    committed = " ".join(f"word{i}" for i in range(60))
    view = LiveCanvasView(side, committed, out, frame_time=0)
    view.on_step(step(draft=(300, 391) * 8, accepted=(True, False) * 8))
    frame = live_view._ANSI.sub("", out.getvalue())
    assert view._lines_drawn <= 7 and live_view._lines(frame, 40) <= 7
    assert "…" in frame and frame.split("\n", 1)[1].startswith("…") and "word59" in frame
    view.close(interrupted=True)
    assert out.getvalue().endswith(committed + "\n" + live_view.SHOW_CURSOR)  # the whole text at the end


def test_frames_faster_than_the_frame_time_are_dropped(side):
    out = io.StringIO()
    view = LiveCanvasView(side, "", out, frame_time=0.1, clock=Clock([0.0, 0.05, 0.09, 0.12, 0.13, 0.5]))
    for i in range(5):
        view.on_step(step(i=i))
    assert (view.frames, view.dropped) == (2, 3)  # drawn at t=0 and t=0.12
    view.on_canvas(SimpleNamespace(canvas_index=0, tokens=np.array([[300]]), steps=5, n_canvases=1))
    assert view.frames == 3  # a committed canvas is always drawn
    assert out.getvalue().count("step ") == 2 and "committed after 5 steps" in out.getvalue()


def test_wait_shows_every_step_sleeping_out_the_frame_time(side):
    slept = []
    times = iter([0.0, 0.03, 0.1, 0.15, 0.2])  # step 1 waits 0.07 s, step 2 waits 0.05 s
    view = LiveCanvasView(side, "", io.StringIO(), frame_time=0.1, wait=True, clock=lambda: next(times),
                          sleep=slept.append)
    for i in range(3):
        view.on_step(step(i=i))
    assert view.frames == 3 and view.dropped == 0
    assert slept == pytest.approx([0.07, 0.05])


def test_close_after_interrupt_restores_the_terminal(side):
    out = io.StringIO()
    view = LiveCanvasView(side, "And God said", out, frame_time=0)
    view.on_step(step())
    assert live_view.HIDE_CURSOR in out.getvalue()
    view.close(interrupted=True)
    tail = out.getvalue().rsplit(live_view.CLEAR_BELOW, 1)[1]
    assert tail == live_view.RESET + "And God said\n" + live_view.SHOW_CURSOR


def test_live_view_on_a_terminal_by_default(monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["generate", "And God said", *SMALL]) == 0
    text = terminal.getvalue()
    assert "\x1b[J" in text and "canvas 1/2 · step 1/6 · accepted" in text
    assert text.endswith(live_view.SHOW_CURSOR + "And God said" + text.rsplit("And God said", 1)[1])


def test_json_never_holds_terminal_codes(monkeypatch, capsys):
    for view in ("auto", "live"):
        assert main(["generate", "And God said", "--json", "--view", view, *SMALL]) == 0
        captured = capsys.readouterr()
        assert "\x1b" not in captured.out and "\x1b" not in captured.err
        assert json.loads(captured.out)["text"]
    # stdout a terminal, stderr not (2>log): nothing drawn at all
    monkeypatch.setattr(sys, "stdout", Terminal())
    for view in ("auto", "live"):
        assert main(["generate", "And God said", "--json", "--view", view, *SMALL]) == 0
        out = sys.stdout.getvalue()
        assert "\x1b" not in out and json.loads(out.splitlines()[-1])["text"]
    monkeypatch.undo()
    # --view live --json on a terminal: the view goes to stderr, the JSON stays clean on stdout
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["generate", "And God said", "--json", "--view", "live", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and json.loads(out)["text"]
    assert "canvas 1/2 · step 1/6" in terminal.getvalue()
