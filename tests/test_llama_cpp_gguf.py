"""GGUF out (``diffusiongemma convert MODEL out.gguf``) and ``diffusiongemma crosscheck llama.cpp``.

The writer's file is the one llama.cpp loaded for the goldens (tests/test_llama_cpp_golden.py checks the bytes);
here: it reads back to the same model (F32 bit for bit, F16 / Q8_0 within their rounding), keeps float32 what
llama.cpp's converter keeps float32, carries a tokenizer that encodes like the checkpoint's, pads the token list
to the vocabulary, and refuses bad requests with one line. The crosscheck command is run against stand-in
binaries (small Python scripts) that replay a golden, so no llama.cpp build is needed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

import gguf

from diffusiongemma.checkpoint import default_model_dir, load_generation_config, load_text_side
from diffusiongemma.crosscheck.llama_cpp_peer import (LLAMA_CPP_COMMIT, byte_level_tokenizer,
                                                      random_tiny_model, write_tiny_checkpoint_text)
from diffusiongemma.reference import InputError, Model
from diffusiongemma.weights_converter.gguf import GGUFCheckpoint

try:
    from diffusiongemma.gguf_writer import PASS_THROUGH_TEMPLATE as PASS_THROUGH, write_gguf, write_model_gguf
except ImportError:  # pragma: no cover - the writer's earlier home
    from diffusiongemma.weights_converter.gguf_writer import (PASS_THROUGH_TEMPLATE as PASS_THROUGH, write_gguf,
                                                              write_model_gguf)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "llama.cpp")


@pytest.fixture(scope="module")
def shipped():
    return Model.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    return {t: write_gguf(default_model_dir(), out / f"kjv-{t}.gguf", t).destination for t in ("f32", "f16", "q8_0")}


def test_f32_reads_back_identical(shipped, written):
    back = Model.from_pretrained(written["f32"])
    assert back.config == shipped.config
    assert set(back.tensors) == set(shipped.tensors)
    assert all(np.array_equal(back.tensors[k], shipped.tensors[k]) for k in shipped.tensors)
    assert load_generation_config(written["f32"]) == load_generation_config(default_model_dir())


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_quantized_reads_back_within_rounding(shipped, written, kind):
    back = Model.from_pretrained(written[kind])
    checkpoint = GGUFCheckpoint.open(written[kind])
    assert back.config == shipped.config
    for name, want in shipped.tensors.items():
        got = back.tensors[name]
        if want.ndim == 1 or name.endswith(("norm", "router.proj", "router.scale", "per_expert_scale")):
            assert np.array_equal(got, want), name  # stored float32
            continue
        if kind == "f16" or want.shape[-1] % 32:
            bound = np.abs(want) * 2.0 ** -11 + 2.0 ** -25  # float16 rounding (subnormals near 0)
        else:  # Q8_0: 32-value blocks, scale d = max|x| / 127 stored as float16, values rounded to d * q
            d = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            bound = np.broadcast_to(d * (0.5 + 127 * 2.0 ** -11) + 1e-12, (d.shape[0], 32)).reshape(want.shape)
        assert (np.abs(got - want) <= bound).all(), name
        assert not np.array_equal(got, want), name  # it really is stored narrower
    types = {t.name: t.tensor_type.name for t in checkpoint.tensors.values()}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32" and types["output_norm.weight"] == "F32"
    assert types["blk.0.ffn_gate_inp.scale"] == "F32" and types["blk.0.ffn_down_exps.scale"] == "F32"
    assert types["blk.0.attn_q.weight"] == kind.upper()
    assert types["blk.0.ffn_gate_up_exps.weight"] == kind.upper()


def test_metadata_llama_cpp_needs(written):
    c = GGUFCheckpoint.open(written["f32"])
    assert c.string("general.architecture") == "diffusion-gemma"
    assert c.integer("diffusion.canvas_length") == 32 and c.integer("diffusion.eb_max_steps") == 16
    assert c.integer("tokenizer.ggml.mask_token_id") == 4  # llama.cpp's diffusion CLI asserts a mask token
    assert c.string("tokenizer.ggml.model") == "gpt2" and c.string("tokenizer.ggml.pre") == "gpt-2"
    assert len(c.array("tokenizer.ggml.tokens", "string")) == 4096  # llama.cpp draws canvas ids over its tokens
    assert c.string("tokenizer.chat_template") == PASS_THROUGH  # the shipped model has none
    assert c.boolean("tokenizer.ggml.add_bos_token") is True
    assert "rope_freqs.weight" in c.tensors and "output.weight" not in c.tensors
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length", "attention.key_length_swa", "expert_count",
                "expert_used_count", "expert_feed_forward_length", "attention.sliding_window"):
        assert c.has(f"diffusion-gemma.{key}"), key


def test_tokenizer_encodes_like_the_checkpoint(written):
    from diffusiongemma.weights_converter.gguf import gguf_text_side
    from diffusiongemma.checkpoint import TextSide

    side = gguf_text_side(written["f32"])
    side = side if isinstance(side, TextSide) else TextSide(*side)
    original = load_text_side(default_model_dir())
    for text in ("In the beginning God created the heaven and the earth.\n\nAnd", "  two  spaces, Ünïcödé\t", "x"):
        assert side.encode(text) == original.encode(text)
        assert side.decode(side.encode(text)) == original.decode(original.encode(text))


def test_token_list_padded_to_the_vocabulary(tmp_path):
    tiny = random_tiny_model(0)
    config = dataclasses.replace(tiny.config, vocab_size=270)
    tensors = dict(tiny.tensors)
    tensors["embed_tokens"] = np.concatenate([tensors["embed_tokens"], np.zeros((8, 32), np.float32)])
    write_tiny_checkpoint_text(str(tmp_path / "text"))
    path = write_model_gguf(Model(config, tensors), tmp_path / "text", tmp_path / "wide.gguf").destination
    c = GGUFCheckpoint.open(path)
    tokens, types = c.array("tokenizer.ggml.tokens", "string"), c.array("tokenizer.ggml.token_type", "integer")
    assert len(tokens) == 270 and tokens[262:] == [f"[PAD{i}]" for i in range(262, 270)]
    assert types[262:] == [5] * 8 and types[:5] == [3] * 5  # UNUSED pads, CONTROL specials
    assert Model.from_pretrained(path).config.vocab_size == 270


def test_bad_requests(tmp_path):
    with pytest.raises(InputError, match="gguf-type"):
        write_gguf(default_model_dir(), tmp_path / "a.gguf", "q4_k")
    with pytest.raises(InputError, match="must end in .gguf"):
        write_gguf(default_model_dir(), tmp_path / "a.bin")
    (tmp_path / "b.gguf").write_bytes(b"keep")
    with pytest.raises(InputError, match="already exists"):
        write_gguf(default_model_dir(), tmp_path / "b.gguf")
    assert (tmp_path / "b.gguf").read_bytes() == b"keep"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".partial-")]


# ------------------------------------------------------------------------------------------------ crosscheck
REPLAY = r'''#!{python}
import json, os, sys
golden = json.load(open({golden!r}))
mode = {mode!r}
args = sys.argv[1:]
assert args[args.index("-s") + 1] == str(golden["seed"]) and args[args.index("-p") + 1] == golden["prompt"]
if mode == "fail":
    sys.stderr.write("llama_model_load: error loading model\n"); sys.exit(3)
trace = os.environ.get("DIFFUSION_TRACE_FILE")
if mode != "stock" and trace:
    with open(trace, "a") as f:
        for block in golden["blocks"]:
            prompt = golden["prompt_ids"] + [t for b in golden["blocks"][:golden["blocks"].index(block)]
                                             for t in b[-1]["argmax"]]
            for step in block:
                record = dict(step, prompt=prompt)
                if mode == "wrong" and step["step"] == 3:
                    record["argmax"] = [(t + 1) % 4096 for t in step["argmax"]]
                f.write(json.dumps(record) + "\n")
sys.stdout.write("\n" + golden["text"] + "\ntotal time: 1.00ms, time per step: 1.00ms\n")
'''


def _stand_in(tmp_path, mode: str) -> str:
    path = tmp_path / f"llama-diffusion-cli-{mode}"
    path.write_text(REPLAY.format(python=sys.executable, golden=os.path.join(GOLDEN, "shipped-seed1.json"), mode=mode))
    path.chmod(0o755)
    return str(path)


def _crosscheck(capsys, *extra):
    """``diffusiongemma crosscheck llama.cpp --seed 1 -n 64 EXTRA`` through the peer's own argument handling."""
    import argparse

    from diffusiongemma.crosscheck.llama_cpp_peer import add_arguments, run

    parser = argparse.ArgumentParser()
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    add_arguments(parser)
    status = run(parser.parse_args(["--seed", "1", "-n", "64", *extra]))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_crosscheck_without_a_binary_says_how_to_get_one(capsys):
    status, out, err = _crosscheck(capsys)
    assert status == 2 and LLAMA_CPP_COMMIT in err and "llama-diffusion-cli" in err
    status, out, err = _crosscheck(capsys, "--llama-bin", "/nonexistent/llama-diffusion-cli")
    assert status == 2 and "not an executable" in err


