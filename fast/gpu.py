"""DiffusionGemma on an NVIDIA GPU: CuPy arrays, cuBLAS matrix products, custom CUDA kernels.

    text -> input_ids -> Model.encode (KV cache on the device) -> for each canvas:
        [decoder pass -> logits (B, C, V) in one device buffer -> sampling kernel -> acceptance kernel]
        x steps -> commit the draft -> encode it -> next canvas

Same interface as ``diffusiongemma.reference`` (``Model.from_pretrained(path, device="cuda")``,
``new_cache``, ``encode``, ``denoise``, and ``generate`` with the reference's arguments and random-draw
contract), same numbers up to float32 rounding: every weight is float32 on the device, matrix products go
through cuBLAS (``xp.matmul``, no TF32), and the rest runs in the kernels of ``fast/cuda`` (launch geometry
and argument checks in ``fast/gpu_launch.py``):

* RMSNorm fused with its weight, the residual add and the layer scalar; per-head q/k/v norms fused with
  the rotary embedding; gated GELU of a fused gate/up projection;
* attention over [cache ++ new keys] with GQA, the encoder's causal sliding window and the decoder's
  bidirectional read of the retained cache (sliding layers keep a ring of W - 1 slots);
* the MoE: router top-K, grouping by expert, a grouped GEMM, the weighted combination (no host sync);
* one sampling pass per canvas row (max, log-sum-exp, entropy, argmax, the inverse-CDF draw from a
  uniform drawn on the host), then the entropy-bound acceptance and renoising.

Randomness never comes from the device: ``generate`` asks the reference's draw source for every draw, in
the reference's order (``reference/draws.py``): with ``SeededDraws`` it takes the uniforms of the
categorical draw from the same Philox stream and copies them to the device, so a run reproduces the
reference token for token whenever both compute the same probabilities to within the draw's resolution;
any other source (``ReplayDraws``, a recording...) is given the probabilities on the host.

Self-conditioning keeps exactly one (canvas x vocabulary) float32 buffer per sequence: the decoder writes
its logits there, the sampling pass turns them into probabilities in place, and the next step's
self-conditioning input reads those probabilities (softmax of the processed logits, SPEC §7.1) before the
decoder overwrites the buffer with new logits. Rows that finished denoising are not recomputed, so their
probabilities stay as they were (the reference's freezing, SPEC §8.2 h).

CuPy is optional: importing this module never imports it. ``Model.from_pretrained(..., device="cuda")``
raises ``RuntimeError`` naming what is missing (CuPy, a driver, a GPU). The host orchestration is written
against an array module (``xp``) and a ``Device`` object, so the tests run all of it on the CPU with NumPy
arrays and emulated kernels (tests/test_gpu_host.py).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np

import importlib

from diffusiongemma.reference.cache import KVCache as ReferenceKVCache
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.draws import SeededDraws, as_draw_source
from diffusiongemma.reference.errors import InputError, SamplingError
from diffusiongemma.reference.primitives import rope_inverse_frequencies
from diffusiongemma.reference.sampling import StableAndConfident, temperature
from diffusiongemma.reference.model import check_attention_mask, check_token_ids
from diffusiongemma.reference.weights import check_tensors, load_checkpoint

from . import gpu_launch as gl

# the module (the package re-exports a function of the same name)
ref_generate = importlib.import_module("diffusiongemma.reference.generate")

__all__ = ["Model", "GpuKVCache", "CupyDevice", "generate", "gpu_available"]


# ================================================================================================ devices
class CupyDevice:
    """The real device: CuPy arrays on one CUDA GPU and the kernels of ``fast/cuda`` compiled by NVRTC.

    device: "cuda" (GPU 0) or "cuda:N". Raises ``RuntimeError`` when CuPy is not installed, when no CUDA
    driver/GPU is usable, or when the kernels do not compile (with the compiler log), and ``InputError`` for
    a malformed device string.
    """

    def __init__(self, device: str = "cuda"):
        index = _device_index(device)
        try:
            import cupy
        except ImportError as error:
            raise RuntimeError("the GPU backend needs CuPy, which is not installed: pip install "
                               "'diffusiongemma[gpu]' (cupy-cuda12x), or cupy-cuda13x for a CUDA 13 driver") from error
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # CUDARuntimeError: no driver, no device, driver too old
            raise RuntimeError(f"CuPy is installed but no usable CUDA GPU was found ({error})") from error
        if index >= count:
            raise RuntimeError(f"device {device!r} asked for GPU {index}, but {count} CUDA GPU(s) are visible")
        from .cuda_build import assemble_all

        self.xp = cupy
        self.name = f"cuda:{index}"
        self._device = cupy.cuda.Device(index)
        self._source = assemble_all()
        self._kernels: dict[str, Any] = {}
        self._opted_in: dict[str, int] = {}
        with self._device:
            try:  # compile now, so that a broken toolchain fails here and not mid-generation
                for name in gl.signatures():
                    self._kernel(name).compile()
            except Exception as error:
                raise RuntimeError(f"the CUDA kernels did not compile on {self.name}: {error}") from error

    def _kernel(self, name: str):
        kernel = self._kernels.get(name)
        if kernel is None:
            # every kernel shares one source text: CuPy compiles it once and caches the module
            kernel = self.xp.RawKernel(self._source, name, options=("--std=c++14",))
            self._kernels[name] = kernel
        return kernel

    def context(self):
        return self._device

    def launch(self, launch: gl.Launch) -> None:
        kernel = self._kernel(launch.kernel)
        if launch.needs_shared_opt_in and self._opted_in.get(launch.kernel, 0) < launch.shared_mem:
            kernel.max_dynamic_shared_size_bytes = launch.shared_mem
            self._opted_in[launch.kernel] = launch.shared_mem
        args = tuple(np.uint64(0) if a is None else a for a in launch.args)  # None would not be NULL in CuPy
        kernel(launch.grid, launch.block, args, shared_mem=launch.shared_mem)

    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype=dtype)

    def to_device(self, array: np.ndarray):
        return self.xp.asarray(np.ascontiguousarray(array))

    def to_host(self, array) -> np.ndarray:
        return self.xp.asnumpy(array)

    def synchronize(self) -> None:
        self.xp.cuda.Device().synchronize()


def _device_index(device: str) -> int:
    if not isinstance(device, str):
        raise InputError(f"device must be a string like 'cuda' or 'cuda:1', got {device!r}")
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise InputError(f"device must be 'cuda' or 'cuda:N', got {device!r}")


def gpu_available() -> tuple[bool, str]:
    """(True, description) when CuPy imports and sees a CUDA GPU, else (False, the reason). Never raises."""
    try:
        import cupy
    except ImportError as error:
        return False, f"CuPy is not installed ({error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:
        return False, f"CuPy cannot reach a CUDA GPU ({error})"
    if count == 0:
        return False, "no CUDA GPU is visible"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props.get("name"), bytes) else props.get("name")
    return True, f"{count} GPU(s), GPU 0 = {name}, CuPy {cupy.__version__}"


# ================================================================================================ cache
class GpuKVCache:
    """The encoder's keys and values on the device, for ``batch_size`` rows.

    Same contents as ``reference.cache.KVCache`` (keys after k_norm and RoPE, values after the weightless
    value norm; full layers keep every encoded token, sliding layers the last ``W - 1``; SPEC §6 step 3),
    stored like ``fast.cache.KVCache``:
        keys[l], values[l]: (B, g, slots_l, d) float32 device arrays (slots_l = W - 1 for a sliding layer,
            a ring where position p lives in slot p mod (W - 1); ``capacity`` for a full layer, slot = position);
        slot_positions[l]: (slots_l,) int64 on the host (position held by each slot, -1 empty), mirrored on
            the device for the attention kernel;
        real: (B, capacity) uint8 on the device (1 = a real token), mirrored on the host.
    The decoder only reads it; ``Model.encode`` appends (``begin_append`` / ``store`` / ``end_append``).
    """

    def __init__(self, config: ModelConfig, batch_size: int, device: Any):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.config, self.batch_size, self.device = config, int(batch_size), device
        self._length = 0
        self._capacity = 0
        self._chunk = max(1, int(config.canvas_length))
        self.keys, self.values, self.slot_positions, self._slots_dev = [], [], [], []
        for layer in range(config.num_hidden_layers):
            g, d = config.layer_num_key_value_heads[layer], config.layer_head_dim[layer]
            slots = config.sliding_window - 1 if config.is_sliding(layer) else 0
            self.keys.append(device.zeros((self.batch_size, g, slots, d), np.float32))
            self.values.append(device.zeros((self.batch_size, g, slots, d), np.float32))
            self.slot_positions.append(np.full(slots, -1, dtype=np.int64))
            self._slots_dev.append(device.to_device(self.slot_positions[-1]))
        self._real_host = np.zeros((self.batch_size, 0), dtype=np.uint8)
        self.real = device.to_device(self._real_host)

    # ------------------------------------------------------------------ views
    @property
    def length(self) -> int:
        """L: tokens encoded so far (padding included); the next token sits at position L."""
        return self._length

    @property
    def capacity(self) -> int:
        """Positions the full layers and the realness table hold without growing."""
        return self._capacity

    @property
    def is_real(self) -> np.ndarray:
        """(B, L) bool on the host: position p of row b was a real token."""
        return self._real_host[:, : self._length].astype(bool)

    def layer_capacity(self, layer: int) -> int | None:
        """``W - 1`` for a sliding layer, None (unbounded) for a full layer."""
        return self.config.sliding_window - 1 if self.config.is_sliding(layer) else None

    def cached_slots(self, layer: int) -> int:
        """Leading slots of ``layer`` that hold data (the attention kernel scans these)."""
        cap = self.layer_capacity(layer)
        return self._length if cap is None else min(self._length, cap)

    def slot_positions_device(self, layer: int):
        """(slots_l,) int64 device copy of ``slot_positions[layer]``."""
        return self._slots_dev[layer]

    # ------------------------------------------------------------------ growth and appending
    def reserve(self, total_positions: int) -> None:
        """Room for ``total_positions`` positions in the full layers and the realness table (grows to at
        least 1.5x, rounded up to whole canvases; contents kept)."""
        if total_positions <= self._capacity:
            return
        dev = self.device
        new_cap = max(int(total_positions), (self._capacity * 3) // 2)
        new_cap = -(-new_cap // self._chunk) * self._chunk
        L = self._length
        for layer in range(self.config.num_hidden_layers):
            if self.config.is_sliding(layer):
                continue
            for store in (self.keys, self.values):
                old = store[layer]
                grown = dev.zeros(old.shape[:2] + (new_cap, old.shape[3]), np.float32)
                grown[:, :, :L] = old[:, :, :L]
                store[layer] = grown
            positions = np.full(new_cap, -1, dtype=np.int64)
            positions[:L] = np.arange(L)
            self.slot_positions[layer] = positions
        real = np.zeros((self.batch_size, new_cap), dtype=np.uint8)
        real[:, :L] = self._real_host[:, :L]
        self._real_host = real
        self._capacity = new_cap

    def begin_append(self, mask: np.ndarray) -> None:
        """Record the realness (B, n) of the next n positions and label the full layers' next slots,
        without changing ``length`` (nothing new is visible to a decoder until ``end_append``)."""
        n = mask.shape[1]
        L = self._length
        self.reserve(L + n)
        self._real_host[:, L:L + n] = mask
        self.real = self.device.to_device(self._real_host)
        for layer in range(self.config.num_hidden_layers):
            if not self.config.is_sliding(layer):
                self.slot_positions[layer][L:L + n] = np.arange(L, L + n)
                self._slots_dev[layer] = self.device.to_device(self.slot_positions[layer])

    def store(self, layer: int, keys, values) -> None:
        """Keep the fresh keys/values (B, g, n, d) of positions ``length .. length + n - 1``: all of them
        in a full layer, the newest ``min(n, W - 1)`` in a sliding layer's ring."""
        n = keys.shape[2]
        L = self._length
        cap = self.layer_capacity(layer)
        if cap is None:
            self.keys[layer][:, :, L:L + n] = keys
            self.values[layer][:, :, L:L + n] = values
            return
        keep = min(n, cap)
        positions = np.arange(L + n - keep, L + n, dtype=np.int64)
        slots = positions % cap
        slots_dev = self.device.to_device(slots)
        self.keys[layer][:, :, slots_dev] = keys[:, :, n - keep:]
        self.values[layer][:, :, slots_dev] = values[:, :, n - keep:]
        self.slot_positions[layer][slots] = positions
        self._slots_dev[layer] = self.device.to_device(self.slot_positions[layer])

    def end_append(self, n: int) -> None:
        """Make the n appended positions part of the cache."""
        self._length += n

    # ------------------------------------------------------------------ conversion
    def to_reference(self) -> ReferenceKVCache:
        """The same cache on the host in the reference layout (entries in position order)."""
        keys, values = [], []
        for layer in range(self.config.num_hidden_layers):
            n = self.cached_slots(layer)
            order = np.argsort(self.slot_positions[layer][:n], kind="stable")
            keys.append(self.device.to_host(self.keys[layer])[:, :, order].copy())
            values.append(self.device.to_host(self.values[layer])[:, :, order].copy())
        return ReferenceKVCache(self.config, self.batch_size, keys, values, self.is_real)

    @classmethod
    def from_reference(cls, cache: ReferenceKVCache, device: Any) -> "GpuKVCache":
        """A device cache holding exactly what a reference cache holds."""
        out = cls(cache.config, cache.batch_size, device)
        L = cache.length
        out.begin_append(np.asarray(cache.is_real, dtype=np.uint8))
        for layer in range(cache.config.num_hidden_layers):
            keys, values = cache.keys[layer], cache.values[layer]
            T = keys.shape[2]
            positions = np.arange(L - T, L, dtype=np.int64)
            cap = out.layer_capacity(layer)
            slots = positions if cap is None else positions % cap
            k_host, v_host = device.to_host(out.keys[layer]), device.to_host(out.values[layer])
            k_host[:, :, slots], v_host[:, :, slots] = keys, values
            out.keys[layer], out.values[layer] = device.to_device(k_host), device.to_device(v_host)
            if cap is not None:
                out.slot_positions[layer][slots] = positions
                out._slots_dev[layer] = device.to_device(out.slot_positions[layer])
        out.end_append(L)
        return out

    def copy(self) -> "GpuKVCache":
        """A deep copy (device arrays copied)."""
        out = GpuKVCache.__new__(GpuKVCache)
        out.config, out.batch_size, out.device = self.config, self.batch_size, self.device
        out._length, out._capacity, out._chunk = self._length, self._capacity, self._chunk
        out.keys = [k.copy() for k in self.keys]
        out.values = [v.copy() for v in self.values]
        out.slot_positions = [p.copy() for p in self.slot_positions]
        out._slots_dev = [p.copy() for p in self._slots_dev]
        out._real_host = self._real_host.copy()
        out.real = self.real.copy()
        return out


