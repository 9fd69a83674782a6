"""The released-shape checkpoint maker (``diffusiongemma.released``, ``diffusiongemma make-checkpoint``).

What is checked, at reduced widths (CI-sized) but the released layer pattern:
* the names and shapes it writes are those transformers' ``save_pretrained`` writes for the same config, and
  the others of transformers' state dict are ties;
* the folder loads in transformers (no missing, unexpected or mismatched key; the values are the maker's) and
  in the project, in bfloat16 and float32, one file or sharded; a forward pass is finite;
* config.json is transformers' own: the released layer pattern and zero-padded ``per_layer_config`` keys;
* the values depend on (seed, name) only, and every weight is a bfloat16 number;
* writing holds one chunk of one tensor, not the model (peak traced memory, in a child process);
* bad options are refused by name and leave nothing behind; ``--gguf`` writes a GGUF the project reads.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from diffusiongemma import released
from diffusiongemma.reference.support.errors import InputError
from diffusiongemma.released import FULL, SLIDING

import torch  # noqa: E402  (the test extra installs both)
import transformers  # noqa: E402

# 12 layers: two full layers (5 and 11), so per_layer_config's keys are zero-padded ("05", "11")
SMALL = dict(layers=12, scale=64)


def header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(n))
    entries.pop("__metadata__", None)
    return entries


def stored(directory: str) -> dict[str, dict]:
    """name -> header entry over every safetensors file of ``directory``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(header(os.path.join(directory, name)))
    return out


def values(name: str, shape: tuple, seed: int = 0) -> np.ndarray:
    return np.concatenate([c.copy() for c in released.tensor_chunks(name, shape, seed)]).reshape(shape)


@pytest.fixture(scope="module")
def small_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("released") / "bf16"
    made = released.make_checkpoint(path, dtype="bfloat16", seed=3, shard_size=400_000, **SMALL)
    return str(path), made


def test_the_released_shape_is_the_specs():
    shape = released.released_shape()
    assert (shape.layers, shape.vocab_size, shape.hidden_size, shape.intermediate_size) == (30, 262_144, 2816, 2112)
    assert (shape.num_experts, shape.top_k_experts, shape.moe_intermediate_size) == (128, 8, 704)
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.num_global_key_value_heads) == (16, 8, 2)
    assert (shape.head_dim, shape.global_head_dim, shape.sliding_window, shape.canvas_length) == (256, 512, 1024, 256)
    kinds = shape.layer_types()
    assert [i for i, k in enumerate(kinds) if k == FULL] == [5, 11, 17, 23, 29]
    # 25.2 B parameters, 50.5 GB in bfloat16 (the tiny vision tower adds 0.33 M)
    assert 25.2e9 < shape.parameters() < 25.3e9
    assert 50.5e9 < 2 * shape.parameters() < 50.6e9
    config = released.hf_config(shape).to_dict()
    text = config["text_config"]
    assert text["per_layer_config"] == {key: {"head_dim": 512, "num_key_value_heads": 2}
                                        for key in ("05", "11", "17", "23", "29")}
    assert (text["rope_parameters"][FULL]["partial_rotary_factor"], text["final_logit_softcapping"]) == (0.25, 30.0)
    assert (config["image_token_id"], config["boi_token_id"], config["eoi_token_id"]) == (258_880, 255_999, 258_882)
    from diffusiongemma.reference.config import ModelConfig

    ours = ModelConfig.from_transformers(config)
    assert ours.layer_head_dim == tuple(512 if k == FULL else 256 for k in kinds)
    assert ours.layer_num_key_value_heads == tuple(2 if k == FULL else 8 for k in kinds)


@pytest.mark.parametrize("layers", [1, 2, 5, 6, 7, 12, 13, 30])
def test_layer_pattern_is_transformers_default(layers):
    from transformers import DiffusionGemmaTextConfig

    assert released.layer_types(layers) == DiffusionGemmaTextConfig(num_hidden_layers=layers).layer_types
    assert released.layer_types(layers)[-1] == FULL


