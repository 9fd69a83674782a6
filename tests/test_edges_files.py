"""Files a user hands the project at the edges: damaged GGUF files, absurd or float32-overflowing settings in
config.json / generation_config.json, chat templates that blow up, GGUF exports under faults, checkpoints
replaced while they are read.

Every case came from a seeded trial of file mutations on commit f616ecb, where it ended in a traceback, a
MemoryError, a misread value or a silently accepted setting. Each now ends in one line that names the file,
the field or key and the value (or behaves correctly), before anything is allocated from the bad value.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from diffusiongemma.checkpoint import TextSide, default_model_dir
from diffusiongemma.cli.main import main
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.generation_config import GenerationConfig
from diffusiongemma.reference.support import checkpoint_io, config_checks
from diffusiongemma.reference.support.errors import CheckpointError, ConfigError, InputError, NonFiniteError
from diffusiongemma import gguf_writer
from diffusiongemma.weights_converter import gguf as gguf_reader
from diffusiongemma.weights_converter import writer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = default_model_dir()


# ================================================================================================ helpers
@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory) -> str:
    """The shipped model exported as a Q8_0 GGUF (4.6 MB), read-only for the tests: each copies it first."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf")
    gguf_writer.write_gguf(SHIPPED, path, "q8_0")
    return path


def _copy(src: str, dst) -> tuple[str, bytearray]:
    data = bytearray(open(src, "rb").read())
    return str(dst), data


def _tensor_info_type_offset(data: bytes, name: str) -> int:
    """Byte offset of the ggml type id in the tensor info of ``name``."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims


def _transformers_config() -> dict:
    with open(os.path.join(SHIPPED, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _checkpoint_with(tmp_path, config: dict | None = None, generation: dict | None = None,
                     template: str | None = None) -> str:
    """A copy of the shipped (transformers-layout) checkpoint with some files replaced."""
    dst = tmp_path / "model"
    shutil.copytree(SHIPPED, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    return str(dst)


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.err


def _generate(capsys, model: str, *options) -> tuple[int, str]:
    return _cli(capsys, "generate", "-m", model, "-n", "8", "--steps", "2", "--seed", "1", "--view", "plain",
                *options, "And God said")


# ================================================================================================ GGUF files
def test_damaged_gguf_vocabulary_is_named_by_the_cli_and_the_api(tmp_path, q8_gguf, capsys):
    """One flipped bit in a token string leaves a merge whose result is no token: tokenizers raises a bare
    ``Exception: Error while initializing BPE``, which used to escape as a traceback."""
    path, data = _copy(q8_gguf, tmp_path / "vocab.gguf")
    tokens_at = gguf_reader.read_gguf_header(q8_gguf).fields["tokenizer.ggml.tokens"].offset
    at = data.index(struct.pack("<Q", 2) + b"th", tokens_at) + 9  # the token "th" (merge 't h') -> "tj"
    data[at] ^= 0x02
    open(path, "wb").write(data)
    with pytest.raises(CheckpointError, match=r"vocab\.gguf: the tokenizer vocabulary .* is damaged: .*th"):
        gguf_reader.gguf_text_side(path)
    rc, err = _generate(capsys, path)
    assert rc == 2 and "Traceback" not in err
    assert f"{path}: the tokenizer vocabulary" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("new_type", [1, 30], ids=["F16", "BF16"])
def test_one_element_tensor_relabelled_to_a_smaller_type_is_refused(tmp_path, q8_gguf, new_type):
    """An F32 scalar relabelled F16/BF16 keeps its offsets (both pad to 32 bytes) but would be read from half its
    bytes: the other half now lies in the padding, which must be zero."""
    path, data = _copy(q8_gguf, tmp_path / "relabelled.gguf")
    name = "blk.0.enc_layer_output_scale.weight"
    at = _tensor_info_type_offset(data, name)
    assert struct.unpack_from("<I", data, at)[0] == 0  # F32
    struct.pack_into("<I", data, at, new_type)
    open(path, "wb").write(data)
    with pytest.raises(gguf_reader.GGUFLayoutError, match=rf"relabelled\.gguf: tensor '{name}' of type "
                                                           r"B?F16 .* padding bytes after it are not zero"):
        gguf_reader.GGUFCheckpoint.open(path)


@pytest.mark.parametrize("new_type", [28, 26], ids=["F64", "I32"])
def test_tensor_relabelled_to_a_type_no_weight_has_is_refused(tmp_path, q8_gguf, new_type):
    """F32 -> F64 (the scalar read with four zero padding bytes: 0.0) or I32 (same size, its bits as an integer)."""
    path, data = _copy(q8_gguf, tmp_path / "relabelled.gguf")
    name = "blk.0.enc_layer_output_scale.weight"
    struct.pack_into("<I", data, _tensor_info_type_offset(data, name), new_type)
    open(path, "wb").write(data)
    with pytest.raises(CheckpointError, match=rf"relabelled\.gguf: tensor '{name}' has type (F64|I32); "
                                              r"DiffusionGemma weights are F32, F16, BF16 or a quantized type"):
        checkpoint_io.load_checkpoint(path)


@pytest.mark.parametrize("delta", [-7, -2, 2, 9])
def test_wrong_metadata_count_is_a_metadata_error(tmp_path, q8_gguf, delta):
    """A metadata count off by more than one used to be reported as a tensor error (only +-1 was tried)."""
    path, data = _copy(q8_gguf, tmp_path / "count.gguf")
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    struct.pack_into("<Q", data, 16, n_kv + delta)
    open(path, "wb").write(data)
    with pytest.raises(gguf_reader.GGUFLayoutError,
                       match=rf"count\.gguf: the header's metadata key/value count is {n_kv + delta}, but the "
                             rf"file holds {n_kv} metadata key/value entries"):
        gguf_reader.GGUFCheckpoint.open(path)


@pytest.mark.parametrize("delta", [-30, -2, 5])
def test_wrong_tensor_count_is_found_whatever_the_offset(tmp_path, q8_gguf, delta):
    path, data = _copy(q8_gguf, tmp_path / "tensors.gguf")
    n_tensors = struct.unpack_from("<Q", data, 8)[0]
    struct.pack_into("<Q", data, 8, n_tensors + delta)
    open(path, "wb").write(data)
    with pytest.raises(gguf_reader.GGUFLayoutError,
                       match=rf"tensors\.gguf: the header's tensor count is {n_tensors + delta}, but the file holds "
                             rf"{n_tensors} tensor entries"):
        gguf_reader.GGUFCheckpoint.open(path)


def _set_metadata_uint32(data: bytearray, key: str, value: int) -> None:
    raw = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(raw) + len(raw)
    assert struct.unpack_from("<I", data, at)[0] == 4  # UINT32
    struct.pack_into("<I", data, at + 4, value)


def test_gguf_canvas_length_beyond_the_context_is_refused_by_key(tmp_path, q8_gguf):
    """``diffusion.canvas_length`` 2^32-1 used to reach the fast path's buffers (64 TiB)."""
    path, data = _copy(q8_gguf, tmp_path / "canvas.gguf")
    _set_metadata_uint32(data, "diffusion.canvas_length", 2**32 - 1)
    open(path, "wb").write(data)
    with pytest.raises(ConfigError, match=r"canvas\.gguf: canvas_length must be at most max_position_embeddings="
                                          r"131072, got 4294967295 \(metadata key 'diffusion.canvas_length'\)"):
        gguf_reader.GGUFCheckpoint.open(path)