# ================================================================================================ model
class Model:
    """DiffusionGemma with its weights resident on a GPU.

    Build it with ``Model.from_pretrained(path, device="cuda")`` or ``Model(config, tensors, device=...)``
    (``tensors``: the project's tensor names -> float32/bf16 NumPy arrays, ``reference.weights``). ``device``
    is "cuda", "cuda:N", or a device object (the tests pass a NumPy stand-in). Loading widens every tensor
    to float32 on the device and fuses q/k/v and every gate/up pair into one matrix each.
    """

    def __init__(self, config: ModelConfig, tensors: Mapping[str, np.ndarray], device: Any = "cuda"):
        check_tensors(tensors, config)
        self.config = config
        self.device = CupyDevice(device) if isinstance(device, str) else device
        dev = self.device
        up = lambda array: dev.to_device(np.ascontiguousarray(array, dtype=np.float32))  # noqa: E731
        with dev.context():
            t = tensors
            self.embed_tokens = up(t["embed_tokens"])  # (V, H): embedding, lm_head and SC soft embedding
            self.final_norm = up(t["final_norm"])
            self.sc_pre_norm = up(t["self_conditioning.pre_norm"])
            self.sc_gate_up = up(np.concatenate([t["self_conditioning.gate_proj"], t["self_conditioning.up_proj"]]))
            self.sc_down = up(t["self_conditioning.down_proj"])
            self.layers = [self._upload_layer(t, l, up) for l in range(config.num_hidden_layers)]
        self._omega = {kind: rope_inverse_frequencies(config.rope_parameters[kind], d)
                       for kind, d in zip(config.layer_types, config.layer_head_dim)}

    def _upload_layer(self, t: Mapping[str, np.ndarray], l: int, up) -> dict:
        p = f"layers.{l}."
        qkv = [t[p + "q_proj"], t[p + "k_proj"]] + ([t[p + "v_proj"]] if self.config.is_sliding(l) else [])
        names = ("input_layernorm", "o_proj", "q_norm", "k_norm", "post_attention_layernorm",
                 "pre_feedforward_layernorm", "mlp.down_proj", "post_feedforward_layernorm_1", "router.proj",
                 "router.scale", "router.per_expert_scale", "pre_feedforward_layernorm_2", "experts.gate_up_proj",
                 "experts.down_proj", "post_feedforward_layernorm_2", "post_feedforward_layernorm")
        w = {name: up(t[p + name]) for name in names}
        w["qkv"] = up(np.concatenate(qkv))  # (n_h*d + g*d [+ g*d], H)
        w["mlp.gate_up"] = up(np.concatenate([t[p + "mlp.gate_proj"], t[p + "mlp.up_proj"]]))  # (2*I_d, H)
        w["encoder_scalar"] = float(np.float32(np.asarray(t[p + "encoder_layer_scalar"]).reshape(-1)[0]))
        w["decoder_scalar"] = float(np.float32(np.asarray(t[p + "decoder_layer_scalar"]).reshape(-1)[0]))
        return w

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: Any = "cuda") -> "Model":
        """Load a converted checkpoint (or a transformers one, converted in memory) onto ``device``.

        Raises ``RuntimeError`` when the GPU backend is unusable (no CuPy, no GPU), ``CheckpointError`` /
        ``ConfigError`` for a bad checkpoint. The device is checked before the (slow) weight read.
        """
        dev = CupyDevice(device) if isinstance(device, str) else device
        config, tensors = load_checkpoint(path)
        return cls(config, tensors, device=dev)

    def new_cache(self, batch_size: int) -> GpuKVCache:
        """An empty device cache for ``batch_size`` rows."""
        with self.device.context():
            return GpuKVCache(self.config, batch_size, self.device)

    # ------------------------------------------------------------------ checks
    def _check_ids(self, name: str, ids: Any, cache: Any) -> np.ndarray:
        if not isinstance(cache, GpuKVCache):
            raise InputError(f"cache must be a GpuKVCache from Model.new_cache, got {type(cache).__name__}")
        return check_token_ids(name, ids, cache.batch_size, self.config.vocab_size)

    # ------------------------------------------------------------------ encoder
    def encode(self, input_ids: Any, cache: GpuKVCache, attention_mask: Any = None) -> np.ndarray:
        """Run the causal encoder over new tokens and append their keys/values to ``cache``.

        input_ids: (B, n) int ids in [0, V) at positions ``cache.length ..`` (padding included, trap T18).
        attention_mask: (B, n) of 0/1, default all ones. Returns the final-norm hidden states (B, n, H)
        float32 on the host (upstream ``last_hidden_state``). Raises ``InputError`` for bad ids, shapes or
        a cache of another batch size; the cache's length is unchanged on error.
        """
        return self._encode(input_ids, cache, attention_mask, return_hidden=True)

    def _encode(self, input_ids: Any, cache: GpuKVCache, attention_mask: Any, return_hidden: bool):
        ids = self._check_ids("input_ids", input_ids, cache)
        B, n = ids.shape
        if n == 0:
            raise InputError("input_ids has no tokens (shape (B, 0))")
        mask = check_attention_mask(attention_mask, (B, n)).astype(np.uint8)
        config, dev = self.config, self.device
        with dev.context():
            L = cache.length
            positions = L + np.arange(n, dtype=np.int64)
            cache.begin_append(mask)
            h = dev.empty((B * n, config.hidden_size), np.float32)
            dev.launch(gl.embed(dev.to_device(ids.reshape(-1)), self.embed_tokens, config.embed_scale, None, False, h,
                                config.rms_norm_eps))
            pos_dev, real_dev = dev.to_device(positions), dev.to_device(mask)
            tables = self._rope_tables(positions)
            pending = []
            for l, w in enumerate(self.layers):
                attn = _Attention(cache, l, n_cache=cache.cached_slots(l), rows=None, new_pos=pos_dev,
                                  new_real=real_dev, causal=True,
                                  window=config.sliding_window if config.is_sliding(l) else 0)
                k, v = self._layer(h, B, n, l, pos_dev, tables, attn, w["encoder_scalar"])
                pending.append((k, v))
            for l, (k, v) in enumerate(pending):  # commit only once every layer succeeded
                cache.store(l, k, v)
            cache.end_append(n)
            if not return_hidden:
                return None
            out = dev.empty((B * n, config.hidden_size), np.float32)
            dev.launch(gl.rms_norm(h, self.final_norm, out, config.rms_norm_eps))
            return dev.to_host(out).reshape(B, n, config.hidden_size)

    # ------------------------------------------------------------------ decoder
    def denoise(self, canvas: Any, cache: GpuKVCache, self_conditioning_logits: Any = None,
                self_conditioning_mask: Any = None, *, device_output: bool = False):
        """One decoder pass: soft-capped logits (B, C, V) float32 for every canvas position.

        canvas: (B, C) int ids, C = ``config.canvas_length``, at positions ``cache.length ..``.
        self_conditioning_logits: (B, C, V) float32 (host or device) or None (first step: no signal).
        self_conditioning_mask: (B,) bool or None (training: rows with False get no signal).
        Returns a NumPy array, or the device array when ``device_output``. Never writes the cache.
        Raises ``InputError`` like ``reference.model.Model.denoise``.
        """
        config, dev = self.config, self.device
        ids = self._check_ids("canvas", canvas, cache)
        B, C = ids.shape
        V = config.vocab_size
        if C != config.canvas_length:
            raise InputError(f"canvas has length {C}, but this model's canvas_length is {config.canvas_length}")
        mask = None
        if self_conditioning_mask is not None:
            if np.shape(self_conditioning_mask) != (B,):
                raise InputError(f"self_conditioning_mask has shape {np.shape(self_conditioning_mask)}, expected {(B,)}")
            mask = np.asarray(self_conditioning_mask, dtype=bool)
        with dev.context():
            buffer = dev.empty((B, C, V), np.float32)  # SC probabilities in, logits out
            has_sc = False
            if self_conditioning_logits is not None:
                if not hasattr(self_conditioning_logits, "shape"):
                    self_conditioning_logits = np.asarray(self_conditioning_logits, dtype=np.float32)
                if tuple(self_conditioning_logits.shape) != (B, C, V):
                    raise InputError(f"self_conditioning_logits has shape {tuple(self_conditioning_logits.shape)}, "
                                     f"expected {(B, C, V)}")
                sc = self_conditioning_logits
                buffer[...] = sc if not isinstance(sc, np.ndarray) else dev.to_device(sc.astype(np.float32))
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
        flat = _flat_rows(rows, C)
        R = flat.shape[0]
        outs = _StepOutputs(dev, R)
        dev.launch(gl.sample_rows(buffer.reshape(B * C, V), dev.to_device(flat), 0.0, 0.0, None, outs.argmax,
                                  outs.entropy, outs.sampled, outs.flags))
        _raise_for_flags(dev.to_host(outs.flags), flat, C, what, InputError)

    def _decoder_logits(self, canvas_dev, cache: GpuKVCache, rows: np.ndarray, buffer, has_sc: bool,
                        sc_mask: np.ndarray | None = None) -> None:
        """Decoder pass for batch rows ``rows`` (host int array): raw logits (before the soft-cap) into
        ``buffer[rows]``. canvas_dev: (len(rows), C) int64 device ids of those rows. When ``has_sc``,
        ``buffer[rows]`` holds the self-conditioning probabilities on entry (read before any write)."""
        config, dev = self.config, self.device
        n_rows = rows.shape[0]
        B, C, V = buffer.shape
        H = config.hidden_size
        positions = cache.length + np.arange(C, dtype=np.int64)
        signal = None
        if has_sc:
            u = dev.empty((n_rows, C, H), np.float32)
            for i, b in enumerate(rows):  # (C, V) @ (V, H) per row: rows of the buffer are not contiguous as a set
                dev.xp.matmul(buffer[int(b)], self.embed_tokens, out=u[i])
            dev.xp.multiply(u, np.float32(config.embed_scale), out=u)
            if sc_mask is not None:
                u[dev.to_device(np.flatnonzero(~sc_mask[rows]))] = 0.0
            u = u.reshape(n_rows * C, H)
            x = dev.empty((n_rows * C, H), np.float32)
            dev.launch(gl.rms_norm(u, self.sc_pre_norm, x, config.rms_norm_eps))
            signal = self._gated_mlp(x, self.sc_gate_up, self.sc_down)
        h = dev.empty((n_rows * C, H), np.float32)
        dev.launch(gl.embed(canvas_dev.reshape(-1), self.embed_tokens, config.embed_scale, signal, True, h,
                            config.rms_norm_eps))
        pos_dev = dev.to_device(positions)
        tables = self._rope_tables(positions)
        cache_rows = dev.to_device(rows.astype(np.int32))
        ones = dev.to_device(np.ones((n_rows, C), dtype=np.uint8))
        for l, w in enumerate(self.layers):
            attn = _Attention(cache, l, n_cache=cache.cached_slots(l), rows=cache_rows, new_pos=pos_dev,
                              new_real=ones, causal=False, window=0)
            self._layer(h, n_rows, C, l, pos_dev, tables, attn, w["decoder_scalar"])
        hf = dev.empty((n_rows * C, H), np.float32)
        dev.launch(gl.rms_norm(h, self.final_norm, hf, config.rms_norm_eps))
        for i, b in enumerate(rows):  # tied lm_head straight into the buffer rows
            dev.xp.matmul(hf[i * C:(i + 1) * C], self.embed_tokens.T, out=buffer[int(b)])

    # ------------------------------------------------------------------ shared block
    def _rope_tables(self, positions: np.ndarray) -> dict:
        """Per layer type, device (S, d/2) cos and sin of ``float32(p) * omega`` (the reference's angles)."""
        tables = {}
        for kind, omega in self._omega.items():
            angles = positions.astype(np.float32)[:, None] * omega  # (S, d/2)
            tables[kind] = (self.device.to_device(np.cos(angles)), self.device.to_device(np.sin(angles)))
        return tables

    def _layer(self, h, N: int, S: int, l: int, pos_dev, tables: dict, attn: "_Attention", scalar: float):
        """One block on the residual ``h`` (N*S, H), in place. Returns this call's keys and values
        (N, g, S, d) (the encoder stores them in the cache)."""
        config, dev, w = self.config, self.device, self.layers[l]
        eps, H = config.rms_norm_eps, config.hidden_size
        n_h, g, d = config.num_attention_heads, config.layer_num_key_value_heads[l], config.layer_head_dim[l]
        has_v = config.is_sliding(l)
        x = dev.empty((N * S, H), np.float32)
        dev.launch(gl.rms_norm(h, w["input_layernorm"], x, eps))
        proj = dev.empty((N * S, w["qkv"].shape[0]), np.float32)
        dev.xp.matmul(x, w["qkv"].T, out=proj)
        q = dev.empty((N, S, n_h, d), np.float32)
        k = dev.empty((N, g, S, d), np.float32)
        v = dev.empty((N, g, S, d), np.float32)
        cos, sin = tables[config.layer_types[l]]
        dev.launch(gl.qkv_heads(proj, N, S, n_h, g, d, has_v, w["q_norm"], w["k_norm"], cos, sin, q, k, v, eps))
        heads = dev.empty((N, S, n_h * d), np.float32)
        dev.launch(attn.launch(q, pos_dev, k, v, heads))
        y = dev.empty((N * S, H), np.float32)
        dev.xp.matmul(heads.reshape(N * S, n_h * d), w["o_proj"].T, out=y)
        dev.launch(gl.residual_norm(h, y, w["post_attention_layernorm"], 1.0, eps))
        dev.launch(gl.rms_norm(h, w["pre_feedforward_layernorm"], x, eps))
        dense = self._gated_mlp(x, w["mlp.gate_up"], w["mlp.down_proj"])
        moe = self._experts(h, w)
        dev.launch(gl.ffn_tail(h, dense, moe, w["post_feedforward_layernorm_1"], w["post_feedforward_layernorm_2"],
                               w["post_feedforward_layernorm"], scalar, eps))
        return k, v

    def _gated_mlp(self, x, gate_up, down):
        """``(gelu(x G^T) * (x U^T)) D^T`` with [G; U] fused: x (N, H) -> (N, H_out) device arrays."""
        dev = self.device
        N = x.shape[0]
        inner = gate_up.shape[0] // 2
        gu = dev.empty((N, 2 * inner), np.float32)
        dev.xp.matmul(x, gate_up.T, out=gu)
        act = dev.empty((N, inner), np.float32)
        dev.launch(gl.gated_gelu(gu, act))
        out = dev.empty((N, down.shape[0]), np.float32)
        dev.xp.matmul(act, down.T, out=out)
        return out

    def _experts(self, h, w: dict):
        """Routed experts of the residual ``h`` (N, H): router on the raw residual, experts on
        pre_feedforward_layernorm_2(h) (SPEC §4.2 steps 10-11, trap T7); returns (N, H) before its norm."""
        config, dev = self.config, self.device
        N, H = h.shape
        E, K, I_e, eps = config.num_experts, config.top_k_experts, config.moe_intermediate_size, config.rms_norm_eps
        z = dev.empty((N, H), np.float32)
        dev.launch(gl.rms_norm(h, w["router.scale"], z, eps, post=float(np.float32(H ** -0.5))))
        probs = dev.empty((N, E), np.float32)
        dev.xp.matmul(z, w["router.proj"].T, out=probs)
        indices = dev.empty((N, K), np.int64)
        weights = dev.empty((N, K), np.float32)
        dev.launch(gl.router(probs, w["router.per_expert_scale"], indices, weights))
        xe = z  # reuse: the router input is no longer needed
        dev.launch(gl.rms_norm(h, w["pre_feedforward_layernorm_2"], xe, eps))
        tiles, rows = gl.moe_rows(N, K, E)
        offsets = dev.empty((E + 1,), np.int32)
        row_token = dev.empty((rows,), np.int32)
        choice_row = dev.empty((N, K), np.int32)
        tile_expert = dev.empty((tiles,), np.int32)
        dev.launch(gl.group_experts(indices, E, offsets, row_token, choice_row, tile_expert))
        xg = dev.empty((rows, H), np.float32)
        dev.launch(gl.gather_rows(xe, row_token, xg))
        gu = dev.zeros((rows, 2 * I_e), np.float32)
        dev.launch(gl.grouped_gemm_nt(xg, w["experts.gate_up_proj"], tile_expert, gu))
        act = dev.empty((rows, I_e), np.float32)
        dev.launch(gl.gated_gelu(gu, act))
        yo = dev.empty((rows, H), np.float32)
        dev.launch(gl.grouped_gemm_nt(act, w["experts.down_proj"], tile_expert, yo))
        out = dev.empty((N, H), np.float32)
        dev.launch(gl.combine_experts(yo, indices, choice_row, weights, out))
        return out


