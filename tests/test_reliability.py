"""Reliability: bad input, broken weights, interrupted writers and impossible requests end in the project's
own errors, never in a crash, a silent mixture or lost data.

One section per class of fault (the numbering of the README's "What the project promises" section):

1. memory safety of the CPU fast path (every kernel index validated or impossible; NaN never crashes);
2. non-finite values named (the first layer output, and the weight, cache entry or overflow behind it);
3. one weight validation for every layout (NaN/inf, unlisted tensors, index dtype);
4. whole checkpoints for readers, never an empty destination for writers, stale partial output removed;
5. bounds up front (positions, memory) and linear encoder memory in the reference;
6. every bad value named (JSON types, index files, paths, caches, masks, self-conditioning input);
8. exact ``tokens_per_forward`` (transformers' float32 arithmetic, with and without a pad id).

Anything that could crash the interpreter on a broken build (the fast path fed NaN, kernels fed bad
indices) runs in a child process, so that a regression shows up as a failed test, not a dead test run.
Every test here failed on the code before these guarantees were added (commit cde6dde).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
import ml_dtypes
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from diffusiongemma.reference.support import errors
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.errors import CheckpointError, ConfigError, InputError, SamplingError
from diffusiongemma.reference.model import Model as ReferenceModel
from diffusiongemma.reference.sampling import tokens_per_forward
from diffusiongemma.reference.support.checkpoint_io import INDEX_FILE, load_checkpoint, load_converted
from diffusiongemma.weights_converter import writer
from tests.random_weights import make_config, random_tensors

generate_module = importlib.import_module("diffusiongemma.reference.generate")
reference_model_module = importlib.import_module("diffusiongemma.reference.model")
weights_module = importlib.import_module("diffusiongemma.reference.support.checkpoint_io")
# Names that the guarantees introduced; looked up softly so that, on older code, each test fails on its own.
NonFiniteError = getattr(errors, "NonFiniteError", type("NonFiniteErrorMissing", (Exception,), {}))
WriteError = getattr(writer, "WriteError", type("WriteErrorMissing", (Exception,), {}))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ================================================================================================ helpers
def tiny(seed: int = 0, **config_changes):
    config = make_config()
    if config_changes:
        config = dataclasses.replace(config, **config_changes)
    return config, random_tensors(config, seed=seed)


def write_converted(dst, config, tensors, *, dtype="float32", shard_size=40_000, force=False, extra=None,
                    index_changes=None):
    """A converted checkpoint at ``dst`` written with the converter's own writer (atomic, digests)."""
    with writer.atomic_directory(dst, force=force) as tmp:
        shards = writer.ShardWriter(tmp, shard_size)
        for name, array in tensors.items():  # written as given: NaN too (the writer's own check is bypassed)
            shards.add(name, np.asarray(array, np.float32 if dtype == "float32" else ml_dtypes.bfloat16))
        weight_map = shards.close()
        if extra:  # tensors the index will not list, appended to the first file (its metadata kept)
            first = os.path.join(tmp, shards.files[0])
            with safe_open(first, "numpy") as f:
                metadata = f.metadata()
            content = load_file(first)
            content.update(extra)
            save_file(content, first, metadata=metadata)
        index = {"format": "diffusiongemma", "format_version": 1, "dtype": dtype,
                 "model_config": config.to_dict(), "weight_map": weight_map,
                 "file_digests": dict(getattr(shards, "digests", {}))}
        index.update(index_changes or {})
        with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f)
    return dst