def test_q8_0_overflow_on_the_cpu_fast_path_names_the_layer(tmp_path, q8_gguf):
    """A Q8_0 GGUF whose activations overflow float32: the CPU fast path's diagnosis used to be handed the
    quantized experts (``TypeError: ufunc 'isfinite' not supported``); it now says what the reference says."""
    from diffusiongemma import fast
    from diffusiongemma.reference.generate import generate as reference_generate
    from diffusiongemma.reference.model import Model as ReferenceModel

    path, data = _copy(q8_gguf, tmp_path / "big.gguf")
    norm = [t for t in gguf_reader.read_gguf_header(q8_gguf).tensors if t.name == "blk.1.post_ffw_norm.weight"][0]
    assert norm.tensor_type.name == "F32"
    data[norm.data_offset:norm.data_offset + norm.n_bytes] = np.full(norm.n_elements, 3e38, np.float32).tobytes()
    open(path, "wb").write(data)
    prompt = np.array([[2, 100, 200]])
    fast_model = fast.Model.from_pretrained(path, device="cpu")
    assert fast_model.layers[1].experts.kind == "q8_0"  # kept quantized in the panel layout: the failing case
    messages = []
    with np.errstate(all="ignore"):
        for model, run in ((fast_model, fast.generate), (ReferenceModel.from_pretrained(path), reference_generate)):
            with pytest.raises(NonFiniteError) as caught:
                run(model, prompt, max_new_tokens=32)
            messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert "the output of encoder layer 1 is not finite" in messages[0]


