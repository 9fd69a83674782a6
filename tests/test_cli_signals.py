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
