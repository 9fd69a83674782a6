"""Inputs at the export and configuration edges that used to end in a corrupt file or a silently wrong run:

* a finite weight that F16 or Q8_0 cannot hold (a GGUF export wrote ``+inf`` with a NumPy warning and exit 0);
* a final soft-cap so small that dividing the logits by it overflows (a raw NumPy RuntimeWarning, then a run
  of ties), in config.json and in a GGUF's metadata;
* ``tie_word_embeddings: null`` (upstream reads it as untied), a JSON key given twice, ``per_layer_config``
  keys in digits that are not ASCII.

Each is now one line naming the file, the field or the tensor and the value.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings

import numpy as np
import pytest

from diffusiongemma import gguf_writer
from diffusiongemma.checkpoint import default_model_dir
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.generation_config import GenerationConfig
from diffusiongemma.reference.model import Model
from diffusiongemma.reference.support.config_io import per_layer_overrides
from diffusiongemma.reference.support.errors import ConfigError, InputError
from diffusiongemma.weights_converter import gguf as gguf_reader
from diffusiongemma.weights_converter.cli import main as convert_main

SHIPPED = default_model_dir()


@pytest.fixture(scope="module")
def shipped_model() -> Model:
    return Model.from_pretrained(SHIPPED)


def _with_weight(model: Model, name: str, index: tuple, value: float) -> Model:
    """A shallow copy of ``model`` whose tensor ``name`` has ``value`` at ``index`` (the others shared)."""
    copy = object.__new__(Model)
    copy.__dict__.update(model.__dict__)
    copy.tensors = dict(model.tensors)
    copy.tensors[name] = model.tensors[name].copy()
    copy.tensors[name][index] = value
    return copy


# ================================================================================================ GGUF export
@pytest.mark.parametrize("gguf_type, value, limit", [
    ("f16", 65_536.0, r"F16 cannot store \(\|x\| <= 65504"),
    ("f16", 1e20, r"F16 cannot store"),
    ("q8_0", 1e20, r"Q8_0 cannot store \(\|x\| <= about 8\.32e\+06"),
    ("q8_0", -9e6, r"Q8_0 cannot store"),
])
def test_gguf_export_refuses_a_weight_the_type_cannot_hold(tmp_path, shipped_model, gguf_type, value, limit):
    model = _with_weight(shipped_model, "layers.0.q_proj", (3, 5), value)
    dst = tmp_path / "big.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning on the way
        with pytest.raises(InputError, match=rf"tensor blk\.0\.attn_q\.weight \(layers\.0\.q_proj\) holds "
                                             rf"{np.float32(value)}".replace("+", r"\+") + rf" at \[3, 5\], which {limit}"):
            gguf_writer.write_model_gguf(model, SHIPPED, dst, gguf_type)
    assert os.listdir(tmp_path) == []  # no file, no partial file


def test_gguf_export_keeps_what_the_type_can_hold(tmp_path, shipped_model):
    """The largest F16 value stays finite; f32 keeps 1e20 bit for bit; Q8_0 takes a weight of 8e6."""
    dst = tmp_path / "edge.gguf"
    gguf_writer.write_model_gguf(_with_weight(shipped_model, "layers.0.q_proj", (0, 0), 65504.0), SHIPPED, dst, "f16")
    _, tensors = gguf_reader.load_gguf_checkpoint(str(dst))
    assert tensors["layers.0.q_proj"][0, 0] == 65504.0 and np.isfinite(tensors["layers.0.q_proj"]).all()
    gguf_writer.write_model_gguf(_with_weight(shipped_model, "layers.0.q_proj", (0, 0), 1e20), SHIPPED, dst, "f32",
                                 force=True)
    _, tensors = gguf_reader.load_gguf_checkpoint(str(dst))
    assert tensors["layers.0.q_proj"][0, 0] == np.float32(1e20)
    gguf_writer.write_model_gguf(_with_weight(shipped_model, "layers.0.q_proj", (0, 0), 8e6), SHIPPED, dst, "q8_0",
                                 force=True)
    _, tensors = gguf_reader.load_gguf_checkpoint(str(dst))
    assert np.isfinite(tensors["layers.0.q_proj"]).all()


def test_gguf_export_of_an_overflowing_checkpoint_exits_1_with_one_line(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    src = tmp_path / "model"
    shutil.copytree(SHIPPED, src)
    weights = load_file(str(src / "model.safetensors"))
    name = next(k for k in weights if k.endswith("layers.1.self_attn.o_proj.weight"))
    weights[name][0, 0] = 70_000.0
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert convert_main([str(src), str(tmp_path / "out.gguf"), "--gguf-type", "f16"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "tensor blk.1.attn_output.weight (layers.1.o_proj) holds 70000.0 at [0, 0]" in err
    assert not (tmp_path / "out.gguf").exists()


# ================================================================================================ soft-cap
def _transformers_config() -> dict:
    with open(os.path.join(SHIPPED, "config.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("cap", [1e-45, 1e-30, 9.9e-4])
def test_a_soft_cap_that_overflows_the_logits_is_refused(cap):
    config = _transformers_config()
    config["text_config"]["final_logit_softcapping"] = cap
    with pytest.raises(ConfigError, match=rf"final_logit_softcapping must be at least 0\.001 .* got {cap!r}"):
        ModelConfig.from_transformers(config)


def test_a_small_soft_cap_that_is_safe_is_kept():
    config = _transformers_config()
    config["text_config"]["final_logit_softcapping"] = 0.001
    assert ModelConfig.from_transformers(config).final_logit_softcapping == 0.001


def test_a_gguf_soft_cap_of_1e_45_is_refused_by_key(tmp_path, shipped_model):
    path = tmp_path / "m.gguf"
    gguf_writer.write_model_gguf(shipped_model, SHIPPED, path, "f32")
    data = bytearray(path.read_bytes())
    key = b"diffusion-gemma.final_logit_softcapping"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 6  # FLOAT32
    struct.pack_into("<f", data, at + 4, 1e-45)
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"m\.gguf: final_logit_softcapping must be at least 0\.001"):
        gguf_reader.GGUFCheckpoint.open(str(path))


# ================================================================================================ config.json
def test_tie_word_embeddings_null_is_refused_by_name():
    for where in ("top", "text"):
        config = _transformers_config()
        (config if where == "top" else config["text_config"])["tie_word_embeddings"] = None
        prefix = "" if where == "top" else r"text_config\."
        with pytest.raises(ConfigError, match=rf"^{prefix}tie_word_embeddings must be true or false .* got null"):
            ModelConfig.from_transformers(config)


def _config_file(tmp_path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_repeated_per_layer_key_is_refused_by_name(tmp_path):
    text = json.dumps(_transformers_config())
    assert '"per_layer_config": {"1": {' in text
    text = text.replace('"per_layer_config": {"1": {', '"per_layer_config": {"3": {"head_dim": 32}, "1": {', 1)
    with pytest.raises(ConfigError, match=r"config\.json: the key text_config\.per_layer_config\.3 is given twice"):
        ModelConfig.from_json_file(_config_file(tmp_path, text))


def test_a_repeated_top_level_key_is_refused_by_name(tmp_path):
    text = json.dumps(_transformers_config())
    text = text.replace('"canvas_length": 32', '"canvas_length": 32, "canvas_length": 64', 1)
    with pytest.raises(ConfigError, match=r"the key canvas_length is given twice"):
        ModelConfig.from_json_file(_config_file(tmp_path, text))


def test_a_repeated_generation_config_key_is_refused_by_name(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text('{"t_min": 0.4, "t_max": 0.8, "t_min": 0.1}')
    with pytest.raises(ConfigError, match=r"generation_config\.json: the key t_min is given twice"):
        GenerationConfig.from_pretrained(str(tmp_path))


def test_the_converter_refuses_a_repeated_key(tmp_path, capsys):
    src = tmp_path / "model"
    shutil.copytree(SHIPPED, src)
    text = (src / "config.json").read_text().replace('"vocab_size": 4096', '"vocab_size": 4096, "vocab_size": 8', 1)
    (src / "config.json").write_text(text)
    assert convert_main([str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "the key text_config.vocab_size is given twice" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["\u0663", "\u00b3", "\uff13", "1\u0663"])  # Arabic-Indic 3, superscript 3, fullwidth 3
def test_per_layer_keys_must_be_ascii_digits(key):
    with pytest.raises(ConfigError, match=r"per_layer_config key .* is not a layer index \(ASCII digits 0-9\)"):
        per_layer_overrides({key: {"head_dim": 64}}, 30)


def test_per_layer_keys_in_ascii_keep_working():
    assert per_layer_overrides({"03": {}, "5": {"head_dim": 8}, 7: {}}, 8) == {3: {}, 5: {"head_dim": 8}, 7: {}}