class _Attention:
    """The key set of one layer's attention call: the cache's leading slots plus the call's own keys."""

    def __init__(self, cache: GpuKVCache, layer: int, n_cache: int, rows, new_pos, new_real, causal: bool,
                 window: int):
        self.cache, self.layer, self.n_cache, self.rows = cache, layer, n_cache, rows
        self.new_pos, self.new_real, self.causal, self.window = new_pos, new_real, causal, window

    def launch(self, q, q_pos, new_k, new_v, out) -> gl.Launch:
        c, l = self.cache, self.layer
        if self.n_cache > 0:
            return gl.attention(q, q_pos, c.keys[l], c.values[l], self.rows, self.n_cache,
                                c.slot_positions_device(l), c.real, new_k, new_v, self.new_pos, self.new_real,
                                self.window, self.causal, out)
        return gl.attention(q, q_pos, None, None, None, 0, None, None, new_k, new_v, self.new_pos, self.new_real,
                            self.window, self.causal, out)


# ================================================================================================ sampling state
def _flat_rows(batch_rows: np.ndarray, C: int) -> np.ndarray:
    """int32 indices of the (B*C, V) rows belonging to ``batch_rows``: b*C + c."""
    return (np.asarray(batch_rows, dtype=np.int64)[:, None] * C + np.arange(C)).reshape(-1).astype(np.int32)


