"""The parity tests can fail: each classic DiffusionGemma mistake, injected into the reference, produces a
mismatch against transformers far above the parity tolerance (SPEC §14 check 2)."""

from __future__ import annotations

import numpy as np
import pytest

from diffusiongemma.reference import cache as cache_module
from diffusiongemma.reference import layers as layers_module
from diffusiongemma.reference import model as model_module
from diffusiongemma.reference.model import Model
from tests.hf_oracle import hf_cache, hf_denoise, hf_encode
from tests.hf_tiny import TinySpec, save_tiny, tiny_model
from tests.test_model_parity import ATOL


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = tiny_model(TinySpec())
    return hf, save_tiny(hf, tmp_path_factory.mktemp("mut") / "hf")


def decoder_gap(hf, path, mutate=None) -> float:
    """Max |ours - transformers| over the decoder logits after a 13-token prefill (W = 8)."""
    ours = Model.from_pretrained(path)
    if mutate is not None:
        mutate(ours)
    prompt = np.random.default_rng(0).integers(3, 125, size=(2, 13))
    canvas = np.random.default_rng(1).integers(0, 128, size=(2, 16))
    cache, hc = ours.new_cache(2), hf_cache(hf)
    ours.encode(prompt, cache)
    hf_encode(hf, hc, prompt)
    return float(np.abs(ours.denoise(canvas, cache) - hf_denoise(hf, hc, canvas)).max())


def one_plus_w_norms(monkeypatch):
    original = layers_module.rms_norm

    def gemma1_norm(x, weight, eps, *dtype):
        return original(x, None if weight is None else 1.0 + weight, eps, *dtype)

    monkeypatch.setattr(layers_module, "rms_norm", gemma1_norm)
    monkeypatch.setattr(model_module, "rms_norm", gemma1_norm)


def keep_w_not_w_minus_1(monkeypatch):
    monkeypatch.setattr(cache_module.KVCache, "layer_capacity",
                        lambda self, layer: self.config.sliding_window if self.config.is_sliding(layer) else None)


def router_on_normed_input(monkeypatch):
    original = layers_module.route

    def route(h, w, config, *args, **kwargs):
        return original(layers_module.rms_norm(h, w["pre_feedforward_layernorm_2"], config.rms_norm_eps), w, config,
                        *args, **kwargs)

    monkeypatch.setattr(layers_module, "route", route)


def swap_layer_scalars(model):
    for w in model.layers:
        w["encoder_layer_scalar"], w["decoder_layer_scalar"] = w["decoder_layer_scalar"], w["encoder_layer_scalar"]


def test_unmutated_reference_passes(pair):
    assert decoder_gap(*pair) < ATOL


@pytest.mark.parametrize("mutation", ["x*(1+w) norms", "W cached instead of W-1", "router fed normed input",
                                      "encoder/decoder layer scalars swapped"])
def test_mutations_are_caught(pair, monkeypatch, mutation):
    mutate_model = None
    if mutation == "x*(1+w) norms":
        one_plus_w_norms(monkeypatch)
    elif mutation == "W cached instead of W-1":
        keep_w_not_w_minus_1(monkeypatch)
    elif mutation == "router fed normed input":
        router_on_normed_input(monkeypatch)
    else:
        mutate_model = swap_layer_scalars
    gap = decoder_gap(*pair, mutate=mutate_model)
    print(f"{mutation}: max |diff| = {gap:.3e}")
    assert gap > 100 * ATOL, f"mutation {mutation!r} went unnoticed (gap {gap:.3e})"