def test_overflow_with_float32_experts_on_the_cpu_fast_path_names_the_layer():
    """The same with float32 experts: the diagnosis was handed None for the experts the panels hold."""
    from diffusiongemma import fast
    from diffusiongemma.reference.generate import generate as reference_generate
    from diffusiongemma.reference.model import Model as ReferenceModel

    reference = ReferenceModel.from_pretrained(SHIPPED)
    tensors = {name: np.array(array) for name, array in reference.tensors.items()}
    tensors["layers.2.post_feedforward_layernorm"][:] = 3e38
    messages = []
    with np.errstate(all="ignore"):
        for model, run in ((fast.Model(reference.config, dict(tensors)), fast.generate),
                           (ReferenceModel(reference.config, dict(tensors)), reference_generate)):
            with pytest.raises(NonFiniteError) as caught:
                run(model, np.array([[2, 100, 200]]), max_new_tokens=32)
            messages.append(str(caught.value))
    assert messages[0] == messages[1] and "the output of encoder layer 2 is not finite" in messages[0]


def test_diagnosis_judges_every_weight_layout():
    """The shared diagnosis names a NaN in a bfloat16 weight or in a Q8_0 tensor's scales and passes over int8
    values (finite by construction), instead of failing on them."""
    import ml_dtypes

    from diffusiongemma.reference.support.diagnosis import non_finite_error
    from diffusiongemma.reference.support.quantized import Q8_0Tensor

    inf = np.array([[np.inf]], np.float32)
    q8 = Q8_0Tensor.from_blocks(np.zeros((1, 34), np.uint8), (1, 32))
    assert "so float32 overflowed" in str(non_finite_error("denoise", "x", inf, {"q": q8, "v": q8.values}))
    q8.scales[...] = np.nan
    assert "weight 'q' holds NaN" in str(non_finite_error("denoise", "x", inf, {"q": q8}))
    bf16 = np.array([1.0, np.nan], ml_dtypes.bfloat16)
    assert "weight 'b' holds NaN" in str(non_finite_error("denoise", "x", inf, {"b": bf16}))


# ================================================================================================ config files
@pytest.mark.parametrize("where, field, value, pattern", [
    ("text", "sliding_window", 2**63, r"sliding_window must be at most max_position_embeddings=131072, got 9223"),
    ("text", "sliding_window", 2**40, r"sliding_window must be at most max_position_embeddings=131072, got 1099"),
    ("top", "canvas_length", 2**33, r"canvas_length must be at most max_position_embeddings=131072, got 8589"),
    ("text", "max_position_embeddings", 2**40, r"max_position_embeddings must be at most 2147483647"),
    ("text", "num_hidden_layers", 2**40, r"num_hidden_layers must be at most 4096, got 1099511627776"),
    ("top", "tie_word_embeddings", False, r"^tie_word_embeddings=False is not supported"),
    ("text", "tie_word_embeddings", "8", r"text_config.tie_word_embeddings must be true or false .* got '8'"),
    ("top", "tie_word_embeddings", float("nan"), r"tie_word_embeddings must be true or false .* got nan"),
    ("text", "rms_norm_eps", 1.5, r"rms_norm_eps must be in \(0, 0.01\] .* got 1.5"),
    ("text", "rms_norm_eps", 2.0**40, r"rms_norm_eps must be in \(0, 0.01\] .* got 1099511627776.0"),
    ("text", "rms_norm_eps", 1e308, r"rms_norm_eps must be a finite float32 number .* got 1e\+308"),
    ("text", "final_logit_softcapping", 1e308, r"final_logit_softcapping must be a finite float32 number"),
    ("text", "final_logit_softcapping", 1e-50, r"final_logit_softcapping=1e-50 is below float32's smallest"),
    ("text", "rope_parameters", 0, r"rope_parameters must be an object .* got 0"),
    ("text", "rope_parameters", [], r"rope_parameters must be an object .* got \[\]"),
    ("text", "rope_parameters", {}, r"rope_parameters must be an object .* got \{\}"),
])
def test_config_json_values_are_bounded_and_named(where, field, value, pattern):
    config = _transformers_config()
    if field == "num_hidden_layers":
        config["text_config"].pop("layer_types")  # then built from num_hidden_layers (2^40 entries: a hang)
    (config if where == "top" else config["text_config"])[field] = value
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_transformers(config)


