"""Misuse at the edges of the command line and the Python API, and sizes checked before anything is allocated.

Each case is one a trial of inputs no earlier test had tried found ending in a traceback, a MemoryError or
someone else's words: a configuration whose sizes the fast path allocated before checking them, a batch
too large for memory, ragged id lists, a model that is not a model, numbers finite in float64 but not in
float32, impossible trace records, a configuration altered after recording, a disk that fills up, a
``--llama-bin`` that is not llama.cpp. Each now gets one line naming the path, option, field or value.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest

from diffusiongemma import fast
from diffusiongemma.reference.generate import generate as reference_generate
from diffusiongemma.reference.model import Model as ReferenceModel
from diffusiongemma.reference.support.errors import InputError
from tests.random_weights import make_config, random_tensors

CONFIG = make_config()  # V=128, C=16, W=8, layers S,S,F,S,F
TENSORS = random_tensors(CONFIG, 0)
LIMIT = 2 ** 31 - 1  # the largest max_position_embeddings a configuration may declare (int32 positions)


# ------------------------------------------------------------------------------------------------ sizes first
def _before_but(message: str) -> str:
    """The estimate part of a memory refusal (the free-memory number after "but" varies from call to call)."""
    return message.split(" but ")[0]


def test_a_huge_canvas_is_refused_with_the_byte_estimate_on_every_backend():
    """canvas_length 2^30: the fast path allocated its (B, C, V) logits buffer (512 GiB) before the loop's
    budget check and died in a MemoryError; now every backend gives the reference's estimate."""
    config = dataclasses.replace(CONFIG, canvas_length=2 ** 30, max_position_embeddings=LIMIT)
    messages = []
    for model, run in ((ReferenceModel(config, TENSORS), reference_generate), (fast.Model(config, TENSORS), fast.generate)):
        with pytest.raises(InputError) as error:
            run(model, np.full((1, 4), 5), max_new_tokens=32)
        messages.append(_before_but(str(error.value)))
    assert messages[0] == messages[1]
    assert re.search(r"this run needs about [\d,]{17,} bytes \(\d+\.\d\d GiB: KV cache, logits and activations for "
                     r"a 4-token prompt and 1 canvas\(es\) of 1073741824, 1 row\(s\)\)", messages[0]), messages[0]


def test_a_huge_sliding_window_costs_nothing_up_front():
    """sliding_window 2^31 - 1: the fast cache allocated W - 1 ring slots per sliding layer at once (256 GiB);
    its rings now grow with the positions, so the run gives the reference's tokens."""
    config = dataclasses.replace(CONFIG, sliding_window=LIMIT, max_position_embeddings=LIMIT)
    ids = np.random.default_rng(0).integers(3, 125, (2, 5))
    want = reference_generate(ReferenceModel(config, TENSORS), ids, max_new_tokens=32, max_denoising_steps=3)
    model = fast.Model(config, TENSORS)
    got = fast.generate(model, ids, max_new_tokens=32, max_denoising_steps=3)
    np.testing.assert_array_equal(got.sequences, want.sequences)
    cache = model.new_cache(2)
    model.encode(ids, cache)
    assert max(k.shape[2] for k in cache.keys) == cache.capacity < 64  # no ring of 2^31 - 2 slots


def test_a_ring_that_grows_keeps_the_reference_cache():
    """Rings allocated lazily, grown past W - 1 over several encode calls: the same keys as the reference."""
    model, ref = fast.Model(CONFIG, TENSORS), ReferenceModel(CONFIG, TENSORS)
    cache, ref_cache = model.new_cache(1), ref.new_cache(1)
    for n in (3, 2, 6, 1):  # positions 0..11 with W - 1 = 7 slots
        ids = np.full((1, n), 7 + n)
        model.encode(ids, cache)
        ref.encode(ids, ref_cache)
    back = cache.to_reference()
    for layer in range(CONFIG.num_hidden_layers):
        np.testing.assert_allclose(back.keys[layer], ref_cache.keys[layer], rtol=1e-4, atol=1e-5)