class _StepOutputs:
    """Device outputs of one sampling pass over R rows."""

    def __init__(self, dev: Any, R: int):
        self.argmax = dev.empty((R,), np.int64)
        self.entropy = dev.empty((R,), np.float32)
        self.sampled = dev.zeros((R,), np.int64)
        self.flags = dev.empty((R,), np.int32)


def _raise_for_flags(flags: np.ndarray, flat_rows: np.ndarray, C: int, what: str, error=SamplingError) -> None:
    """Raise naming the first (row, position) whose logits hold NaN / +inf / no finite value."""
    bad = np.flatnonzero(flags)
    if bad.size == 0:
        return
    i = int(bad[0])
    row, pos = divmod(int(flat_rows[i]), C)
    f = int(flags[i])
    reason = "NaN" if f & 1 else "+inf" if f & 2 else "no finite value (all -inf)"
    raise error(f"{what} at (row, position) {(row, pos)} hold {reason}; cannot sample a token")


# ================================================================================================ generation
def generate(model: Model, input_ids: Any, attention_mask: Any = None,
             generation_config: ref_generate.GenerationConfig | None = None, *, random: Any = None,
             denoiser: Any = None, encoder: Any = None, cache: GpuKVCache | None = None,
             decoder_input_ids: Any = None, self_conditioning_logits: Any = None, callback: Any = None,
             progress: bool = True, **overrides: Any) -> ref_generate.GenerationResult:
    """Entropy-bound block diffusion on the GPU: ``reference.generate.generate`` with the same arguments,
    lengths, EOS/pad rules, callbacks and draw order (SPEC §8), returning a ``GenerationResult`` whose
    ``cache`` is a ``GpuKVCache``.

    Differences: ``denoiser`` / ``encoder`` replacements are not supported (they exchange host arrays every
    step; use the reference loop for them) and raise ``InputError``; for a row that had already finished
    denoising, ``StepInfo.sampled`` reports its frozen canvas (its categorical draw is not computed; the
    draw is still consumed from the source, so later draws are unchanged).
    Raises what the reference raises (``InputError``, ``ConfigError``, ``SamplingError``, ``ReplayError``).
    """
    if denoiser is not None or encoder is not None:
        raise InputError("the GPU generate runs its own model: denoiser/encoder replacements are not supported "
                         "(use diffusiongemma.reference.generate.generate for them)")
    return _generate(model, input_ids, attention_mask, generation_config, random=random, cache=cache,
                     decoder_input_ids=decoder_input_ids, self_conditioning_logits=self_conditioning_logits,
                     callback=callback, progress=progress, overrides=overrides)


