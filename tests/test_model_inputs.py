"""Bad input to the reference model raises an error that names the problem."""

from __future__ import annotations

import numpy as np
import pytest

from diffusiongemma.reference import CheckpointError, ConfigError, InputError, ModelConfig
from diffusiongemma.reference.model import Model
from tests.hf_tiny import TinySpec, save_tiny, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return Model.from_pretrained(save_tiny(tiny_model(TinySpec()), tmp_path_factory.mktemp("inputs") / "hf"))


def test_token_ids_out_of_range(model):
    cache = model.new_cache(1)
    with pytest.raises(InputError, match="token id 128"):
        model.encode(np.array([[3, 128]]), cache)
    with pytest.raises(InputError, match="token id -1"):
        model.encode(np.array([[-1, 5]]), cache)
    assert cache.length == 0, "a rejected encode must not touch the cache"
    model.encode(np.array([[3, 4]]), cache)
    with pytest.raises(InputError, match="token id 999"):
        model.denoise(np.full((1, 16), 999), cache)


def test_wrong_shapes_and_dtypes(model):
    cache = model.new_cache(2)
    with pytest.raises(InputError, match="2-D integer"):
        model.encode(np.array([3, 4]), cache)
    with pytest.raises(InputError, match="2-D integer"):
        model.encode(np.ones((2, 3), dtype=np.float32), cache)
    with pytest.raises(InputError, match=r"attention_mask has shape \(1, 3\)"):
        model.encode(np.ones((2, 3), dtype=np.int64), cache, np.ones((1, 3)))
    with pytest.raises(InputError, match="only 0 and 1"):
        model.encode(np.ones((2, 3), dtype=np.int64), cache, np.full((2, 3), 2))
    with pytest.raises(InputError, match="no tokens"):
        model.encode(np.ones((2, 0), dtype=np.int64), cache)


def test_wrong_canvas_length(model):
    cache = model.new_cache(1)
    model.encode(np.array([[3, 4, 5]]), cache)
    with pytest.raises(InputError, match="canvas has length 15, but this model's canvas_length is 16"):
        model.denoise(np.zeros((1, 15), dtype=np.int64), cache)


def test_cache_of_another_batch_size(model):
    cache = model.new_cache(2)
    model.encode(np.ones((2, 3), dtype=np.int64), cache)
    with pytest.raises(InputError, match="batch size 1 but the cache was made for batch size 2"):
        model.denoise(np.zeros((1, 16), dtype=np.int64), cache)
    with pytest.raises(InputError, match="positive integer"):
        model.new_cache(0)


def test_bad_self_conditioning_logits(model):
    cache = model.new_cache(1)
    model.encode(np.array([[3, 4, 5]]), cache)
    canvas = np.zeros((1, 16), dtype=np.int64)
    with pytest.raises(InputError, match="self_conditioning_logits has shape"):
        model.denoise(canvas, cache, np.zeros((1, 16, 127), dtype=np.float32))
    bad = np.zeros((1, 16, 128), dtype=np.float32)
    bad[0, 3, 7] = np.nan
    with pytest.raises(InputError, match="NaN"):
        model.denoise(canvas, cache, bad)


def test_missing_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Model.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint this project reads; it reads a converted"):
        Model.from_pretrained(tmp_path / "empty")


@pytest.mark.parametrize("field,value,match", [
    ("use_bidirectional_attention", "all", "use_bidirectional_attention='all'"),
    ("num_key_value_heads", 3, "must divide num_attention_heads"),
    ("layer_types", ["full_attention", "sliding_attention"], r"layer_types\[-1\]"),
    ("vocab_size", 0, "vocab_size must be a positive integer"),
    ("top_k_experts", 9, "top_k_experts"),
    ("tie_word_embeddings", False, "tie_word_embeddings=False"),
])
def test_bad_config_values(field, value, match):
    text = dict(model_type="diffusion_gemma_text", vocab_size=64, hidden_size=16, intermediate_size=8,
                moe_intermediate_size=4, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, global_head_dim=8, num_experts=4, top_k_experts=2, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"])
    ModelConfig.from_transformers(text)  # the unmodified config is valid
    text[field] = value
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_transformers(text)


def test_default_layer_pattern_and_softcap():
    config = ModelConfig.from_transformers(dict(
        model_type="diffusion_gemma", canvas_length=8,
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=8, moe_intermediate_size=4,
                         num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, top_k_experts=2)))
    assert config.layer_types == tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                       for i in range(12))
    assert config.final_logit_softcapping == 30.0
    assert config.layer_head_dim[5] == 512 and config.layer_head_dim[0] == 8  # legacy global_head_dim default
    assert config.canvas_length == 8