def test_config_json_accepts_what_upstream_writes():
    """The bounds leave real settings alone: the shipped config, tie_word_embeddings true or absent, a
    window equal to the context."""
    config = _transformers_config()
    ModelConfig.from_transformers(config)
    for holder in (config, config["text_config"]):
        holder.pop("tie_word_embeddings")
    config["text_config"]["sliding_window"] = config["text_config"]["max_position_embeddings"]
    assert ModelConfig.from_transformers(config).sliding_window == 131072


def test_absurd_config_is_refused_by_the_cli_naming_the_field(tmp_path, capsys):
    config = _transformers_config()
    config["text_config"]["sliding_window"] = 2**63  # OverflowError traceback on f616ecb
    rc, err = _generate(capsys, _checkpoint_with(tmp_path, config=config))
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "sliding_window must be at most max_position_embeddings=131072, got 9223372036854775808" in err


@pytest.mark.parametrize("data, pattern", [
    ({"stability_threshold": 2**40}, r"stability_threshold must be at most max_denoising_steps=48 .* got 1099"),
    ({"stability_threshold": 17, "max_denoising_steps": 16}, r"stability_threshold must be at most "
                                                               r"max_denoising_steps=16"),
    ({"t_max": 1e308}, r"t_max must be a finite float32 number .* got 1e\+308"),
    ({"t_min": 0.1, "t_max": 1e39}, r"t_max must be a finite float32 number"),
    ({"confidence_threshold": 1e308}, r"confidence_threshold must be a finite float32 number"),
    ({"sampler_config": {"entropy_bound": 1e308}}, r"entropy_bound must be a finite float32 number"),
    ({"sampler_config": {"entropy_bound": 1e-60}}, r"entropy_bound=1e-60 is below float32's smallest"),
])
def test_generation_config_values_are_bounded_and_named(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        GenerationConfig.from_dict(data)


def test_generation_config_keeps_its_real_range():
    """A stability threshold equal to the step count (never stable: no early stop) and float32's largest
    values stay accepted."""
    config = GenerationConfig.from_dict({"stability_threshold": 16, "max_denoising_steps": 16, "t_max": 3e38})
    assert (config.stability_threshold, config.t_max) == (16, 3e38)


def test_huge_stability_threshold_is_refused_by_the_cli(tmp_path, capsys):
    """generation_config.json stability_threshold 2^40 ended in a MemoryError (256 TiB of draft history)."""
    with open(os.path.join(SHIPPED, "generation_config.json"), encoding="utf-8") as f:
        generation = json.load(f)
    generation["stability_threshold"] = 2**40
    rc, err = _generate(capsys, _checkpoint_with(tmp_path, generation=generation))
    assert rc == 2 and "Traceback" not in err and "MemoryError" not in err
    assert "generation_config.json: stability_threshold must be at most max_denoising_steps=16" in err


def test_gguf_sampler_defaults_are_bounded_and_name_the_file(tmp_path, q8_gguf):
    from diffusiongemma.checkpoint import load_generation_config

    path, data = _copy(q8_gguf, tmp_path / "eb.gguf")
    _set_metadata_uint32(data, "diffusion.eb_stability_threshold", 2**32 - 1)
    open(path, "wb").write(data)
    with pytest.raises(ConfigError, match=r"eb\.gguf: stability_threshold must be at most max_denoising_steps=16 "
                                          r".* got 4294967295 \(GGUF metadata diffusion\.eb_\*\)"):
        load_generation_config(path)


def test_float32_checker_for_the_command_line():
    """``config_checks.check_float32`` is the one rule for every real-valued setting, flags included."""
    check = config_checks.check_float32
    assert check("--temp", 0.5) == 0.5 and check("--temp", 3.4e38) == 3.4e38
    for value, pattern in ((1e308, r"--temp must be a finite float32 number"), (float("inf"), "finite float32"),
                           (float("nan"), "finite float32"), (True, "must be a number"), ("1", "must be a number")):
        with pytest.raises(ConfigError, match=pattern):
            check("--temp", value)
    with pytest.raises(ConfigError, match=r"--entropy-bound=1e-50 is below float32's smallest"):
        check("--entropy-bound", 1e-50, positive=True)


# ================================================================================================ chat template
def test_chat_template_that_overflows_the_sandbox_is_named(tmp_path, capsys):
    template = "{% for i in range(10**8) %}x{% endfor %}"
    side = TextSide(tokenizer=None, chat_template=template, bos_token=None, eos_token=None)
    with pytest.raises(CheckpointError, match=r"the checkpoint's chat template failed to render: Range too big"):
        side.apply_chat_template("hi")
    model = _checkpoint_with(tmp_path, template=template)
    rc, err = _generate(capsys, model, "--chat")
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{model}/chat_template.jinja: the checkpoint's chat template failed to render" in err
    assert "OverflowError" in err


def test_tokenizer_files_of_a_directory_are_checked_by_name(tmp_path):
    """tokenizer.json with a damaged vocabulary, a tokenizer_config.json that is not an object (it used to end
    in AttributeError), a chat template that is not UTF-8; and transformers' list of named templates works."""
    from diffusiongemma.checkpoint import load_text_side

    model = _checkpoint_with(tmp_path)
    tokenizer_json = os.path.join(model, "tokenizer.json")
    original = open(tokenizer_json, encoding="utf-8").read()
    data = json.loads(original)
    data["model"]["vocab"] = {("tj" if k == "th" else k): v for k, v in data["model"]["vocab"].items()}
    open(tokenizer_json, "w", encoding="utf-8").write(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json' is not a valid tokenizers file \(its vocabulary "
                                              r"is damaged\): .*out of vocabulary"):
        load_text_side(model)
    open(tokenizer_json, "w", encoding="utf-8").write(original)

    config_file = os.path.join(model, "tokenizer_config.json")
    config = json.load(open(config_file, encoding="utf-8"))
    json.dump([config], open(config_file, "w"))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json' must hold a JSON object, got list"):
        load_text_side(model)
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "<{{ "
                                                                       "messages[0].content }}>"}]
    json.dump(config, open(config_file, "w"))
    assert load_text_side(model).apply_chat_template("hi") == "<hi>"
    config["chat_template"] = 7
    json.dump(config, open(config_file, "w"))
    with pytest.raises(CheckpointError, match=r"chat_template must be a string or a list .* got 7"):
        load_text_side(model)
    open(os.path.join(model, "chat_template.jinja"), "wb").write(b"\xff{{ x }}")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja' is not UTF-8 text"):
        load_text_side(model)


