"""DiffusionGemma on an NVIDIA GPU: CuPy arrays, cuBLAS matrix products, custom CUDA kernels.

    text -> input_ids -> Model.encode (KV cache on the device) -> for each canvas:
        [decoder pass -> logits (B, C, V) in one device buffer -> sampling kernel -> acceptance kernel]
        x steps -> commit the draft -> encode it -> next canvas

Same interface as ``diffusiongemma.reference`` (``Model.from_pretrained(path, device="cuda")``,
``new_cache``, ``encode``, ``denoise``; ``generate`` is the reference's one loop, which runs this model on
its own denoising step, ``sampling.GpuBackend``), same numbers up to float32 rounding: every weight is float32
on the device, matrix products go through cuBLAS (``xp.matmul``, no TF32), and the rest runs in the kernels of
``fast/gpu/cuda`` (launch geometry and argument checks in ``fast/gpu/launch.py``). ``dtype="bfloat16"`` is
the reference's bfloat16 run instead (``Bf16GpuOps``: bfloat16 weights, tensor-core products, the reference's
rounding points):

* RMSNorm fused with its weight, the residual add and the layer scalar; per-head q/k/v norms fused with
  the rotary embedding; gated GELU of a fused gate/up projection;
* attention over [cache ++ new keys] with GQA, the encoder's causal sliding window and the decoder's
  bidirectional read of the retained cache (sliding layers keep a ring of W - 1 slots);
* the MoE: router top-K, grouping by expert, a grouped GEMM, the weighted combination (no host sync);
* one sampling pass per canvas row (max, log-sum-exp, entropy, argmax, the inverse-CDF draw from a
  uniform drawn on the host), then the entropy-bound acceptance and renoising.

Randomness never comes from the device, and self-conditioning keeps one (canvas x vocabulary) buffer per
sequence: see ``sampling.py``. Within a canvas the steps run on the device with no host round trip (the loop's
state, a canvas's draws made ahead, a stop flag read every few steps): see ``canvas.py``.

CuPy is optional: importing this module never imports it. ``Model.from_pretrained(..., device="cuda")``
raises ``RuntimeError`` naming what is missing (CuPy, a driver, a GPU). The host orchestration is written
against an array module (``xp``) and a ``Device`` object (the block itself is ``fast/block.py``'s, shared
with the CPU model, on ``GpuOps``), so the tests run all of it on the CPU with NumPy
arrays and the unchanged CUDA kernels executed by the checked CPU executor (``device="cuda-sim"``,
``fast/gpu/sim.py``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.errors import InputError
from diffusiongemma.reference.generate import ReferenceBackend, generate
from diffusiongemma.reference.support.observer import NULL_OBSERVER
from diffusiongemma.reference.primitives import BFLOAT16, compute_dtype, rope_inverse_frequencies, round_to, softcap
from diffusiongemma.reference.support.checkpoint_io import check_tensors, open_checkpoint
from diffusiongemma.reference.support.weight_store import WeightStore

from .. import block
from . import launch as gl
from ..weights import StoreArrays, pack
from .cache import GpuKVCache
from .device import CupyDevice, gpu_available, make_device
from .experts import expert_mix
from .flags import flat_rows, raise_for_flags
from .sampling import GpuBackend, _StepOutputs
from .weights_bf16 import pack_bf16, weight_bytes


class Model:
    """DiffusionGemma with its weights resident on a GPU.

    Build it with ``Model.from_pretrained(path, device="cuda")`` or ``Model(config, tensors, device=...)``
    (``tensors``: the project's tensor names -> float32/bf16 NumPy arrays, ``reference.weights``). ``device``
    is "cuda", "cuda:N", or a device object (the tests pass a NumPy stand-in). Loading widens every tensor
    to float32 on the device and fuses q/k/v and every gate/up pair into one matrix each.

    ``dtype``: "float32" (default) or "bfloat16", upstream's bfloat16 run as the reference defines it
    (``reference.Model(..., dtype="bfloat16")``, SPEC §10.1 B1-B9): every tensor rounded to bfloat16 on load,
    the matrices kept as bfloat16 bits and multiplied on tensor cores (``dg_gemm_bf16``, float32
    accumulation), every other kernel rounding its results to bfloat16 where the reference does
    (``Bf16GpuOps``); see ``weights_bf16.py`` for the layout. The logits stay float32 (the soft-cap and the
    sampling kernel run in float32, as upstream's), so the loop, graphs and sampling are the float32 run's.
    ``self.dtype`` is the NumPy dtype (``reference.primitives.FLOAT32`` / ``BFLOAT16``).
    """

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], device: Any = "cuda",
                 dtype: str | np.dtype = "float32"):
        self.dtype = compute_dtype(dtype)
        self.bf16 = self.dtype == BFLOAT16
        check_tensors(tensors, config)
        if isinstance(tensors, WeightStore):  # mapped files: each tensor read, widened and uploaded in turn
            tensors = StoreArrays(tensors)
        self.config = config
        self.device = make_device(device) if isinstance(device, str) else device
        dev = self.device
        with dev.context():
            if self.bf16:
                packed = pack_bf16(config, tensors, upload=dev.to_device)
            else:
                packed = pack(config, tensors, upload=dev.to_device)
        self.embed_tokens, self.final_norm = packed.embed_tokens, packed.final_norm  # (V, H), (H,)
        self.sc_pre_norm, self.sc_gate_up, self.sc_down = packed.sc_pre_norm, packed.sc_gate_up, packed.sc_down
        self.layers = packed.layers
        self._omega = {kind: rope_inverse_frequencies(config.rope_parameters[kind], d)
                       for kind, d in zip(config.layer_types, config.layer_head_dim)}
        self._decoder_memo: tuple | None = None  # (key, device inputs) of the last decoder pass
        self.weight_bytes = weight_bytes(packed)  # bytes of the weights on the device
        self.block_ops = Bf16GpuOps(self) if self.bf16 else GpuOps(self)  # fast.block's operations here

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: Any = "cuda",
                        dtype: str | np.dtype = "float32") -> "Model":
        """Load a converted checkpoint (or a transformers one, converted in memory) onto ``device``, in ``dtype``
        ("float32" or "bfloat16", see the class notes).

        Raises ``RuntimeError`` when the GPU backend is unusable (no CuPy, no GPU), ``CheckpointError`` /
        ``ConfigError`` for a bad checkpoint or dtype. The device and the dtype are checked before the (slow)
        weight read.
        """
        compute_dtype(dtype)
        dev = make_device(device) if isinstance(device, str) else device
        config, store = open_checkpoint(path)  # mapped: the host holds one tensor at a time on its way up
        return cls(config, store, device=dev, dtype=dtype)

    def denoising_backend(self, draws: Any, batch_size: int, denoiser: Any = None, observer: Any = NULL_OBSERVER,
                          logits_hook: Any = None, device_loop: bool = True, sync_every: int = 4,
                          graphs: bool | None = None) -> Any:
        """The per-step compute the generation loop (``reference.generate.generate``) runs this model with:
        ``GpuBackend`` (device buffer and kernels), or, for a replaced host ``denoiser``, the reference's step
        inside the device context. device_loop: run each canvas's steps on the device (``canvas.py``) when
        the run allows it; sync_every: steps between two reads of its stop flag; graphs: replay each canvas's
        whole denoising step captured once (``graph.py``; default: on cuda-sim yes, on a GPU no)."""
        if denoiser is not None:
            return ReferenceBackend(denoiser, draws, self.config.vocab_size, batch_size, observer=observer,
                                    context=self.device.context)
        return GpuBackend(self, draws, batch_size, observer=observer, logits_hook=logits_hook,
                          device_loop=device_loop, sync_every=sync_every, graphs=graphs)

    def diagnose_non_finite(self, error: Exception, canvas: np.ndarray, cache: Any) -> Exception:
        """The error for NaN/+inf logits the sampling kernel flagged (``error``) in a decoder pass over ``canvas``
        (B, C) with ``cache``: the reference's ``NonFiniteError`` naming the layer, from a host re-run
        (``diagnosis.diagnose``; the GPU's pass itself has no per-layer checks)."""
        from .diagnosis import diagnose

        return diagnose(self, error, canvas, cache)

    def softcapped_host_logits(self, buffer, rows: np.ndarray, cap: float) -> np.ndarray:
        """Rows ``rows`` of a (B, C, V) device buffer of raw logits, soft-capped, on the host (observers)."""
        host = self.device.to_host(buffer)[rows]
        return softcap(host, cap) if cap else host

    def new_cache(self, batch_size: int) -> GpuKVCache:
        """An empty device cache for ``batch_size`` rows."""
        with self.device.context():
            return GpuKVCache(self.config, batch_size, self.device)

    # ------------------------------------------------------------------ encoder
    def encode(self, input_ids: Any, cache: GpuKVCache, attention_mask: Any = None) -> np.ndarray:
        """Run the causal encoder over new tokens and append their keys/values to ``cache``.

        input_ids: (B, n) int ids in [0, V) at positions ``cache.length ..`` (padding included, trap T18).
        attention_mask: (B, n) of 0/1, default all ones. Returns the final-norm hidden states (B, n, H)
        float32 on the host (upstream ``last_hidden_state``). Raises ``InputError`` for bad ids, shapes,
        a cache of another batch size or positions past ``max_position_embeddings`` (``fast.block``'s checks,
        the CPU model's); the cache's length is unchanged on error.
        """
        return self._encode(input_ids, cache, attention_mask, return_hidden=True)

    def _encode(self, input_ids: Any, cache: GpuKVCache, attention_mask: Any, return_hidden: bool):
        ids, mask = block.encode_inputs(self.config, input_ids, cache, attention_mask, GpuKVCache)  # shared checks
        B, n = ids.shape
        config, dev = self.config, self.device
        with dev.context():
            L = cache.length
            positions = L + np.arange(n, dtype=np.int64)
            cache.begin_append(mask)
            ids_dev = dev.to_device(ids.reshape(-1))
            pos_dev, real_dev = dev.to_device(positions), dev.to_device(mask)
            tables = self._rope_tables(positions)
            keys = _GpuKeys(self, cache, B, n, rows=None, new_pos=pos_dev, new_real=real_dev, tables=tables,
                            decoder=False)
            h = block.encoder_hidden(self.block_ops, keys, self, ids_dev, B, n)  # fast/block.py
            for l, (k, v) in enumerate(keys.pending):  # commit only once every layer succeeded
                cache.store(l, k, v)
            cache.end_append(n)
            if not return_hidden:
                return None
            out = dev.empty((B * n, config.hidden_size), np.float32)
            dev.launch(gl.rms_norm(h, self.final_norm, out, config.rms_norm_eps, bf16=int(self.bf16)))
            return dev.to_host(out).reshape(B, n, config.hidden_size)

    # ------------------------------------------------------------------ decoder
    def denoise(self, canvas: Any, cache: GpuKVCache, self_conditioning_logits: Any = None,
                self_conditioning_mask: Any = None, *, device_output: bool = False):
        """One decoder pass: soft-capped logits (B, C, V) float32 for every canvas position.

        canvas: (B, C) int ids, C = ``config.canvas_length``, at positions ``cache.length ..``.
        self_conditioning_logits: (B, C, V) float32 (host or device) or None (first step: no signal).
        self_conditioning_mask: (B,) bool or None (training: rows with False get no signal).
        Returns a NumPy array, or the device array when ``device_output``. Never writes the cache.
        Raises ``InputError`` like ``reference.model.Model.denoise`` (``fast.block.denoise_inputs``, positions
        past ``max_position_embeddings`` included).
        """
        config, dev = self.config, self.device
        ids, sc_in, mask = block.denoise_inputs(config, canvas, cache, self_conditioning_logits,
                                                self_conditioning_mask, GpuKVCache)
        B, C = ids.shape
        V = config.vocab_size
        with dev.context():
            buffer = dev.empty((B, C, V), np.float32)  # SC probabilities in, logits out
            has_sc = False
            if sc_in is not None:
                buffer[...] = dev.to_device(sc_in) if isinstance(sc_in, np.ndarray) else sc_in
                self._softmax_in_place(buffer, np.arange(B), "self_conditioning_logits")
                has_sc = True
            rows = np.arange(B)
            self._decoder_logits(dev.to_device(ids), cache, rows, buffer, has_sc, mask)
            dev.launch(gl.softcap(buffer, config.final_logit_softcapping))
            return buffer if device_output else dev.to_host(buffer)

    def _softmax_in_place(self, buffer, rows: np.ndarray, what: str) -> None:
        """Turn rows ``rows`` (batch indices) of a (B, C, V) logits buffer into probabilities in place."""
        B, C, V = buffer.shape
        dev = self.device
        flat = flat_rows(rows, C)
        R = flat.shape[0]
        if self.bf16:  # SPEC B8: upstream casts the processed logits to bfloat16 before its float32 softmax
            for b in rows:
                dev.launch(gl.round_bf16(buffer[int(b)]))
        outs = _StepOutputs(dev, R)
        dev.launch(gl.sample_rows(buffer.reshape(B * C, V), dev.to_device(flat), 0.0, 0.0, None, outs.argmax,
                                  outs.entropy, outs.sampled, outs.flags))
        raise_for_flags(dev.to_host(outs.flags), flat, C, None, InputError, what)

    def _decoder_logits(self, canvas_dev, cache: GpuKVCache, rows: np.ndarray, buffer, has_sc: bool,
                        sc_mask: np.ndarray | None = None, sc_probs: Any = None) -> None:
        """Decoder pass for batch rows ``rows`` (host int array): raw logits (before the soft-cap) into
        ``buffer[rows]``. canvas_dev: (len(rows), C) int64 device ids of those rows. When ``has_sc``,
        ``buffer[rows]`` (or ``sc_probs[rows]``, another (B, C, V) buffer, when given) holds the
        self-conditioning probabilities on entry (read before any write)."""
        dev, n_rows, C = self.device, rows.shape[0], buffer.shape[1]
        pos_dev, tables, cache_rows, ones = self._decoder_inputs(cache.length, rows, C)
        signal = None
        if has_sc:  # SPEC §7.1, fast/block.py
            probs = buffer if sc_probs is None else sc_probs
            signal = block.self_conditioning_signal(self.block_ops, self, probs, rows, C, sc_mask)
        keys = _GpuKeys(self, cache, n_rows, C, rows=cache_rows, new_pos=pos_dev, new_real=ones, tables=tables,
                        decoder=True)
        hf = block.decoder_hidden(self.block_ops, keys, self, canvas_dev.reshape(-1), n_rows, C, signal)
        for i, b in enumerate(rows):  # tied lm_head straight into the buffer rows
            if self.bf16:  # SPEC B9: the bfloat16 lm_head's output, widened to float32 for the soft-cap
                dev.launch(gl.gemm_bf16(None, self.embed_tokens, buffer[int(b)], a_f32=hf[i * C:(i + 1) * C],
                                        round_c=True))
            else:
                dev.xp.matmul(hf[i * C:(i + 1) * C], self.embed_tokens.T, out=buffer[int(b)])

    def _decoder_inputs(self, cache_length: int, rows: np.ndarray, C: int) -> tuple:
        """The device inputs of a decoder pass that depend only on the cache length and the rows decoded:
        positions (C,) int64, RoPE tables, cache rows (n,) int32 and realness (n, C) uint8. Uploaded once
        and kept while the next pass asks for the same (the steps of a canvas), so a denoising step copies
        nothing to the device."""
        key = (int(cache_length), C, np.asarray(rows, dtype=np.int64).tobytes())
        if self._decoder_memo is None or self._decoder_memo[0] != key:
            dev = self.device
            positions = int(cache_length) + np.arange(C, dtype=np.int64)
            value = (dev.to_device(positions), self._rope_tables(positions),
                     dev.to_device(np.asarray(rows).astype(np.int32)),
                     dev.to_device(np.ones((len(rows), C), dtype=np.uint8)))
            self._decoder_memo = (key, value)
        return self._decoder_memo[1]

    # ------------------------------------------------------------------ shared block
    def _rope_tables(self, positions: np.ndarray) -> dict:
        """Per layer type, device (S, d/2) cos and sin of ``float32(p) * omega`` (the reference's angles)."""
        tables = {}
        for kind, omega in self._omega.items():
            angles = positions.astype(np.float32)[:, None] * omega  # (S, d/2)
            cos, sin = round_to(np.cos(angles), self.dtype), round_to(np.sin(angles), self.dtype)  # SPEC B4
            tables[kind] = (self.device.to_device(cos), self.device.to_device(sin))
        return tables

class GpuOps:
    """``fast.block``'s device operations on a ``CupyDevice`` / ``SimDevice`` (or a wrapper: counting,
    capture): cuBLAS products through ``device.xp``, the CUDA kernels through ``device.launch`` (``launch.py``),
    every buffer fresh from the device's pool (a captured pass keeps the buffers it used). Never copies
    between host and device."""

    bf16 = False  # the float32 run; ``Bf16GpuOps``: the bfloat16 one (the kernels' ``bf16`` flags set)

    def __init__(self, model: "Model"):
        self.model, self.config = model, model.config
        self.eps = float(model.config.rms_norm_eps)
        self.embed_scale = np.float32(model.config.embed_scale)
        self.router_factor = float(np.float32(model.config.hidden_size ** -0.5))

    @property
    def dev(self) -> Any:
        return self.model.device

    def buffer(self, name: str, shape: tuple, dtype: Any = np.float32) -> Any:
        return self.model.device.empty(shape, dtype)

    def embed(self, ids, table, signal, normed: bool, out) -> None:
        self.model.device.launch(gl.embed(ids, table, self.config.embed_scale, signal, normed, out, self.eps,
                                          bf16=self.bf16))

    def probs_times_embedding(self, probs, rows: np.ndarray, C: int, table, out) -> None:
        """``out = probs[rows] @ table`` (N*C, H), one product per row (the rows of the (B, C, V) buffer are
        not contiguous as a set)."""
        xp = self.model.device.xp
        for i, b in enumerate(rows):
            xp.matmul(probs[int(b)], table, out=out[i * C:(i + 1) * C])

    def scale(self, x, factor) -> None:
        self.model.device.xp.multiply(x, factor, out=x)

    def mask_rows(self, u, N: int, C: int, rows: np.ndarray, sc_mask: np.ndarray) -> None:
        """sc_mask: (B,) bool of every batch row; the decoded rows ``rows`` switched off get a zero signal
        (a copy to the device: not in a captured pass, which never has a mask)."""
        dev = self.model.device
        u.reshape(N, C, -1)[dev.to_device(np.flatnonzero(~sc_mask[rows]))] = 0.0

    def count_non_finite_rows(self, h) -> int:
        return 0  # no per-layer check on the device: a flagged step is diagnosed on the host (diagnosis.py)

    def non_finite(self, *args) -> Exception:
        raise AssertionError("the GPU pass counts no non-finite rows")  # unreachable: the counts are 0

    def layer(self, keys, l: int, w, h, N: int, S: int, scalar) -> int:
        return block.layer(self, keys, l, w, h, N, S, self.config.num_attention_heads, scalar)

    def matmul(self, a, b, out) -> None:
        self.model.device.xp.matmul(a, b, out=out)

    def rms_norm(self, x, weight, out) -> None:
        self.model.device.launch(gl.rms_norm(x, weight, out, self.eps, bf16=int(self.bf16)))

    def router_input(self, h, weight, out) -> None:
        self.model.device.launch(gl.rms_norm(h, weight, out, self.eps, post=self.router_factor,
                                             bf16=2 if self.bf16 else 0))

    def heads(self, proj, N, S, n_h, g, d, has_v, q_norm, k_norm, cos, sin, q, k, v) -> None:
        self.model.device.launch(gl.qkv_heads(proj, N, S, n_h, g, d, has_v, q_norm, k_norm, cos, sin, q, k, v,
                                              self.eps, bf16=self.bf16))

    def residual_norm_add(self, h, y, weight) -> None:
        self.model.device.launch(gl.residual_norm(h, y, weight, 1.0, self.eps, bf16=self.bf16))

    def gated_gelu(self, gate_up, out) -> None:
        self.model.device.launch(gl.gated_gelu(gate_up, out, bf16=self.bf16))

    def route(self, logits, per_expert_scale, indices, weights) -> None:
        self.model.device.launch(gl.router(logits, per_expert_scale, indices, weights))

    def gated_mlp(self, x, gate_up, down, out) -> None:
        block.gated_mlp(self, x, gate_up, down, out)

    def experts(self, w, h) -> Any:
        return block.experts(self, w, h, self.config.num_experts, self.config.top_k_experts)

    def expert_mix(self, w, x, indices, weights) -> Any:
        """Tokens grouped by expert into tiles, two grouped GEMMs around the gated GELU, the weighted
        combination (N, H); no host synchronisation (``experts.expert_mix``, bfloat16 in ``Bf16GpuOps``)."""
        return expert_mix(self.model.device, x, indices, weights, w.expert_gate_up, w.expert_down,
                          self.config.num_experts, self.bf16)

    def feed_forward_residual(self, h, dense, moe, w, scalar) -> int:
        """The block's fused tail; 0: the GPU pass counts no non-finite rows (``diagnosis.py`` does)."""
        self.model.device.launch(gl.ffn_tail(h, dense, moe, w.post_ffn_norm_1, w.post_ffn_norm_2,
                                             w.post_ffn_norm, scalar, self.eps, bf16=self.bf16))
        return 0


class Bf16GpuOps(GpuOps):
    """``GpuOps`` of a bfloat16 run (``Model(..., dtype="bfloat16")``): the same sequence with the reference's
    rounding points (SPEC §10.1; ``reference.primitives`` / ``layers`` / ``model`` with dtype bfloat16).
    Activations are float32 arrays holding bfloat16 values; the matrices are bfloat16 bits (``weights_bf16``).

    * products: ``dg_gemm_bf16`` on tensor cores, the activation rounded to bfloat16 as it is loaded (exact
      here), float32 accumulation, the output rounded (``linear``); the self-conditioning ``probs @ E`` reads
      the (V, H) table as stored ("nn") with the float32 probabilities rounded on load (B8);
    * norms (B2, B5, B7), the router's input (B6: norm, times scale, times H^-1/2, each rounded), the residual
      adds and the layer scalar, the embedding (B1: the scale rounded first), the heads' norms and RoPE (B4),
      the gated GELU (GELU and product rounded): ``GpuOps``'s launches of the float32 kernels, with their
      ``bf16`` flag set (``bf16 = True``);
    * the experts (``experts.expert_mix`` in bfloat16) and the attention (``dg_attention_bf16``, chosen by
      ``_GpuKeys.attend``);
    * the router's softmax, top-K and weights stay float32 (upstream's ``softmax(dtype=float32)``).
    """

    bf16 = True

    def __init__(self, model: "Model"):
        super().__init__(model)
        self.embed_scale = np.float32(round_to(np.float32(model.config.embed_scale), BFLOAT16))  # B8

    def probs_times_embedding(self, probs, rows: np.ndarray, C: int, table, out) -> None:
        """``out = bf16(bf16(probs[rows]) @ table)`` (N*C, H), one product per row, the (V, H) table of bits as
        stored (B8)."""
        dev = self.model.device
        for i, b in enumerate(rows):
            dev.launch(gl.gemm_bf16(None, table, out[i * C:(i + 1) * C], a_f32=probs[int(b)], b_kn=True,
                                    round_c=True))

    def scale(self, x, factor) -> None:
        """``x = bf16(x * factor)`` (``factor``: the embedding scale already rounded to bfloat16, B8)."""
        dev = self.model.device
        dev.xp.multiply(x, factor, out=x)
        dev.launch(gl.round_bf16(x))

    def matmul(self, a, b, out) -> None:
        """``out = bf16(a @ b)`` where ``b`` is the transposed view ``w.T`` of bfloat16 bits ``w`` (out, in), as
        ``fast.block`` passes every weight; a float32 (bf16-valued)."""
        self.model.device.launch(gl.gemm_bf16(None, b.T, out, a_f32=a, round_c=True))


class _GpuKeys:
    """``fast.block``'s key set of one GPU pass: each layer's retained cache slots plus the call's own keys
    (fresh buffers of ``model.device``, which a capture replaces by its recorder). The encoder (causal, a
    sliding window on sliding layers) keeps every layer's new keys and values in ``pending`` for the model
    to commit once all layers succeeded; the decoder reads the cache rows ``rows`` bidirectionally and
    keeps nothing."""

    def __init__(self, model: "Model", cache: GpuKVCache, N: int, S: int, rows, new_pos, new_real, tables: dict,
                 decoder: bool):
        self.model, self.cache, self.N, self.S, self.rows = model, cache, N, S, rows
        self.new_pos, self.new_real, self.tables, self.decoder = new_pos, new_real, tables, decoder
        self.pending: list = []

    def new_kv(self, l: int, w) -> tuple:
        dev, shape = self.model.device, (self.N, w.num_kv_heads, self.S, w.head_dim)  # (a capture's recorder)
        return dev.empty(shape, np.float32), dev.empty(shape, np.float32)

    def rope(self, l: int) -> tuple:
        return self.tables[self.cache.config.layer_types[l]]

    def attend(self, l: int, w, q, new_k, new_v, out) -> None:
        c = self.cache
        window = c.config.sliding_window if (w.sliding and not self.decoder) else 0
        causal, n_cache = not self.decoder, c.cached_slots(l)
        attention = gl.attention_bf16 if self.model.bf16 else gl.attention
        if n_cache > 0:
            launch = attention(q, self.new_pos, c.keys[l], c.values[l], self.rows, n_cache,
                               c.slot_positions_device(l), c.real, new_k, new_v, self.new_pos, self.new_real,
                               window, causal, out)
        else:
            launch = attention(q, self.new_pos, None, None, None, 0, None, None, new_k, new_v, self.new_pos,
                               self.new_real, window, causal, out)
        self.model.device.launch(launch)
        if not self.decoder:
            self.pending.append((new_k, new_v))


# ================================================================================================ sampling state


def _generate(model: Model, input_ids: Any, attention_mask: Any = None, generation_config: Any = None, *,
              logits_hook: Any = None, overrides: Mapping[str, Any] | None = None, **kwargs: Any):
    """The one loop on this model with ``GpuBackend``'s ``logits_hook`` (tests only: the same host logits
    fed to the GPU step and to the reference's). ``overrides``: generation settings, as a mapping."""
    return generate(model, input_ids, attention_mask, generation_config,
                    backend_options={"logits_hook": logits_hook}, **kwargs, **dict(overrides or {}))