def run_isolated(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository root (a crash there fails only this test)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def isolated_result(code: str) -> dict:
    """``run_isolated`` for code that prints one JSON object last; asserts the child exited normally."""
    proc = run_isolated(code)
    assert proc.returncode == 0, f"child exited with {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


PRELUDE = """
import json, numpy as np
from tests.random_weights import make_config, random_tensors
from diffusiongemma.fast.model import Model as Fast
from diffusiongemma.reference.model import Model as Ref
config = make_config()
tensors = random_tensors(config)

def outcome(call):
    try:
        call()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return ["no error", ""]
"""


# ================================================================================================ 1. memory safety
def test_nan_router_weight_is_a_named_error_on_the_cpu_path_not_a_crash():
    result = isolated_result(PRELUDE + """
fast = Fast(config, tensors)
router = fast.layers[1].router.copy()
fast.layers[1].router[:] = np.nan           # bypasses the load-time check, as a corrupted buffer would
cache = fast.new_cache(2)
enc = outcome(lambda: fast.encode(np.array([[5, 6, 7], [8, 9, 10]]), cache))
cache = fast.new_cache(1)
fast.layers[1].router[:] = router
fast.encode(np.array([[5, 6, 7]]), cache)
fast.layers[3].router[0, 0] = np.inf
dec = outcome(lambda: fast.denoise(np.zeros((1, config.canvas_length), np.int64), cache))
print(json.dumps({"encode": enc, "denoise": dec}))
""")
    for stage in ("encode", "denoise"):
        name, message = result[stage]
        assert name == "NonFiniteError", result
        assert "router.proj" in message, message


def test_self_conditioning_infinities_never_reach_the_router():
    result = isolated_result(PRELUDE + """
out = {}
for label, M in (("fast", Fast), ("reference", Ref)):
    model = M(config, tensors)
    cache = model.new_cache(1)
    model.encode(np.array([[5, 6, 7]]), cache)
    C, V = config.canvas_length, config.vocab_size
    canvas = np.zeros((1, C), np.int64)
    plus = np.zeros((1, C, V), np.float32); plus[0, 3, 7] = np.inf
    minus = np.zeros((1, C, V), np.float32); minus[0, 5, :] = -np.inf
    out[label] = [outcome(lambda: model.denoise(canvas, cache, plus)),
                  outcome(lambda: model.denoise(canvas, cache, minus))]
print(json.dumps(out))
""")
    for label, (plus, minus) in result.items():
        assert plus[0] == "InputError" and "(0, 3)" in plus[1] and "+inf" in plus[1], (label, plus)
        assert minus[0] == "InputError" and "(0, 5)" in minus[1], (label, minus)


def test_kernels_validate_every_index_before_use():
    result = isolated_result("""
import json, numpy as np
from diffusiongemma.fast import _kernels as k

def outcome(call):
    try:
        call()
    except (IndexError, ValueError) as exc:
        return type(exc).__name__
    return "no error"

N, K, E, H = 4, 2, 3, 8
indices = np.array([[0, 1], [2, -1], [1, 2], [0, 2]], np.int64)
out = {
  "group_by_expert": outcome(lambda: k.group_by_expert(indices, np.zeros(E + 1, np.int64),
                                                      np.zeros(N * K, np.int64), np.zeros((N, K), np.int64))),
  "group_by_expert_high": outcome(lambda: k.group_by_expert(np.full((N, K), E, np.int64), np.zeros(E + 1, np.int64),
                                                           np.zeros(N * K, np.int64), np.zeros((N, K), np.int64))),
  "gather_rows": outcome(lambda: k.gather_rows(np.zeros((N, H), np.float32), np.array([0, 4], np.int64),
                                              np.zeros((2, H), np.float32))),
  "combine_experts": outcome(lambda: k.combine_experts(np.zeros((N * K, H), np.float32), np.zeros((N, K), np.int64),
                                                      np.full((N, K), N * K, np.int64), np.ones((N, K), np.float32),
                                                      np.zeros((N, H), np.float32))),
  "embed": outcome(lambda: k.embed(np.array([0, 9], np.int64), np.zeros((9, H), np.float32), np.float32(1), None,
                                   False, np.float32(1e-6), np.zeros((2, H), np.float32))),
}
print(json.dumps(out))
""")
    assert result == {"group_by_expert": "IndexError", "group_by_expert_high": "IndexError",
                      "gather_rows": "IndexError", "combine_experts": "IndexError", "embed": "IndexError"}


def test_router_top_k_always_picks_experts_in_range_like_the_reference():
    result = isolated_result("""
import json, numpy as np
from diffusiongemma.fast import _kernels as k
from diffusiongemma.reference.layers import route
from tests.random_weights import make_config
E, K = 6, 3
scale = np.linspace(0.5, 1.5, E).astype(np.float32)
rows = np.array([[np.nan] * E, [1.0, np.nan, 3.0, -np.inf, np.inf, 0.0], [-np.inf] * E,
                 [0.1, 0.5, 0.2, 0.9, 0.3, 0.4]], np.float32)
indices, weights = np.zeros((4, K), np.int64), np.zeros((4, K), np.float32)
k.route(rows.copy(), scale, indices, weights)
config = make_config(num_experts=E, top_k_experts=K, hidden_size=E)
w = {"router.scale": np.ones(E, np.float32), "router.proj": np.eye(E, dtype=np.float32),
     "router.per_expert_scale": scale}
ref_indices, _ = route(np.array([[0.1, 0.5, 0.2, 0.9, 0.3, 0.4]], np.float32), w, config)
print(json.dumps({"indices": indices.tolist(), "nan_weights": bool(np.isnan(weights[:3]).all()),
                  "finite_row": indices[3].tolist(), "finite_weights": weights[3].tolist(),
                  "reference_finite_row": ref_indices[0].tolist()}))
""")
    assert all(0 <= i < 6 for row in result["indices"] for i in row), result
    assert result["indices"][0] == [0, 1, 2]  # all NaN: the reference's stable argsort order
    assert result["nan_weights"], "a NaN router row must keep NaN weights so the block output check sees it"
    assert result["finite_row"] == [3, 1, 5]


def test_masked_softmax_keeps_nan_instead_of_a_zero_row():
    from diffusiongemma.fast import _kernels

    scores = np.array([[np.nan, 1.0, 2.0], [np.nan, np.nan, np.nan], [0.0, 1.0, 2.0]], np.float32)
    _kernels.masked_softmax(scores, np.array([5], np.int64), np.array([0, 1, 2], np.int64),
                            np.ones(3, np.uint8), 0, True)
    assert np.isnan(scores[:2]).all(), scores  # a NaN score is visible: the row is NaN, not zeros
    np.testing.assert_allclose(scores[2], np.exp([0, 1, 2]) / np.exp([0, 1, 2]).sum(), rtol=1e-6)


def test_nan_weight_gives_the_same_named_error_on_every_backend():
    result = isolated_result(PRELUDE + """
out = {}
for label, M in (("fast", Fast), ("reference", Ref)):
    model = M(config, tensors)
    q = model.layers[1].qkv if label == "fast" else model.layers[1]["q_proj"]
    q[3, 5] = np.nan
    from diffusiongemma.reference.generate import generate
    out[label] = outcome(lambda: generate(model, np.array([[5, 6, 7]]), max_new_tokens=4, max_denoising_steps=2))
print(json.dumps(out))
""")
    assert result["fast"][0] == result["reference"][0] == "NonFiniteError", result
    assert result["fast"][1] == result["reference"][1], result
    assert "encoder layer 1" in result["fast"][1] and "'layers.1.q_proj'" in result["fast"][1]


# ================================================================================================ 2. naming
def test_non_finite_error_names_the_weight_and_the_first_layer():
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    cache = model.new_cache(1)
    model.encode(np.array([[5, 6, 7]]), cache)
    model.layers[2]["mlp.up_proj"][0, 0] = np.nan
    with pytest.raises(NonFiniteError) as info:
        model.denoise(np.zeros((1, config.canvas_length), np.int64), cache)
    message = str(info.value)
    assert "decoder layer 2" in message and "'layers.2.mlp.up_proj' holds NaN" in message
    assert "(row, position) (0, 0)" in message
    assert isinstance(info.value, SamplingError)  # what generation callers already catch


def test_non_finite_error_names_overflow_when_every_weight_is_finite():
    config, tensors = tiny()
    tensors["layers.3.decoder_layer_scalar"][:] = 3e38
    for model in (ReferenceModel(config, tensors),):
        cache = model.new_cache(1)
        model.encode(np.array([[5, 6, 7]]), cache)
        with pytest.raises(NonFiniteError, match=r"decoder layer 3 is not finite .*float32 overflowed"):
            model.denoise(np.zeros((1, config.canvas_length), np.int64), cache)


def test_non_finite_error_names_a_cache_entry():
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    cache = model.new_cache(1)
    model.encode(np.array([[5, 6, 7]]), cache)
    cache.keys[1][0, 0, 1, 2] = np.nan  # e.g. a cache filled by a caller's own encoder
    with pytest.raises(NonFiniteError, match=r"decoder layer 1 .*'cache keys of layer 1' holds NaN"):
        model.denoise(np.zeros((1, config.canvas_length), np.int64), cache)


def test_the_soft_cap_does_not_hide_an_infinity():
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    cache = model.new_cache(1)
    model.encode(np.array([[5, 6, 7]]), cache)
    model.tensors["final_norm"][4] = np.inf  # every logit would be capped to +-30 and generate
    with pytest.raises(NonFiniteError, match=r"logits before the soft-cap .*'final_norm' holds inf"):
        model.denoise(np.zeros((1, config.canvas_length), np.int64), cache)


def test_self_conditioning_input_is_named_with_its_position():
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    cache = model.new_cache(1)
    model.encode(np.array([[5, 6, 7]]), cache)
    sc = np.zeros((1, config.canvas_length, config.vocab_size), np.float32)
    sc[0, 9, 3] = np.nan
    with pytest.raises(InputError, match=r"self_conditioning_logits .*\(0, 9\)"):
        model.denoise(np.zeros((1, config.canvas_length), np.int64), cache, sc)


# ================================================================================================ 3. weights
@pytest.fixture(scope="module")
def transformers_dir(tmp_path_factory):
    """A transformers-layout tiny checkpoint (config.json + model.safetensors)."""
    from tests.hf_tiny import tiny_model

    path = tmp_path_factory.mktemp("hf") / "tiny"
    tiny_model(seed=0).save_pretrained(path)
    return path


def _poisoned_copy(src, dst, key_part, value):
    import shutil

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    content = load_file(file)
    key = next(k for k in content if key_part in k)
    content[key] = content[key].copy()
    content[key].reshape(-1)[0] = value
    save_file(content, file, metadata={"format": "pt"})
    return dst


def test_nan_and_inf_weights_are_refused_in_every_layout(tmp_path, transformers_dir):
    config, tensors = tiny()
    for value in (np.nan, np.inf, -np.inf):
        bad = {name: t.copy() for name, t in tensors.items()}
        bad["layers.2.k_norm"][1] = value
        converted = write_converted(tmp_path / f"converted-{value}", config, bad)
        with pytest.raises(CheckpointError, match=r"'layers.2.k_norm' holds 1 NaN or infinite"):
            load_converted(converted)
        for model_class in (ReferenceModel, importlib.import_module("diffusiongemma.fast.model").Model):
            with pytest.raises(CheckpointError, match=r"'layers.2.k_norm' holds 1 NaN or infinite"):
                model_class(config, bad)  # in memory, bypassing every file
    hf_bad = _poisoned_copy(transformers_dir, tmp_path / "hf-bad", "layers.1.self_attn.q_norm", np.nan)
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        load_checkpoint(hf_bad)


def test_inf_in_a_norm_weight_is_refused_not_capped(tmp_path):
    config, tensors = tiny()
    tensors["final_norm"][0] = np.inf
    path = write_converted(tmp_path / "ckpt", config, tensors, dtype="bfloat16")
    model = ReferenceModel.from_pretrained(path)  # the weights stay mapped: values are checked as first read
    cache = model.new_cache(1)
    with pytest.raises(CheckpointError, match=r"'final_norm' holds 1 NaN or infinite .*inf"):
        model.encode(np.array([[1, 2, 3]]), cache)
    assert cache.length == 0  # refused before the cache took the pass's keys


def test_a_tensor_the_index_does_not_list_is_refused(tmp_path):
    config, tensors = tiny()
    path = write_converted(tmp_path / "ckpt", config, tensors, extra={"stray.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"\['stray.weight'\] that diffusiongemma.json does not list"):
        load_converted(path)


def test_the_index_dtype_must_match_the_stored_tensors(tmp_path):
    config, tensors = tiny()
    float32_files = write_converted(tmp_path / "a", config, tensors, index_changes={"dtype": "bfloat16"})
    with pytest.raises(CheckpointError, match=r"stored as F32, but diffusiongemma.json says dtype 'bfloat16'"):
        load_converted(float32_files)
    bf16_files = write_converted(tmp_path / "b", config, tensors, dtype="bfloat16",
                                 index_changes={"dtype": "float32"})
    with pytest.raises(CheckpointError, match=r"stored as BF16, but diffusiongemma.json says dtype 'float32'"):
        load_converted(bf16_files)


# ================================================================================================ 4. whole checkpoints
def _same(a, b):
    return set(a) == set(b) and all(np.array_equal(a[n], b[n]) for n in a)


def test_a_reader_during_a_replace_gets_the_old_checkpoint_whole(tmp_path, monkeypatch):
    config, old = tiny(seed=1)
    _, new = tiny(seed=2)
    dst = write_converted(tmp_path / "ckpt", config, old)
    real_open, calls = weights_module.safe_open, []

    def open_and_replace(path, *args, **kwargs):  # the replace lands between the first and second weight file
        calls.append(path)
        if len(calls) == 2:
            write_converted(dst, config, new, force=True)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(weights_module, "safe_open", open_and_replace)
    try:
        _, got = load_converted(dst)
    except CheckpointError as exc:  # also allowed: a named error, never a mixture
        assert "replaced while it was being read" in str(exc)
    else:
        assert _same(got, old) or _same(got, new), "a reader got a mixture of two checkpoints"
    monkeypatch.undo()
    assert _same(load_converted(dst)[1], new)


def test_weight_files_of_two_conversions_are_not_mixed(tmp_path):
    config, a = tiny(seed=1)
    _, b = tiny(seed=2)
    first, second = write_converted(tmp_path / "a", config, a), write_converted(tmp_path / "b", config, b)
    files = sorted(n for n in os.listdir(first) if n.endswith(".safetensors"))
    assert len(files) > 1
    os.replace(second / files[-1], first / files[-1])  # same names and shapes, another conversion's values
    with pytest.raises(CheckpointError, match="replaced while it was being read, or mixes files"):
        load_converted(first)


KILL_SCRIPT = """
import os, signal, shutil, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.test_reliability import tiny, write_converted
from diffusiongemma.weights_converter import writer
dst, moment = {dst!r}, {moment!r}
config, tensors = tiny(seed=2)
real_rename, real_rmtree = os.rename, shutil.rmtree

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def rename(src, target, *a, **k):
    real_rename(src, target, *a, **k)
    if moment == "after-moving-the-old-away" and os.path.abspath(src) == dst:
        die()

def rmtree(path, *a, **k):
    if moment == "before-deleting-the-old":
        die()
    return real_rmtree(path, *a, **k)

os.rename, shutil.rmtree = rename, rmtree
if {no_exchange!r}:
    writer._swap = lambda new, old: False  # a system without an atomic exchange
if moment == "mid-write":
    real_flush = writer.ShardWriter._flush
    def flush(self):
        if self.files:
            die()
        real_flush(self)
    writer.ShardWriter._flush = flush
write_converted(dst, config, tensors, force=True)
die()  # no earlier moment of this kind on this system: die right after the replace
"""


def _kill_during_replace(tmp_path, moment, no_exchange=False):
    dst = str(tmp_path / "ckpt")
    script = KILL_SCRIPT.format(root=ROOT, dst=dst, moment=moment, no_exchange=no_exchange)
    proc = run_isolated(script)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return dst


def _hidden(tmp_path):
    return sorted(n for n in os.listdir(tmp_path) if n.startswith("."))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["after-moving-the-old-away", "before-deleting-the-old", "mid-write"])
def test_a_killed_replace_never_leaves_the_destination_missing(tmp_path, moment):
    config, old = tiny(seed=1)
    _, new = tiny(seed=2)
    write_converted(tmp_path / "ckpt", config, old)
    dst = _kill_during_replace(tmp_path, moment)
    _, got = load_converted(dst)  # there, and whole: the old or the new checkpoint
    assert _same(got, old) or _same(got, new)
    write_converted(tmp_path / "ckpt", config, new, force=True)  # the next run cleans up after the dead one
    assert _hidden(tmp_path) == [], "partial directories of a dead writer must be removed by the next run"


def test_without_an_atomic_exchange_the_next_run_puts_the_old_checkpoint_back(tmp_path):
    config, old = tiny(seed=1)
    write_converted(tmp_path / "ckpt", config, old)
    dst = _kill_during_replace(tmp_path, "after-moving-the-old-away", no_exchange=True)
    assert not os.path.exists(dst)  # the unavoidable window of a two-rename replace
    writer.cleanup_stale(dst)
    assert _same(load_converted(dst)[1], old) and _hidden(tmp_path) == []


def test_stale_partials_are_removed_only_when_their_writer_is_gone(tmp_path):
    config, tensors = tiny()
    dst = tmp_path / "ckpt"
    host, start = getattr(writer, "_HOST", "0" * 8), getattr(writer, "_process_start", lambda pid: 0)(os.getpid())
    alive = tmp_path / f".ckpt.partial-{host}-{os.getpid()}-{start}-live"
    alive.mkdir()  # a writer that still runs (this process)
    unrelated = tmp_path / ".ckpt.notes"
    unrelated.mkdir()
    old_legacy = tmp_path / ".ckpt.partial-abcd1234"  # an earlier version's partial, untouched for two days
    old_legacy.mkdir()
    (old_legacy / "weights-00001.safetensors").write_bytes(b"x")
    two_days_ago = os.path.getmtime(tmp_path) - 2 * 86400
    os.utime(old_legacy / "weights-00001.safetensors", (two_days_ago, two_days_ago))
    os.utime(old_legacy, (two_days_ago, two_days_ago))
    _kill_during_replace(tmp_path, "mid-write")  # leaves a dead writer's partial behind
    assert len(_hidden(tmp_path)) >= 3
    write_converted(dst, config, tensors, force=True)
    assert _hidden(tmp_path) == sorted([alive.name, unrelated.name])


def test_a_full_disk_is_a_named_error_and_leaves_nothing(tmp_path):
    result = run_isolated(f"""
import resource, signal, sys
sys.path.insert(0, {ROOT!r})
from tests.test_reliability import tiny, write_converted
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, resource.RLIM_INFINITY))
config, tensors = tiny()
try:
    write_converted({str(tmp_path / "ckpt")!r}, config, tensors)
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc)
""")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("WriteError 27 [Errno 27] cannot write "), result.stdout
    assert "weights-0000" in result.stdout and "File too large" in result.stdout
    assert os.listdir(tmp_path) == []


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch, transformers_dir):
    from diffusiongemma.weights_converter import convert

    class Usage:
        free = 1000

    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(WriteError, match=r"needs [\d,]+ bytes but .* has 1,000 bytes free"):
        convert(transformers_dir, tmp_path / "out", progress=False)
    assert os.listdir(tmp_path) == []


# ================================================================================================ 5. bounds
def _sentinel_encoder(ids, cache, mask):
    raise AssertionError("generation started; it should have been refused up front")


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_max_new_tokens_beyond_the_positions_is_refused_up_front(backend):
    config, tensors = tiny()
    model_class = ReferenceModel if backend == "reference" else importlib.import_module("diffusiongemma.fast.model").Model
    model = model_class(config, tensors)
    with pytest.raises(InputError, match=r"positions 0\.\.1000000002 .* max_position_embeddings=131072"):
        generate_module.generate(model, np.array([[5, 6, 7]]), max_new_tokens=10 ** 9, encoder=_sentinel_encoder)


@pytest.mark.parametrize("backend", ["reference", "fast", "cuda-sim"])
def test_a_prompt_longer_than_max_position_embeddings_is_refused(backend):
    config, tensors = tiny(max_position_embeddings=64)
    if backend == "cuda-sim":  # the GPU model's checks are the CPU model's (fast/block.py)
        model = importlib.import_module("diffusiongemma.fast.gpu.model").Model(config, tensors, device="cuda-sim")
    else:
        model_class = ReferenceModel if backend == "reference" else importlib.import_module("diffusiongemma.fast.model").Model
        model = model_class(config, tensors)
    prompt = np.full((1, 65), 5)
    with pytest.raises(InputError, match=r"positions 0\.\.64, but this model has max_position_embeddings=64"):
        model.encode(prompt, model.new_cache(1))
    cache = model.new_cache(1)
    model.encode(prompt[:, :60], cache)  # fits, but a canvas of 16 after it does not
    with pytest.raises(InputError, match=r"the canvas \(16 tokens\) would occupy positions 60\.\.75"):
        model.denoise(np.zeros((1, 16), np.int64), cache)
    with pytest.raises(InputError, match="max_position_embeddings=64"):
        generate_module.generate(model, prompt[:, :50], max_new_tokens=16, encoder=_sentinel_encoder)


def test_a_run_larger_than_the_available_memory_is_refused(monkeypatch):
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    from diffusiongemma.reference.support import checks as checks_module  # where check_budget looks it up

    monkeypatch.setattr(checks_module, "available_memory", lambda: 10 ** 6)
    with pytest.raises(InputError, match=r"needs about [\d,]+ bytes .* but 1,000,000 bytes"):
        generate_module.generate(model, np.ones((64, 8), np.int64), max_new_tokens=512, encoder=_sentinel_encoder)


def test_long_prompts_need_linear_memory_in_the_reference_encoder(monkeypatch):
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 1500))
    whole = model.encode(ids, model.new_cache(1))
    monkeypatch.setattr(reference_model_module, "ATTENTION_SCORE_BYTES", 2 ** 18)
    tracemalloc.start()
    blocked = model.encode(ids, model.new_cache(1))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    scores = 4 * config.num_attention_heads * ids.shape[1] ** 2  # one (n, n) float32 score matrix per head
    assert peak < scores / 4, f"peak {peak} bytes for {scores} bytes of scores: still quadratic"
    np.testing.assert_allclose(blocked, whole, rtol=1e-4, atol=1e-4)


