"""The fast paths' KV cache: preallocated storage, sliding layers as rings, on the host or on a device.

Same contents as ``reference.cache.KVCache`` (keys after ``k_norm`` and RoPE, values after the weightless
value norm; full-attention layers keep every encoded token, sliding layers the last ``sliding_window - 1``;
SPEC §6 step 3, traps T5/T6), stored so that nothing is copied or reallocated per token:

* a sliding layer owns a ring of ``W - 1`` slots; position p lives in slot ``p mod (W - 1)``. The ring is
  allocated as the positions arrive: ``min(W - 1, capacity)`` slots (while fewer than W - 1 positions are
  held, slot = position), so a huge ``sliding_window`` costs nothing up front;
* a full layer owns ``capacity`` slots, slot = position; capacity grows geometrically (rounded up to
  whole canvases, never past ``max_position_embeddings``) only when an encode call needs more, and
  ``reserve`` can size it up front. Every growth first checks its bytes against the memory the device
  has free (``InputError`` with the estimate, before anything is allocated);
* ``slot_positions[l][t]`` is the absolute position held by slot t of layer l (-1: empty), and
  ``real[b, p]`` (uint8) says whether position p of row b was a real token or padding.

One class serves the CPU fast path and the GPU: the storage is allocated through an array ``device``
(``HOST``: NumPy arrays on the host; ``fast.gpu.device.CupyDevice``: CuPy arrays on a GPU). The position
table and the realness table always live on the host too, mirrored on the device for the kernels.
The decoder only reads the cache; the encoder appends to it (``begin_append``, ``store``, ``end_append``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusiongemma.reference.cache import KVCache as ReferenceKVCache
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.checks import available_memory
from diffusiongemma.reference.support.errors import InputError

__all__ = ["KVCache", "HostArrays", "HOST"]


class HostArrays:
    """The array interface of a device, on the host: NumPy arrays, and copies that are no copies."""

    xp = np
    name = "cpu"

    def zeros(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_host(self, array: np.ndarray) -> np.ndarray:
        return array

    def available_memory(self) -> int | None:
        """Bytes of host memory still free (``reference.support.checks.available_memory``)."""
        return available_memory()


HOST = HostArrays()


class KVCache:
    """Keys and values of everything encoded so far, for ``batch_size`` rows (the fast paths' layout).

    Attributes (per layer l; g, d = KV heads and head dim of that layer):
        keys[l], values[l]: (B, g, slots_l, d) float32 device arrays (slots_l = W - 1 for sliding layers,
            ``capacity`` for full layers). Only the slots listed in ``slot_positions[l]`` hold data.
        slot_positions[l]: (slots_l,) int64 host array, the position stored in each slot, -1 when empty
            (``slot_positions_device(l)``: its device mirror).
        real: (B, capacity) uint8 device array, 1 where the position was a real token (host mirror:
            ``is_real``).
    """

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int = 0, device: Any = HOST):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.config, self.batch_size, self.device = config, int(batch_size), device
        self._length = 0
        self._capacity = 0
        self._chunk = max(1, int(config.canvas_length))
        self.keys: list = []
        self.values: list = []
        self.slot_positions: list[np.ndarray] = []
        self._slots_dev: list = []
        for layer in range(config.num_hidden_layers):
            g, d = config.layer_num_key_value_heads[layer], config.layer_head_dim[layer]
            slots = 0  # sliding rings too grow with the positions (``reserve``), up to W - 1 slots
            self.keys.append(device.zeros((self.batch_size, g, slots, d), np.float32))
            self.values.append(device.zeros((self.batch_size, g, slots, d), np.float32))
            self.slot_positions.append(np.full(slots, -1, dtype=np.int64))
            self._slots_dev.append(device.to_device(self.slot_positions[-1]))
        self._real_host = np.zeros((self.batch_size, 0), dtype=np.uint8)
        self.real = device.to_device(self._real_host)
        if capacity:
            self.reserve(capacity)

    # ------------------------------------------------------------------ views
    @property
    def length(self) -> int:
        """L: tokens encoded so far (padding included); the next token sits at position L."""
        return self._length

    @property
    def capacity(self) -> int:
        """Positions the full layers and the realness table can hold without growing."""
        return self._capacity

    @property
    def is_real(self) -> np.ndarray:
        """(B, L) bool on the host: position p of row b was a real (non-pad) token. A read-only view."""
        view = self._real_host[:, : self._length].view(bool)
        view.flags.writeable = False
        return view

    def layer_capacity(self, layer: int) -> int | None:
        """Entries a layer retains: ``sliding_window - 1`` for sliding layers, None (unbounded) for full."""
        return self.config.sliding_window - 1 if self.config.is_sliding(layer) else None

    def cached_slots(self, layer: int) -> int:
        """How many leading slots of ``layer`` the attention kernel must scan (the rest are empty)."""
        cap = self.layer_capacity(layer)
        return self._length if cap is None else min(self._length, cap)

    def slot_positions_device(self, layer: int):
        """(slots_l,) int64 device copy of ``slot_positions[layer]``."""
        return self._slots_dev[layer]

    # ------------------------------------------------------------------ growth
    def reserve(self, total_positions: int) -> None:
        """Make room for ``total_positions`` encoded positions (full layers, sliding rings up to W - 1 slots,
        and the realness table).

        Grows to at least 1.5x the current capacity, rounded up to whole canvases (but never past
        ``max_position_embeddings`` when that covers the request), so that appending canvas after canvas
        reallocates O(log n) times. Existing contents are kept. Raises ``InputError`` with the byte
        estimate, before allocating anything, when the growth does not fit in the device's free memory.
        """
        if total_positions <= self._capacity:
            return
        dev, L = self.device, self._length
        new_cap = max(int(total_positions), (self._capacity * 3) // 2)
        new_cap = -(-new_cap // self._chunk) * self._chunk  # round up to whole canvases
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and total_positions <= int(limit) < new_cap:
            new_cap = int(limit)  # positions past the model's limit are refused anyway (check_positions)
        self._check_growth(new_cap)
        window = int(self.config.sliding_window) - 1
        for layer in range(self.config.num_hidden_layers):
            slots = min(new_cap, window) if self.config.is_sliding(layer) else new_cap
            if slots <= self.keys[layer].shape[2]:
                continue
            kept = min(L, self.keys[layer].shape[2])  # a ring smaller than W - 1 holds positions 0..L-1 as is
            for store in (self.keys, self.values):
                old = store[layer]
                grown = dev.zeros(old.shape[:2] + (slots, old.shape[3]), np.float32)
                grown[:, :, :kept] = old[:, :, :kept]
                store[layer] = grown
            positions = np.full(slots, -1, dtype=np.int64)
            positions[:kept] = self.slot_positions[layer][:kept]
            self.slot_positions[layer] = positions
            self._slots_dev[layer] = dev.to_device(positions)
        real = np.zeros((self.batch_size, new_cap), dtype=np.uint8)
        real[:, :L] = self._real_host[:, :L]
        self._real_host = real
        self.real = dev.to_device(real)
        self._capacity = new_cap

    def growth_bytes(self, new_capacity: int) -> int:
        """Bytes that growing to ``new_capacity`` positions allocates: float32 keys and values of every layer
        (a sliding ring at most W - 1 slots) plus the uint8 realness table and the int64 slot tables."""
        window = int(self.config.sliding_window) - 1
        total = self.batch_size * int(new_capacity)  # realness table
        for layer in range(self.config.num_hidden_layers):
            slots = min(new_capacity, window) if self.config.is_sliding(layer) else new_capacity
            have = self.keys[layer].shape[2] if layer < len(self.keys) else 0
            if slots > have:
                g, d = self.config.layer_num_key_value_heads[layer], self.config.layer_head_dim[layer]
                total += 2 * 4 * self.batch_size * g * int(slots) * d + 8 * int(slots)
        return total

    def _check_growth(self, new_capacity: int) -> None:
        """Refuse (``InputError`` with the numbers) a growth that cannot fit in the device's free memory."""
        needed = self.growth_bytes(new_capacity)
        probe = getattr(self.device, "available_memory", None)
        free = probe() if probe is not None else None
        if free is not None and needed > free:
            raise InputError(f"the KV cache for {self.batch_size} row(s) and {new_capacity:,} positions needs about "
                             f"{needed:,} bytes ({needed / 2 ** 30:.2f} GiB) but {free:,} bytes "
                             f"({free / 2 ** 30:.2f} GiB) of memory are available; use fewer tokens or rows")

    # ------------------------------------------------------------------ appending (encoder)
    def begin_append(self, mask: np.ndarray) -> None:
        """Record the realness of the n positions about to be encoded, without advancing the length.

        mask: (B, n) bool/0-1 on the host. Reserves room first and labels the full layers' next n slots
        with their positions. Until ``end_append`` nothing becomes visible to a decoder.
        """
        n = mask.shape[1]
        L = self._length
        self.reserve(L + n)
        self._real_host[:, L: L + n] = mask
        self.real = self.device.to_device(self._real_host)
        for layer in range(self.config.num_hidden_layers):
            if not self.config.is_sliding(layer):
                self.slot_positions[layer][L: L + n] = np.arange(L, L + n, dtype=np.int64)
                self._slots_dev[layer] = self.device.to_device(self.slot_positions[layer])

    def full_layer_slots(self, layer: int, n: int) -> tuple[Any, Any]:
        """Storage views (B, g, n, d) of the next n positions of a full layer (written in place)."""
        start = self._length
        return self.keys[layer][:, :, start: start + n], self.values[layer][:, :, start: start + n]

    def store_sliding(self, layer: int, keys: Any, values: Any) -> None:
        """Put the newest ``min(n, W - 1)`` of n fresh keys/values (B, g, n, d) into a sliding ring.

        Positions are ``length .. length + n - 1`` (the length advances only in ``end_append``).
        """
        cap = self.layer_capacity(layer)
        n = keys.shape[2]
        keep = min(n, cap)
        positions = np.arange(self._length + n - keep, self._length + n, dtype=np.int64)
        slots = positions % cap
        slots_dev = self.device.to_device(slots)
        self.keys[layer][:, :, slots_dev] = keys[:, :, n - keep:]
        self.values[layer][:, :, slots_dev] = values[:, :, n - keep:]
        self.slot_positions[layer][slots] = positions
        self._slots_dev[layer] = self.device.to_device(self.slot_positions[layer])

    def store(self, layer: int, keys: Any, values: Any) -> None:
        """Keep the fresh keys/values (B, g, n, d) of positions ``length .. length + n - 1``: all of them in
        a full layer, the newest ``min(n, W - 1)`` in a sliding layer's ring."""
        if self.layer_capacity(layer) is not None:
            self.store_sliding(layer, keys, values)
            return
        k_slots, v_slots = self.full_layer_slots(layer, keys.shape[2])
        k_slots[...] = keys
        v_slots[...] = values

    def end_append(self, n: int) -> None:
        """Advance the length by n once every layer has stored its keys/values."""
        self._length += n

    # ------------------------------------------------------------------ conversion
    def to_reference(self) -> ReferenceKVCache:
        """The same cache in the reference layout on the host (keys ordered by position, copied)."""
        keys, values = [], []
        for layer in range(self.config.num_hidden_layers):
            n = self.cached_slots(layer)
            order = np.argsort(self.slot_positions[layer][:n], kind="stable")
            keys.append(np.array(self.device.to_host(self.keys[layer])[:, :, order]))
            values.append(np.array(self.device.to_host(self.values[layer])[:, :, order]))
        return ReferenceKVCache(self.config, self.batch_size, keys, values,
                                self._real_host[:, : self._length].astype(bool))

    @classmethod
    def from_reference(cls, cache: ReferenceKVCache, device: Any = HOST) -> "KVCache":
        """A cache holding exactly what a reference cache holds."""
        out = cls(cache.config, cache.batch_size, device=device)
        L = cache.length
        out.begin_append(np.asarray(cache.is_real, dtype=np.uint8))
        for layer in range(cache.config.num_hidden_layers):
            keys, values = cache.keys[layer], cache.values[layer]
            positions = np.arange(L - keys.shape[2], L, dtype=np.int64)
            cap = out.layer_capacity(layer)
            slots = positions if cap is None else positions % cap
            k_host, v_host = np.array(device.to_host(out.keys[layer])), np.array(device.to_host(out.values[layer]))
            k_host[:, :, slots], v_host[:, :, slots] = keys, values
            out.keys[layer], out.values[layer] = device.to_device(k_host), device.to_device(v_host)
            if cap is not None:
                out.slot_positions[layer][slots] = positions
                out._slots_dev[layer] = device.to_device(out.slot_positions[layer])
        out.end_append(L)
        return out

    def copy(self) -> "KVCache":
        """A deep copy (storage copied on its device)."""
        out = type(self).__new__(type(self))
        out.config, out.batch_size, out.device = self.config, self.batch_size, self.device
        out._length, out._capacity, out._chunk = self._length, self._capacity, self._chunk
        out.keys = [k.copy() for k in self.keys]
        out.values = [v.copy() for v in self.values]
        out.slot_positions = [p.copy() for p in self.slot_positions]
        out._slots_dev = [self.device.to_device(p) for p in out.slot_positions]
        out._real_host = self._real_host.copy()
        out.real = self.device.to_device(out._real_host)
        return out
