"""The command-line entries of the llama.cpp work: ``diffusiongemma convert MODEL out.gguf --gguf-type`` and
``diffusiongemma crosscheck llama.cpp`` (their registration in weights_converter/cli.py and
diffusiongemma/crosscheck/cli.py)."""

from __future__ import annotations

import subprocess
import sys

from diffusiongemma.checkpoint import default_model_dir
from diffusiongemma.crosscheck.llama_cpp_peer import LLAMA_CPP_COMMIT
from diffusiongemma.weights_converter.gguf import GGUFCheckpoint

CLI = [sys.executable, "-m", "diffusiongemma"]


def test_convert_command_writes_gguf(tmp_path):
    out = tmp_path / "m.gguf"
    done = subprocess.run(CLI + ["convert", default_model_dir(), str(out), "--gguf-type", "q8_0"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert GGUFCheckpoint.open(str(out)).tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    again = subprocess.run(CLI + ["convert", default_model_dir(), str(out)], capture_output=True, text=True)
    assert again.returncode == 1 and "already exists" in again.stderr and "Traceback" not in again.stderr
    bad = subprocess.run(CLI + ["convert", default_model_dir(), str(out), "--gguf-type", "q4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--gguf-type" in bad.stderr


def test_crosscheck_command_is_registered():
    done = subprocess.run(CLI + ["crosscheck", "llama.cpp"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and LLAMA_CPP_COMMIT in done.stderr and "Traceback" not in done.stderr
