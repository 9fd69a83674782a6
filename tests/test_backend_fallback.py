"""``--backend auto`` and ``--backend gpu`` with a CuPy that is installed but broken.

A fake ``cupy`` package is put first on ``sys.path`` of a fresh interpreter; it fails the way real installs
do: on import (a SyntaxError of a half-written upgrade, an OSError of a missing CUDA library, a RuntimeError or
ImportError of its own checks), in the CUDA driver (``getDeviceCount``), or on first use (the device context
that loading the model opens). ``auto`` then runs on the CPU path and says why in one line; ``gpu`` exits 2
with one line naming CuPy's message. Before, each of these was a traceback or a silent fallback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a CuPy that imports and sees one GPU; what fails is said by the module-level FAIL_* lines prepended to it
_WORKING_SURFACE = textwrap.dedent("""
    import types
    __version__ = "13.9.9-fake"

    class CUDARuntimeError(RuntimeError):
        pass

    def _device_count():
        if FAIL_DRIVER:
            raise CUDARuntimeError(FAIL_DRIVER)
        return 1

    class Device:
        def __init__(self, index=0):
            if FAIL_FIRST_USE:
                raise CUDARuntimeError(FAIL_FIRST_USE)

    cuda = types.SimpleNamespace(
        Device=Device,
        runtime=types.SimpleNamespace(getDeviceCount=_device_count,
                                      getDeviceProperties=lambda index: {"name": b"Fake GPU"}))
""")

CASES = {
    "syntax": ("raise SyntaxError('invalid syntax (_core.py, line 7)')", "SyntaxError: invalid syntax (_core.py, line 7)"),
    "oserror": ("raise OSError('libcudart.so.12: cannot open shared object file')",
                "OSError: libcudart.so.12: cannot open shared object file"),
    "runtime": ("raise RuntimeError('CuPy was built for CUDA 12\\nbut found CUDA 11')",
                "CuPy was built for CUDA 12 but found CUDA 11"),
    "import": ("raise ImportError('libnvrtc.so.12: cannot open shared object file')",
               "libnvrtc.so.12: cannot open shared object file"),
    "driver": ("FAIL_DRIVER, FAIL_FIRST_USE = 'cudaErrorInsufficientDriver: CUDA driver version is insufficient', None",
               "cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
    "first-use": ("FAIL_DRIVER, FAIL_FIRST_USE = None, 'cudaErrorLaunchFailure: unspecified launch failure'",
                  "cudaErrorLaunchFailure: unspecified launch failure"),
}

_RUN_BOTH = textwrap.dedent("""
    import json, sys
    from diffusiongemma.cli.main import main
    for backend in ("auto", "gpu"):
        rc = main(["generate", "And God said", "-n", "8", "--steps", "2", "--seed", "3", "--json", "--no-progress",
                   "--backend", backend])
        print("RC", backend, rc, flush=True)
        print("END", file=sys.stderr, flush=True)
""")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_cupy_falls_back_under_auto_and_is_named_under_gpu(tmp_path, case):
    first_lines, message = CASES[case]
    package = tmp_path / "fake" / "cupy"
    package.mkdir(parents=True)
    body = first_lines + "\n" + _WORKING_SURFACE if case in ("driver", "first-use") else first_lines + "\n"
    (package / "__init__.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), ROOT]))
    proc = subprocess.run([sys.executable, "-c", _RUN_BOTH], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert "RC auto 0" in out and "RC gpu 2" in out, proc.stdout + proc.stderr
    result = json.loads(out[0])
    assert result["backend"] == "cpu" and result["backend_choice"].startswith("auto") and result["token_ids"]
    auto_err, gpu_err = proc.stderr.split("END\n")[:2]
    notes = [line for line in auto_err.splitlines() if "note: --backend auto" in line]
    assert len(notes) == 1 and message in notes[0], auto_err  # one line, naming CuPy's message
    assert notes[0].endswith(("running on the CPU", "running on the compiled CPU path instead"))
    assert message in result["backend_choice"]
    gpu_lines = gpu_err.strip().splitlines()
    assert len(gpu_lines) == 1 and gpu_lines[0].startswith("diffusiongemma generate: error: --backend gpu: the GPU "
                                                           "failed: "), gpu_err
    assert message in gpu_lines[0], gpu_err


def test_auto_stays_quiet_when_there_is_no_gpu_to_take(capsys):
    """No note where nothing is broken: CuPy absent (this machine) or no GPU visible."""
    from diffusiongemma.cli import generate_cmd

    assert generate_cmd.auto_note("auto: no GPU (CuPy is not installed)") is None
    assert generate_cmd.auto_note("auto: no GPU (no CUDA GPU is visible)") is None
    assert generate_cmd.auto_note("auto: 1 GPU(s), GPU 0 = x") is None
    assert generate_cmd.auto_note("--backend cpu") is None
    note = generate_cmd.auto_note("auto: no GPU (CuPy cannot reach a CUDA GPU (driver too old))")
    assert note.endswith("the GPU is not usable (CuPy cannot reach a CUDA GPU (driver too old)); running on the CPU")