def test_a_batch_too_large_for_memory_is_refused_before_allocating(monkeypatch):
    """``fast.generate(model, np.full((10**6, 4), 5), ...)`` on the shipped model (V = 4096, C = 32) asked
    NumPy for a 488 GiB logits buffer before the budget check; now it is the reference's refusal."""
    from diffusiongemma.checkpoint import default_model_dir

    monkeypatch.setattr("diffusiongemma.reference.support.checks.available_memory", lambda: 2 ** 30)
    monkeypatch.setattr("diffusiongemma.fast.cache.available_memory", lambda: 2 ** 30, raising=False)
    model = fast.Model.from_pretrained(default_model_dir())
    with pytest.raises(InputError, match=r"this run needs about [\d,]+ bytes .*1000000 row\(s\)\) but "
                                         r"1,073,741,824 bytes"):
        fast.generate(model, np.full((10 ** 6, 4), 5), max_new_tokens=32)
    cache = model.new_cache(10 ** 6)  # the API's own calls: the encoder's pass and the cache's growth
    with pytest.raises(InputError, match=r"^encoding input_ids \(1000000 x 4 tokens\) needs about [\d,]+ bytes"):
        model.encode(np.full((10 ** 6, 4), 5), cache)
    with pytest.raises(InputError, match=r"^the KV cache for 1000000 row\(s\) and 1,024 positions needs about"):
        cache.reserve(1000)
    assert cache.capacity == 0


def test_the_gpu_path_refuses_a_huge_canvas_before_allocating():
    """The same on the GPU path (cuda-sim): its (B, C, V) device buffer was allocated before the budget check;
    the check now asks the cache's device how much memory it has free."""
    from diffusiongemma.fast import gpu
    from diffusiongemma.fast.gpu.sim import SimDevice

    config = dataclasses.replace(CONFIG, canvas_length=2 ** 30, max_position_embeddings=LIMIT)
    model = gpu.Model(config, TENSORS, device=SimDevice(checks=False))
    with pytest.raises(InputError, match=r"this run needs about [\d,]{17,} bytes .*canvas\(es\) of 1073741824"):
        gpu.generate(model, np.full((1, 4), 5), max_new_tokens=32)


# ------------------------------------------------------------------------------------------------ user's path
def _model_copy(tmp_path, **text_config):
    """The shipped model's directory in ``tmp_path`` (weights linked, not copied) with text_config changes."""
    import json
    import os

    from diffusiongemma.checkpoint import default_model_dir

    source, target = default_model_dir(), tmp_path / "my model"
    target.mkdir()
    for name in os.listdir(source):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(source, name), target / name)
        elif name != "config.json":
            (target / name).write_bytes(open(os.path.join(source, name), "rb").read())
    config = json.load(open(os.path.join(source, "config.json")))
    config["text_config"].update(text_config)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("change", [{"hidden_size": -1}, {"rms_norm_eps": "x"}, None])