def _generate(model: Model, input_ids: Any, attention_mask: Any, generation_config, *, random: Any, cache: Any,
              decoder_input_ids: Any, self_conditioning_logits: Any, callback: Any, progress: bool,
              overrides: Mapping[str, Any], logits_hook: Any = None) -> ref_generate.GenerationResult:
    """The loop. ``logits_hook(canvas (B, C) int64, rows)`` -> soft-capped host logits (B, C, V) replaces
    the decoder (tests only: it feeds the same logits to this loop and to the reference's)."""
    R = ref_generate
    config = R.resolve_config(model, generation_config, overrides)
    V, C = int(model.config.vocab_size), int(model.config.canvas_length)
    R.check_special_ids(config, V)
    ids, mask = R.check_prompt(input_ids, attention_mask, V)
    B, P = ids.shape
    start_canvas = R.check_start_canvas(decoder_input_ids, B, C, V)
    start_sc = R.check_start_sc_logits(self_conditioning_logits, B, C, V)
    draws = as_draw_source(random)
    dev = model.device
    with dev.context():
        if cache is None:
            cache = model.new_cache(B)
        elif not isinstance(cache, GpuKVCache) or cache.batch_size != B:
            raise InputError(f"cache must be a GpuKVCache for batch size {B}, got {type(cache).__name__}")
        context_length = P + int(cache.length)
        n_canvases = math.ceil(R.new_token_budget(config, context_length) / C)
        stopper = (StableAndConfident(config.stability_threshold, config.confidence_threshold)
                   if config.uses_adaptive_stopping else None)
        state = _DeviceSampler(model, B, C, V, draws, logits_hook)

        sequences = ids.copy()
        ended = np.zeros(B, dtype=bool)
        forward_passes = np.zeros(B, dtype=np.int64)
        steps_per_canvas: list[int] = []
        new_ids, new_mask = ids, mask
        R.notify(callback, "on_prompt", R.readonly(ids))

        from tqdm import tqdm

        canvas_bar = tqdm(total=n_canvases, desc="canvases", unit="canvas", disable=not progress, leave=False)
        step_bar = tqdm(total=config.max_denoising_steps, desc="denoising", unit="step", disable=not progress,
                        leave=False)
        try:
            for k in range(n_canvases):
                model._encode(new_ids, cache, new_mask, return_hidden=False)
                initial = draws.canvas_ids(B, C, V)  # always drawn (trap T14)
                canvas = start_canvas if (k == 0 and start_canvas is not None) else initial
                step_bar.reset(total=config.max_denoising_steps)
                draft, steps = _denoise_canvas(k, canvas, start_sc if k == 0 else None, cache, state, stopper, config,
                                               ended, forward_passes, callback, step_bar)
                steps_per_canvas.append(steps)
                sequences, tokens, ended = R.commit_canvas(k, draft, steps, sequences, ended, config, callback)
                canvas_bar.update(1)
                if ended.all():
                    break
                new_ids = tokens
                new_mask = None if mask is None else np.ones((B, C), dtype=np.int64)
        finally:
            step_bar.close()
            canvas_bar.close()
    return R.finish_run(sequences, P, forward_passes, steps_per_canvas, cache, config, callback)