# ================================================================================================ GGUF export
def test_gguf_export_keeps_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        dst = tmp_path / "out.gguf"
        gguf_writer.write_gguf(SHIPPED, dst, "q8_0")
        assert stat.S_IMODE(os.stat(dst).st_mode) == 0o644
        os.umask(0o027)
        gguf_writer.write_gguf(SHIPPED, dst, "q8_0", force=True)
        assert stat.S_IMODE(os.stat(dst).st_mode) == 0o640
    finally:
        os.umask(old)


def test_gguf_export_onto_a_full_disk_says_so(tmp_path, monkeypatch):
    """numpy's ``tofile`` reports a short write without an errno ("655360 requested and 485408 written"); the
    export now finds and names the reason, and leaves nothing behind."""
    import gguf

    real_write = os.write

    def full_disk(fd, data):  # the disk is full from the short write on
        raise OSError(28, os.strerror(28))

    def short_write(self, *args, **kwargs):
        monkeypatch.setattr(os, "write", full_disk)  # only from here to the end of the export
        raise OSError("655360 requested and 485408 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", short_write)  # each tensor is written in turn
    dst = tmp_path / "full.gguf"
    try:
        with pytest.raises(writer.WriteError, match=rf"cannot write {dst}: No space left on device"):
            gguf_writer.write_gguf(SHIPPED, dst, "q8_0")
    finally:
        monkeypatch.setattr(os, "write", real_write)
    assert os.listdir(tmp_path) == []


def test_gguf_export_checks_free_space_before_writing(tmp_path, monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: Usage)
    dst = tmp_path / "small.gguf"
    with pytest.raises(writer.WriteError, match=rf"cannot write {dst}: no space left on device \(the output needs "
                                                r"[\d,]+ bytes but .* has 1,000 bytes free\); nothing was written"):
        gguf_writer.write_gguf(SHIPPED, dst, "q8_0")
    assert os.listdir(tmp_path) == []


_HOLD_PARTIAL = textwrap.dedent("""
    import sys, time
    from diffusiongemma.gguf_writer import _begin_export
    print(_begin_export(sys.argv[1], False), flush=True)
    time.sleep(120)
""")


