"""The weight store (reference/support/weight_store.py): checkpoints read from their files as they are used.

The main check runs a model of many narrow layers under a memory limit that one layer's weights fit and the
whole model does not, on every backend and dtype, and compares its tokens with the same run without the
limit. How the limit is imposed: the child process sets RLIMIT_DATA (setrlimit) to the data segment it
already uses after its imports plus ``ALLOWANCE`` bytes. Since Linux 4.7 RLIMIT_DATA counts every private
writable mapping (the heap, NumPy's arrays, thread stacks) and not read-only file mappings, so it limits
exactly "memory beyond the mapped files"; an allocation past it fails with MemoryError. The old loader
(the whole checkpoint read into arrays) is run under the same limit and must fail it, which proves the
limit bites.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from diffusiongemma.reference.support.errors import CheckpointError
from diffusiongemma.reference.support.weight_store import (MappedFile, StreamedTensor, StoredTensor,
                                                           safetensors_header)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA limits private "
                                "mappings only on Linux (>= 4.7)")

LAYERS = 12
NARROW = dict(vocab_size=4096, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_experts=32,
              top_k_experts=4, head_dim=64, global_head_dim=128, sliding_window=32, canvas_length=16)
ALLOWANCE = 96 * 2 ** 20  # bytes a run may allocate beyond its imports: one layer widened fits, the model does not
CPU_BUDGET = 32 * 2 ** 20  # the CPU path's packed-weight budget in the limited runs (a layer packs to ~13 MB)


@pytest.fixture(scope="module")
def tiny_transformers_dir():
    """The shipped model: a transformers directory (config.json + model.safetensors, float32)."""
    from diffusiongemma.checkpoint import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """A 12-layer model at reduced width in transformers' layout (bfloat16, as released) and as a Q8_0 GGUF.
    Its experts are 12.6 MB a layer as stored, 25 MB widened: the model is 151 MB stored, 302 MB widened."""
    from diffusiongemma.released import make_checkpoint

    path = tmp_path_factory.mktemp("narrow") / "ckpt"
    made = make_checkpoint(path, layers=LAYERS, dtype="bfloat16", seed=3, gguf="q8_0", **NARROW)
    return str(path), str(made.gguf)


CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from diffusiongemma.checkpoint import generate_function
    from diffusiongemma.reference.model import Model as Reference
    from diffusiongemma.fast.model import Model as Fast
    from diffusiongemma.reference.support.checkpoint_io import open_checkpoint

    path, backend, dtype, limit, loader = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

    def data_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024

    if limit:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (data_bytes() + limit, hard))
    try:
        if loader == "whole":  # what the loader did before the weight store: every tensor read into an array
            # (widened by NumPy here: safetensors' own reader, out of memory in Rust, can hang in its panic hook)
            config, store = open_checkpoint(path)
            model = Reference(config, {name: store[name].float32().copy() for name in store}, dtype=dtype)
        elif backend == "reference":
            model = Reference.from_pretrained(path, dtype=dtype)
        else:
            model = Fast.from_pretrained(path, dtype=dtype, weight_budget=int(sys.argv[6]))
        result = generate_function(backend)(model, np.array([[2, 17, 300, 41]]), random=5, max_new_tokens=16,
                                            max_denoising_steps=2)
    except MemoryError:
        print(json.dumps({"memory_error": True}))
        sys.exit(0)
    experts = type(model.layers[0].experts).__name__ if backend == "cpu" else None
    print(json.dumps({"tokens": np.asarray(result.sequences).tolist(), "experts": experts}))
""")