class _DeviceSampler:
    """One denoising step on the device for the rows still denoising; owns the (B, C, V) buffer."""

    def __init__(self, model: Model, B: int, C: int, V: int, draws: Any, logits_hook: Any):
        self.model, self.dev = model, model.device
        self.B, self.C, self.V = B, C, V
        self.draws = draws
        self.logits_hook = logits_hook
        self.buffer = self.dev.empty((B, C, V), np.float32)  # the one (C x V) float32 buffer per sequence
        self.has_sc = False  # buffer holds self-conditioning probabilities for every row

    def start_canvas(self, sc_logits: np.ndarray | None) -> None:
        """Start a canvas: no self-conditioning, or the caller's logits (first canvas only)."""
        self.has_sc = False
        if sc_logits is not None:
            self.buffer[...] = self.dev.to_device(sc_logits)
            self.model._softmax_in_place(self.buffer, np.arange(self.B), "self_conditioning_logits")
            self.has_sc = True

    def _uniforms(self) -> np.ndarray | None:
        """The categorical uniforms of ``SeededDraws`` (its exact generator call), or None for another source."""
        if type(self.draws) is SeededDraws:
            return self.draws.generator.random(size=(self.B, self.C), dtype=np.float64)
        return None

    def step(self, canvas: np.ndarray, live: np.ndarray, temp: np.float32 | None, bound: float) -> dict:
        """Decoder pass, sampling pass and acceptance for the batch rows ``live``; returns host arrays
        (len(live), C): draft, entropies, sampled, accepted, next canvas."""
        dev, B, C, V = self.dev, self.B, self.C, self.V
        model = self.model
        cap = model.config.final_logit_softcapping
        if self.logits_hook is not None:
            logits = np.asarray(self.logits_hook(canvas, live), dtype=np.float32)
            self.buffer[dev.to_device(live)] = dev.to_device(logits[live])
            cap = 0.0
        else:
            model._decoder_logits(dev.to_device(canvas[live]), self._cache, live, self.buffer, self.has_sc)
        flat = _flat_rows(live, C)
        n = flat.shape[0]
        out = _StepOutputs(dev, n)
        uniforms = self._uniforms()
        temp_value = 0.0 if temp is None else float(temp)
        what = "denoiser logits" if temp is None else f"logits divided by temperature {float(temp)!r}"
        dev.launch(gl.sample_rows(self.buffer.reshape(B * C, V), dev.to_device(flat), cap, temp_value,
                                  None if uniforms is None else dev.to_device(uniforms[live].reshape(-1)),
                                  out.argmax, out.entropy, out.sampled, out.flags))
        _raise_for_flags(dev.to_host(out.flags), flat, C, what)
        if uniforms is None:  # any other draw source decides on the host, from the probabilities
            probs = dev.to_host(self.buffer)
            frozen = np.setdiff1d(np.arange(B), live)
            probs[frozen] = np.float32(1.0 / V)  # not recomputed; their draws are consumed and discarded
            sampled = self.draws.categorical(probs)
            out.sampled = dev.to_device(np.ascontiguousarray(sampled[live].reshape(-1)))
        noise = self.draws.renoise_ids(B, C, V)
        accepted = dev.empty((live.shape[0], C), np.uint8)
        next_canvas = dev.empty((live.shape[0], C), np.int64)
        entropy = out.entropy.reshape(live.shape[0], C)
        sampled_dev = out.sampled.reshape(live.shape[0], C)
        dev.launch(gl.accept_renoise(entropy, sampled_dev, dev.to_device(noise[live]), bound, accepted, next_canvas))
        self.has_sc = True
        shape = (live.shape[0], C)
        return {"draft": dev.to_host(out.argmax).reshape(shape), "entropies": dev.to_host(entropy),
                "sampled": dev.to_host(sampled_dev), "accepted": dev.to_host(accepted).astype(bool),
                "canvas": dev.to_host(next_canvas)}


