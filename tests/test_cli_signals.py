"""Interruptions and disks: Ctrl-C gives status 130 and one line (no traceback) in generate, trace and
convert; trace checks its output path before the run; a file-size limit during convert is a named error."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest

from diffusiongemma.cli import live_view
from diffusiongemma.cli.main import main


def _default_sigint():
    """In the child before exec: Ctrl-C's default disposition. A suite started in the background by a shell
    without job control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_ctrl_c_in_generate_restores_the_terminal_and_exits_130():
    # the view waits 30 s after its first frame, so the signal surely arrives mid-run
    proc = subprocess.Popen([sys.executable, "-m", "diffusiongemma", "generate", "And God said", "--seed", "1",
                             "--view", "live", "--view-wait", "--frame-time", "30"], bufsize=0,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(),
                            preexec_fn=_default_sigint)
    first = proc.stdout.read(1)  # the first frame is being drawn: the run is under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    out = first + out
    assert proc.returncode == 130
    assert err.decode() == "diffusiongemma generate: interrupted\n"
    assert out.decode().endswith(live_view.CLEAR_BELOW + live_view.RESET + "And God said\n" + live_view.SHOW_CURSOR)


@pytest.mark.parametrize("command", [
    ["generate", "And God said", "-n", "32", "--steps", "4", "--no-progress"],
    ["trace", "--prompt", "And God said", "-n", "32", "--steps", "4", "--no-progress"],
])
def test_ctrl_c_during_the_run_is_one_line(monkeypatch, tmp_path, capsys, command):
    import diffusiongemma.checkpoint as checkpoint

    real = checkpoint.generate_function

    def interrupted_generate(backend):
        generate = real(backend)

        def run(*args, callback=None, **kwargs):
            class Interrupt:
                def on_step(self, info):
                    if callback is not None and hasattr(callback, "on_step"):
                        callback.on_step(info)
                    raise KeyboardInterrupt
            return generate(*args, callback=Interrupt(), **kwargs)
        return run

    monkeypatch.setattr(checkpoint, "generate_function", interrupted_generate)
    output = tmp_path / "run.trace"
    if command[0] == "trace":
        command = [*command, "-o", str(output)]
    assert main(command) == 130
    captured = capsys.readouterr()
    assert captured.err == f"diffusiongemma {command[0]}: interrupted\n"
    assert not output.exists() and os.listdir(tmp_path) == []  # no partial trace either


def test_ctrl_c_in_convert_is_one_line(monkeypatch, tmp_path, capsys):
    import diffusiongemma.weights_converter.cli as converter_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(converter_cli, "convert", interrupted)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err and "Traceback" not in err


@pytest.mark.parametrize("where,message", [
    ("missing/run.trace", "is not an existing folder"),
    (".", "is a folder; give a file name"),
    ("file.txt/run.trace", "is not an existing folder"),
])
def test_trace_output_is_checked_before_the_run(monkeypatch, tmp_path, capsys, where, message):
    import diffusiongemma.checkpoint as checkpoint

    (tmp_path / "file.txt").write_text("a file, not a folder")
    loaded = []
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: loaded.append(a))
    target = str(tmp_path / where) if where != "." else str(tmp_path)
    assert main(["trace", "--prompt", "hi", "-o", target, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "-o/--output" in err and message in err
    assert loaded == []  # failed before loading the model, let alone running it


def test_file_size_limit_during_convert_is_a_named_error(tmp_path):
    from tests.hf_tiny import save_tiny, tiny_model

    src = save_tiny(tiny_model(seed=0), tmp_path / "hf")
    dst = tmp_path / "out"
    size = os.path.getsize(os.path.join(src, "model.safetensors"))
    limit = size // 4

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "diffusiongemma", "convert", src, str(dst), "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=child_env(), preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr
    assert "cannot write" in proc.stderr and "File too large" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not dst.exists() and [p for p in os.listdir(tmp_path) if p != "hf"] == []


def _interrupt_after_canvases(monkeypatch, canvases: int):
    """generate_function's run raises KeyboardInterrupt (as Ctrl-C would) after ``canvases`` committed canvases."""
    import diffusiongemma.checkpoint as checkpoint

    real = checkpoint.generate_function

    def interrupted_generate(backend):
        generate = real(backend)

        def run(*args, callback=None, **kwargs):
            class Interrupt:
                seen = 0

                def __getattr__(self, name):
                    return getattr(callback, name)

                def on_canvas(self, info):
                    callback.on_canvas(info)
                    Interrupt.seen += 1
                    if Interrupt.seen == canvases:
                        raise KeyboardInterrupt
            return generate(*args, callback=Interrupt(), **kwargs)
        return run

    monkeypatch.setattr(checkpoint, "generate_function", interrupted_generate)


def test_ctrl_c_with_stdout_not_a_terminal_keeps_the_committed_text(monkeypatch, capsys):
    """#33: with stdout redirected (no live view) an interrupted run printed nothing; it now prints the prompt
    and the canvases committed so far: here exactly what a run whose budget ends after them prints."""
    args = ["generate", "And God said", "--seed", "3", "--steps", "4", "--ignore-eos", "--no-progress"]
    assert main([*args, "-n", "64"]) == 0
    two_canvases = capsys.readouterr().out
    assert two_canvases.startswith("And God said") and len(two_canvases) > len("And God said\n")
    _interrupt_after_canvases(monkeypatch, 2)
    assert main([*args, "-n", "256"]) == 130
    captured = capsys.readouterr()
    assert captured.out == two_canvases
    assert captured.err == "diffusiongemma generate: interrupted\n"


def test_ctrl_c_in_a_json_run_prints_no_partial_json(monkeypatch, capsys):
    _interrupt_after_canvases(monkeypatch, 1)
    assert main(["generate", "And God said", "--seed", "3", "-n", "128", "--json", "--no-progress"]) == 130
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_real_ctrl_c_with_stdout_in_a_file_keeps_the_committed_text(tmp_path):
    import re
    import time

    out_path = tmp_path / "out.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "diffusiongemma", "generate", "And God said", "--seed", "1",
                                 "-n", "4096", "--ignore-eos", "--backend", "reference", "--progress"], stdout=out,
                                stderr=subprocess.PIPE, env=child_env(), preexec_fn=_default_sigint)
        seen, deadline = b"", time.monotonic() + 120
        while not re.search(rb"canvases: .*\| *[1-9][0-9]*/128", seen) and time.monotonic() < deadline:
            chunk = proc.stderr.read1(4096)
            if not chunk:
                break
            seen += chunk
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen + err).decode(errors="replace")
    text = out_path.read_text(encoding="utf-8")
    assert text.startswith("And God said") and len(text) > len("And God said\n"), text
    assert "interrupted" in err.decode()