def test_names_and_shapes_are_what_transformers_saves(tmp_path):
    """``tensor_shapes`` against a ``save_pretrained`` of transformers' own model of the same config, and
    against its state dict (whose other keys are the tied encoder text weights and lm_head)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    shape = released.released_shape(**SMALL)
    model = DiffusionGemmaForBlockDiffusion._from_config(released.hf_config(shape, "float32"), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    theirs = {name: tuple(entry["shape"]) for name, entry in stored(str(tmp_path)).items()}
    ours = released.tensor_shapes(shape)
    assert ours == theirs
    state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: state[name] for name in ours} == ours
    tied = set(state) - set(ours)
    assert tied and all(n == "lm_head.weight" or (n.startswith("model.encoder.language_model.")
                                                  and not n.endswith("layer_scalar")) for n in tied)


def test_checkpoint_loads_in_transformers_with_the_makers_values(small_bf16):
    path, made = small_bf16
    from transformers import DiffusionGemmaForBlockDiffusion

    assert len(made.files) > 1 and os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model, info = DiffusionGemmaForBlockDiffusion.from_pretrained(path, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert model.dtype == torch.bfloat16
    state = model.state_dict()
    shapes = released.tensor_shapes(made.shape)
    for name in ("model.decoder.layers.11.self_attn.q_proj.weight", "model.decoder.layers.4.experts.down_proj",
                 "model.decoder.norm.weight", "model.encoder.language_model.layers.5.layer_scalar",
                 "model.decoder.layers.5.layer_scalar", "model.decoder.embed_tokens.weight"):
        got = state[name].float().numpy()
        np.testing.assert_array_equal(got, values(name, shapes[name], seed=3), err_msg=name)
    # tied: the encoder's text weights and lm_head are the decoder's embedding / layers
    assert torch.equal(state["lm_head.weight"], state["model.decoder.embed_tokens.weight"])
    assert not torch.equal(state["model.encoder.language_model.layers.5.layer_scalar"],
                           state["model.decoder.layers.5.layer_scalar"])


def test_config_is_transformers_own(small_bf16):
    path, made = small_bf16
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    text = config["text_config"]
    assert text["layer_types"] == [FULL if i in (5, 11) else SLIDING for i in range(12)]
    assert list(text["per_layer_config"]) == ["05", "11"]  # zero-padded, as save_pretrained writes them
    assert text["per_layer_config"]["05"] == {"head_dim": made.shape.global_head_dim, "num_key_value_heads": 2}
    assert (config["dtype"], text["dtype"], config["architectures"]) == ("bfloat16", "bfloat16",
                                                                         ["DiffusionGemmaForBlockDiffusion"])
    from transformers import DiffusionGemmaConfig

    assert DiffusionGemmaConfig.from_pretrained(path).to_dict()["text_config"]["per_layer_config"] == \
        text["per_layer_config"]
    with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as f:
        assert json.load(f)["max_denoising_steps"] == 48


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_checkpoint_loads_in_the_project_and_runs_finite(tmp_path, dtype, small_bf16):
    path = str(tmp_path / "ckpt")
    made = released.make_checkpoint(path, dtype=dtype, seed=3, **SMALL)
    assert made.files == ["model.safetensors"]
    entries = stored(path)
    assert {n: tuple(e["shape"]) for n, e in entries.items()} == released.tensor_shapes(made.shape)
    assert {e["dtype"] for e in entries.values()} == {"BF16" if dtype == "bfloat16" else "F32"}
    # every entry is back to back: the data section is exactly the tensors' bytes
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert n % 8 == 0
    assert os.path.getsize(os.path.join(path, "model.safetensors")) == 8 + n + made.weight_bytes
    from diffusiongemma.checkpoint import load_model

    model = load_model(path, "reference")
    assert model.config.layer_head_dim == tuple(made.shape.global_head_dim if i in (5, 11) else made.shape.head_dim
                                                for i in range(12))
    # the same weights as the bfloat16 checkpoint of the same seed, whatever the storage dtype
    other = load_model(small_bf16[0], "reference")
    for name in ("embed_tokens", "layers.11.experts.gate_up_proj", "layers.0.q_norm"):
        np.testing.assert_array_equal(model.tensors[name], other.tensors[name], err_msg=name)
    cache = model.new_cache(1)
    model.encode(np.array([[2, 100, 200, 300, 400]]), cache)
    logits = model.denoise(np.full((1, made.shape.canvas_length), 7), cache)
    assert np.isfinite(logits).all() and logits.std() > 0.1


def test_values_depend_on_seed_and_name_only():
    shape = (3, 5, 70)
    name = "model.decoder.layers.0.experts.down_proj"
    whole = values(name, shape)
    chunked = np.concatenate([c.copy() for c in released.tensor_chunks(name, shape, 0, chunk=17)])
    np.testing.assert_array_equal(whole.reshape(-1), chunked)
    assert not np.array_equal(whole, values(name, shape, seed=1))
    assert not np.array_equal(whole, values(name.replace("0", "1"), shape))
    assert not (whole.view(np.uint32) & 0xFFFF).any()  # bfloat16 numbers
    a = math.sqrt(3 / 70)
    assert -a <= whole.min() < -0.8 * a and 0.8 * a < whole.max() <= a
    scalars = values("model.decoder.layers.0.layer_scalar", (4000,))
    assert 0.5 <= scalars.min() and scalars.max() <= 1.5
    norms = values("model.decoder.norm.weight", (4000,))
    assert 0.75 <= norms.min() and norms.max() <= 1.25 and norms.std() > 0.1


def test_a_layer_does_not_depend_on_the_layer_count(tmp_path):
    a = released.make_checkpoint(tmp_path / "a", layers=2, scale=64, dtype="float32")
    b = released.make_checkpoint(tmp_path / "b", layers=7, scale=64, dtype="float32")
    from safetensors.numpy import load_file

    ta, tb = load_file(os.path.join(a.path, "model.safetensors")), load_file(os.path.join(b.path, "model.safetensors"))
    for name in ("model.decoder.layers.0.self_attn.k_proj.weight", "model.decoder.embed_tokens.weight"):
        np.testing.assert_array_equal(ta[name], tb[name])


PEAK_SCRIPT = r"""
import json, math, sys, tracemalloc
from diffusiongemma import released
released.make_checkpoint(sys.argv[1] + "/warm", layers=1, scale=64)   # imports and first-use allocations
tracemalloc.start()
made = released.make_checkpoint(sys.argv[1] + "/big", layers=6, dtype="float32", chunk=1 << 16,
                                vocab_size=4096, hidden_size=256, num_experts=16, moe_intermediate_size=64,
                                intermediate_size=256, head_dim=16, global_head_dim=32)