# ================================================================================================ 6. named values
def _transformers_config(**text_changes):
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=4, top_k_experts=2)
    text.update(text_changes)
    return {"model_type": "diffusion_gemma", "text_config": text}


@pytest.mark.parametrize("changes, field", [
    (dict(rope_parameters=[1, 2]), "rope_parameters"),
    (dict(per_layer_config={"1": {"head_dim": "64"}}), r"per_layer_config\[1\]\.head_dim"),
    (dict(rope_parameters={"sliding_attention": {"rope_theta": "big"},
                           "full_attention": {"rope_theta": 1e6}}), r"rope_parameters\['sliding_attention'\]"),
    (dict(layer_types="sliding_attention"), "layer_types must be a list"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps must be a number, got 'tiny'"),
])
def test_wrong_json_types_in_config_json_are_named(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_transformers(_transformers_config(**changes))


@pytest.mark.parametrize("write, expected", [
    (lambda p: p.write_text("[1, 2]"), "expected a JSON object, got list"),
    (lambda p: p.write_bytes(b'{"format": "diffusiongemma\xff"}'), "not valid UTF-8"),
    (lambda p: p.write_text(json.dumps({"format": "diffusiongemma", "format_version": 1, "dtype": "float32",
                                        "weight_map": {}})), "'model_config'"),
    ("weight_map", r"weight_map\['embed_tokens'\] must be a file name"),
])
def test_bad_index_files_are_named(tmp_path, write, expected):
    config, tensors = tiny()
    path = write_converted(tmp_path / "ckpt", config, tensors)
    index = path / INDEX_FILE
    if write == "weight_map":
        data = json.loads(index.read_text())
        data["weight_map"]["embed_tokens"] = 7
        index.write_text(json.dumps(data))
    else:
        write(index)
    with pytest.raises(CheckpointError, match=expected):
        load_converted(path)


def test_from_pretrained_on_a_regular_file_says_so(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model.safetensors' is not a checkpoint this project reads"):
        ReferenceModel.from_pretrained(file)


def test_generate_with_something_that_is_not_a_cache():
    config, tensors = tiny()
    with pytest.raises(InputError, match="cache must be a KV cache"):
        generate_module.generate(ReferenceModel(config, tensors), np.array([[5, 6]]), cache=object())


def test_an_all_zero_attention_mask_row_is_refused_unless_the_row_has_cached_tokens():
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    ids, mask = np.array([[5, 6, 7], [8, 9, 10]]), np.array([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(InputError, match="attention_mask row 1 is all zeros"):
        generate_module.generate(model, ids, mask, max_new_tokens=4, max_denoising_steps=2)
    cache = model.new_cache(2)
    model.encode(ids, cache)  # both rows have real tokens in the cache: padding after them is fine
    result = generate_module.generate(model, ids, mask, cache=cache, max_new_tokens=4, max_denoising_steps=2)
    assert result.sequences.shape == (2, 3 + config.canvas_length)


def test_self_conditioning_logits_with_an_all_minus_inf_position_are_refused():
    config, tensors = tiny()
    model = ReferenceModel(config, tensors)
    sc = np.zeros((1, config.canvas_length, config.vocab_size), np.float32)
    sc[0, 2] = -np.inf
    with pytest.raises(InputError, match=r"self_conditioning_logits .*\(0, 2\)"):
        generate_module.generate(model, np.array([[5, 6]]), self_conditioning_logits=sc, max_new_tokens=4,
                                 max_denoising_steps=2)
    cache = model.new_cache(1)
    model.encode(np.array([[5, 6]]), cache)
    with pytest.raises(InputError, match=r"\(0, 2\)"):
        model.denoise(np.zeros((1, config.canvas_length), np.int64), cache, sc)


# ================================================================================================ 8. counters
def test_tokens_per_forward_is_torchs_arithmetic_for_every_count():
    import torch
    passes = np.arange(1, 97, dtype=np.int64)
    for count in range(16, 16 * 40, 16):  # generated columns come in whole canvases
        tokens = np.full((passes.size, count), 9, dtype=np.int64)
        expected = (count / torch.tensor(passes, dtype=torch.int)).numpy()  # upstream, no pad id
        np.testing.assert_array_equal(tokens_per_forward(tokens, passes, None), expected, err_msg=str(count))
        tokens[:, : count // 3] = 0
        counted = (torch.tensor(tokens) != 0).sum(dim=-1)
        expected = (counted / torch.tensor(passes, dtype=torch.int)).numpy()  # upstream, pad id 0
        np.testing.assert_array_equal(tokens_per_forward(tokens, passes, 0), expected, err_msg=str(count))


def test_tokens_per_forward_matches_transformers_generate_without_a_pad_id():
    from tests.hf_tiny import TinySpec, tiny_model
    from tests.test_generate_parity import record_transformers, replay_ours

    model = tiny_model(TinySpec(final_norm_gain=25), seed=0)
    ids = np.random.default_rng(2).integers(3, 120, size=(2, 6))
    settings = dict(max_new_tokens=48, max_denoising_steps=5, stability_threshold=1, confidence_threshold=0.3,
                    pad_token_id=None)
    recording = record_transformers(model, ids, seed=2, **settings)
    ours, _ = replay_ours(recording, ids, **settings)
    np.testing.assert_array_equal(ours.sequences, recording.sequences)
    assert recording.tokens_per_forward.tolist() != [np.float32(48) / np.float32(15)] * 2  # the case that differs
    np.testing.assert_array_equal(ours.tokens_per_forward, recording.tokens_per_forward)
