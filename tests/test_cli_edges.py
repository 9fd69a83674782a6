"""Options that used to be silently ignored, and errors that used to be tracebacks or someone else's words.

Each case is one a new user hit: an option that changes nothing under the chosen semantics, a setting the
Python API refuses but the command line ran, a JSON record with impossible contents, a negative value read
as an option, a Ctrl-C during start-up, a full disk, a checkpoint replaced while it is being loaded. Every
one now takes effect, is refused with one line naming the option and the value, or is warned about by name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from diffusiongemma.checkpoint import default_model_dir
from diffusiongemma.cli.main import main

PROMPT = "And God said"


def _generate(capsys, *options):
    rc = main(["generate", "-n", "8", "--steps", "2", "--seed", "1", "--view", "plain", *options, PROMPT])
    return rc, capsys.readouterr()


# ------------------------------------------------------------------------------------------------ generate
def test_entropy_bound_under_a_semantics_without_it_is_named(capsys):
    """mlx-vlm's sampler is a confidence threshold: --entropy-bound changes nothing there, and says so."""
    rc, out = _generate(capsys, "--semantics", "mlx-vlm", "--entropy-bound", "0.5")
    assert rc == 0
    assert "--entropy-bound 0.5 has no effect under --semantics mlx-vlm" in out.err
    rc, out = _generate(capsys, "--entropy-bound", "0.5")  # the spec's sampler uses it: no warning
    assert rc == 0 and "no effect" not in out.err


def test_max_length_without_room_is_refused_with_or_without_n(capsys):
    """--max-length 3 with -n 32 used to give 32 tokens; the API refuses max_length=3 after a longer prompt."""
    for options in (["--max-length", "3", "-n", "32"], ["--max-length", "3"]):
        rc = main(["generate", "--steps", "2", "--seed", "1", "--view", "plain", *options, PROMPT])
        err = capsys.readouterr().err
        assert rc == 2, (options, err)
        assert "--max-length 3 leaves no room for new tokens after the" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ plot
def _record(C=4, steps=2, draft=None, committed=None) -> dict:
    draft = [[5] * C for _ in range(steps)] if draft is None else draft
    return {"canvas_length": C, "max_steps": steps, "canvases": [{
        "entropy": [[0.5] * C for _ in range(steps)], "accepted": [[1] * C for _ in range(steps)],
        "draft": draft, "temperature": [0.5] * steps, "committed": [5] * C if committed is None else committed}]}


def _plot(tmp_path, capsys, record, output="out.png"):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(record))
    rc = main(["plot", str(run), "-o", str(tmp_path / output)])
    return rc, capsys.readouterr().err


def test_plot_refuses_a_committed_list_longer_than_the_canvas(tmp_path, capsys):
    rc, err = _plot(tmp_path, capsys, _record(committed=[5] * 1000))
    assert rc == 2 and "canvas 0's 'committed' holds 1000 token ids (shape (1000,)) for canvas_length=4" in err
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize("bad", [-5, 10 ** 12])
def test_plot_refuses_draft_ids_outside_the_vocabulary(tmp_path, capsys, bad):
    """An OverflowError traceback from the tokenizer before; now the canvas, step and position."""
    draft = [[5, 5, 5, 5], [5, 5, bad, 5]]
    rc, err = _plot(tmp_path, capsys, _record(draft=draft), output="run.html")
    assert rc == 2, err
    assert f"canvas 0's 'draft' holds token id {bad} at step 1 position 2" in err
    assert "Traceback" not in err and not (tmp_path / "run.html").exists()


