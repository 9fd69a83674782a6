"""The GPU path's KV cache (device arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np


from diffusiongemma.reference.cache import KVCache as ReferenceKVCache
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.errors import InputError



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