def test_cli_errors_name_the_users_directory_not_the_handle(tmp_path, capsys, change):
    """The command reads a checkpoint through one directory handle (/proc/self/fd/N); its errors said so."""
    from diffusiongemma.cli.main import main

    model = _model_copy(tmp_path, **(change or {}))
    if change is None:
        (model / "config.json").write_text("{not json")
    rc = main(["generate", "-m", str(model), "-n", "8", "--steps", "2", "--view", "plain", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "/proc/self/fd" not in err
    assert f"{model}/config.json" in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("option,value,expected", [
    ("--temp", "1e308", "argument --temp: '1e308' is beyond float32's largest number"),
    ("--entropy-bound", "1e308", "argument --entropy-bound: '1e308' is beyond float32's largest number"),
    ("--t-max", "3.5e38", "argument --t-max: '3.5e38' is beyond float32's largest number"),
    ("--entropy-bound", "1e-50", "argument --entropy-bound: '1e-50' is below float32's smallest positive number"),
    ("--entropy-bound", "-inf", "argument --entropy-bound: expected a finite number > 0, got '-inf'"),
    ("--temp", "-1e5", "argument --temp: expected a finite number >= 0, got '-1e5'"),
    ("--temp", "-nan", "argument --temp: expected a finite number >= 0, got '-nan'"),
])
def test_numbers_beyond_float32_or_signed_are_refused_naming_the_option(capsys, option, value, expected):
    """1e308 is finite in float64 but not in float32, in which every backend computes: it ran on with NumPy's
    RuntimeWarning. ``-inf`` looked like an option to argparse ("expected one argument")."""
    from diffusiongemma.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "-n", "8", "--steps", "2", "--view", "plain", option, value, "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and expected in err, err
    assert "expected one argument" not in err


def test_signed_values_are_joined_only_after_options_that_take_one():
    from diffusiongemma.cli.argtypes import join_signed_values
    from diffusiongemma.cli.main import build_parser

    parser = build_parser()
    argv = ["generate", "--temp", "-inf", "--greedy", "-1e5", "-n", "-2e3", "--", "--temp", "-inf"]
    assert join_signed_values(parser, argv) == ["generate", "--temp=-inf", "--greedy", "-1e5", "-n=-2e3", "--",
                                                "--temp", "-inf"]
    assert join_signed_values(parser, ["generate", "--temp", "0.5", "-m", "-dir"]) == [
        "generate", "--temp", "0.5", "-m", "-dir"]


# ------------------------------------------------------------------------------------------------ Python API misuse
@pytest.mark.parametrize("run", [reference_generate, fast.generate], ids=["reference", "fast"])
def test_ragged_ids_and_masks_are_named_input_errors(run):
    """A list of rows of different lengths gave NumPy's "inhomogeneous shape" ValueError."""
    model = fast.Model(CONFIG, TENSORS) if run is fast.generate else ReferenceModel(CONFIG, TENSORS)
    with pytest.raises(InputError, match=r"^input_ids has rows of different lengths \(2, 1\); pad them"):
        run(model, [[5, 6], [7]], max_new_tokens=16)
    with pytest.raises(InputError, match=r"^attention_mask has rows of different lengths \(2, 1\)"):
        run(model, [[5, 6], [7, 8]], attention_mask=[[1, 1], [1]], max_new_tokens=16)
    with pytest.raises(InputError, match=r"^input_ids has rows of different lengths \(1, 3\)"):
        model.encode([[5], [6, 7, 8]], model.new_cache(2))


@pytest.mark.parametrize("model,expected", [
    (None, r"^model must be a loaded DiffusionGemma model \(Model.from_pretrained\(path\)\), got None$"),
    ("path/to/model", r"^model is the path 'path/to/model', not a model: pass a loaded model, e\.g\. "
                      r"Model.from_pretrained\('path/to/model'\)$"),
    (__import__("pathlib").Path("ckpt"), r"^model is the path 'ckpt', not a model"),
    (object(), r"^model must be a loaded DiffusionGemma model .*got object$"),
])
def test_generate_without_a_loaded_model_says_what_to_pass(model, expected):
    """``generate(None, ...)`` and ``generate("path", ...)`` ended in ``AttributeError ... 'config'``."""
    for run in (reference_generate, fast.generate):
        with pytest.raises(InputError, match=expected):
            run(model, [[5, 6]], max_new_tokens=16)


# ------------------------------------------------------------------------------------------------ plot records
def _run_record(**changes) -> dict:
    """A well-formed ``generate --json`` denoising record of one canvas (C = 4, 2 steps), with changes:
    ``entropy``/``accepted``/``temperature`` replace one entry of step 1, other keys replace top-level fields."""
    canvas = {"entropy": [[0.5] * 4, [0.2] * 4], "accepted": [[0, 1, 0, 1], [1] * 4], "draft": [[5] * 4] * 2,
              "temperature": [0.8, 0.4], "committed": [5] * 4}
    record = {"canvas_length": 4, "max_steps": 2, "canvases": [canvas]}
    for key, value in changes.items():
        if key == "temperature":
            canvas[key][1] = value
        elif key in canvas:
            canvas[key][1][2] = value
        else:
            record[key] = value
    return record


@pytest.mark.parametrize("changes,expected", [
    ({"entropy": float("nan")}, "canvas 0's 'entropy' holds nan at step 1 position 2; an entropy is a finite number"),
    ({"entropy": -3.0}, "canvas 0's 'entropy' holds -3.0 at step 1 position 2"),
    ({"entropy": float("inf")}, "canvas 0's 'entropy' holds inf at step 1 position 2"),
    ({"temperature": -0.5}, "canvas 0's 'temperature' holds -0.5 at step 1; a temperature is a finite number >= 0"),
    ({"accepted": 7}, "canvas 0's 'accepted' holds 7; each entry is 0 (renoised) or 1 (accepted)"),
    ({"accepted": "yes"}, "canvas 0's 'accepted' holds '"),
    ({"max_steps": -1}, "max_steps must be an integer >= 1, got -1"),
    ({"canvas_length": 2.5}, "canvas_length must be an integer >= 1, got 2.5"),
    ({"canvas_length": True}, "canvas_length must be an integer >= 1, got True"),
])
def test_plot_refuses_impossible_records_naming_the_field(tmp_path, capsys, changes, expected):
    """NaN entropies, a negative temperature, an accepted flag of 7 and max_steps -1 were drawn as given."""
    import json

    from diffusiongemma.cli.main import main

    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run_record(**changes)))
    for output in ("out.png", "out.html"):
        rc = main(["plot", str(run), "-o", str(tmp_path / output)])
        err = capsys.readouterr().err
        assert rc == 2 and f"{run}: " in err and expected in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / output).exists()


