"""The fast CPU DiffusionGemma model: the reference's math on compiled kernels and preallocated buffers.

Same public interface and semantics as ``reference.model.Model`` (``from_pretrained``, ``new_cache``,
``encode``, ``denoise``; same shapes, same errors), computing the same float32 function up to
summation order (see ``fast/_kernels.pyx`` for where the numbers can differ, and
``tests/test_fast_equivalence.py`` for the measured agreement). What changes is how it is computed:

* weights are repacked once: q/k/v projections concatenated into one matrix per layer, gate and up
  projections of the dense MLP and of the self-conditioning MLP likewise, so each is one BLAS call;
* matrix products run on NumPy's OpenBLAS as tiles taken by the kernels' threads (``fast.blas``; the
  BLAS itself on one thread), with ``out=`` into a ``Workspace`` of reused buffers; everything
  between them (norms, RoPE, GELU, the masked attention softmax, routing, soft-cap) is a fused kernel
  of ``_kernels``; attention (``fast.attention``) shares each KV head among its query heads as strided
  views, never repeating keys or values;
* the KV cache (``fast.cache.KVCache``) is preallocated; sliding layers are rings of ``W - 1`` slots;
* experts run once per expert on the gathered block of tokens routed to it (tokens sorted by expert),
  all experts of a layer in one parallel loop, on weights packed once into panels and a register-tiled
  kernel of our own instead of BLAS (``fast.experts``); Q8_0 experts of a GGUF file stay quantized;
* ``denoise`` can write into a caller's ``out`` array and computes the self-conditioning softmax in that
  same array before the logits overwrite it, so a denoising step allocates nothing proportional to the
  vocabulary or to the cache once the workspace has warmed up.

``Model(..., dtype="bfloat16")`` is upstream's bfloat16 run, as ``reference.model.Model(..., dtype="bfloat16")``
defines it (SPEC §10.1 B1-B9): every weight is rounded to bfloat16 on load (the matrices, the experts and the
embedding then held as bfloat16, the products widening them piece by piece and accumulating in float32; the
soft-embedding product by blocks of vocabulary rows, ``CpuOps._soft_embedding``), and ``CpuOps``
with ``bf16`` set rounds each result where the reference's ``round_to`` does: after each product, inside the
fused kernels through their ``bf16`` flags (norms, RoPE, GELU and its product, the attention scores and
weights, the experts, the residual tail, the embedding), and on the logits before the float32 soft-cap.

Array-module note: the block's order (norms, attention with the KV cache, dense MLP, router and experts,
the fused tail) is ``fast.block``'s, shared with the GPU model; ``CpuOps`` below gives it this model's
matrix products (``self.xp``, NumPy here) and compiled kernels (``self.ops``), and ``_CpuKeys`` the
cache handling of one block call.

Not thread-safe: a model owns one workspace; use one model per thread.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Mapping

import numpy as np

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.generate import ReferenceBackend
from diffusiongemma.reference.support.errors import ConfigError, InputError
from diffusiongemma.reference.support.checks import check_pass_memory, check_positions
from diffusiongemma.reference.support.diagnosis import non_finite_error
from diffusiongemma.reference.support.observer import NULL_OBSERVER
from diffusiongemma.reference.primitives import BFLOAT16, compute_dtype, rope_inverse_frequencies
from diffusiongemma.reference.support.checkpoint_io import check_tensors, load_checkpoint, open_checkpoint
from diffusiongemma.reference.support.weight_store import STREAM_BYTES, StoredTensor, WeightStore
from diffusiongemma.reference.support.quantized import is_bfloat16, widen

from . import _kernels, block
from .attention import attend
from .backend import CpuBackend
from .blas import CPU_ARRAYS
from .cache import KVCache
from .experts import ExpertPanels, ExpertRows
from .weights import LAYER_TENSOR_NAMES, LayerWeights, StoreArrays, pack, pack_layer

DEVICES = ("cpu",)  # devices this module can run on ("cuda" lives elsewhere)
WEIGHT_BUDGET = 2 ** 30  # bytes of packed layer weights a model over a mapped checkpoint holds at most (1 GiB)


def _packed_layer_bytes(store: WeightStore, config: ModelConfig, kept_as_stored: bool) -> int:
    """About the bytes ``pack_layer`` holds for every layer of ``store``: the stored bytes where bfloat16 and
    Q8_0 stay as stored (``keep_bf16``, or the bfloat16 run's two bytes a weight), float32 bytes otherwise."""
    total = 0
    for name in store:
        if name.startswith("layers."):
            t = store[name]
            total += (min(t.stored_nbytes, t.nbytes // 2) if kept_as_stored and t.kind != "float32" else t.nbytes)
    return total


class PackedLayers:
    """The layers of a model larger than its weight budget, as a sequence: ``layers[l]`` packs layer ``l``
    from the mapped checkpoint (``pack(l)``) unless it is still held, and drops the least recently used
    layers while the held ones exceed ``budget`` bytes (the layer in use always stays). A pass walks the
    layers in order, so with a budget below the model each pass packs every layer again: reading the files
    (or the page cache) and repacking, in exchange for memory flat in the number of layers."""

    def __init__(self, pack: Any, count: int, budget: int, prefetch: Any = None):
        """prefetch: ``WeightStore.prefetch``, called with the next layer's prefix as each layer is packed."""
        self._pack, self._count, self.budget, self.prefetch = pack, count, budget, prefetch
        self._held: dict[int, LayerWeights] = {}  # in order of use, the most recent last
        self.packs = 0  # layers packed so far (a test and a benchmark read it)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, l: int) -> LayerWeights:
        if not 0 <= l < self._count:
            raise IndexError(l)
        w = self._held.pop(l, None)
        if w is None:
            while self._held and sum(map(_layer_nbytes, self._held.values())) > self.budget // 2:
                del self._held[next(iter(self._held))]  # room for the next layer before it is packed
            w = self._pack(l)
            self.packs += 1
        if self.prefetch is not None:  # the next layer's bytes (its experts in the file) read while this one runs
            self.prefetch(f"layers.{(l + 1) % self._count}.")
        self._held[l] = w
        while len(self._held) > 1 and sum(map(_layer_nbytes, self._held.values())) > self.budget:
            del self._held[next(iter(self._held))]
        return w

    def __iter__(self):
        return (self[l] for l in range(self._count))

    def held(self) -> list[LayerWeights]:
        return list(self._held.values())


def _layer_nbytes(w: LayerWeights) -> int:
    total = sum(int(v.nbytes) for v in vars(w).values() if isinstance(v, np.ndarray))
    return total + (w.experts.nbytes if w.experts is not None else 0)


def check_device(device: str) -> str:
    """Return ``device`` if this model supports it; raise ``ConfigError`` naming it otherwise."""
    if device not in DEVICES:
        raise ConfigError(f"device {device!r} is not supported by diffusiongemma.fast.Model "
                          f"(supported: {', '.join(DEVICES)})")
    return device


class Workspace:
    """Named scratch buffers reused across calls; a buffer grows only when a larger view is requested.

    ``get(name, shape, dtype)`` returns a C-contiguous view of the first prod(shape) elements of the
    buffer called ``name``; its contents are whatever the last user left there.
    """

    def __init__(self, xp=np):
        self.xp = xp
        self._buffers: dict[tuple[str, type], np.ndarray] = {}
        self._views: dict[tuple[str, tuple[int, ...], type], np.ndarray] = {}  # memoised views (hot path)

    def get(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        view = self._views.get((name, shape, dtype))
        if view is not None:
            return view
        size = math.prod(shape)
        key = (name, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.size < size:
            buffer = self.xp.empty(max(size, 1), dtype=dtype)
            self._buffers[key] = buffer
            self._views = {k: v for k, v in self._views.items() if k[0] != name or k[2] != dtype}
        view = buffer[:size].reshape(shape)
        if len(self._views) > 4096:  # shapes vary with prompt lengths: keep the memo bounded
            self._views.clear()
        self._views[(name, shape, dtype)] = view
        return view

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.nbytes for b in self._buffers.values())


def _serial_blas(method):
    """Run ``method`` with the BLAS library on one thread (``fast.blas.CpuArrays.serial_blas``) when the
    model's array module offers it."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        scope = getattr(self.xp, "serial_blas", None)
        if scope is None:
            return method(self, *args, **kwargs)
        with scope():
            return method(self, *args, **kwargs)
    return wrapper


class Model:
    """DiffusionGemma text model on the fast CPU kernels.

    Build it with ``Model.from_pretrained(path, device="cpu")`` or ``Model(config, tensors)`` where
    ``tensors`` maps the project's tensor names (``reference.weights``) to arrays (widened to float32),
    or, for the experts' two tensors of a layer, to ``Q8_0Tensor`` (kept quantized, ``fast.experts``).
    ``dtype``: "float32" (default) or "bfloat16", the reference's ``Model(dtype=...)`` (module notes);
    ``self.dtype`` is the NumPy dtype (``reference.primitives.FLOAT32`` / ``BFLOAT16``).
    Raises ``CheckpointError`` for missing/unknown/misshapen tensors and ``ConfigError`` for an
    unsupported device or dtype.
    """

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], device: str = "cpu",
                 release_tensors: bool = False, keep_bf16: bool = True, dtype: str | np.dtype = "float32",
                 weight_budget: int = WEIGHT_BUDGET):
        """``release_tensors``: ``tensors`` is a dict this model may empty as it repacks (``from_pretrained``
        passes its own, so that loading never holds the checkpoint's experts and their panels at once).
        ``keep_bf16``: bfloat16 arrays among ``tensors`` stay bfloat16 (the experts, and the matrices of
        ``fast.weights.MATRICES_KEPT_BF16``), products widening them piece by piece: the float32 path's
        result on the widened weights, bit for bit; False widens them at load. ``dtype="bfloat16"`` rounds
        every tensor to bfloat16 first (Q8_0 experts dequantized, then rounded), so that with ``keep_bf16``
        those matrices, the experts and the embedding are held bfloat16 whatever the checkpoint stores.

        ``tensors`` may be a ``WeightStore`` (``from_pretrained``: the checkpoint's files mapped). Then nothing
        is copied that the kernels can read where it lies (a float32 matrix of a float32 file, a bfloat16 one
        kept bfloat16; an embedding table above ``STREAM_BYTES`` stays as stored, its products widening
        blocks of rows), and when the layers' packed weights would exceed ``weight_budget`` bytes, each layer
        is packed from the mapping when a pass reaches it and dropped when the budget needs the room
        (``PackedLayers``), so that memory beyond the mapped files does not grow with the number of layers.
        Values are checked finite as each tensor is first read."""
        self.device = check_device(device)
        self.dtype = compute_dtype(dtype)
        self.bf16 = self.dtype == BFLOAT16  # the bfloat16 run: CpuOps rounds where the reference's round_to does
        check_tensors(tensors, config)
        mapped = isinstance(tensors, WeightStore)
        keep_bf16_embedding, embedding = self.bf16, None
        if mapped:  # a checkpoint's mapped files: tensors read (and checked) as packed, no copy where none is needed
            table = tensors["embed_tokens"]
            keep_bf16_embedding = self.bf16 or table.nbytes > STREAM_BYTES  # a large table is never widened whole:
            if keep_bf16_embedding and not self.bf16 and table.kind not in ("float32", "bfloat16"):
                embedding = tensors.checked("embed_tokens")  # Q8_0 / float16 rows widened a block at a time
            store, tensors = tensors, StoreArrays(tensors, self.bf16, keep_bf16)
        elif self.bf16:
            tensors = _rounded_to_bf16(tensors, keep_bf16, release_tensors)
            release_tensors = True  # a dict of our own (or the caller's, already given up)
        self.config = config
        self.xp = CPU_ARRAYS  # NumPy with the products on the kernels' tiled BLAS calls (fast.blas)
        self.ops = _kernels
        experts = functools.partial(ExpertPanels.from_weights, keep_bf16=keep_bf16)
        lazy = mapped and _packed_layer_bytes(store, config, keep_bf16 or self.bf16) > weight_budget
        packed = pack(config, tensors, experts=experts, release=release_tensors, keep_bf16=keep_bf16,
                      keep_bf16_embedding=keep_bf16_embedding, layers=not lazy, embedding=embedding)
        self.embed_tokens, self.final_norm = packed.embed_tokens, packed.final_norm  # (V, H), (H,)
        self.sc_pre_norm, self.sc_gate_up, self.sc_down = packed.sc_pre_norm, packed.sc_gate_up, packed.sc_down
        self.layers = packed.layers
        if lazy:  # more layers than the budget holds: each read from the mapping when a pass reaches it, its
            # experts in place (ExpertRows: no packed copy), the rest packed and dropped as the budget needs
            rows = StoreArrays(store, self.bf16, keep_bf16, experts_stored=True)
            self.layers = PackedLayers(functools.partial(
                pack_layer, config, rows, experts=functools.partial(ExpertRows.from_stored, bf16_run=self.bf16),
                keep_bf16=keep_bf16), config.num_hidden_layers, weight_budget, store.prefetch)
        self._omega = {kind: rope_inverse_frequencies(config.rope_parameters[kind], d)
                       for kind, d in zip(config.layer_types, config.layer_head_dim)}
        self._eps = np.float32(config.rms_norm_eps)
        self._embed_scale = np.float32(config.embed_scale)
        if self.bf16:  # upstream casts the scale to the weight dtype (B1): 53.0 for sqrt(2816) = 53.066
            self._embed_scale = _round_bf16(self._embed_scale)
        self._router_factor = np.float32(config.hidden_size ** -0.5)
        self._cap = np.float32(config.final_logit_softcapping)
        self._rope_tables: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.workspace = Workspace(self.xp)
        self.block_ops = CpuOps(self)  # fast.block's operations on this model's kernels and workspace

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str = "cpu", keep_quantized: bool = True,
                        keep_bf16: bool = True, dtype: str | np.dtype = "float32",
                        weight_budget: int = WEIGHT_BUDGET) -> "Model":
        """Load a converted checkpoint directory, a transformers checkpoint directory or a GGUF file.

        Reading is the reference's (``reference.weights.load_checkpoint``: same formats, same
        ``CheckpointError`` / ``ConfigError``); ``device`` must be "cpu" (``ConfigError`` otherwise,
        raised before anything is read). ``keep_quantized``: a GGUF file's Q8_0 experts stay Q8_0 in
        memory (the result is the float32 path's on the dequantized weights, bit for bit; every other
        Q8_0 tensor is widened to float32); False widens everything at load, as the reference does.
        ``keep_bf16``: the large matrices of a checkpoint that stores bfloat16 (a converted directory of
        dtype bfloat16, a transformers directory of bfloat16 safetensors, a GGUF file's BF16 tensors) stay
        bfloat16 in memory (``Model(keep_bf16=...)``: the
        same results, bit for bit, in half the bytes); False widens them at load.
        ``dtype``: "float32" (default) or "bfloat16" (the bfloat16 run, ``Model``); a bad value raises
        ``ConfigError`` before anything is read.
        """
        check_device(device)
        compute_dtype(dtype)
        if not keep_quantized:  # the reference's float32 values, read whole (a caller's comparison run)
            config, tensors = load_checkpoint(path, keep_bf16=keep_bf16)
            return cls(config, tensors, device=device, release_tensors=True, keep_bf16=keep_bf16, dtype=dtype)
        config, store = open_checkpoint(path)  # mapped: see ``Model``
        return cls(config, store, device=device, keep_bf16=keep_bf16, dtype=dtype, weight_budget=weight_budget)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights this model holds (its packed layout, quantized experts at their own size)."""
        arrays = [self.embed_tokens, self.final_norm, self.sc_pre_norm, self.sc_gate_up, self.sc_down]
        total = sum(int(a.nbytes) for a in arrays)
        layers = self.layers.held() if isinstance(self.layers, PackedLayers) else self.layers
        return total + sum(map(_layer_nbytes, layers))

    def new_cache(self, batch_size: int, capacity: int = 0) -> KVCache:
        """An empty fast KV cache for ``batch_size`` rows; ``capacity`` pre-sizes it (positions).

        Raises ``InputError`` unless batch_size is a positive integer.
        """
        return KVCache(self.config, batch_size, capacity)

    def denoising_backend(self, draws, batch_size: int, denoiser=None, observer=NULL_OBSERVER) -> Any:
        """The per-step compute the generation loop (``reference.generate.generate``) runs this model with:
        the fused decoder buffer and sampling pass (``fast.backend.CpuBackend``), or, for a replaced
        ``denoiser``, the reference's step."""
        if denoiser is not None:
            return ReferenceBackend(denoiser, draws, self.config.vocab_size, batch_size, observer=observer)
        return CpuBackend(self, draws, batch_size, observer=observer)

    # ------------------------------------------------------------------ encoder
    @_serial_blas
    def encode(self, input_ids: np.ndarray, cache: KVCache, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """Run the causal encoder over new tokens and append their keys/values to ``cache``.

        input_ids: (B, n) int token ids in [0, V) at positions ``cache.length .. cache.length + n - 1``.
        attention_mask: (B, n) of 0/1 (1 = real token), default all ones; padding keys are hidden.
        Returns the final-norm hidden states (B, n, H) float32 (padded positions: unspecified values).
        Raises ``InputError`` for ids out of range, wrong shapes, a cache of another batch size or positions
        beyond ``max_position_embeddings`` (the cache is unchanged then), and ``NonFiniteError`` naming the
        first encoder layer whose output is not finite and why (the block's fused output check). Same
        contract as ``reference.model.Model.encode`` (SPEC §6). Any failure in the middle of the pass (that
        error, KeyboardInterrupt, MemoryError) can leave the sliding rings partly updated, so it marks the
        cache unusable: later calls with it raise ``InputError``.
        """
        ids, mask = block.encode_inputs(self.config, input_ids, cache, attention_mask, KVCache)  # the shared checks
        B, n = ids.shape
        config, ops = self.config, self.ops
        L = cache.length
        check_pass_memory(config, B * n, f"encoding input_ids ({B} x {n} tokens)")  # before the workspace grows
        positions = L + np.arange(n, dtype=np.int64)  # (n,)
        rows = np.arange(B, dtype=np.int64)
        cache.begin_append(mask)
        keys = _CpuKeys(self, cache, positions, rows, mask, False, B, n)
        try:
            h = block.encoder_hidden(self.block_ops, keys, self, ids.reshape(-1), B, n)  # fast/block.py
        except BaseException as exc:
            cache.unusable = f"an encode call failed midway ({type(exc).__name__})"
            raise
        cache.end_append(n)
        out = np.empty((B, n, config.hidden_size), dtype=np.float32)
        ops.rms_norm(h, self.final_norm, self._eps, out.reshape(B * n, -1), self.bf16)
        return out

    # ------------------------------------------------------------------ decoder
    def denoise(self, canvas: np.ndarray, cache: KVCache, self_conditioning_logits: np.ndarray | None = None,
                self_conditioning_mask: np.ndarray | None = None, *, out: np.ndarray | None = None) -> np.ndarray:
        """One decoder pass: soft-capped logits for every canvas position. Never writes the cache.

        canvas: (B, C) int ids in [0, V), C = ``config.canvas_length``, at positions L .. L + C - 1.
        self_conditioning_logits: (B, C, V) float32 or None (first step of a canvas).
        self_conditioning_mask: (B,) bool or None (training: per-row switch for self-conditioning).
        out: optional (B, C, V) float32 C-contiguous array to write the logits into (it may *be*
            ``self_conditioning_logits``: the input is consumed before the output is written).
        Returns the logits (B, C, V) float32 (``out`` when given). Raises ``InputError`` exactly where
        ``reference.model.Model.denoise`` does (wrong canvas length, ids out of range, SC logits of the
        wrong shape or holding NaN, cache of another batch size, positions beyond
        ``max_position_embeddings``) and for a misshapen ``out``; ``NonFiniteError`` as the reference does
        (same message for the same fault; ``decode_rows``).
        SPEC §7; the self-conditioning softmax is computed inside ``out`` (no second (C, V) buffer).
        """
        config = self.config
        ids, sc, self_conditioning_mask = block.denoise_inputs(config, canvas, cache, self_conditioning_logits,
                                                               self_conditioning_mask, KVCache)
        B, C = ids.shape
        V = config.vocab_size
        if out is None:
            out = np.empty((B, C, V), dtype=np.float32)
        elif (not isinstance(out, np.ndarray) or out.shape != (B, C, V) or out.dtype != np.float32
              or not out.flags.c_contiguous):
            raise InputError(f"out must be a C-contiguous float32 array of shape {(B, C, V)}")
        probs = None
        if sc is not None:
            if self.bf16:  # B8: the processed logits cast to bfloat16 (by upstream's generate), then softmaxed
                np.copyto(out, sc)
                self.ops.round_bf16(out.reshape(B * C, V))
                sc = out
            self.ops.softmax(sc.reshape(B * C, V), out.reshape(B * C, V))  # SC probabilities, in out
            probs = out
        mask = None if self_conditioning_mask is None else np.asarray(self_conditioning_mask, dtype=np.float32)
        self.decode_rows(ids, np.arange(B, dtype=np.int64), cache, probs, out, mask)
        return out

    @_serial_blas
    def decode_rows(self, canvas: np.ndarray, rows: np.ndarray, cache: KVCache, probs: np.ndarray | None,
                    logits: np.ndarray, sc_mask: np.ndarray | None = None) -> None:
        """The decoder on a subset of batch rows, for callers that manage their own buffers (``generate``).

        canvas: (N, C) int64 ids (checked by the caller) of cache rows ``rows`` (N,) int64.
        probs: None (no self-conditioning) or an array (R, C, V) float32 whose row ``rows[i]`` holds the
            self-conditioning *probabilities* (softmax of the processed logits) of canvas row i.
        logits: (R, C, V) float32; row ``rows[i]`` receives canvas row i's soft-capped logits (it may be
            ``probs``: the probabilities are consumed first). sc_mask: (N,) float32 or None.
        Other rows of ``probs`` / ``logits`` are not touched.
        Raises ``InputError`` for positions beyond ``max_position_embeddings`` and ``NonFiniteError`` naming
        the decoder input, the first decoder layer output or the pre-cap logits that are not finite, with
        the weight or cache entry behind it (checks fused into the block's last kernel and the soft-cap).
        """
        config, ops, ws, xp = self.config, self.ops, self.workspace, self.xp
        N, C = canvas.shape
        H, M = config.hidden_size, N * C
        check_positions(config, cache.length, C, f"the canvas ({C} tokens)")
        contiguous = logits.shape[0] == N and bool(np.array_equal(rows, np.arange(N)))
        signal = None
        if probs is not None:  # SPEC §7.1: u = softmax(S) @ E * s_emb -> SC MLP(pre_norm(u))
            signal = block.self_conditioning_signal(self.block_ops, self, probs, rows, C, sc_mask)
        positions = cache.length + np.arange(C, dtype=np.int64)
        canvas_real = ws.get("canvas_real", (N, C), np.uint8)
        canvas_real.fill(1)
        keys = _CpuKeys(self, cache, positions, rows, canvas_real, True, N, C)
        hn = block.decoder_hidden(self.block_ops, keys, self, canvas.reshape(-1), N, C, signal)  # fast/block.py
        bad = 0
        if contiguous:
            flat = logits.reshape(M, -1)
            self._output_projection(hn, flat)
            bad = ops.softcap(flat, self._cap, self.bf16)  # bfloat16 run: the logits rounded, then capped (B9)
        else:
            for i, row in enumerate(rows):
                self._output_projection(hn[i * C:(i + 1) * C], logits[row])
                bad += ops.softcap(logits[row], self._cap, self.bf16)
        if bad:  # the cap turned the infinities into +-c: recompute the raw logits for the message
            raw = np.ascontiguousarray(hn @ _table_rows(self.embed_tokens).T, dtype=np.float32)
            if self.bf16:
                ops.round_bf16(raw)
            raise self._non_finite("denoise", "the logits before the soft-cap", raw.reshape(N, C, -1), None)

    def _output_projection(self, hn: np.ndarray, out: np.ndarray) -> None:
        """``out = hn @ E^T`` (M, V) with the tied table E (V, H): one tiled product, or, for a table kept as the
        file stores it (Q8_0, float16), a block of ``SOFT_EMBEDDING_BLOCK`` rows widened at a time."""
        table = self.embed_tokens
        if not isinstance(table, StoredTensor):
            self.xp.matmul(hn, table.T, out=out)
            return
        V = table.shape[0]
        for v0 in range(0, V, SOFT_EMBEDDING_BLOCK):
            n = min(V, v0 + SOFT_EMBEDDING_BLOCK) - v0
            part = self.workspace.get("output_block", (hn.shape[0], n))
            self.xp.matmul(hn, table.float32(slice(v0, v0 + n)).T, out=part)
            out[:, v0:v0 + n] = part

    # ------------------------------------------------------------------ failure diagnosis
    def _non_finite(self, stage: str, where: str, array: np.ndarray, layer: int | None,
                    cache: KVCache | None = None) -> Exception:
        """``reference.model.non_finite_error`` with the (unpacked) weights and cache rows that stage read."""
        weights = {"embed_tokens": self.embed_tokens, "final_norm": self.final_norm,
                   "self_conditioning.pre_norm": self.sc_pre_norm}
        I = self.sc_down.shape[1]
        weights.update({"self_conditioning.gate_proj": self.sc_gate_up[:I],
                        "self_conditioning.up_proj": self.sc_gate_up[I:], "self_conditioning.down_proj": self.sc_down})
        inputs = {}
        if layer is not None:
            weights = (weights if layer == 0 else {}) | self._layer_weights(layer)
            if cache is not None:
                slots = cache.cached_slots(layer)
                inputs = {f"cache keys of layer {layer}": cache.keys[layer][:, :, :slots],
                          f"cache values of layer {layer}": cache.values[layer][:, :, :slots]}
        weights = {name: widen(value) if is_bfloat16(value) else _table_rows(value) for name, value in weights.items()}
        return non_finite_error(stage, where, array, weights, inputs)

    def _layer_weights(self, l: int) -> dict[str, np.ndarray]:
        """Layer ``l``'s packed weights under the project's tensor names (views, for diagnosis)."""
        w, p = self.layers[l], f"layers.{l}."
        nq, nk = self.config.num_attention_heads * w.head_dim, w.num_kv_heads * w.head_dim
        I = w.mlp_down.shape[1]
        out = {p + "q_proj": w.qkv[:nq], p + "k_proj": w.qkv[nq:nq + nk]}
        if w.sliding:
            out[p + "v_proj"] = w.qkv[nq + nk:]
        out.update({p + "mlp.gate_proj": w.mlp_gate_up[:I], p + "mlp.up_proj": w.mlp_gate_up[I:]})
        out.update({p + name: np.asarray(getattr(w, field)) for field, name in LAYER_TENSOR_NAMES.items()
                    if getattr(w, field) is not None})
        if w.experts is not None:  # the panel layout: Q8_0 values are int8 (finite), their scales may not be
            panels = w.experts
            q8 = getattr(panels, "gate_up_scales", None) is not None
            out[p + "experts.gate_up_proj"] = panels.gate_up_scales if q8 else panels.gate_up
            out[p + "experts.down_proj"] = panels.down_scales if q8 else panels.down
        return out

    # ------------------------------------------------------------------ shared block
    def _rope(self, kind: str, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(n, d/2) float32 cos and sin of positions start..start+n-1 (memoised: a canvas reuses them)."""
        key = (kind, int(start), int(n))
        tables = self._rope_tables.get(key)
        if tables is None:
            if len(self._rope_tables) > 32:
                self._rope_tables.clear()
            angles = (start + np.arange(n)).astype(np.float32)[:, None] * self._omega[kind]  # (n, d/2)
            tables = (np.ascontiguousarray(np.cos(angles)), np.ascontiguousarray(np.sin(angles)))
            if self.bf16:  # B4: float32 angles, cos and sin, the tables rounded
                for table in tables:
                    self.ops.round_bf16(table)
            self._rope_tables[key] = tables
        return tables

    def _block(self, l: int, w: LayerWeights, h: np.ndarray, N: int, S: int, positions: np.ndarray,
               cache: KVCache, rows: np.ndarray, new_real: np.ndarray, decoder: bool) -> int:
        """One transformer block on the residual ``h`` (N*S, H), in place (SPEC §4; the order is
        ``fast.block.layer``'s, shared with the GPU).

        Returns the number of rows of the new ``h`` that hold a NaN or an infinity (0 normally).

        Encoder (decoder=False): the S new tokens attend causally to the retained cache plus themselves
        and their keys/values are stored (full layers: straight into the cache slots; sliding layers:
        into the ring after the attention). Decoder: the canvas attends bidirectionally to the retained
        cache plus the whole canvas; nothing is stored.
        """
        keys = _CpuKeys(self, cache, positions, rows, new_real, decoder, N, S)
        scalar = w.decoder_scalar if decoder else w.encoder_scalar
        return block.layer(self.block_ops, keys, l, w, h, N, S, self.config.num_attention_heads, scalar)

    def _gated_mlp(self, x: np.ndarray, gate_up: np.ndarray, down: np.ndarray, out: np.ndarray) -> None:
        """``out = (gelu(x G^T) * (x U^T)) D^T`` with [G; U] stacked in ``gate_up``. x, out: (M, H)."""
        block.gated_mlp(self.block_ops, x, gate_up, down, out)

    def _experts(self, w: LayerWeights, h: np.ndarray) -> np.ndarray:
        """Router and experts on the residual h (M, H): each expert runs once on its gathered tokens.

        Returns the weighted expert sum (M, H) (before ``post_feedforward_layernorm_2``), a workspace view.
        """
        return block.experts(self.block_ops, w, h, self.config.num_experts, self.config.top_k_experts)


class CpuOps:
    """``fast.block``'s device operations on the CPU: the compiled kernels (``model.ops``) and the tiled BLAS
    (``model.xp``) on the model's ``Workspace``. It reads ``model.xp``, ``model.ops`` and the model's
    ``_gated_mlp`` / ``_experts`` at each call, so that a profiler may wrap them (``bench_fast.py``).

    ``bf16`` (the model's bfloat16 run): every result is rounded to bfloat16 where
    ``reference.model.Model(dtype="bfloat16")`` rounds it (SPEC §10.1): each product's float32 output
    (``matmul``, the soft embedding), the scaled soft embedding, the router input's three steps, and inside
    the kernels through their ``bf16`` flags. Off, every call is the float32 path's, unchanged."""

    __slots__ = ("model", "ws", "eps", "router_factor", "embed_scale", "bf16")

    def __init__(self, model: Model):
        self.model, self.ws = model, model.workspace
        self.eps, self.router_factor, self.embed_scale = model._eps, model._router_factor, model._embed_scale
        self.bf16 = bool(getattr(model, "bf16", False))

    def buffer(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return self.ws.get(name, shape, dtype)

    def embed(self, ids: np.ndarray, table: np.ndarray, signal, normed: bool, out: np.ndarray) -> None:
        if is_bfloat16(table) or isinstance(table, StoredTensor):  # a table kept bfloat16, Q8_0 or float16: the
            N = ids.shape[0]                                          # rows read, widened (exact)
            rows = self.ws.get("embed_rows", (N, table.shape[1]))
            np.copyto(rows, _table_rows(table, ids))
            ids, table = self.ws.get("embed_row_ids", (N,), np.int64), rows
            ids[:] = np.arange(N)
        self.model.ops.embed(ids, table, self.embed_scale, signal, normed, self.eps, out, self.bf16)

    def _soft_embedding(self, probs: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
        """``out = probs @ table`` for probs (M, V) float32 C-contiguous and a bfloat16 table (V, H): blocks of
        ``SOFT_EMBEDDING_BLOCK`` vocabulary rows widened (exact) into a buffer and multiplied on the tiled
        BLAS, the blocks' float32 products summed in order (another summation order than one product over
        V: float32 rounding, below the bfloat16 rounding that follows)."""
        ws, xp = self.ws, self.model.xp
        (M, V), H = probs.shape, table.shape[1]
        for v0 in range(0, V, SOFT_EMBEDDING_BLOCK):
            n = min(V, v0 + SOFT_EMBEDDING_BLOCK) - v0
            wide, part = ws.get("soft_embedding_rows", (n, H)), ws.get("soft_embedding_probs", (M, n))
            np.copyto(wide, _table_rows(table, slice(v0, v0 + n)))
            np.copyto(part, probs[:, v0:v0 + n])
            if v0 == 0:
                xp.matmul(part, wide, out=out)
            else:
                partial = ws.get("soft_embedding_partial", (M, H))
                xp.matmul(part, wide, out=partial)
                xp.add(out, partial, out=out)

    def probs_times_embedding(self, probs: np.ndarray, rows: np.ndarray, C: int, table: np.ndarray,
                              out: np.ndarray) -> None:
        """``out = probs[rows] @ table`` (N*C, H): one product when ``rows`` are all of ``probs``'s rows in
        order, else one per row. In bfloat16 the probabilities are rounded first, in place (the caller's
        buffer is consumed by this pass), and the product is rounded (B8)."""
        xp, ops, N = self.model.xp, self.model.ops, rows.shape[0]
        product = (self._soft_embedding if is_bfloat16(table) or isinstance(table, StoredTensor)
                   else lambda a, b, c: xp.matmul(a, b, out=c))
        if probs.shape[0] == N and bool(np.array_equal(rows, np.arange(N))):
            flat = probs.reshape(N * C, -1)
            if self.bf16:
                ops.round_bf16(flat)
            product(flat, table, out)
        else:
            for i, row in enumerate(rows):
                if self.bf16:
                    ops.round_bf16(probs[row])
                product(probs[row], table, out[i * C:(i + 1) * C])
        if self.bf16:
            ops.round_bf16(out)

    def scale(self, x: np.ndarray, factor) -> None:
        self.model.xp.multiply(x, factor, out=x)
        if self.bf16:
            self.model.ops.round_bf16(x)

    def mask_rows(self, u: np.ndarray, N: int, C: int, rows: np.ndarray, sc_mask: np.ndarray) -> None:
        """sc_mask: (N,) float32, one factor per decoded row (0 or 1)."""
        H = u.shape[1]
        self.model.xp.multiply(u.reshape(N, C, H), sc_mask[:, None, None], out=u.reshape(N, C, H))

    def count_non_finite_rows(self, h: np.ndarray) -> int:
        return self.model.ops.count_non_finite_rows(h)

    def non_finite(self, stage: str, where: str, array: np.ndarray, layer, cache) -> Exception:
        return self.model._non_finite(stage, where, array, layer, cache)

    def layer(self, keys: "_CpuKeys", l: int, w: LayerWeights, h: np.ndarray, N: int, S: int, scalar) -> int:
        return self.model._block(l, w, h, N, S, keys.positions, keys.cache, keys.rows, keys.new_real, keys.decoder)

    def matmul(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        self.model.xp.matmul(a, b, out=out)
        if self.bf16:  # B3: the float32 accumulation rounded once
            self.model.ops.round_bf16(out)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
        self.model.ops.rms_norm(x, weight, self.eps, out, self.bf16)

    def router_input(self, h: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
        ops, xp = self.model.ops, self.model.xp
        if not self.bf16:
            ops.rms_norm(h, weight, self.eps, out)
            xp.multiply(out, self.router_factor, out=out)
            return
        ops.rms_norm(h, None, self.eps, out, True)  # B6: the weightless norm, the product with the scale and
        xp.multiply(out, weight, out=out)  # the one with the float32 H**-0.5 are each rounded
        ops.round_bf16(out)
        xp.multiply(out, self.router_factor, out=out)
        ops.round_bf16(out)

    def heads(self, proj, N, S, n_h, g, d, has_v, q_norm, k_norm, cos, sin, q, k, v) -> None:
        self.model.ops.heads(proj.reshape(N, S, -1), n_h, g, d, has_v, q_norm, k_norm, self.eps, cos, sin, q, k, v,
                             self.bf16)

    def residual_norm_add(self, h: np.ndarray, y: np.ndarray, weight: np.ndarray) -> None:
        self.model.ops.residual_norm_add(h, y, weight, self.eps, _ONE, self.bf16)

    def gated_gelu(self, gate_up: np.ndarray, out: np.ndarray) -> None:
        self.model.ops.gelu_gate(gate_up, out, self.bf16)

    def route(self, logits, per_expert_scale, indices, weights) -> None:
        self.model.ops.route(logits, per_expert_scale, indices, weights)

    def gated_mlp(self, x, gate_up, down, out) -> None:
        self.model._gated_mlp(x, gate_up, down, out)

    def experts(self, w: LayerWeights, h: np.ndarray) -> np.ndarray:
        return self.model._experts(w, h)

    def expert_mix(self, w: LayerWeights, x: np.ndarray, indices: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Tokens sorted by expert, every expert once on its block (``fast.experts``), weighted sum (M, H)."""
        ops, ws = self.model.ops, self.ws
        M, H = x.shape
        E, K = self.model.config.num_experts, indices.shape[1]
        offsets = ws.get("expert_offsets", (E + 1,), np.int64)
        order = ws.get("expert_order", (M * K,), np.int64)
        position = ws.get("expert_position", (M, K), np.int64)
        ops.group_by_expert(indices, offsets, order, position)
        grouped = ws.get("expert_x", (M * K, H))
        ops.gather_rows(x, order, grouped)
        I = self.model.config.moe_intermediate_size  # noqa: E741
        gate_up = ws.get("expert_gate_up", (M * K, 2 * I))
        act = ws.get("expert_act", (M * K, I))
        y = ws.get("expert_y", (M * K, H))
        w.experts(grouped, offsets, gate_up, act, y, self.bf16)  # every expert in one parallel loop (fast.experts)
        moe = ws.get("moe", (M, H))
        ops.combine_experts(y, indices, position, weights, moe, self.bf16)
        return moe

    def feed_forward_residual(self, h, dense, moe, w: LayerWeights, scalar) -> int:
        return self.model.ops.feed_forward_residual(h, dense, moe, w.post_ffn_norm_1, w.post_ffn_norm_2,
                                                    w.post_ffn_norm, self.eps, scalar, self.bf16)


_ONE = np.float32(1.0)
SOFT_EMBEDDING_BLOCK = 8192  # vocabulary rows of a bfloat16 embedding widened at a time (CpuOps._soft_embedding)


def _table_rows(table: Any, index: Any = None) -> Any:
    """Rows ``index`` (all: None) of the embedding table as the products take them: a ``StoredTensor`` (a Q8_0 or
    float16 table kept as its file stores it) widened to float32, anything else indexed as it is."""
    if isinstance(table, StoredTensor):
        return table.float32(index)
    return table if index is None else table[index]


def _round_bf16(value: np.float32) -> np.float32:
    """A float32 scalar rounded to bfloat16 (``reference.primitives.round_to``)."""
    return np.float32(np.float32(value).astype(BFLOAT16))


def _rounded_to_bf16(tensors: Mapping[str, Any], keep_bf16: bool, release: bool) -> dict:
    """The bfloat16 run's weights (reference ``Model(dtype="bfloat16")``: every tensor rounded to bfloat16 on
    load): each tensor's float32 values (Q8_0 dequantized) rounded, kept as bfloat16 arrays when ``keep_bf16``
    (``pack`` then holds the matrices and the experts bfloat16 and widens the rest exactly), else as float32.
    ``release``: ``tensors`` is a dict that may be emptied as it goes (a load never holds two copies)."""
    out = {}
    for name in list(tensors):
        value = tensors.pop(name) if release else tensors[name]
        if not is_bfloat16(value):
            value = widen(value).astype(BFLOAT16)
        out[name] = value if keep_bf16 else widen(value)
    return out


class _CpuKeys:
    """``fast.block``'s key set of one CPU block call: the retained cache plus the call's own keys. The
    encoder's full layers write their keys straight into the cache slots; its sliding layers put them into
    the ring right after the attention; the decoder keeps nothing."""

    __slots__ = ("model", "cache", "positions", "rows", "new_real", "decoder", "N", "S")

    def __init__(self, model: Model, cache: KVCache, positions, rows, new_real, decoder: bool, N: int, S: int):
        self.model, self.cache, self.positions, self.rows = model, cache, positions, rows
        self.new_real, self.decoder, self.N, self.S = new_real, decoder, N, S

    def _in_place(self, w: LayerWeights) -> bool:
        return not self.decoder and not w.sliding  # full-layer encode: keys go straight into the cache

    def new_kv(self, l: int, w: LayerWeights):
        if self._in_place(w):
            return self.cache.full_layer_slots(l, self.S)
        shape, ws = (self.N, w.num_kv_heads, self.S, w.head_dim), self.model.workspace
        return ws.get("new_k", shape), ws.get("new_v", shape)

    def rope(self, l: int):
        return self.model._rope(self.model.config.layer_types[l], int(self.positions[0]), self.S)

    def attend(self, l: int, w: LayerWeights, q, new_k, new_v, out) -> None:
        model, cache, positions, new_real, decoder = self.model, self.cache, self.positions, self.new_real, self.decoder
        if self._in_place(w):
            ws, empty = model.workspace, (self.N, w.num_kv_heads, 0, w.head_dim)
            n_cache, keys, values = cache.length + self.S, ws.get("no_k", empty), ws.get("no_v", empty)
            key_pos, key_real = positions[:0], new_real[:, :0]
        else:
            n_cache, keys, values, key_pos, key_real = cache.cached_slots(l), new_k, new_v, positions, new_real
        window = model.config.sliding_window if (w.sliding and not decoder) else 0
        attend(model, q, positions, cache.keys[l], cache.values[l], self.rows, n_cache, cache.slot_positions[l],
               cache.real, keys, values, key_pos, key_real, window, not decoder, out)
        if model.bf16:  # B5: the product of the rounded weights with V, rounded
            model.ops.round_bf16(out.reshape(self.N * self.S, -1))
        if not decoder and w.sliding:
            cache.store_sliding(l, new_k, new_v)