def _run(path: str, backend: str, dtype: str, limit: int, loader: str = "store") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")  # one order of sums in both runs of a pair
    done = subprocess.run([sys.executable, "-c", CHILD, path, backend, dtype, str(limit), loader, str(CPU_BUDGET)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_old_loader_fails_the_limit(narrow):
    """The limit is real: reading the whole checkpoint into arrays (302 MB widened) does not fit it."""
    assert _run(narrow[0], "reference", "float32", ALLOWANCE, loader="whole") == {"memory_error": True}


@pytest.mark.slow
@pytest.mark.parametrize("backend, dtype, source", [
    ("reference", "float32", 0), ("reference", "bfloat16", 0), ("cpu", "float32", 0), ("cpu", "bfloat16", 0),
    ("cpu", "float32", 1), ("reference", "float32", 1)])
def test_many_layers_run_under_a_limit_one_layer_fits(narrow, backend, dtype, source):
    """Every backend and dtype, on the safetensors checkpoint and its Q8_0 GGUF (source 1), gives the same
    tokens under the limit as without it: memory beyond the mapped files does not grow with the layers."""
    path = narrow[source]
    free = _run(path, backend, dtype, 0)
    limited = _run(path, backend, dtype, ALLOWANCE)
    assert "memory_error" not in limited, f"{backend} {dtype} {path} ran out of memory under the limit"
    assert limited["tokens"] == free["tokens"]
    if backend == "cpu":  # over its budget, the CPU path reads the experts where they lie
        assert limited["experts"] == "ExpertRows"


# ---------------------------------------------------------------------------------------------- files
def test_a_file_too_short_for_its_header_is_refused_at_open(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((10_000).to_bytes(8, "little") + b'{"a": 1}')
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated safetensors file \(its header says "
                                              r"10000 header bytes, the file has 8"):
        safetensors_header(MappedFile(str(bad)))
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than the 8-byte header length"):
        safetensors_header(MappedFile(str(tiny)))
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty.safetensors: empty file"):
        MappedFile(str(empty))


def test_a_truncated_checkpoint_is_refused_before_any_weight_is_read(tmp_path, tiny_transformers_dir):
    """A weight file cut short: refused when the model is opened, naming the file and the tensor."""
    import shutil

    from diffusiongemma.reference.model import Model

    broken = tmp_path / "cut"
    shutil.copytree(tiny_transformers_dir, broken)
    weights = broken / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*truncated"):
        Model.from_pretrained(str(broken))


def test_a_run_keeps_working_when_convert_force_replaces_its_checkpoint(tmp_path, tiny_transformers_dir):
    """The replace is an atomic rename of a new directory: the mapped old files stay whole, so a model opened
    before it computes on the old weights to the end (every tensor read after the replace)."""
    from diffusiongemma.reference.model import Model
    from diffusiongemma.weights_converter import convert

    dst = tmp_path / "converted"
    convert(tiny_transformers_dir, dst, progress=False)
    before = Model.from_pretrained(str(dst))  # nothing read yet
    expected = Model.from_pretrained(str(dst))
    ids = np.array([[2, 5, 9]])
    cache = expected.new_cache(1)
    expected.encode(ids, cache)
    want = expected.denoise(np.arange(expected.config.canvas_length)[None] % 7, cache)
    convert(tiny_transformers_dir, dst, dtype="bfloat16", force=True, progress=False)  # other values now
    cache = before.new_cache(1)
    before.encode(ids, cache)
    got = before.denoise(np.arange(before.config.canvas_length)[None] % 7, cache)
    np.testing.assert_array_equal(got, want)  # same code, same inputs, same weights: same sums
    after = Model.from_pretrained(str(dst))
    cache = after.new_cache(1)
    after.encode(ids, cache)
    assert not np.array_equal(after.denoise(np.arange(after.config.canvas_length)[None] % 7, cache), want)


# ---------------------------------------------------------------------------------------------- pieces
def test_a_streamed_tensor_widens_rows_and_blocks_its_products(monkeypatch):
    from diffusiongemma.reference.support import weight_store

    rng = np.random.default_rng(0)
    table = rng.standard_normal((1000, 48)).astype(np.float32)
    monkeypatch.setattr(weight_store, "BLOCK_BYTES", 48 * 4 * 64)  # 64 rows a block: 16 blocks
    t = StreamedTensor(StoredTensor.of_array(table, "table"), np.dtype(np.float32))
    ids = np.array([[3, 999], [0, 3]])
    np.testing.assert_array_equal(t[ids], table[ids])
    x = rng.standard_normal((5, 48)).astype(np.float32)
    np.testing.assert_allclose(x @ t.T, x @ table.T, rtol=1e-5, atol=1e-5)  # blocks of output columns
    p = rng.random((5, 1000)).astype(np.float32)
    # blocks of the summed axis: the partial sums added in another order than one product, float32 only
    np.testing.assert_allclose(p @ t, p @ table, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(t), table)


def test_packing_for_a_device_holds_one_tensor_at_a_time(narrow):
    """The GPU path's loading (``pack`` with an upload per tensor) over the mapped checkpoint: the host's
    traced peak is about one tensor, whatever the number of layers (a 'device' that keeps only sizes)."""
    from diffusiongemma.fast.gpu.weights_bf16 import pack_bf16
    from diffusiongemma.fast.weights import StoreArrays, pack
    from diffusiongemma.reference.support.checkpoint_io import open_checkpoint

    config, store = open_checkpoint(narrow[0])
    largest = max(t.nbytes for t in store.values())  # float32 bytes of the largest tensor (one layer's experts)
    for packer in (lambda: pack(config, StoreArrays(store), upload=lambda a: a.nbytes),
                   lambda: pack_bf16(config, StoreArrays(store), upload=lambda a: a.nbytes)):
        tracemalloc.start()
        try:
            packer()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 3 * largest, f"peak {peak} bytes for a largest tensor of {largest}"
        assert peak < store.stored_nbytes / 3  # far below the model


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8_0"])
@pytest.mark.parametrize("bf16", [False, True])
def test_experts_read_in_place_equal_the_packed_panels(kind, bf16):
    """``ExpertRows`` (row-major weights read where they lie) against ``ExpertPanels`` (packed once), bit for
    bit: both run the same tile on the same widened values in the same order (only the gather differs).
    Sizes off the panel and chunk widths (2I = 96 + 32 rows, H = 288 > DG_KC) and experts with no rows."""
    from diffusiongemma.fast.experts import ExpertPanels, ExpertRows
    from diffusiongemma.reference.support.quantized import BFLOAT16, Q8_0Tensor

    rng = np.random.default_rng(7)
    E, I, H, R = 5, 64, 288, 23
    g = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    d = rng.standard_normal((E, H, I)).astype(np.float32)
    if kind == "q8_0":
        import gguf

        blocks = [gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0) for a in (g, d)]
        rows = ExpertRows(blocks[0], blocks[1], I, H)
        panels = ExpertPanels.from_weights(*(Q8_0Tensor.from_blocks(b, a.shape) for b, a in zip(blocks, (g, d))))
    else:
        if kind == "bfloat16":
            g, d = g.astype(BFLOAT16), d.astype(BFLOAT16)
        rows, panels = ExpertRows(g, d, I, H), ExpertPanels.from_weights(g, d)
    assert rows.kind == panels.kind == kind
    x = rng.standard_normal((R, H)).astype(np.float32)
    offsets = np.array([0, 7, 7, 15, 22, 23], dtype=np.int64)  # expert 1 gets no rows
    outs = []
    for experts in (rows, panels):
        gate_up, act, y = np.empty((R, 2 * I), np.float32), np.empty((R, I), np.float32), np.full((R, H), np.nan, np.float32)
        experts(x, offsets, gate_up, act, y, bf16)
        outs.append(y)
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_each_layer_reads_the_next_one_ahead(narrow, monkeypatch):
    """While a block runs, the next layer's bytes are asked of the kernel in the background (madvise
    WILLNEED), on the reference and on the CPU path over its budget: a pass's file reads overlap its work."""
    from diffusiongemma.fast.model import Model as Fast
    from diffusiongemma.reference.model import Model as Reference
    from diffusiongemma.reference.support.weight_store import MappedFile, WeightStore

    prefixes, ranges = [], []
    store_prefetch, file_prefetch = WeightStore.prefetch, MappedFile.prefetch
    monkeypatch.setattr(WeightStore, "prefetch", lambda self, prefix: (prefixes.append(prefix),
                                                                       store_prefetch(self, prefix)))
    monkeypatch.setattr(MappedFile, "prefetch", lambda self, offset, count: (ranges.append(count),
                                                                             file_prefetch(self, offset, count)))
    for model in (Reference.from_pretrained(narrow[0]), Fast.from_pretrained(narrow[0], weight_budget=CPU_BUDGET)):
        prefixes.clear()
        ranges.clear()
        model.encode(np.array([[2, 5, 7]]), model.new_cache(1))
        assert [f"layers.{l}." for l in range(1, LAYERS)] == [p for p in prefixes if p != "layers.0."][:LAYERS - 1]
        experts = 32 * 512 * 256 * 2  # one layer's experts.gate_up_proj in the file (bfloat16)
        assert ranges.count(experts) >= LAYERS - 1  # each asked of the file as one range


def test_a_large_q8_0_table_stays_quantized_on_the_cpu_path(narrow, monkeypatch):
    """A Q8_0 embedding table above STREAM_BYTES (2.95 GB widened at the released shape) is never widened whole
    on the CPU path: its lookups, output projection and soft embedding widen blocks of rows. The same logits as
    the table widened at load, up to the order of the soft embedding's float32 sums over the vocabulary."""
    from diffusiongemma.fast import model as fast_model

    widened = fast_model.Model.from_pretrained(narrow[1])
    monkeypatch.setattr(fast_model, "STREAM_BYTES", 0)  # this model's 4 MB table counts as large
    monkeypatch.setattr(fast_model, "SOFT_EMBEDDING_BLOCK", 1000)  # several blocks of the 4,096 rows
    kept = fast_model.Model.from_pretrained(narrow[1])
    assert isinstance(kept.embed_tokens, StoredTensor) and kept.embed_tokens.kind == "q8_0"
    assert not isinstance(widened.embed_tokens, StoredTensor)
    canvas = np.random.default_rng(1).integers(0, 4096, size=(1, 16))
    out = []
    for model in (widened, kept):
        cache = model.new_cache(1)
        model.encode(np.array([[2, 17, 300, 41]]), cache)
        first = model.denoise(canvas, cache)
        out.append((first, model.denoise(canvas, cache, first / np.float32(0.8))))
    np.testing.assert_array_equal(out[1][0], out[0][0])  # lookups and output projection: the same products
    # the self-conditioned pass: the soft embedding adds its blocks' partial sums, another float32 order than
    # one product, which 12 random layers amplify (measured 1.7e-4 of the largest logit here)
    np.testing.assert_allclose(out[1][1], out[0][1], rtol=0, atol=1e-3 * float(np.abs(out[0][1]).max()))
    # ... and that product itself is the blocks' products of the widened rows, added in order
    probs = np.random.default_rng(2).random((16, 4096)).astype(np.float32)
    got = np.empty((16, 256), np.float32)
    kept.block_ops._soft_embedding(probs, kept.embed_tokens, got)
    table = widened.embed_tokens
    want = sum((probs[:, a:a + 1000] @ table[a:a + 1000] for a in range(1000, 4096, 1000)), probs[:, :1000] @ table[:1000])
    # two float32 orders of the same sums (the tiled BLAS and NumPy's): within the standard bound n u sum|p e|
    bound = 4096 * 2.0 ** -24 * (np.abs(probs) @ np.abs(table))
    assert (np.abs(got - want) <= bound).all(), float(np.abs(got - want).max())
