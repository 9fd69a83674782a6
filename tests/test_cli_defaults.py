"""The command line's defaults (#33): the fastest usable backend unless one is asked for, with the choice printed
and the reference's tokens."""

from __future__ import annotations

import json
import sys

import pytest

from diffusiongemma.cli import generate_cmd
from diffusiongemma.cli.main import main

SMALL = ["--max-new-tokens", "64", "--steps", "6", "--no-progress"]


def run_json(capsys, *args) -> dict:
    assert main(["generate", *args, "--json", *SMALL]) == 0
    return json.loads(capsys.readouterr().out)


def _cupy_sees_a_gpu() -> bool:
    try:
        from diffusiongemma.fast.gpu.device import gpu_available
    except ImportError:
        return False
    return gpu_available()[0]


@pytest.mark.parametrize("seed", ["0", "5", "11"])
def test_the_default_backend_is_the_fastest_here_and_gives_the_reference_tokens(capsys, seed):
    auto = run_json(capsys, "And God said", "--seed", seed)
    assert auto["backend"] == ("gpu" if _cupy_sees_a_gpu() else "cpu"), auto["backend_choice"]
    assert auto["backend_choice"].startswith("auto")
    ref = run_json(capsys, "And God said", "--seed", seed, "--backend", "reference")
    assert ref["backend"] == "reference" and ref["backend_choice"] == "--backend reference"
    assert auto["token_ids"] == ref["token_ids"] and auto["steps_per_canvas"] == ref["steps_per_canvas"]


def test_the_backend_that_ran_is_printed(capsys):
    assert main(["generate", "And God said", "--seed", "1", *SMALL]) == 0
    err = capsys.readouterr().err
    expected = "gpu" if _cupy_sees_a_gpu() else "cpu"
    assert f"backend {expected} (auto)]" in err, err
    assert main(["generate", "And God said", "--seed", "1", "--backend", "reference", *SMALL]) == 0
    assert "backend reference]" in capsys.readouterr().err


def test_auto_falls_back_to_the_reference_without_the_compiled_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusiongemma.fast", None)  # `import diffusiongemma.fast` raises ImportError
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # no CuPy
    backend, why = generate_cmd.choose_backend("auto")
    assert backend == "reference" and "CuPy is not installed" in why and "failed to import" in why


def test_auto_takes_a_usable_gpu(monkeypatch):
    import diffusiongemma.fast.gpu.device as device

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    monkeypatch.setattr(device, "gpu_available", lambda: (True, "1 GPU(s), GPU 0 = test"))
    assert generate_cmd.choose_backend("auto") == ("gpu", "auto: 1 GPU(s), GPU 0 = test")
    monkeypatch.setattr(device, "gpu_available", lambda: (False, "no CUDA GPU is visible"))
    assert generate_cmd.choose_backend("auto") == ("cpu", "auto: no GPU (no CUDA GPU is visible)")


def test_an_explicit_backend_is_kept():
    for name in ("reference", "cpu", "gpu", "gpu-sim"):
        assert generate_cmd.choose_backend(name)[0] == name


def test_greedy_and_semantics_run_on_the_reference_under_auto(capsys):
    assert run_json(capsys, "And God said", "--seed", "2", "--greedy")["backend"] == "reference"
    assert run_json(capsys, "And God said", "--seed", "2", "--semantics", "jax")["backend"] == "reference"


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "-n", "0"], "diffusiongemma generate: error: argument -n/--max-new-tokens: expected a positive "
                                    "integer, got 0"),
    (["generate", "hi", "--backend", "tpu"], "diffusiongemma generate: error: argument --backend: invalid choice: 'tpu'"),
    (["convert"], "diffusiongemma convert: error: the following arguments are required"),
    (["generat", "hi"], "diffusiongemma: error: argument COMMAND: invalid choice: 'generat'"),
])
def test_an_argument_error_is_one_line_and_a_hint(capsys, args, message):
    """#33: `-n 0` printed argparse's 11-line usage block before the error."""
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith(message), lines
    assert lines[1].endswith("--help lists the options)") and "usage:" not in lines[0]


def test_convert_draws_no_progress_bar_into_a_stderr_that_is_not_a_terminal(tmp_path, capsys):
    """#33: `convert` drew its tqdm bar (carriage returns and all) into redirected stderr."""
    from tests.hf_tiny import save_tiny, tiny_model
    from diffusiongemma.weights_converter.cli import show_progress

    src = save_tiny(tiny_model(seed=0), tmp_path / "hf")
    capsys.readouterr()  # transformers' own bars while the source is saved
    assert main(["convert", src, str(tmp_path / "quiet")]) == 0
    assert capsys.readouterr().err == ""
    assert main(["convert", src, str(tmp_path / "asked"), "--progress"]) == 0
    assert "\r" in capsys.readouterr().err  # asked for: drawn anyway

    class Terminal:
        def isatty(self):
            return True
    assert show_progress(None, Terminal()) and not show_progress(False, Terminal())
    assert not show_progress(None, open(tmp_path / "log", "w"))


def _readme_block(marker: str) -> str:
    import os
    import re

    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    with open(readme, encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.DOTALL)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"README: {len(found)} bash blocks hold {marker!r}"
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("marker,expected", [("tiny-q8_0.gguf", "And God said"), ("tiny-chat", "")])
def test_the_readmes_shipped_model_examples_run_from_any_folder(tmp_path, marker, expected):
    """#33: the README's `convert diffusiongemma/assets/tiny-kjv tiny-q8_0.gguf` worked only from the clone's
    root, and its --chat example needed a checkpoint with a chat template. Both blocks run as written in an
    empty folder elsewhere."""
    import os
    import subprocess

    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", _readme_block(marker)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(line.startswith(expected) and len(line.strip()) > len(expected)  # the generated text
               for line in proc.stdout.splitlines()), proc.stdout
    assert "tokens in" in proc.stderr and "Traceback" not in proc.stderr


def test_the_converters_own_command_has_one_line_errors_too(capsys):
    from diffusiongemma.weights_converter.cli import main as convert_main

    with pytest.raises(SystemExit) as info:
        convert_main(["src", "dst", "--gguf-type", "q4"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["diffusiongemma-convert: error: argument --gguf-type: invalid choice: 'q4' (choose from "
                     "'f32', 'f16', 'q8_0')", "(diffusiongemma-convert --help lists the options)"]