# ------------------------------------------------------------------------------------------------ seeds
@pytest.mark.parametrize("value", ["-1", str(2 ** 70), "2**70"])
def test_crosscheck_seed_out_of_range_is_refused_by_name(capsys, value):
    with pytest.raises(SystemExit) as info:
        main(["crosscheck", "mlx-vlm", "--seed", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --seed: expected an integer seed in [0, 2**64)" in err and value in err


# ------------------------------------------------------------------------------------------------ convert
@pytest.mark.parametrize("entry", ["diffusiongemma-convert", "diffusiongemma convert"])
def test_negative_shard_size_is_named(tmp_path, capsys, entry):
    from diffusiongemma.weights_converter import cli

    argv = [str(tmp_path / "src"), str(tmp_path / "dst"), "--shard-size", "-1MB"]
    with pytest.raises(SystemExit) as info:
        cli.main(argv) if entry == "diffusiongemma-convert" else main(["convert", *argv])
    assert info.value.code == 2
    assert "argument --shard-size: size must be positive, got '-1MB'" in capsys.readouterr().err


_INTERRUPT_AT_NUMPY = """
import sys
class Interrupt:  # a Ctrl-C arriving while the converter imports its libraries
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupt())
from diffusiongemma.weights_converter.cli import main  # what the diffusiongemma-convert script runs
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_converter_start_up_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_NUMPY, str(tmp_path / "src"), str(tmp_path / "dst")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip() == "diffusiongemma-convert: interrupted; nothing was written"
    assert not (tmp_path / "dst").exists()


def test_ctrl_c_while_parsing_the_converter_arguments(tmp_path, monkeypatch, capsys):
    from diffusiongemma.weights_converter import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        rc = cli.main([str(tmp_path / "src"), str(tmp_path / "dst")])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped diffusiongemma-convert's main")
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ trace
def test_trace_onto_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys):
    """safetensors reports ENOSPC as a SafetensorError; the command names -o and the cause, leaves no file."""
    import safetensors.numpy
    from safetensors import SafetensorError

    def full_disk(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    out = tmp_path / "run.trace"
    rc = main(["trace", "--prompt-ids", "2,818,7", "--steps", "1", "-n", "8", "--no-layers", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"-o/--output {str(out)!r}: the trace could not be written (No space left on device)" in err
    assert "Traceback" not in err and not out.exists() and os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------ replace
@pytest.fixture()
def two_versions(tmp_path):
    """Two copies of the shipped checkpoint told apart by their tokenizer's BOS string and their rms_norm_eps."""
    versions = {}
    for name, eps in (("a", 1e-6), ("b", 3e-6)):
        folder = tmp_path / name
        shutil.copytree(default_model_dir(), folder)
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        config["bos_token"] = f"<bos-{name}>"
        config_file.write_text(json.dumps(config))
        config_file = folder / "config.json"  # the shipped model is a transformers directory
        config = json.loads(config_file.read_text())
        config["text_config"]["rms_norm_eps"] = eps
        config_file.write_text(json.dumps(config))
        versions[name] = str(folder)
    return versions


def _swap_in(path: str, new: str, delete_old_files: bool) -> None:
    """What convert --force does: the new directory takes the name, the old one is deleted file by file."""
    old = path + ".old"
    os.rename(path, old)
    os.rename(new, path)
    if delete_old_files:  # the reader still holds the old directory open; its weight files go first
        for name in os.listdir(old):
            if name.endswith(".safetensors"):
                os.remove(os.path.join(old, name))


@pytest.mark.parametrize("delete_old_files", [False, True])
def test_a_replace_between_tokenizer_and_weights_gives_one_version(two_versions, monkeypatch, delete_old_files):
    """The tokenizer and the weights come from the same version even when a replace lands between the two
    reads; a read that failed because the old files vanished ("weight file ... is missing") is retried."""
    from diffusiongemma import checkpoint

    path, real_load_model = two_versions["a"], checkpoint.load_model
    calls = []

    def replaced_during_load(where, backend="reference", dtype="float32"):
        calls.append(where)
        if len(calls) == 1:
            _swap_in(path, two_versions["b"], delete_old_files)
        return real_load_model(where, backend, dtype)

    monkeypatch.setattr(checkpoint, "load_model", replaced_during_load)
    text_side, model = checkpoint.load_checkpoint(path)
    assert len(calls) == 2  # read again after the replace
    assert (text_side.bos_token, model.config.rms_norm_eps) == ("<bos-b>", 3e-6)


def test_a_replace_that_never_ends_is_reported_as_such(two_versions, monkeypatch):
    from diffusiongemma import checkpoint

    path, real_load_model = two_versions["a"], checkpoint.load_model

    def always_replaced(where, backend="reference", dtype="float32"):
        os.utime(path)  # the checkpoint at path changes during every read
        return real_load_model(where, backend, dtype)

    monkeypatch.setattr(checkpoint, "load_model", always_replaced)
    with pytest.raises(checkpoint.CheckpointReplaced, match=r"was replaced while it was being read, 3 times"):
        checkpoint.load_checkpoint(path)


def test_generate_loads_tokenizer_and_weights_through_one_pinned_version(two_versions, monkeypatch, capsys):
    """The command line uses load_checkpoint: a replace during its load does not pair two versions."""
    from diffusiongemma import checkpoint

    path, real_load_model = two_versions["a"], checkpoint.load_model
    calls, seen = [], []

    def replaced_during_load(where, backend="reference", dtype="float32"):
        calls.append(where)
        if len(calls) == 1:
            _swap_in(path, two_versions["b"], delete_old_files=True)
        model = real_load_model(where, backend, dtype)
        seen.append(model.config.rms_norm_eps)
        return model

    monkeypatch.setattr(checkpoint, "load_model", replaced_during_load)
    rc = main(["generate", "--model", path, "-n", "8", "--steps", "1", "--seed", "1", "--view", "plain", PROMPT])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert len(calls) == 2 and seen == [3e-6]  # the first read failed on the deleted files and was retried


# ------------------------------------------------------------------------------------------------ the API
@pytest.fixture(scope="module")
def shipped():
    from diffusiongemma.reference import GenerationConfig, Model

    path = default_model_dir()
    return Model.from_pretrained(path), GenerationConfig.from_pretrained(path).replace(max_new_tokens=8,
                                                                                        max_denoising_steps=1)


@pytest.mark.parametrize("callback", [42, "on_step", print, object()])
def test_a_callback_without_callback_methods_is_refused(shipped, callback):
    """callback=42 used to be accepted and never called; a function (not an object with on_step etc.) too."""
    from diffusiongemma.reference import InputError, generate

    model, settings = shipped
    with pytest.raises(InputError, match=r"callback must be None or an object with .*on_step.*, got "):
        generate(model, [[2, 818, 7]], generation_config=settings, random=0, callback=callback)


def test_a_callback_method_that_is_not_callable_is_refused(shipped):
    from diffusiongemma.reference import InputError, generate

    class Half:
        on_step = 5

        def on_canvas(self, info):
            pass

    with pytest.raises(InputError, match=r"callback\.on_step is int, not a method"):
        generate(shipped[0], [[2, 818, 7]], generation_config=shipped[1], random=0, callback=Half())


@pytest.mark.parametrize("seed", [-1, -(2 ** 70)])
def test_a_negative_seed_is_named(shipped, seed):
    """NumPy's "expected non-negative integer" before; now the argument and the value."""
    from diffusiongemma.reference import InputError, generate

    with pytest.raises(InputError, match=rf"random: an integer seed must be >= 0, got {seed}"):
        generate(shipped[0], [[2, 818, 7]], generation_config=shipped[1], random=seed)
