"""Google's JAX DiffusionGemma, recorded (tests/golden/jax/<case>.json), replayed here without JAX.

``examples/record_jax_golden.py`` ran ``gemma.diffusion``'s sampler (google-deepmind/gemma main 7691fd4) on
tiny models mapped from this project's checkpoints and kept, per canvas and step, the input canvas, the
argmax canvas, the proposals, the accepted set, the sampled-and-renoised canvas and the stop flags, then
the final tokens, plus one step's logits. Here the reference runs the same prompts with
``semantics="jax"`` and ``random=JaxDraws(seed)``, from the seed alone, and must reproduce every one of
them. The cases:

* ``window``: one row, canvas 16 = sliding window 16; stops early in both canvases, an end token in the
  middle of the second (pad 0 after it, the run ends).
* ``band``: two rows, canvas 16 over a window of 8 (JAX's sliding layers then hide canvas keys with
  |i - j| >= 8); three canvases, rows stopping at different steps, row 0 ending in canvas 1 (its canvas
  2 is all pad), row 1 running out of budget.

Both use the decoder's layer scalar for the encoder too (JAX has one ``skip_scale`` per layer) and the
self-conditioning MLP's down projection scaled by 1/8 (``sc_down_scale``): JAX rounds the
self-conditioning embedding to bfloat16, the reference's float32 embedding differs from XLA's in the last
bit, and the rare component that then rounds to the other bfloat16 neighbour (0-3 of 1024 per step)
moves the logits by ~1e-3, which the low temperature these cases need for early stops amplifies step by
step. At 1/8 the same flips move the logits by at most 4e-4 in these runs, and no decision.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest

from diffusiongemma.reference import GenerationConfig, Model, generate
from diffusiongemma.reference.stages import SEMANTICS
from diffusiongemma.reference.support.observer import Observer
from diffusiongemma.reference.variants.jax_draws import JaxDraws, jax_temperature
from diffusiongemma.reference.variants.window import PerQueryWindow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "jax")
CASES = ("window", "band")
LOGITS_TOLERANCE = 1e-4  # float32 paths of two frameworks (measured: 1.8e-6 window, 6.9e-5 band)


def load(name: str) -> tuple[dict, dict]:
    with open(os.path.join(GOLDEN, f"{name}.json"), encoding="utf-8") as f:
        data = json.load(f)
    with np.load(os.path.join(GOLDEN, f"{name}.npz")) as z:
        return data, {k: z[k] for k in z.files}


def case_model(data: dict) -> Model:
    """The project checkpoint of the case with JAX's single layer scalar and the case's SC scale."""
    directory = os.path.join(ROOT, "tests", "golden", data["model"], "model")
    base = Model.from_pretrained(directory)
    tensors = dict(base.tensors)
    for l in range(base.config.num_hidden_layers):
        tensors[f"layers.{l}.encoder_layer_scalar"] = tensors[f"layers.{l}.decoder_layer_scalar"]
    name = "self_conditioning.down_proj"
    tensors[name] = (tensors[name] * np.float32(data["sc_down_scale"])).astype(np.float32)
    return Model(dataclasses.replace(base.config, sliding_window=data["sliding_window"]), tensors)


def case_config(data: dict) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=data["max_new_tokens"], max_denoising_steps=data["max_denoising_steps"],
                            entropy_bound=data["entropy_bound"], t_min=data["t_min"], t_max=data["t_max"],
                            stability_threshold=1, confidence_threshold=data["entropy_threshold"],
                            eos_token_id=data["end_tokens"])


class StepLog(Observer):
    """Keeps what the reference did at each step, grouped by canvas like the golden."""

    def __init__(self):
        self.canvases: list[list[dict]] = []  # per canvas, per step: the input canvas and end_step's arrays
        self.raw_logits: list[list[np.ndarray]] = []  # per canvas, per step: the denoiser's logits
        self._input = None

    def begin_canvas(self, initial_canvas):
        self.canvases.append([])
        self.raw_logits.append([])
        self._input = np.array(initial_canvas)

    def logits(self, logits, rows=None):
        self.raw_logits[-1].append(np.array(logits))

    def end_step(self, **step):
        arrays = {k: np.array(v) for k, v in step.items() if isinstance(v, np.ndarray)}
        self.canvases[-1].append({"input_canvas": self._input, **arrays})
        self._input = arrays["canvas"]


def replay(data: dict, semantics="jax") -> tuple[object, StepLog]:
    log = StepLog()
    result = generate(case_model(data), np.array(data["prompts"]), generation_config=case_config(data),
                      random=JaxDraws(data["seed"]), semantics=semantics, trace=log)
    return result, log


def test_golden_files_name_their_source_and_weights():
    for name in CASES:
        data, arrays = load(name)
        assert data["versions"]["gemma"] == "7691fd4e7f26c9ec5db38110dddb3addfab4d767"
        assert data["versions"]["python"].startswith("3.12") and data["versions"]["jax"]
        path = os.path.join(ROOT, "tests", "golden", data["model"], "model", "model.safetensors")
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == data["weights_sha256"], (
                f"{name}: the checkpoint changed since the golden was recorded; "
                f"run python examples/record_jax_golden.py {name} in a JAX environment")
        assert arrays["raw_logits"].shape == (len(data["prompts"]), data["canvas_length"], data["vocab_size"])
    window, band = load("window")[0], load("band")[0]
    assert window["canvas_length"] <= window["sliding_window"] and band["canvas_length"] > band["sliding_window"]


@pytest.mark.parametrize("name", CASES)
def test_the_reference_replays_jax_token_for_token(name):
    data, arrays = load(name)
    result, log = replay(data)
    P = len(data["prompts"][0])
    assert [len(c) for c in log.canvases] == data["steps_per_canvas"]
    for k, (ours, theirs) in enumerate(zip(log.canvases, data["canvases"])):
        stopped = np.zeros(len(data["prompts"]), dtype=bool)
        for s, (a, b) in enumerate(zip(ours, theirs)):
            live = ~stopped  # JAX reports every row; the reference freezes rows that had stopped
            where = f"{name}: canvas {k} step {s}"
            assert np.array_equal(a["input_canvas"][live], np.array(b["input_canvas"])[live]), where
            assert np.array_equal(a["draft"][live], np.array(b["argmax"])[live]), where
            assert np.array_equal(a["sampled"][live], np.array(b["proposed"])[live]), where
            assert np.array_equal(a["accepted"][live], np.array(b["accepted"], dtype=bool)[live]), where
            assert np.array_equal(a["canvas"][live], np.array(b["sampled"])[live]), where
            stopped = stopped | np.array(b["stop"])
            assert np.array_equal(a["finished"], stopped), where
    new = result.sequences[:, P:]
    jax_tokens = np.array(data["tokens"])
    assert np.array_equal(new, jax_tokens[:, :new.shape[1]]) and not jax_tokens[:, new.shape[1]:].any()
    k, s = data["logits_step"]
    assert np.abs(log.raw_logits[k][s] - arrays["raw_logits"]).max() < LOGITS_TOLERANCE


@pytest.mark.parametrize("name", CASES)
def test_jax_scales_the_logits_by_the_reciprocal_of_its_temperature(name):
    """JAX's own output: the shaped logits are the raw ones times float32(1 / T), bit for bit."""
    data, arrays = load(name)
    k, s = data["logits_step"]
    factor = jax_temperature(s, data["max_denoising_steps"], data["t_min"], data["t_max"])[1]
    assert np.array_equal((arrays["raw_logits"] * factor).view(np.uint32), arrays["shaped_logits"].view(np.uint32))


