"""The generate command's options: prompt sources, seeds, --temp, --ignore-eos, the stop reason, help and
version, and argument errors that name the option."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from diffusiongemma import __version__
from diffusiongemma.checkpoint import default_model_dir
from diffusiongemma.cli.main import build_parser, main
from diffusiongemma.reference.generate import GenerationConfig, generate
from diffusiongemma.reference.model import Model
from diffusiongemma.reference.sampling import temperature

SMALL = ["--steps", "6", "--no-progress"]


def run_json(capsys, *args) -> dict:
    assert main(["generate", *args, "--json", *SMALL]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def model():
    return Model.from_pretrained(default_model_dir())


# ------------------------------------------------------------------------------------------------ prompt
def test_prompt_from_option_argument_and_stdin_agree(capsys, monkeypatch):
    a = run_json(capsys, "And God said", "--seed", "2", "-n", "32")
    b = run_json(capsys, "-p", "And God said", "--seed", "2", "-n", "32")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("And God said\n".encode())))  # as echo writes
    c = run_json(capsys, "-", "--seed", "2", "-n", "32")
    assert a["token_ids"] == b["token_ids"] == c["token_ids"] and c["prompt"] == "And God said"


@pytest.mark.parametrize("args,stdin,message", [
    ([], None, "no prompt: give one as an argument, with -p/--prompt"),
    (["hi", "-p", "there"], None, "the prompt was given twice"),
    (["-p", "  "], None, "-p/--prompt: the prompt is empty"),
    (["-"], b"And \xff God", "the prompt on standard input is not valid UTF-8: byte 0xff at offset 4"),
    (["And \udcff God"], None, "the prompt argument is not valid UTF-8: byte 0xff at character 4"),
])
def test_prompt_errors_name_the_source(capsys, monkeypatch, args, stdin, message):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main(["generate", *args, *SMALL]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_undecodable_argv_bytes_get_the_named_error():
    """Bytes that are not UTF-8 on the real command line (Python hands them over as lone surrogates)."""
    proc = subprocess.run([sys.executable, "-m", "diffusiongemma", "generate", b"And \xff God", "-n", "8"],
                          capture_output=True, timeout=300)
    assert proc.returncode == 2
    assert b"not valid UTF-8: byte 0xff" in proc.stderr and b"Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------------ seeds
def test_seed_is_random_by_default_printed_and_repeatable(capsys):
    first = run_json(capsys, "In the beginning", "-n", "32")
    second = run_json(capsys, "In the beginning", "-n", "32")
    assert first["seed_given"] is False and isinstance(first["seed"], int)
    assert first["seed"] != second["seed"]  # 32 random bits each: equal with probability 2**-32
    again = run_json(capsys, "In the beginning", "-n", "32", "--seed", str(first["seed"]))
    assert again["token_ids"] == first["token_ids"] and again["seed_given"] is True
    assert main(["generate", "In the beginning", "-n", "32", *SMALL]) == 0
    err = capsys.readouterr().err
    seed = int(err.split("seed ")[1].split()[0])
    assert f"--seed {seed} repeats this run" in err


# ------------------------------------------------------------------------------------------------ settings
def test_temp_gives_one_temperature_at_every_step(capsys, model):
    out = run_json(capsys, "And God said", "--temp", "0.55", "--seed", "1", "-n", "32", "--ignore-eos")
    settings = GenerationConfig.from_dict(out["settings"])
    N = settings.max_denoising_steps
    assert {float(temperature(n, N, settings.t_min, settings.t_max)) for n in range(1, N + 1)} == \
        {float(np.float32(0.55))}
    temps = [t for canvas in out["denoising"]["canvases"] for t in canvas["temperature"]]
    assert temps and set(temps) == {float(np.float32(0.55))}
    assert settings.t_min == 0.55 and settings.t_max == math.nextafter(0.55, math.inf)


def test_ignore_eos_runs_the_whole_budget(capsys, model):
    C = model.config.canvas_length
    plain = run_json(capsys, "And God said", "--seed", "9", "-n", str(4 * C))
    ignored = run_json(capsys, "And God said", "--seed", "9", "-n", str(4 * C), "--ignore-eos")
    assert plain["stop_reason"]["reason"] == "eos"  # on seed 9 the shipped model ends a chapter in canvas 3
    assert ignored["settings"]["eos_token_id"] in ([], None)
    assert ignored["canvases"] == 4 and ignored["stop_reason"] == {"reason": "max_new_tokens", "canvas": 3}
    end = plain["token_ids"].index(1) + 1  # EOS id 1; pads follow it in the run that stops
    assert ignored["token_ids"][:end] == plain["token_ids"][:end]  # same draws up to the first commit


@pytest.mark.parametrize("backend", ["reference", "cpu", "gpu-sim"])
def test_dtype_bfloat16_loads_upstreams_bfloat16_run_on_every_backend(backend):
    from diffusiongemma.checkpoint import load_model

    for dtype in ("float32", "bfloat16"):
        assert str(load_model(default_model_dir(), backend, dtype).dtype) == dtype


def test_dtype_bfloat16_runs_the_bfloat16_run_and_says_so(capsys):
    """--dtype bfloat16 gives the bfloat16 reference's run (the library's, same draws), not the float32 one,
    and the JSON and the summary line say which dtype ran."""
    args = ["And God said", "--seed", "4", "-n", "16", "--backend", "reference"]
    bf16 = run_json(capsys, *args, "--dtype", "bfloat16")
    fp32 = run_json(capsys, *args)
    assert (bf16["dtype"], fp32["dtype"]) == ("bfloat16", "float32")
    library = Model.from_pretrained(default_model_dir(), dtype="bfloat16")
    settings = GenerationConfig.from_dict(bf16["settings"])
    ids = np.array([bf16["prompt_token_ids"]], dtype=np.int64)
    out = generate(library, ids, generation_config=settings, random=4)
    assert list(out.sequences[0, ids.shape[1]:ids.shape[1] + len(bf16["token_ids"])]) == bf16["token_ids"]
    entropy = [[c["entropy"] for c in run["denoising"]["canvases"]] for run in (bf16, fp32)]
    assert entropy[0] != entropy[1]  # the rounding reached the logits
    assert main(["generate", *args, "--dtype", "bfloat16", *SMALL]) == 0
    assert "backend reference, bfloat16]" in capsys.readouterr().err


@pytest.mark.slow
def test_stop_reason_matches_the_library_and_is_said_in_text(capsys, model):
    C = model.config.canvas_length
    out = run_json(capsys, "And God said", "--seed", "9", "-n", str(4 * C))  # seed 9 ends with EOS (canvas 3)
    settings = GenerationConfig.from_dict(out["settings"])
    result = generate(model, np.array([out["prompt_token_ids"]]), generation_config=settings, random=9)
    assert out["stop_reason"] == result.stop_reasons[0]
    k = out["stop_reason"]["canvas"]
    assert 1 in out["token_ids"][k * C:(k + 1) * C] and 1 not in out["token_ids"][:k * C]  # EOS id 1 there
    assert out["stop"] == f"stopped: EOS in canvas {k + 1} of 4"
    assert main(["generate", "And God said", "--seed", "9", "-n", str(4 * C), *SMALL]) == 0
    assert f"stopped: EOS in canvas {k + 1} of 4" in capsys.readouterr().err

    budget = run_json(capsys, "And God said", "--seed", "1", "-n", str(C), "--ignore-eos")
    assert budget["stop_reason"] == {"reason": "max_new_tokens", "canvas": 0}
    assert budget["stop"] == f"stopped: token budget ({C} new tokens = 1 canvas of {C}) used up"
    P = len(budget["prompt_token_ids"])
    limit = run_json(capsys, "And God said", "--seed", "1", "-n", str(3 * C), "--max-length", str(P + C + 1),
                     "--ignore-eos")  # the first canvas leaves the output 1 short of max_length, the second reaches it
    assert limit["stop_reason"] == {"reason": "max_length", "canvas": 1} and limit["canvases"] == 2
    assert limit["stop"] == f"stopped: length limit (max_length {P + C + 1}) after canvas 2"


def test_json_reports_threads_version_and_timings(capsys):
    out = run_json(capsys, "And God said", "--seed", "1", "-n", "32")
    assert out["version"] == __version__ and out["threads"]["chosen_by"] in ("diffusiongemma", "environment",
                                                                              "library default")
    assert out["timings"]["generate_s"] > 0 and out["backend"] in ("reference", "cpu", "gpu")
    assert out["backend_choice"].startswith("auto")


# ------------------------------------------------------------------------------------------------ help
def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"diffusiongemma {__version__}"


def test_help_shows_defaults_and_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("-n N, --max-new-tokens N", "-m PATH, --model PATH", "-p TEXT, --prompt TEXT", "--temp T",
                   "--ignore-eos", "--seed SEED", "--frame-time S", "--view-wait", "--greedy", "--threads N"):
        assert option in text, option
    assert "(default: auto)" in text and "(default: 0.08)" in text and "shipped model: 16" in text


def test_convert_help_lists_the_converter_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["convert", "--help"])
    text = capsys.readouterr().out
    assert info.value.code == 0
    for option in ("SRC", "DST", "--dtype", "--shard-size", "--force", "--no-progress"):
        assert option in text, option
    assert "args" not in text.split()


def test_subcommands_come_from_one_table():
    from diffusiongemma.cli.main import SUBCOMMANDS

    parser = build_parser()
    names = set(parser._subparsers._group_actions[0].choices)  # argparse keeps no public list
    assert names == {name for _, commands in SUBCOMMANDS for name in commands}


def test_the_help_lines_of_unloaded_commands_are_their_own():
    """``diffusiongemma --help`` lists every command from ``SUMMARIES`` without importing its module; each line
    is the one the module registers, and the commands are listed in the table's order either way."""
    from diffusiongemma.cli.main import SUBCOMMANDS, SUMMARIES

    def listed(parser):
        return [(a.dest, a.help) for a in parser._subparsers._group_actions[0]._choices_actions]

    full = listed(build_parser())
    assert [name for name, _ in full] == [name for _, commands in SUBCOMMANDS for name in commands]
    assert full == [(name, SUMMARIES[name]) for name, _ in full]
    assert listed(build_parser(["--help"])) == full
    assert listed(build_parser(["plot", "run.json"])) == full


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["generate", "--help"], ["nonsense"]])
def test_version_and_help_import_no_numerical_module(args):
    """The start of the command pays only for what it runs: ``--version``, ``--help``, a command's help and a
    bad command name import neither NumPy nor the reference, ml_dtypes, torch or matplotlib."""
    code = ("import sys\nfrom diffusiongemma.cli.main import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nheavy = ('numpy', 'ml_dtypes', 'torch', 'matplotlib', "
            "'diffusiongemma.reference', 'diffusiongemma.fast', 'diffusiongemma.checkpoint')\n"
            "print('LOADED', sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy)))\n")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    loaded = [line for line in done.stdout.splitlines() if line.startswith("LOADED")]
    assert loaded == ["LOADED []"], (done.stdout[-2000:], done.stderr[-2000:])


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--seed", "-1"], "argument --seed: expected an integer seed in [0, 2**64), got -1"),
    (["generate", "hi", "--seed", "2**64"], "argument --seed: expected an integer seed in [0, 2**64), got '2**64'"),
    (["generate", "hi", "-n", "0"], "argument -n/--max-new-tokens: expected a positive integer, got 0"),
    (["generate", "hi", "--temp", "-0.5"], "argument --temp: expected a finite number >= 0, got '-0.5'"),
    (["generate", "hi", "--temp", "nan"], "argument --temp: expected a finite number >= 0, got 'nan'"),
    (["generate", "hi", "--threads", "0"], "argument --threads: expected a positive integer, got 0"),
    (["generate", "hi", "--temp", "0.5", "--t-min", "0.1"], "argument --t-min: not allowed with argument --temp"),
    (["generate", "hi", "--frame-time", "-1"], "argument --frame-time: expected a finite number >= 0"),
    (["generate", "hi", "--entropy-bound", "0"], "argument --entropy-bound: expected a finite number > 0"),
    (["generate", "hi", "--max-length", "x"], "argument --max-length: expected a positive integer, got 'x'"),
    (["trace", "--prompt", "hi", "-o", "x", "--seed", "-3"], "argument --seed: expected an integer seed"),
    (["plot", "run.json", "--figure", "pie", "-o", "x.png"], "argument --figure: invalid choice: 'pie'"),
    (["generate", "hi", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
])
def test_argument_errors_name_the_option(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_settings_that_clash_with_the_checkpoints_name_the_options(capsys):
    assert main(["generate", "hi", "--t-min", "0.9", *SMALL]) == 2  # the shipped t_max is 0.8
    err = capsys.readouterr().err
    assert "--steps 6, --t-min 0.9: t_max (0.8) must be greater than t_min (0.9)" in err
    assert "generation_config.json" in err


def test_temp_with_t_max_names_both(capsys):
    assert main(["generate", "hi", "--temp", "0.5", "--t-max", "0.9", *SMALL]) == 2
    assert "--temp sets both t_min and t_max; drop --t-max" in capsys.readouterr().err