def _denoise_canvas(k: int, canvas: np.ndarray, sc_logits: np.ndarray | None, cache: GpuKVCache,
                    state: _DeviceSampler, stopper: StableAndConfident | None, config: Any, ended: np.ndarray,
                    forward_passes: np.ndarray, callback: Any, step_bar: Any) -> tuple[np.ndarray, int]:
    """The denoising steps of canvas ``k`` (SPEC §8.2 step 3; letters as in reference.generate). Rows that
    finished denoising are not recomputed: their draft, canvas, entropies and buffer row stay frozen."""
    R = ref_generate
    B, C = canvas.shape
    N = config.max_denoising_steps
    state._cache = cache
    state.start_canvas(sc_logits)
    draft = canvas
    entropies = np.zeros((B, C), dtype=np.float32)
    finished = np.zeros(B, dtype=bool)
    if stopper is not None:
        stopper.reset()
    step_index = 0
    for step_index, step in enumerate(range(N, 0, -1)):
        forward_passes += ~(finished | ended)  # (a)
        live = np.flatnonzero(~finished)
        temp = temperature(step, N, config.t_min, config.t_max) if config.uses_temperature else None
        out = state.step(canvas, live, temp, config.entropy_bound)  # (b)-(g) for the live rows
        new_draft, next_canvas, step_entropies = draft.copy(), canvas.copy(), entropies.copy()  # (h) frozen rows
        sampled, accepted = canvas.copy(), np.zeros((B, C), dtype=bool)
        new_draft[live], next_canvas[live], step_entropies[live] = out["draft"], out["canvas"], out["entropies"]
        sampled[live], accepted[live] = out["sampled"], out["accepted"]
        if stopper is not None:
            finished = finished | stopper(new_draft, step_entropies)  # (i)
        canvas, draft, entropies = next_canvas, new_draft, step_entropies  # (j)
        step_bar.update(1)
        R.notify(callback, "on_step", R.StepInfo(
            canvas_index=k, step=step, step_index=step_index,
            temperature=None if temp is None else float(temp), draft=R.readonly(draft),
            sampled=R.readonly(sampled), accepted=R.readonly(accepted), canvas=R.readonly(canvas),
            entropies=R.readonly(entropies), finished=R.readonly(finished.copy())))
        if finished.all():  # (k)
            break
    return draft, step_index + 1