class _PromptKeysOnly(PerQueryWindow):
    """JAX's window over the prompt keys without its band over the canvas keys (what the variant did before)."""

    def keys(self, key_positions, prompt_end, canvas_length, window):
        return super().keys(key_positions, prompt_end, canvas_length, window)[:, :np.shape(key_positions)[0]]


def test_without_the_canvas_band_the_band_case_diverges():
    data, _ = load("band")
    result, _ = replay(data, SEMANTICS["jax"].replace(canvas_window=_PromptKeysOnly()))
    P = len(data["prompts"][0])
    new = result.sequences[:, P:]
    assert not np.array_equal(new, np.array(data["tokens"])[:, :new.shape[1]])


def test_without_the_bfloat16_carry_the_logits_miss_jax():
    data, arrays = load("window")
    k, s = data["logits_step"]
    _, log = replay(data, SEMANTICS["jax"].replace(sc_temperature="divide"))
    assert np.abs(log.raw_logits[k][s] - arrays["raw_logits"]).max() > LOGITS_TOLERANCE


@pytest.mark.parametrize("name", CASES)
def test_the_replay_holds_under_float_noise_of_another_machine(name):
    """The goldens do not rest on this machine's float32 rounding: noise of 2e-5 on every logit of every
    step (ten times the two frameworks' disagreement) changes no decision."""
    import functools

    data, _ = load(name)
    model = case_model(data)
    rng = np.random.default_rng(0)
    exact = model.denoise

    @functools.wraps(exact)  # keeps the signature: the run still passes the window and SC stages
    def noisy(*args, **kwargs):
        z = exact(*args, **kwargs)
        return (z + rng.standard_normal(z.shape).astype(np.float32) * np.float32(2e-5)).astype(np.float32)

    model.denoise = noisy
    result = generate(model, np.array(data["prompts"]), generation_config=case_config(data),
                      random=JaxDraws(data["seed"]), semantics="jax")
    new = result.sequences[:, len(data["prompts"][0]):]
    assert result.steps_per_canvas == data["steps_per_canvas"]
    assert np.array_equal(new, np.array(data["tokens"])[:, :new.shape[1]])
