"""Tests of the weights converter (transformers checkpoint -> diffusiongemma format).

Ground truth is the tiny randomised transformers model of SPEC §14 (``hf_tiny``): every converted
tensor is compared with the parameter it came from, found by walking the transformers module tree
(not through the converter's name map), so a wrong or swapped mapping fails here.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from diffusiongemma.reference.support.errors import CheckpointError, ConfigError, InputError
from diffusiongemma.reference.weights import expected_shapes
from diffusiongemma.reference.support.checkpoint_io import load_converted
from diffusiongemma.weights_converter import convert, load_transformers_checkpoint
from diffusiongemma.weights_converter import cli, conversion
from diffusiongemma.weights_converter.names import hf_name, project_name, skipped_group, tied_source
from diffusiongemma.weights_converter.writer import to_storage

from tests.hf_tiny import TinySpec, tiny_model

BF16 = np.dtype(ml_dtypes.bfloat16)
SINGLE = "model.safetensors"


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf_model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    """A single-file float32 checkpoint, plus a fake tokenizer and chat template to be copied."""
    path = tmp_path_factory.mktemp("hf") / "single"
    hf_model.save_pretrained(path)
    (path / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (path / "chat_template.jinja").write_text("{{ messages }}")
    return path


@pytest.fixture(scope="module")
def hf_sharded_dir(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "sharded"
    hf_model.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / SINGLE).exists()
    return path


@pytest.fixture(scope="module")
def hf_bf16(hf_model, tmp_path_factory):
    import torch

    model = copy.deepcopy(hf_model).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("hf") / "bf16"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def f32_state(hf_dir):
    """(tensors, config.json dict) of the float32 checkpoint, for building altered copies."""
    return read_file(hf_dir / SINGLE), json.loads((hf_dir / "config.json").read_text())


def hf_parameters(model) -> dict:
    """Project name -> torch tensor, found by walking the transformers modules (not the name map)."""
    dec, enc = model.model.decoder, model.model.encoder.language_model
    sc = dec.self_conditioning
    out = {"embed_tokens": dec.embed_tokens.weight, "final_norm": dec.norm.weight,
           "self_conditioning.pre_norm": sc.pre_norm.weight, "self_conditioning.gate_proj": sc.gate_proj.weight,
           "self_conditioning.up_proj": sc.up_proj.weight, "self_conditioning.down_proj": sc.down_proj.weight}
    for l, (layer, enc_layer) in enumerate(zip(dec.layers, enc.layers)):
        p, attn = f"layers.{l}.", layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            module = getattr(attn, proj, None)
            if module is not None:
                out[p + proj] = module.weight
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                     "post_feedforward_layernorm_2", "post_feedforward_layernorm"):
            out[p + norm] = getattr(layer, norm).weight
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[p + "mlp." + proj] = getattr(layer.mlp, proj).weight
        out[p + "router.proj"] = layer.router.proj.weight
        out[p + "router.scale"] = layer.router.scale
        out[p + "router.per_expert_scale"] = layer.router.per_expert_scale
        out[p + "experts.gate_up_proj"] = layer.experts.gate_up_proj
        out[p + "experts.down_proj"] = layer.experts.down_proj
        out[p + "decoder_layer_scalar"] = layer.layer_scalar
        out[p + "encoder_layer_scalar"] = enc_layer.layer_scalar
    return out


def as_numpy(tensor) -> np.ndarray:
    """A torch tensor as numpy: float32 stays float32, bfloat16 becomes ml_dtypes bfloat16 (same bits)."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BF16)
    return tensor.numpy()


def bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.dtype(f"u{array.dtype.itemsize}"))


