"""The command line end to end on the shipped model, and its error handling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from diffusiongemma.checkpoint import default_model_dir, load_text_side
from diffusiongemma.cli.main import main

SMALL = ["--max-new-tokens", "40", "--steps", "6", "--no-progress"]


def run_json(capsys, *args) -> dict:
    assert main(["generate", *args, "--json", *SMALL]) == 0
    return json.loads(capsys.readouterr().out)


def test_shipped_model_is_present_and_small():
    path = default_model_dir()
    assert os.path.isfile(os.path.join(path, "config.json")), f"shipped model missing at {path}"
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size < 25 * 2**20, f"shipped model is {size / 2**20:.1f} MiB"


def test_generate_json_end_to_end(capsys):
    from diffusiongemma.reference.generate import GenerationConfig, generate
    from diffusiongemma.reference.model import Model

    out = run_json(capsys, "And God said", "--seed", "3")
    path = default_model_dir()
    model = Model.from_pretrained(path)
    C = model.config.canvas_length
    assert len(out["token_ids"]) == C * len(out["steps_per_canvas"]) and len(out["token_ids"]) <= 2 * C
    assert all(1 <= s <= 6 for s in out["steps_per_canvas"])
    assert out["tokens_per_forward"] > 0 and out["timings"]["tokens_per_s"] > 0
    assert out["timings"]["load_s"] < out["timings"]["first_step_s"]  # the first step's result comes after loading
    assert out["settings"]["max_denoising_steps"] == 6
    # The CLI's tokens are exactly what the library produces for the same prompt, settings and seed.
    side = load_text_side(path)
    ids = side.encode("And God said")
    assert out["prompt_token_ids"] == ids
    settings = GenerationConfig.from_pretrained(path).replace(max_new_tokens=40, max_denoising_steps=6)
    result = generate(model, np.array([ids]), generation_config=settings, random=3)
    assert out["token_ids"] == [int(t) for t in result.sequences[0, len(ids):]]
    assert out["text"] == side.decode(out["token_ids"])


def test_seed_changes_output_and_is_reproducible(capsys):
    a = run_json(capsys, "In the beginning", "--seed", "1")
    b = run_json(capsys, "In the beginning", "--seed", "1")
    c = run_json(capsys, "In the beginning", "--seed", "2")
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_plain_output_and_stats(capsys):
    assert main(["generate", "And the LORD spake", *SMALL]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("And the LORD spake")
    assert "tokens/s" in captured.err and "tokens per forward" in captured.err


def test_live_view_redraws_in_place(capsys):
    assert main(["generate", "And God said", "--view", "live", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "\x1b[J" in out and "step 1" in out and "committed" in out


@pytest.mark.slow
def test_console_script_installed():
    exe = shutil.which("diffusiongemma")
    assert exe is not None, "the diffusiongemma console script is not on PATH (pip install -e .)"
    proc = subprocess.run([exe, "generate", "And God said", "--json", *SMALL], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"]


@pytest.mark.parametrize("args,message", [
    (["generate", "   "], "prompt is empty"),
    (["generate", "hi", "--model", "/nonexistent/dir"], "-m/--model /nonexistent/dir: no such file or directory"),
    (["generate", "hi", "--model", "google/diffusiongemma-26B-A4B-it"], "nothing is downloaded at run time"),
    (["trace", "--prompt", "hi", "-o", "unused.trace", "--model", "google/x"], "nothing is downloaded at run time"),
    (["generate", "hi", "--greedy", "--backend", "cpu"], "--greedy (--temp 0) runs on the reference's"),
])
def test_errors_exit_2_with_message(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_malformed_model_directory(tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(default_model_dir(), broken)
    (broken / "config.json").write_text("{ not json")
    assert main(["generate", "hi", "--model", str(broken), *SMALL]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--backend", "tpu"], "invalid choice: 'tpu'"),
    (["generate", "hi", "--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["generate", "hi", "--t-min", "-1"], "--t-min: expected a finite number >= 0, got '-1'"),
    (["generate", "hi", "--view", "fancy"], "invalid choice: 'fancy'"),
])
def test_bad_option_values_are_rejected(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_chat_template(tmp_path, capsys):
    chat = tmp_path / "chat"
    shutil.copytree(default_model_dir(), chat)
    (chat / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<model> {% endif %}")
    out = run_json(capsys, "Who made the light?", "--chat", "--model", str(chat), "--seed", "2")
    assert out["prompt_text"].endswith("<user> Who made the light?\n<model> ")
    assert main(["generate", "Who made the light?", "--chat", "--model", str(chat), "--seed", "2", *SMALL]) == 0
    printed = capsys.readouterr().out
    assert printed == out["text"] + "\n"  # the reply only, not the templated prompt


def test_greedy_proposes_argmaxes(capsys, monkeypatch):
    """--temp 0 and --greedy: every position proposes its argmax (each step's draws are its draft), while
    the checkpoint's temperature schedule still sets the entropies; without them the draws are sampled."""
    from diffusiongemma.cli import progress

    steps = []

    class Spy(progress.Fanout):
        def on_step(self, info):
            steps.append((np.array(info.sampled), np.array(info.draft), info.temperature))
            self.__getattr__("on_step")(info)

    monkeypatch.setattr(progress, "Fanout", Spy)
    greedy = run_json(capsys, "And God said", "--seed", "5", "--greedy")
    greedy_steps, steps[:] = list(steps), []
    assert run_json(capsys, "And God said", "--seed", "5", "--temp", "0")["token_ids"] == greedy["token_ids"]
    steps[:] = []
    sampled = run_json(capsys, "And God said", "--seed", "5")
    assert greedy_steps and all((draws == draft).all() for draws, draft, _ in greedy_steps)
    assert not all((draws == draft).all() for draws, draft, _ in steps)
    assert len({temp for _, _, temp in greedy_steps}) > 1  # the schedule, not one temperature
    assert greedy["token_ids"] != sampled["token_ids"]


def test_chat_without_template_is_an_error(tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(default_model_dir(), bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = bare / "tokenizer_config.json"
    if config.exists():
        data = json.loads(config.read_text())
        data.pop("chat_template", None)
        config.write_text(json.dumps(data))
    assert main(["generate", "hi", "--chat", "--model", str(bare), *SMALL]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_cpu_backend_gives_the_reference_tokens(capsys):
    ref = run_json(capsys, "And God said", "--seed", "4", "--backend", "reference")
    assert ref["backend"] == "reference"
    cpu = run_json(capsys, "And God said", "--seed", "4", "--backend", "cpu")
    assert cpu["backend"] == "cpu" and cpu["token_ids"] == ref["token_ids"]


def test_gpu_backend_without_cupy_is_a_clear_error(capsys):
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here; the GPU suite (tests/test_gpu_*.py) covers this backend")
    assert main(["generate", "hi", "--backend", "gpu", *SMALL]) == 2
    assert "needs CuPy" in capsys.readouterr().err