def test_the_prefill_line_says_that_the_prompt_is_encoded():
    import io
    import time

    import numpy as np

    from diffusiongemma.cli.progress import PrefillProgress

    stream = io.StringIO()
    line = PrefillProgress(stream, delay=0.0, interval=0.02)
    line.on_prompt(np.zeros((1, 120002), dtype=np.int64))
    deadline = time.monotonic() + 10
    while "encoding the prompt" not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    line.on_step(None)  # the first step erases it, and it stays erased
    text = stream.getvalue()
    assert "\r\x1b[Kencoding the prompt: 120,002 tokens ... 0 s" in text and text.endswith("\r\x1b[K")
    time.sleep(0.1)
    assert stream.getvalue() == text
    quiet = io.StringIO()
    short = PrefillProgress(quiet, delay=5.0)
    short.on_prompt(np.zeros((1, 4), dtype=np.int64))
    short.close()  # a prompt encoded before the delay shows nothing
    assert quiet.getvalue() == ""


def test_a_long_prompt_shows_the_prefill_on_a_terminal(monkeypatch, capsys):
    """#33: a 120,002-token prompt ran for minutes with no output. The command draws the prefill line on a
    terminal's stderr while the prompt is encoded. Made independent of the machine's speed: the line's delay
    is 0 and its erasure at the first step waits until it was drawn (or 10 s), so a fast encode cannot
    finish before the first redraw."""
    import io
    import re
    import threading

    from diffusiongemma.cli import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    drawn = threading.Event()
    original_init, original_close = progress.PrefillProgress.__init__, progress.PrefillProgress.close

    def init(self, stream=None, delay=1.0, interval=0.5):
        original_init(self, stream, delay=0.0, interval=0.01)

    def close(self):
        if self._thread is not None:
            drawn.wait(10)
        original_close(self)

    terminal = Terminal()
    monkeypatch.setattr(progress.PrefillProgress, "__init__", init)
    monkeypatch.setattr(progress.PrefillProgress, "close", close)
    write = terminal.write

    def noting_write(text):
        if "encoding the prompt" in text:
            drawn.set()
        return write(text)

    monkeypatch.setattr(terminal, "write", noting_write)
    monkeypatch.setattr(sys, "stderr", terminal)
    prompt = "And God said, Let there be light: and there was light. " * 20
    assert main(["generate", prompt, "--seed", "1", "-n", "32", "--steps", "2"]) == 0
    seen = terminal.getvalue()
    assert re.search(r"encoding the prompt: [0-9,]+ tokens \.\.\. [0-9]+ s", seen), seen[:500]
    assert capsys.readouterr().out.startswith(prompt[:20])