def test_gguf_export_refuses_a_concurrent_writer_and_cleans_a_killed_ones_partial(tmp_path):
    """Two exports to one new path used to both exit 0 (the last silently won), and a SIGKILL left a hidden
    ``.partial-*.gguf`` forever. A live writer's partial now refuses a second export without --force; once that
    writer is killed, the next export removes its partial."""
    dst = str(tmp_path / "shared.gguf")
    child = subprocess.Popen([sys.executable, "-c", _HOLD_PARTIAL, dst], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    try:
        partial = child.stdout.readline().strip()
        assert os.path.basename(partial).startswith(".shared.gguf.partial-") and os.path.isfile(partial)
        with pytest.raises(InputError, match=r"shared\.gguf' is being written by another export"):
            gguf_writer.write_gguf(SHIPPED, dst, "q8_0")
        assert not os.path.exists(dst)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert os.path.isfile(partial)  # what a SIGKILL leaves
    gguf_writer.write_gguf(SHIPPED, dst, "q8_0")
    assert sorted(os.listdir(tmp_path)) == ["shared.gguf"]


def test_gguf_export_never_replaces_a_file_that_appeared_meanwhile(tmp_path, monkeypatch):
    """The final step without --force cannot replace: the export that finished first keeps its file."""
    import gguf

    dst = tmp_path / "race.gguf"
    real = gguf.GGUFWriter.close

    def close_then_someone_else_finishes(self):
        real(self)
        dst.write_bytes(b"the other export's file")

    monkeypatch.setattr(gguf.GGUFWriter, "close", close_then_someone_else_finishes)
    with pytest.raises(InputError, match=r"race\.gguf' already exists \(written meanwhile by another process"):
        gguf_writer.write_gguf(SHIPPED, dst, "q8_0")
    assert dst.read_bytes() == b"the other export's file" and os.listdir(tmp_path) == ["race.gguf"]


# ================================================================================================ replace, paths
def test_reader_inside_a_replaced_checkpoint_is_told_a_replace_is_in_progress(tmp_path, monkeypatch):
    """``convert --force`` swaps the new directory in, then deletes the old one; a reader still inside the old
    one (through its handle) used to meet "weight file ... is missing" when a weight file went first. The old
    directory now loses its index first, so whichever file the reader misses it is told to read again."""
    from tests.random_weights import make_config, random_tensors

    config = make_config()
    tensors = random_tensors(config, seed=0)
    dst = str(tmp_path / "ckpt")

    def write(seed):
        with writer.atomic_directory(dst, force=True) as tmp:
            shards = writer.ShardWriter(tmp, 40_000)
            for name, array in random_tensors(config, seed=seed).items():
                shards.add(name, np.asarray(array, np.float32))
            weight_map = shards.close()
            with open(os.path.join(tmp, checkpoint_io.INDEX_FILE), "w") as f:
                json.dump({"format": "diffusiongemma", "format_version": 1, "dtype": "float32",
                           "model_config": config.to_dict(), "weight_map": weight_map,
                           "file_digests": shards.digests}, f)

    write(0)
    index = checkpoint_io.read_index(dst)
    seen = []
    real_rmtree = shutil.rmtree

    def reader_meanwhile(path, *args, **kwargs):  # the old checkpoint, as a reader pinned to it sees it
        os.unlink(os.path.join(path, sorted(index["weight_map"].values())[0]))  # rmtree's order is arbitrary
        try:
            checkpoint_io._read_weight_files(dst, path, index, config)
        except CheckpointError as exc:
            seen.append(exc)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(writer.shutil, "rmtree", reader_meanwhile)
    write(1)
    monkeypatch.undo()
    assert len(seen) == 1 and isinstance(seen[0], checkpoint_io.CheckpointChanged), seen
    assert "a replace is in progress" in str(seen[0])
    assert np.array_equal(checkpoint_io.load_converted(dst)[1]["embed_tokens"],
                          random_tensors(config, seed=1)["embed_tokens"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_crosscheck_accepts_the_config_json_of_a_checkpoint(monkeypatch):
    """``crosscheck -m .../config.json`` used to say "no config.json"; the file stands for its directory."""
    import diffusiongemma.crosscheck as crosscheck_module
    from diffusiongemma.reference import Model

    given = []

    class Stop(Exception):
        pass

    def from_pretrained(path, *args, **kwargs):
        given.append(path)
        raise Stop

    monkeypatch.setattr(Model, "from_pretrained", staticmethod(from_pretrained))
    with pytest.raises(Stop):
        crosscheck_module.crosscheck("transformers", os.path.join(SHIPPED, "config.json"))
    assert given == [os.path.abspath(SHIPPED)]
    with pytest.raises(crosscheck_module.PeerUnavailable, match=r"tokenizer\.json' is a file; the peers need"):
        crosscheck_module.crosscheck("transformers", os.path.join(SHIPPED, "tokenizer.json"))
