"""Per-layer shapes read from a config.json as transformers writes it.

transformers 5.15+ ``save_pretrained`` writes ``per_layer_config`` with layer indices zero-padded to a
common width ("05", "11", ... for 30 layers). A reader that looks up ``str(i)`` finds nothing for such keys
and gives the full layers the sliding layers' head size: here each full layer's head dim and KV heads are
compared with transformers' own reading of the same file.
"""

import json

import pytest
from transformers import AutoConfig, DiffusionGemmaConfig

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.config_io import per_layer_overrides
from diffusiongemma.reference.support.errors import ConfigError


def _saved_config(tmp_path, n_layers):
    text = dict(num_hidden_layers=n_layers, hidden_size=64, intermediate_size=32, moe_intermediate_size=16,
                num_experts=4, top_k_experts=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                global_head_dim=32, num_global_key_value_heads=1, vocab_size=96, sliding_window=8,
                max_position_embeddings=512)
    config = DiffusionGemmaConfig(text_config=text, canvas_length=8)
    config.save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.mark.parametrize("n_layers", [6, 12, 30])
def test_full_layers_take_their_shape_from_zero_padded_keys(tmp_path, n_layers):
    path = _saved_config(tmp_path, n_layers)
    keys = list(json.loads(path.read_text())["text_config"]["per_layer_config"])
    if n_layers >= 10:
        assert any(k.startswith("0") for k in keys), f"transformers wrote plain keys {keys}: the case is not reached"
    ours = ModelConfig.from_json_file(path)
    upstream = AutoConfig.from_pretrained(tmp_path).get_text_config()
    expected_dim = [upstream.global_head_dim if t == "full_attention" else upstream.head_dim
                    for t in upstream.layer_types] if hasattr(upstream, "global_head_dim") else None
    full = [i for i, t in enumerate(ours.layer_types) if t == "full_attention"]
    assert full, "the config has no full-attention layer"
    for i, kind in enumerate(ours.layer_types):
        want = (32, 1) if kind == "full_attention" else (16, 2)
        got = (ours.layer_head_dim[i], ours.layer_num_key_value_heads[i])
        assert got == want, f"layer {i} ({kind}): head_dim/kv heads {got}, transformers wrote {want} (keys {keys})"
    if expected_dim is not None:
        assert list(ours.layer_head_dim) == expected_dim


@pytest.mark.parametrize("per_layer, message", [
    ({"5": {}, "05": {}}, "layer 5 twice"),
    ({"x": {}}, "not a layer index"),
    ({"-1": {}}, "not a layer index"),
    ({"30": {}}, "names layer 30"),
    ({True: {}}, "not a layer index"),
    ([{"head_dim": 8}], "must be an object"),
])
def test_bad_per_layer_keys_are_named(per_layer, message):
    with pytest.raises(ConfigError, match=message):
        per_layer_overrides(per_layer, 30)


def test_every_spelling_of_an_index_names_that_layer():
    assert per_layer_overrides({"05": "a", 11: "b", "7": "c"}, 30) == {5: "a", 11: "b", 7: "c"}
