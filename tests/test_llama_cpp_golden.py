"""llama.cpp goldens replayed without llama.cpp: from the seed alone, the reference reproduces llama-diffusion-cli.

tests/golden/llama.cpp/*.json were recorded by examples/record_llama_cpp_golden.py from llama.cpp commit c3fb972
(PR #24423) on the shipped model and on a random tiny model (several blocks, early stops, an end token); each
holds, per block and denoising step, llama.cpp's input canvas, argmax canvas, sampled ids and accepted
positions, its reply, and one step's logits (the ``.npz``). The checks:

* the draws alone: every block's initial canvas and every renoised position are ``LlamaCppDraws(seed)``'s;
* the reference with ``semantics="llama.cpp"`` and ``LlamaCppDraws(seed)`` repeats every step (argmax canvas,
  accepted set, accepted draws, next input, steps per block) and the reply, with llama.cpp's float16 GELU table
  and self-conditioning embedding emulated (``llama_cpp_numerics``); the plain float32 reference gives the
  same reply where the golden says so;
* the step-0 logits agree within a bound, tighter with the float16 emulation;
* the GGUF the tests rebuild is the file llama.cpp ran, and its tokenizer and pass-through template give
  llama.cpp's prompt ids.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from importlib.metadata import version

import numpy as np
import pytest

from diffusiongemma.checkpoint import default_model_dir
from diffusiongemma.crosscheck.llama_cpp_peer import (LlamaCppRun, _encode_like_llama_cpp, case_gguf, compare_runs,
                                                      llama_cpp_numerics, llama_cpp_trim, random_tiny_model,
                                                      reference_run)
from diffusiongemma.reference import GenerationConfig, generate
from diffusiongemma.reference.model import Model
from diffusiongemma.reference.variants.llama_cpp_draws import LlamaCppDraws

HERE = os.path.join(os.path.dirname(__file__), "golden", "llama.cpp")
NAMES = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(HERE, "*.json"))
               if not p.endswith("mt19937_draws.json"))


def load(name: str) -> dict:
    with open(os.path.join(HERE, f"{name}.json"), encoding="utf-8") as f:
        return json.load(f)


_MODELS: dict = {}


def model_of(golden: dict) -> Model:
    key = json.dumps(golden["model"])
    if key not in _MODELS:
        spec = golden["model"]
        _MODELS[key] = (Model.from_pretrained(default_model_dir()) if spec == "shipped"
                        else random_tiny_model(spec["random_tiny_model"]))
    return _MODELS[key]


def peer_run(golden: dict) -> LlamaCppRun:
    return LlamaCppRun(prompt_ids=golden["prompt_ids"], tokens=golden["tokens"], text=golden["text"],
                       blocks=golden["blocks"])


def test_goldens_cover_the_cases():
    goldens = [load(n) for n in NAMES]
    assert any(g["model"] == "shipped" for g in goldens)
    tiny = [g for g in goldens if g["model"] != "shipped"]
    assert any(len(g["blocks"]) >= 3 for g in tiny)  # a canvas spanning several blocks
    assert any(len(block) < g["generation"]["max_denoising_steps"] for g in tiny for block in g["blocks"])  # early stop
    assert any(len(g["tokens"]) < len(g["blocks"]) * 16 for g in tiny)  # a reply cut by an end token
    assert all(g["traced"] for g in goldens)
    # a reply cut at a repetition loop (no end id in it): llama.cpp stops after that canvas
    assert any(len(g["tokens"]) < 16 * len(g["blocks"]) and 1 not in g["blocks"][-1][-1]["argmax"] for g in goldens)


@pytest.mark.parametrize("name", NAMES)
def test_draws_are_llama_cpps(name):
    """Without any model: llama.cpp's initial canvases and renoised positions are LlamaCppDraws(seed)'s."""
    golden = load(name)
    V = model_of(golden).config.vocab_size
    draws = LlamaCppDraws(golden["seed"])  # one source for the whole run, as generate uses it
    for block in golden["blocks"]:
        C = len(block[0]["input"])
        assert draws.canvas_ids(1, C, V)[0].tolist() == block[0]["input"]  # reseeded: the same every block
        for step, following in zip(block, block[1:]):
            probs = np.zeros((1, C, V), dtype=np.float32)
            probs[0, np.arange(C), step["sampled"]] = 1.0  # a one-hot row: the draw is the recorded id
            assert draws.categorical(probs)[0].tolist() == step["sampled"]
            noise = draws.renoise_ids(1, C, V)[0]
            accepted = set(step["accepted"])
            want = [step["sampled"][i] if i in accepted else int(noise[i]) for i in range(C)]
            assert following["input"] == want


@pytest.mark.parametrize("name", NAMES)
def test_reference_repeats_every_step(name):
    golden = load(name)
    model = model_of(golden)
    ours = reference_run(model, golden["prompt_ids"], seed=golden["seed"], n_predict=golden["n_predict"],
                         generation_config=GenerationConfig.from_dict(golden["generation"]), numerics=True)
    assert compare_runs(peer_run(golden), ours) == []
    assert ours.tokens == golden["tokens"]


@pytest.mark.parametrize("name", [n for n in NAMES if load(n)["reference_plain_agrees"]])
def test_plain_reference_gives_llama_cpps_reply(name):
    """The call a porter makes, plain float32: generate(model, ids, semantics="llama.cpp", random=LlamaCppDraws)."""
    golden = load(name)
    model = model_of(golden)
    ids = np.array([golden["prompt_ids"]], dtype=np.int64)
    C = model.config.canvas_length
    result = generate(model, ids, generation_config=GenerationConfig.from_dict(golden["generation"]),
                      semantics="llama.cpp", random=LlamaCppDraws(golden["seed"]),
                      max_new_tokens=-(-golden["n_predict"] // C) * C)
    new = result.sequences[0, ids.shape[1]:].tolist()
    reply = []
    for k in range(0, len(new), C):
        cut = llama_cpp_trim(new[k:k + C], set(model.config.eos_token_id))
        reply += new[k:k + cut]
        if cut < C:
            break
    assert reply == golden["tokens"]
    assert result.steps_per_canvas[:len(golden["blocks"])] == [len(b) for b in golden["blocks"]]


@pytest.mark.parametrize("name", NAMES)
def test_step0_logits(name):
    golden = load(name)
    model = model_of(golden)
    stored = np.load(os.path.join(HERE, golden["logits"]["file"]))["logits"]
    first = golden["blocks"][0][0]
    errors = []
    for numerics in (False, True):
        with (llama_cpp_numerics(model) if numerics else contextlib.nullcontext()):
            cache = model.new_cache(1)
            model.encode(np.array([golden["prompt_ids"]]), cache)
            ours = model.denoise(np.array([first["input"]]), cache, None)[0][:stored.shape[0]]
        errors.append(float(np.abs(ours - stored).max()) / float(np.abs(stored).max()))
    plain, emulated = errors
    assert plain < 3e-3 and emulated < 3e-4 and emulated < plain / 3


@pytest.mark.parametrize("name", NAMES)
def test_gguf_is_the_file_llama_cpp_ran(tmp_path, name):
    golden = load(name)
    spec = golden["model"] if golden["model"] == "shipped" else golden["model"]["random_tiny_model"]
    path = case_gguf(spec, str(tmp_path))
    if version("gguf") == golden["gguf_package"]:
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == golden["gguf_sha256"]
    back = Model.from_pretrained(path)
    model = model_of(golden)
    assert back.config == model.config
    assert all(np.array_equal(back.tensors[k], model.tensors[k]) for k in model.tensors)
    assert _encode_like_llama_cpp(path, golden["prompt"]) == golden["prompt_ids"]


def test_llama_cpp_stages_are_its_float_order():
    """T_n with the step fraction rounded first, and the logits multiplied by float(1 / T) (llama.cpp's temp_inv)."""
    from diffusiongemma.reference.variants import SEMANTICS

    schedule = SEMANTICS["llama.cpp"].temperature
    f = np.float32
    assert schedule(7, 9, 0.4, 0.8) == f(f(0.4) + f(f(f(0.8) - f(0.4)) * f(f(7) / f(9))))
    assert schedule(7, 9, 0.4, 0.8) != f(f(0.4) + f(f(f(f(0.8) - f(0.4)) * f(7)) / f(9)))
    z = np.array([[[1.0, -0.31630015, -2.0]]], dtype=np.float32)
    T = f(0.7)
    scaled = schedule.scale(z, T)
    np.testing.assert_array_equal(scaled, z * f(f(1) / T))
    assert not np.array_equal(scaled, z / T)


def test_llama_cpp_stops_after_a_canvas_cut_at_a_loop():
    """llama-diffusion-cli ends the reply at the first canvas it cuts, at an end id or at a repetition loop."""
    from diffusiongemma.reference.variants import SEMANTICS

    eos = SEMANTICS["llama.cpp"].eos
    tokens = np.array([[3] + [9] * 7 + [4, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [3, 9, 9, 9, 9, 9, 9, 4, 5, 6]])
    kept, finished = eos.finalize(tokens, np.zeros(3, dtype=bool), (1,), 0)
    assert finished.tolist() == [True, False, False] and np.array_equal(kept, tokens)  # six 9s are no loop