@pytest.mark.parametrize("mode, status, says", [("traced", 0, "AGREE: every step"), ("stock", 0, "reply only"),
                                                ("wrong", 1, "DIFFER"), ("fail", 2, "exited with status 3")])
def test_crosscheck_against_a_stand_in(tmp_path, capsys, mode, status, says):
    got, out, err = _crosscheck(capsys, "--llama-bin", _stand_in(tmp_path, mode))
    assert got == status, out + err
    assert says in out + err
    if mode == "wrong":
        assert "block 0 step 3: argmax canvas differs" in out


def test_byte_tokenizer_of_the_tiny_model():
    tokenizer = byte_level_tokenizer()
    assert tokenizer.get_vocab_size() == 262
    ids = tokenizer.encode("And God said", add_special_tokens=True).ids
    assert ids[0] == 2 and tokenizer.decode(ids, skip_special_tokens=True) == "And God said"
    assert json.loads(tokenizer.to_str())["pre_tokenizer"]["type"] == "ByteLevel"


def test_sampler_floats_llama_cpp_would_round_are_named(tmp_path):
    write_tiny_checkpoint_text(str(tmp_path / "text"))
    settings = json.loads((tmp_path / "text" / "generation_config.json").read_text())
    settings["confidence_threshold"] = 1e-7  # printed "%f": 0.000000
    (tmp_path / "text" / "generation_config.json").write_text(json.dumps(settings))
    summary = write_model_gguf(random_tiny_model(0), tmp_path / "text", tmp_path / "t.gguf")
    assert any("eb_confidence_threshold = 1e-07 reaches llama.cpp's sampler as 0.0" in n for n in summary.notes)
    assert not any("eb_t_min" in n for n in summary.notes)  # 0.1 survives six decimals