def test_plot_record_checks_accept_what_a_run_writes():
    from diffusiongemma import plot

    record = plot.DenoisingRecord.from_json(_run_record(temperature=None))
    assert record.canvases[0].accepted.tolist() == [[False, True, False, True], [True] * 4]
    assert np.isnan(record.canvases[0].temperatures[1])


def _full_disk_after(limit: int):
    """A stand-in for ``open`` whose files take ``limit`` bytes and then fail as a full disk does."""
    import builtins
    import errno

    class Full:
        def __init__(self, handle):
            self.handle, self.written = handle, 0

        def write(self, data):
            room = limit - self.written
            if len(data) > room:
                self.handle.write(data[:room])
                self.handle.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(data)
            return self.handle.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    return lambda path, mode="r", **kwargs: Full(builtins.open(path, mode, **kwargs))


@pytest.mark.parametrize("output", ["p.html", "p.png"])
def test_plot_onto_a_full_disk_names_the_file_and_leaves_nothing(tmp_path, capsys, monkeypatch, output):
    """``plot -o p.html`` on a full disk printed ``[Errno 28]`` without the file name and left 8 KiB of page
    under the final name (it wrote straight to the target)."""
    import json

    from diffusiongemma import plot
    from diffusiongemma.cli.main import main

    run = tmp_path / "in" / "run.json"
    run.parent.mkdir()
    run.write_text(json.dumps(_run_record()))
    out = tmp_path / "out" / output
    out.parent.mkdir()
    full = _full_disk_after(1024)
    monkeypatch.setattr("diffusiongemma.cli.plot_cmd.open", full, raising=False)
    monkeypatch.setattr(plot, "save_figure", lambda fig, path: full(path, "wb").__enter__().write(b"\0" * 10000))
    rc = main(["plot", str(run), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"-o/--output {str(out)!r}: the " in err and "could not be written: no space left on device" in err
    assert len(err.strip().splitlines()) == 1 and os.listdir(out.parent) == []


# ------------------------------------------------------------------------------------------------ crosscheck llama.cpp
def test_crosscheck_with_a_binary_that_prints_nothing_says_it_is_not_llama_cpp(capsys):
    """``--llama-bin /bin/true`` was reported as "DIFFER ... 0 tokens", as if llama.cpp had disagreed."""
    import shutil

    from diffusiongemma.cli.main import main

    true = shutil.which("true")
    rc = main(["crosscheck", "llama.cpp", "--llama-bin", true, "-n", "32"])
    out, err = capsys.readouterr()
    assert rc == 2 and "DIFFER" not in out, out + err
    assert f"--llama-bin {true} exited 0 but printed no reply (no output;" in err
    assert "it is not llama.cpp's llama-diffusion-cli" in err


def test_crosscheck_stops_a_binary_that_never_exits(tmp_path, capsys, monkeypatch):
    """A binary that hangs was waited on silently for up to 900 s; now notices on stderr, and an error naming
    the binary and --llama-timeout when it runs past it (its children are stopped too)."""
    import time

    from diffusiongemma.cli.main import main
    from diffusiongemma.crosscheck import llama_cpp_peer

    hang = tmp_path / "llama-diffusion-cli"
    hang.write_text(f"#!/bin/sh\necho started > {tmp_path / 'started'}\nsleep 60\n")
    hang.chmod(0o755)
    monkeypatch.setattr(llama_cpp_peer, "NOTICE_EVERY", 0.3)
    start = time.monotonic()
    rc = main(["crosscheck", "llama.cpp", "--llama-bin", str(hang), "--llama-timeout", "1.2", "-n", "32"])
    waited = time.monotonic() - start
    err = capsys.readouterr().err
    assert rc == 2 and (tmp_path / "started").exists(), err
    assert f"--llama-bin {hang} did not finish within 1.2 s and was stopped (--llama-timeout" in err
    assert "running " in err and "llama.cpp is still running (" in err
    assert waited < 30  # not 900 s, nor the 60 s of the script's child


@pytest.mark.parametrize("option,value", [("--llama-timeout", "0"), ("--llama-timeout", "-inf"), ("-n", "-5"),
                                          ("--canvases", "0")])
def test_crosscheck_numbers_are_checked_by_the_parser(capsys, option, value):
    from diffusiongemma.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["crosscheck", "llama.cpp", option, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {option}" in err and value in err, err


# ------------------------------------------------------------------------------------------------ GPU diagnosis
@pytest.mark.parametrize("name,value,expected", [
    ("layers.2.mlp.down_proj", 3e38, r"^denoise: the output of decoder layer 2 is not finite \(NaN at \(row, "
                                     r"position\) \(0, 0\)\); every weight and input it read is finite, so float32 "
                                     r"overflowed there .*after the GPU flagged it: denoiser logits at .* hold NaN"),
    ("o_proj", float("nan"), r"^the model's weights are no longer finite: tensor 'layers\.1\.o_proj' holds 4096 "
                             r"NaN .*after the GPU flagged: denoiser logits"),
])
def test_the_gpu_path_names_the_layer_behind_nan_logits(name, value, expected):
    """On cuda-sim a 3e38 weight ended in "logits hold NaN" with no layer named; the CPU paths name it. (A NaN
    weight is refused when the model is built; one written into the device copy afterwards is named.)"""
    from diffusiongemma.fast import gpu
    from diffusiongemma.fast.gpu.sim import SimDevice
    from diffusiongemma.reference.support.errors import NonFiniteError

    tensors = dict(TENSORS)
    if name in tensors:
        tensors[name] = np.full_like(TENSORS[name], value)
    model = gpu.Model(CONFIG, tensors, device=SimDevice(checks=False))
    if name not in tensors:
        getattr(model.layers[1], name)[...] = value  # cuda-sim's device arrays are host arrays
    with np.errstate(all="ignore"), pytest.raises(NonFiniteError, match=expected):
        gpu.generate(model, np.full((1, 4), 5), max_new_tokens=16, max_denoising_steps=2)


def test_gpu_host_tensors_are_the_checkpoints():
    from diffusiongemma.fast import gpu
    from diffusiongemma.fast.gpu.diagnosis import host_tensors
    from diffusiongemma.fast.gpu.sim import SimDevice

    back = host_tensors(gpu.Model(CONFIG, TENSORS, device=SimDevice(checks=False)))
    assert sorted(back) == sorted(TENSORS)
    for name, value in TENSORS.items():
        np.testing.assert_array_equal(back[name], np.asarray(value, dtype=np.float32), err_msg=name)


def test_a_long_prompt_with_a_small_window_keeps_the_score_buffer_bounded():
    """With W = 8 a causal sliding layer took a 1500-token prompt as one chunk of queries (1500 x 1500 scores per
    head, over the 16 MiB budget; a 120k-token prompt would have wanted 115 GB); the chunk now follows the
    window, and the keys are the reference's."""
    from diffusiongemma.fast.attention import SCORE_BUDGET

    ids = np.random.default_rng(1).integers(3, 125, (1, 1500))
    model, ref = fast.Model(CONFIG, TENSORS), ReferenceModel(CONFIG, TENSORS)
    cache, ref_cache = model.new_cache(1), ref.new_cache(1)
    hidden = model.encode(ids, cache)
    assert 0 < model.workspace._buffers[("attn_scores", np.float32)].size <= SCORE_BUDGET
    np.testing.assert_allclose(hidden, ref.encode(ids, ref_cache), rtol=1e-3, atol=1e-3)


def test_the_budget_counts_the_activations_of_the_prompts_pass(monkeypatch):
    """KV cache and logits alone left out the pass over the prompt: 64 rows of 512 tokens need ~265 MB of
    activations on this tiny model while their cache and logits need ~20 MB."""
    from diffusiongemma.reference.support import checks

    ids = np.full((64, 512), 5)
    without = checks.run_memory_bytes(CONFIG, 64, 0, 512 + 16, tokens=0) - 4 * 64 * 16 * checks.activation_floats_per_token(CONFIG)
    assert without < 32 * 2 ** 20
    monkeypatch.setattr(checks, "available_memory", lambda: 64 * 2 ** 20)
    monkeypatch.setattr("diffusiongemma.fast.cache.available_memory", lambda: 64 * 2 ** 20, raising=False)
    for model, run in ((fast.Model(CONFIG, TENSORS), fast.generate), (ReferenceModel(CONFIG, TENSORS), reference_generate)):
        with pytest.raises(InputError, match=r"this run needs about [\d,]+ bytes \(0\.2\d GiB: KV cache, logits and "
                                             r"activations for a 512-token prompt and 1 canvas\(es\) of 16, 64 row"):
            run(model, ids, max_new_tokens=16, max_denoising_steps=1)


def test_the_fast_encoder_checks_its_activations_before_growing_its_buffers(monkeypatch):
    """``model.encode`` outside ``generate`` (no run budget): the pass's buffers are sized from the input."""
    from diffusiongemma.reference.support import checks

    model = fast.Model(CONFIG, TENSORS)
    cache = model.new_cache(4)
    monkeypatch.setattr(checks, "available_memory", lambda: 2 ** 20)
    with pytest.raises(InputError, match=r"^encoding input_ids \(4 x 512 tokens\) needs about [\d,]+ bytes "
                                         r"\(0\.0\d GiB\) of activations but 1,048,576 bytes"):
        model.encode(np.full((4, 512), 5), cache)
    assert cache.length == 0 and not model.workspace.nbytes
    model.encode(np.full((4, 8), 5), cache)  # a pass that fits runs, and the cache is still usable
    assert cache.length == 8