peak = tracemalloc.get_traced_memory()[1]
largest = max(math.prod(s) for s in released.tensor_shapes(made.shape).values()) * 4
print(json.dumps({"peak": peak, "largest": largest, "total": made.weight_bytes}))
"""


def test_writing_holds_a_chunk_not_the_model(tmp_path):
    """Peak memory traced (NumPy's buffers included) while writing a float32 model of about 20 MB whose
    largest tensor is 4 MB, with chunks of 65,536 values (256 KiB): under half a tensor, whereas a writer
    that kept the tensors, or one whole tensor as float32 plus its bytes, goes past it. In a child process,
    so that nothing the test session allocated counts."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["total"] > 4 * seen["largest"], seen
    assert seen["peak"] < seen["largest"] / 2, seen


def main(argv: list[str]) -> int:
    """The command line's exit status (argparse's own refusals exit through SystemExit)."""
    from diffusiongemma.cli.main import main as run

    try:
        return run(argv)
    except SystemExit as exc:
        return exc.code


def test_bad_options_are_refused_by_name(tmp_path, capsys):
    out = str(tmp_path / "out")
    cases = [
        (["--layers", "0"], "--layers"),
        (["--dtype", "float16"], "--dtype"),
        (["--gguf", "bf16"], "--gguf"),
        (["--num-experts", "4"], "top_k_experts (--top-k-experts)"),
        (["--scale", "64", "--vocab-size", "1000"], "vocab_size (--vocab-size)"),
        (["--scale", "64", "--num-key-value-heads", "3"], "num_key_value_heads (--num-key-value-heads)"),
        (["--scale", "64", "--head-dim", "9"], "head_dim (--head-dim)"),
        (["--shard-size", "-1MB"], "--shard-size"),
        (["--seed", "-1"], "--seed"),
    ]
    for extra, named in cases:
        assert main(["make-checkpoint", out, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) <= 2, (extra, err)
        assert not os.path.exists(out) and os.listdir(tmp_path) == [], extra
    with pytest.raises(InputError, match="dtype"):
        released.make_checkpoint(out, dtype="float16")
    with pytest.raises(InputError, match="unknown shape field"):
        released.make_checkpoint(out, hidden=64)
    with pytest.raises(InputError, match=r"seed \(--seed\)"):
        released.make_checkpoint(out, seed=2 ** 64)
    with pytest.raises(InputError, match=r"scale \(--scale\)"):
        released.make_checkpoint(out, scale=0)
    assert os.listdir(tmp_path) == []


def test_existing_output_needs_force_and_force_replaces_only_a_checkpoint(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["make-checkpoint", out, "--layers", "2", "--scale", "64", "--seed", "1"]) == 0
    assert "2 layer(s) (1 sliding, 1 full)" in capsys.readouterr().out
    before = stored(out)
    assert main(["make-checkpoint", out, "--layers", "2", "--scale", "64"]) == 2
    assert "already exists" in capsys.readouterr().err and stored(out) == before
    assert main(["make-checkpoint", out, "--layers", "3", "--scale", "64", "--force"]) == 0
    assert "model.decoder.layers.2.layer_scalar" in stored(out)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["make-checkpoint", str(other), "--layers", "2", "--scale", "64", "--force"]) == 2
    assert "not a DiffusionGemma checkpoint" in capsys.readouterr().err
    assert os.listdir(other) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["notes", "out"]  # no hidden partial or replaced folders


def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def interrupt(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    original = released._write_file
    monkeypatch.setattr(released, "_write_file", interrupt)
    with pytest.raises(KeyboardInterrupt):
        released.make_checkpoint(tmp_path / "out", layers=6, scale=64, shard_size=200_000)
    assert len(calls) == 2 and os.listdir(tmp_path) == []


def test_gguf_option_writes_what_the_project_reads(tmp_path):
    made = released.make_checkpoint(tmp_path / "out", layers=2, scale=64, dtype="float32", gguf="f32", seed=5)
    assert made.gguf == os.path.join(made.path, "model-f32.gguf") and os.path.isfile(made.gguf)
    from diffusiongemma.checkpoint import load_model

    a, b = load_model(made.path, "reference"), load_model(made.gguf, "reference")
    assert a.config.layer_types == b.config.layer_types
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name], err_msg=name)