def read_file(path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_stored(dst) -> dict[str, np.ndarray]:
    """Every tensor of a converted checkpoint as stored (no widening)."""
    index = json.loads((dst / "diffusiongemma.json").read_text())
    out = {}
    for filename in sorted(set(index["weight_map"].values())):
        out.update(read_file(dst / filename))
    assert set(out) == set(index["weight_map"])
    return out


def make_checkpoint(path, tensors: dict, config: dict) -> str:
    """Write a single-file transformers-style checkpoint directory."""
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, SINGLE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def assert_no_output(dst) -> None:
    """Neither the destination nor a temporary sibling of it exists."""
    assert not os.path.lexists(dst)
    leftovers = [n for n in os.listdir(os.path.dirname(dst)) if n.startswith(f".{os.path.basename(dst)}.")]
    assert leftovers == []


# ---------------------------------------------------------------------------------------------- name map
@pytest.mark.parametrize("spec", [TinySpec(), TinySpec(layer_types=["full_attention"] * 2)])
def test_name_rules_are_inverse_and_cover_the_format(spec):
    from diffusiongemma.reference.config import ModelConfig
    from tests.hf_tiny import hf_config

    config = ModelConfig.from_transformers(hf_config(spec).to_dict())
    names = list(expected_shapes(config))
    keys = [hf_name(n) for n in names]
    assert len(set(keys)) == len(keys)
    assert [project_name(k) for k in keys] == names
    for key in keys:
        assert tied_source(key) is None and skipped_group(key) is None


def test_name_rules_classify_tied_and_skipped_keys():
    assert tied_source("lm_head.weight") == "model.decoder.embed_tokens.weight"
    assert tied_source("model.encoder.language_model.norm.weight") == "model.decoder.norm.weight"
    assert (tied_source("model.encoder.language_model.layers.3.experts.down_proj")
            == "model.decoder.layers.3.experts.down_proj")
    assert tied_source("model.encoder.language_model.layers.3.layer_scalar") is None
    assert project_name("model.encoder.language_model.layers.3.layer_scalar") == "layers.3.encoder_layer_scalar"
    assert project_name("model.decoder.layers.3.layer_scalar") == "layers.3.decoder_layer_scalar"
    assert skipped_group("model.encoder.vision_tower.patch_embedder.input_proj.weight") == "vision_tower"
    assert skipped_group("model.encoder.embed_vision.embedding_projection.weight") == "embed_vision"
    for odd in ("model.decoder.layers.0.q_proj.weight", "model.decoder.layers.0.self_attn.v_norm.weight",
                "model.decoder.layers.0.router.scale.weight", "model.decoder.self_conditioning.post_norm",
                "model.decoder.layers.x.input_layernorm.weight", "lm_head.bias"):
        assert project_name(odd) is None and tied_source(odd) is None


# ---------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("source", ["hf_dir", "hf_sharded_dir"])
def test_float32_conversion_equals_every_hf_parameter(source, request, hf_model, tmp_path):
    src = request.getfixturevalue(source)
    summary = convert(src, tmp_path / "out", progress=False)
    config, tensors = load_converted(tmp_path / "out")
    expected = {k: as_numpy(v) for k, v in hf_parameters(hf_model).items()}
    assert set(tensors) == set(expected) == set(expected_shapes(config))
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    # The two layer scalars are separate tensors: each came from its own buffer, and they differ.
    for l in range(config.num_hidden_layers):
        enc, dec = tensors[f"layers.{l}.encoder_layer_scalar"], tensors[f"layers.{l}.decoder_layer_scalar"]
        assert enc[0] != dec[0]
    assert summary.num_tensors == len(expected)
    assert summary.parameter_count == sum(v.size for v in expected.values())


def test_in_memory_loader_matches_the_converted_checkpoint(hf_sharded_dir, tmp_path):
    convert(hf_sharded_dir, tmp_path / "out", progress=False)
    config_a, from_disk = load_converted(tmp_path / "out")
    config_b, in_memory = load_transformers_checkpoint(hf_sharded_dir, progress=True)
    assert config_a == config_b
    assert set(from_disk) == set(in_memory)
    for name in from_disk:
        assert in_memory[name].dtype == np.float32 and in_memory[name].flags.c_contiguous
        np.testing.assert_array_equal(in_memory[name], from_disk[name], err_msg=name)


def test_single_and_sharded_sources_give_byte_identical_weights(hf_dir, hf_sharded_dir, tmp_path):
    convert(hf_dir, tmp_path / "a", shard_size=150_000, progress=False)
    convert(hf_sharded_dir, tmp_path / "b", shard_size=150_000, progress=False)
    files = sorted(n for n in os.listdir(tmp_path / "a") if n.endswith(".safetensors"))
    assert len(files) > 1 and files == sorted(n for n in os.listdir(tmp_path / "b") if n.endswith(".safetensors"))
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_bfloat16_source_to_bfloat16_is_bit_identical(hf_bf16, tmp_path):
    model, src = hf_bf16
    convert(src, tmp_path / "out", dtype="bfloat16", progress=False)
    stored = read_stored(tmp_path / "out")
    for name, param in hf_parameters(model).items():
        assert stored[name].dtype == BF16, name
        np.testing.assert_array_equal(bits(stored[name]), bits(as_numpy(param)), err_msg=name)


def test_bfloat16_source_to_float32_widens_exactly(hf_bf16, tmp_path):
    model, src = hf_bf16
    convert(src, tmp_path / "out", dtype="float32", progress=False)
    stored = read_stored(tmp_path / "out")
    for name, param in hf_parameters(model).items():
        assert stored[name].dtype == np.float32
        # bf16 -> f32 is the bf16 bit pattern in the top half of the word.
        np.testing.assert_array_equal(bits(stored[name]), bits(as_numpy(param)).astype(np.uint32) << 16)


def test_float32_source_to_bfloat16_rounds_like_torch(hf_model, hf_dir, tmp_path):
    import torch

    convert(hf_dir, tmp_path / "out", dtype="bfloat16", progress=False)
    stored = read_stored(tmp_path / "out")
    for name, param in hf_parameters(hf_model).items():
        np.testing.assert_array_equal(bits(stored[name]), bits(as_numpy(param.to(torch.bfloat16))), err_msg=name)


def test_float16_source_widens_exactly(f32_state, tmp_path):
    tensors, config = f32_state
    half = {k: v.astype(np.float16) for k, v in tensors.items()}
    src = make_checkpoint(tmp_path / "src", half, config)
    convert(src, tmp_path / "out", progress=False)
    _, converted = load_converted(tmp_path / "out")
    for name in converted:
        np.testing.assert_array_equal(converted[name], half[hf_name(name)].astype(np.float32), err_msg=name)
    assert json.loads((tmp_path / "out" / "diffusiongemma.json").read_text())["source"]["dtypes"] == {"F16": len(converted)}


# ---------------------------------------------------------------------------------------------- dtype properties
def rne_bfloat16_bits(f32_bits: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 on bit patterns (finite inputs), independent of ml_dtypes."""
    u = f32_bits.astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


_low_halves = st.one_of(st.sampled_from([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF]), st.integers(0, 0xFFFF))
_f32_words = st.tuples(st.integers(0, 0xFFFF), _low_halves).map(lambda hl: (hl[0] << 16) | hl[1])


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(_f32_words, min_size=1, max_size=64))
def test_float32_to_bfloat16_is_round_to_nearest_even(words):
    f32 = np.array(words, dtype=np.uint32).view(np.float32)
    expected = rne_bfloat16_bits(bits(f32))
    finite = np.isfinite(f32) & ((expected & 0x7F80) != 0x7F80)  # finite, and does not round up to inf
    if finite.all():
        out = to_storage(f32, "bfloat16")
        assert out.dtype == BF16
        np.testing.assert_array_equal(bits(out), expected)
    else:
        with pytest.raises(CheckpointError, match="NaN or infinite"):
            to_storage(f32, "bfloat16", "weird")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=64))
def test_bfloat16_and_float16_widen_exactly_and_round_trip(words):
    raw = np.array(words, dtype=np.uint16)
    for source_dtype in (BF16, np.dtype(np.float16)):
        value = raw.view(source_dtype)
        if not np.isfinite(value.astype(np.float32)).all():
            with pytest.raises(CheckpointError):
                to_storage(value, "float32")
            continue
        wide = to_storage(value, "float32")
        assert wide.dtype == np.float32
        assert np.array_equal(wide.astype(source_dtype).view(np.uint16), raw)  # widening lost nothing
        narrow = to_storage(value, "bfloat16")
        if source_dtype == BF16:
            assert narrow is value  # kept bit for bit
        else:  # float16 -> float32 is exact, so this is the one rounding to bfloat16
            np.testing.assert_array_equal(bits(narrow), rne_bfloat16_bits(bits(wide)))


def test_to_storage_rejects_other_dtypes():
    with pytest.raises(InputError, match="float16"):
        to_storage(np.zeros(2, np.float32), "float16")
    with pytest.raises(CheckpointError, match="w: unsupported dtype float64"):
        to_storage(np.zeros(2, np.float64), "float32", "w")


# ---------------------------------------------------------------------------------------------- output format
def test_index_summary_and_side_files(hf_dir, tmp_path):
    dst = tmp_path / "out"
    summary = convert(hf_dir, dst, dtype="bfloat16", progress=False)
    index = json.loads((dst / "diffusiongemma.json").read_text())
    config, tensors = load_converted(dst)
    assert index["format"] == "diffusiongemma" and index["format_version"] == 1 and index["dtype"] == "bfloat16"
    assert index["model_config"] == config.to_dict()
    assert index["parameter_count"] == summary.parameter_count == sum(t.size for t in tensors.values())
    assert list(index["weight_map"]) == list(expected_shapes(config))
    source_keys = list(read_file(hf_dir / SINGLE))
    vision = sum(k.startswith("model.encoder.vision_tower.") for k in source_keys)
    embed_vision = sum(k.startswith("model.encoder.embed_vision.") for k in source_keys)
    assert vision > 0 and embed_vision == 1
    assert summary.skipped == index["source"]["skipped"] == {"vision_tower": vision, "embed_vision": embed_vision}
    assert summary.num_tensors + vision + embed_vision == len(source_keys)  # every tensor accounted for
    assert index["source"]["files"] == [SINGLE] and index["source"]["dtypes"] == {"F32": len(tensors)}
    assert summary.output_bytes == {"bfloat16": 2 * summary.parameter_count}
    assert summary.source_bytes == {"F32": 4 * summary.parameter_count}
    for name, dest in [("tokenizer.json", "tokenizer.json"), ("chat_template.jinja", "chat_template.jinja"),
                       ("generation_config.json", "generation_config.json"), ("config.json", "transformers_config.json")]:
        assert (dst / dest).read_bytes() == (hf_dir / name).read_bytes()
        assert dest in summary.copied
    assert not (dst / "tokenizer_config.json").exists()
    text = str(summary)
    assert f"{summary.parameter_count:,}" in text and f"vision_tower {vision}" in text and "bfloat16" in text


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(shard_size=st.integers(1_000, 1_500_000))
def test_output_shards_respect_shard_size(hf_dir, shard_size):
    with tempfile.TemporaryDirectory() as tmp:
        dst = os.path.join(tmp, "out")
        summary = convert(hf_dir, dst, shard_size=shard_size, progress=False)
        index = json.load(open(os.path.join(dst, "diffusiongemma.json")))
        assert list(summary.files) == [f"weights-{i:05d}.safetensors" for i in range(1, len(summary.files) + 1)]
        assert set(index["weight_map"].values()) == set(summary.files)
        shapes = expected_shapes(load_converted(dst)[0])
        for filename in summary.files:
            sizes = [4 * int(np.prod(shapes[n])) for n, f in index["weight_map"].items() if f == filename]
            assert sum(sizes) <= shard_size or len(sizes) == 1, (filename, sizes)
        # Greedy packing: a file is only closed when the next tensor would not fit.
        order = list(index["weight_map"])
        for a, b in zip(order, order[1:]):
            if index["weight_map"][a] != index["weight_map"][b]:
                used = sum(4 * int(np.prod(shapes[n])) for n in order if index["weight_map"][n] == index["weight_map"][a])
                assert used + 4 * int(np.prod(shapes[b])) > shard_size


# ---------------------------------------------------------------------------------------------- tied copies
@pytest.fixture(scope="module")
def full_state(hf_model, hf_dir):
    """Every tensor of ``model.state_dict()``, tied copies (lm_head, encoder text weights) included."""
    tensors = {k: np.ascontiguousarray(v.detach().numpy()) for k, v in hf_model.state_dict().items()}
    config = json.loads((hf_dir / "config.json").read_text())
    return tensors, config


def test_tied_copies_are_checked_then_skipped(full_state, hf_dir, tmp_path):
    tensors, config = full_state
    n_tied = sum(tied_source(k) is not None for k in tensors)
    assert "lm_head.weight" in tensors and n_tied > 50
    src = make_checkpoint(tmp_path / "src", tensors, config)
    summary = convert(src, tmp_path / "out", progress=False)
    assert summary.skipped["tied_copies"] == n_tied
    convert(hf_dir, tmp_path / "plain", progress=False)
    for name in expected_shapes(load_converted(tmp_path / "out")[0]):
        assert (read_stored(tmp_path / "out")[name] == read_stored(tmp_path / "plain")[name]).all()


@pytest.mark.parametrize("key", ["lm_head.weight", "model.encoder.language_model.layers.2.router.per_expert_scale",
                                 "model.encoder.language_model.embed_tokens.weight"])
def test_differing_tied_copy_is_an_error(full_state, key, tmp_path):
    tensors, config = full_state
    tensors = dict(tensors)
    tensors[key] = tensors[key].copy()
    tensors[key].reshape(-1)[-1] += 1.0
    src = make_checkpoint(tmp_path / "src", tensors, config)
    with pytest.raises(CheckpointError, match=rf"'{key}' differs from .* in 1 of"):
        convert(src, tmp_path / "out", progress=False)
    assert_no_output(str(tmp_path / "out"))


# ---------------------------------------------------------------------------------------------- bad input
def _drop(key):
    def edit(t, c):
        del t[key]
        return t, c
    return edit


def _put(key, value):
    return lambda t, c: ({**t, key: value}, c)


def _text_config(**changes):
    def edit(t, c):
        c = copy.deepcopy(c)
        c["text_config"].update(changes)
        return t, c
    return edit


def _nan(t, c):
    t = dict(t)
    t["model.decoder.layers.1.mlp.up_proj.weight"] = t["model.decoder.layers.1.mlp.up_proj.weight"].copy()
    t["model.decoder.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    return t, c


def _untied(t, c):
    c = copy.deepcopy(c)
    c["tie_word_embeddings"] = False
    return t, c


BAD_CHECKPOINTS = {
    "missing tensor": (_drop("model.decoder.layers.3.mlp.up_proj.weight"), CheckpointError,
                       r"missing tensor 'model\.decoder\.layers\.3\.mlp\.up_proj\.weight' \(layers\.3\.mlp\.up_proj, "
                       r"expected shape \(96, 64\)\)"),
    "missing encoder scalar": (_drop("model.encoder.language_model.layers.1.layer_scalar"), CheckpointError,
                               r"missing tensor 'model\.encoder\.language_model\.layers\.1\.layer_scalar'"),
    "missing decoder scalar": (_drop("model.decoder.layers.4.layer_scalar"), CheckpointError,
                               r"missing tensor 'model\.decoder\.layers\.4\.layer_scalar'"),
    "unknown tensor": (_put("model.decoder.layers.0.self_attn.qkv_proj.weight", np.zeros((4, 4), np.float32)),
                       CheckpointError, r"unknown tensor 'model\.decoder\.layers\.0\.self_attn\.qkv_proj\.weight'"),
    "v_proj on a full layer": (_put("model.decoder.layers.2.self_attn.v_proj.weight", np.zeros((32, 64), np.float32)),
                               CheckpointError, r"'model\.decoder\.layers\.2\.self_attn\.v_proj\.weight' .*full_attention"),
    "layer beyond config": (_put("model.decoder.layers.5.input_layernorm.weight", np.ones(64, np.float32)),
                            CheckpointError, r"layer 5, but config\.json has num_hidden_layers=5"),
    "wrong shape": (_put("model.decoder.layers.1.self_attn.k_proj.weight", np.zeros((16, 64), np.float32)),
                    CheckpointError, r"'model\.decoder\.layers\.1\.self_attn\.k_proj\.weight' .* shape \(16, 64\), "
                                     r"but config\.json implies \(32, 64\)"),
    "wrong scalar shape": (_put("model.encoder.language_model.layers.0.layer_scalar", np.ones(2, np.float32)),
                           CheckpointError, r"layer_scalar' .* shape \(2,\), but config\.json implies \(1,\)"),
    "tied copy without source": (_put("model.encoder.language_model.layers.2.self_attn.v_proj.weight",
                                      np.zeros((32, 64), np.float32)), CheckpointError,
                                 r"'model\.encoder\.language_model\.layers\.2\.self_attn\.v_proj\.weight' is a tied "
                                 r"copy of 'model\.decoder\.layers\.2\.self_attn\.v_proj\.weight', which this checkpoint"),
    "tied copy wrong shape": (_put("lm_head.weight", np.zeros((64, 128), np.float32)), CheckpointError,
                              r"tied tensor 'lm_head\.weight' has shape \(64, 128\), but its source "
                              r"'model\.decoder\.embed_tokens\.weight' has shape \(128, 64\)"),
    "integer dtype": (_put("model.decoder.norm.weight", np.ones(64, np.int64)), CheckpointError,
                      r"'model\.decoder\.norm\.weight' has dtype I64"),
    "NaN weight": (_nan, CheckpointError,
                   r"'model\.decoder\.layers\.1\.mlp\.up_proj\.weight \(layers\.1\.mlp\.up_proj\)' holds 1 NaN"),
    "sliding last layer": (_text_config(layer_types=["sliding_attention"] * 5), ConfigError,
                           r"config\.json: .*layer_types\[-1\]"),
    "bidirectional all": (_text_config(use_bidirectional_attention="all"), ConfigError,
                          r"use_bidirectional_attention='all'"),
    "bad kv heads": (_text_config(num_key_value_heads=3), ConfigError, r"num_key_value_heads of layer 0 \(3\)"),
    "untied lm_head": (_untied, ConfigError, r"tie_word_embeddings=False is not supported"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_rejected_and_leaves_nothing(case, f32_state, tmp_path):
    edit, error, pattern = BAD_CHECKPOINTS[case]
    tensors, config = edit(dict(f32_state[0]), copy.deepcopy(f32_state[1]))
    src = make_checkpoint(tmp_path / "src", tensors, config)
    with pytest.raises(error, match=pattern):
        convert(src, tmp_path / "out", progress=False)
    assert_no_output(str(tmp_path / "out"))
    with pytest.raises(error, match=pattern):
        load_transformers_checkpoint(src)


def test_truncated_safetensors_file(hf_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    data = (src / SINGLE).read_bytes()
    (src / SINGLE).write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable or truncated"):
        convert(src, tmp_path / "out", progress=False)
    assert_no_output(str(tmp_path / "out"))


def test_sharded_index_problems(hf_sharded_dir, tmp_path):
    index_name = "model.safetensors.index.json"
    index = json.loads((hf_sharded_dir / index_name).read_text())
    shard = sorted(set(index["weight_map"].values()))[3]

    src = tmp_path / "missing_shard"
    shutil.copytree(hf_sharded_dir, src)
    (src / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard} listed in {index_name} is missing"):
        convert(src, tmp_path / "out", progress=False)

    src = tmp_path / "unlisted"
    shutil.copytree(hf_sharded_dir, src)
    victim = next(k for k, f in index["weight_map"].items() if f == shard)
    edited = dict(index, weight_map={k: f for k, f in index["weight_map"].items() if k != victim})
    (src / index_name).write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=rf"{shard}: holds tensor '{victim}', which {index_name} does not list"):
        convert(src, tmp_path / "out", progress=False)

    src = tmp_path / "not_in_file"
    shutil.copytree(hf_sharded_dir, src)
    other = next(f for f in index["weight_map"].values() if f != shard)
    edited = dict(index, weight_map={**index["weight_map"], victim: other})
    (src / index_name).write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=f"lists tensor '{victim}' in {other}, but the file does not hold it"):
        convert(src, tmp_path / "out", progress=False)
    assert_no_output(str(tmp_path / "out"))


def test_missing_files(hf_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(hf_dir / "config.json", src)
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        convert(src, tmp_path / "out", progress=False)
    (src / "config.json").unlink()
    shutil.copy(hf_dir / SINGLE, src)
    with pytest.raises(CheckpointError, match="config.json is missing"):
        convert(src, tmp_path / "out", progress=False)
    (src / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        convert(src, tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match="not a directory"):
        convert(tmp_path / "nowhere", tmp_path / "out", progress=False)
    assert_no_output(str(tmp_path / "out"))


def test_bad_arguments(hf_dir, tmp_path):
    with pytest.raises(InputError, match="dtype must be one of"):
        convert(hf_dir, tmp_path / "out", dtype="float16", progress=False)
    with pytest.raises(InputError, match="shard_size must be a positive"):
        convert(hf_dir, tmp_path / "out", shard_size=0, progress=False)
    with pytest.raises(FileNotFoundError, match="parent directory"):
        convert(hf_dir, tmp_path / "no" / "out", progress=False)
    assert_no_output(str(tmp_path / "out"))


# ---------------------------------------------------------------------------------------------- destination
def test_existing_destination_needs_force(hf_dir, hf_bf16, tmp_path):
    dst = tmp_path / "out"
    convert(hf_bf16[1], dst, dtype="bfloat16", progress=False)
    before = {n: (dst / n).read_bytes() for n in os.listdir(dst)}
    with pytest.raises(FileExistsError, match="already exists; pass --force"):
        convert(hf_dir, dst, progress=False)
    assert {n: (dst / n).read_bytes() for n in os.listdir(dst)} == before
    convert(hf_dir, dst, force=True, progress=False)
    assert json.loads((dst / "diffusiongemma.json").read_text())["dtype"] == "float32"
    assert [n for n in os.listdir(tmp_path) if n != "out"] == []


def test_force_never_deletes_an_unrelated_directory(hf_dir, tmp_path):
    dst = tmp_path / "precious"
    dst.mkdir()
    (dst / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="not a converted diffusiongemma checkpoint"):
        convert(hf_dir, dst, force=True, progress=False)
    assert os.listdir(dst) == ["thesis.tex"]
    with pytest.raises(InputError, match="same directory"):
        convert(hf_dir, hf_dir, force=True, progress=False)


@pytest.mark.parametrize("existing", [False, True])
def test_interrupt_leaves_no_output_and_keeps_the_old_one(existing, hf_dir, hf_bf16, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    if existing:
        convert(hf_bf16[1], dst, dtype="bfloat16", progress=False)
        before = {n: (dst / n).read_bytes() for n in os.listdir(dst)}
    calls = []
    real = conversion.to_storage

    def interrupting(array, dtype, name):
        calls.append(name)
        if len(calls) == 40:
            raise KeyboardInterrupt
        return real(array, dtype, name)

    monkeypatch.setattr(conversion, "to_storage", interrupting)
    with pytest.raises(KeyboardInterrupt):
        convert(hf_dir, dst, shard_size=20_000, force=True, progress=False)
    assert len(calls) == 40
    if existing:
        assert {n: (dst / n).read_bytes() for n in os.listdir(dst)} == before
        assert [n for n in os.listdir(tmp_path) if n != "out"] == []
    else:
        assert_no_output(str(dst))


# ---------------------------------------------------------------------------------------------- command line
def test_cli_end_to_end(hf_sharded_dir, hf_model, tmp_path, capsys):
    dst = tmp_path / "out"
    status = cli.main([str(hf_sharded_dir), str(dst), "--dtype", "bfloat16", "--shard-size", "100KB", "--no-progress"])
    out = capsys.readouterr()
    assert status == 0, out.err
    params = hf_parameters(hf_model)
    count = sum(p.numel() for p in params.values())
    assert f"parameters: {count:,} in {len(params)} tensors" in out.out
    assert "vision_tower" in out.out and "embed_vision 1" in out.out
    index = json.loads((dst / "diffusiongemma.json").read_text())
    assert index["dtype"] == "bfloat16" and len(set(index["weight_map"].values())) > 1
    _, tensors = load_converted(dst)
    import torch

    for name, param in params.items():
        np.testing.assert_array_equal(tensors[name], param.detach().to(torch.bfloat16).float().numpy())

    # A second run without --force fails with a message and leaves the first result alone.
    status = cli.main([str(hf_sharded_dir), str(dst), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1 and "already exists" in err
    assert json.loads((dst / "diffusiongemma.json").read_text())["dtype"] == "bfloat16"


def test_cli_reports_bad_input(f32_state, tmp_path, capsys):
    tensors, config = f32_state
    config = copy.deepcopy(config)
    config["text_config"]["use_bidirectional_attention"] = "all"
    src = make_checkpoint(tmp_path / "src", tensors, config)
    assert cli.main([src, str(tmp_path / "out"), "--no-progress"]) == 1
    assert "error:" in capsys.readouterr().err
    assert_no_output(str(tmp_path / "out"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([src, str(tmp_path / "out"), "--dtype", "float64"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("text, size", [("1048576", 1048576), ("2GB", 2 * 10 ** 9), ("500MiB", 500 * 2 ** 20),
                                        ("1.5kb", 1500), ("64 KiB", 65536)])
def test_parse_size(text, size):
    assert cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1", "0", "2TB", "lots"])
def test_parse_size_rejects(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_size(text)


def test_output_permissions_follow_the_umask(hf_dir, tmp_path):
    """The atomic temp directory (0700) and safetensors' 0600 files must not leak into the result."""
    import stat

    old = os.umask(0o022)
    try:
        convert(hf_dir, tmp_path / "perm", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "perm").st_mode) == 0o755
    for name in os.listdir(tmp_path / "perm"):
        assert stat.S_IMODE(os.stat(tmp_path / "perm" / name).st_mode) == 0o644, name