def test_too_little_memory_for_the_gguf_or_disk_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(released, "_available_memory", lambda: 1_000_000)
    with pytest.raises(InputError, match=r"gguf \(--gguf\) q8_0: the GGUF converter holds one encoded tensor at a time"):
        released.make_checkpoint(tmp_path / "out", layers=2, scale=64, gguf="q8_0")
    monkeypatch.setattr(released, "_available_memory", lambda: None)

    class Full:
        free = 1000

    monkeypatch.setattr(released.shutil, "disk_usage", lambda path: Full)
    with pytest.raises(InputError, match=r"OUT .*: the checkpoint needs [\d,]+ bytes and its folder's disk has "
                                         r"1,000 bytes free"):
        released.make_checkpoint(tmp_path / "out", layers=2, scale=64)
    assert os.listdir(tmp_path) == []


def test_what_a_killed_write_left_is_removed_by_the_next(tmp_path):
    """A hidden folder named as the maker names its work (host, pid, process start) whose process is gone:
    the next write to the same OUT removes it; one of a live process stays."""
    from diffusiongemma.weights_converter import writer

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    out = tmp_path / "out"
    dead = tmp_path / f".out.partial-{writer._HOST}-{pid}-1-abcd"
    alive = tmp_path / f".out.partial-{writer._HOST}-{os.getppid()}-0-efgh"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
    released.make_checkpoint(out, layers=1, scale=64)
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, "out"])
