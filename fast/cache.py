"""The fast path's KV cache: preallocated storage, sliding layers as rings.

Same contents as ``reference.cache.KVCache`` (keys after ``k_norm`` and RoPE, values after the weightless
value norm; full-attention layers keep every encoded token, sliding layers the last ``sliding_window - 1``;
SPEC §6 step 3, traps T5/T6), stored so that nothing is copied or reallocated per token:

* a sliding layer owns a ring of ``W - 1`` slots; position p lives in slot ``p mod (W - 1)``;
* a full layer owns ``capacity`` slots, slot = position; capacity grows geometrically (rounded up to
  whole canvases) only when an encode call needs more, and ``reserve`` can size it up front;
* ``slot_positions[l][t]`` is the absolute position held by slot t of layer l (-1: empty), and
  ``real[b, p]`` (uint8) says whether position p of row b was a real token or padding.

The decoder only reads the cache; the encoder appends to it (``fast.model.Model.encode``).
"""

from __future__ import annotations

import numpy as np

from diffusiongemma.reference.cache import KVCache as ReferenceKVCache
from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.errors import InputError


class KVCache:
    """Keys and values of everything encoded so far, for ``batch_size`` rows (fast-path layout).

    Attributes (per layer l; g, d = KV heads and head dim of that layer):
        keys[l], values[l]: (B, g, slots_l, d) float32 storage (slots_l = W - 1 for sliding layers,
            ``capacity`` for full layers). Only the slots listed in ``slot_positions[l]`` hold data.
        slot_positions[l]: (slots_l,) int64, the position stored in each slot, -1 when empty.
        real: (B, capacity) uint8, 1 where the position was a real token.
    """

    def __init__(self, config: ModelConfig, batch_size: int, capacity: int = 0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.config = config
        self.batch_size = int(batch_size)
        self._length = 0
        self._capacity = 0
        self._chunk = max(1, int(config.canvas_length))
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.slot_positions: list[np.ndarray] = []
        for layer in range(config.num_hidden_layers):
            g, d = config.layer_num_key_value_heads[layer], config.layer_head_dim[layer]
            slots = config.sliding_window - 1 if config.is_sliding(layer) else 0
            self.keys.append(np.zeros((self.batch_size, g, slots, d), dtype=np.float32))
            self.values.append(np.zeros((self.batch_size, g, slots, d), dtype=np.float32))
            self.slot_positions.append(np.full(slots, -1, dtype=np.int64))
        self.real = np.zeros((self.batch_size, 0), dtype=np.uint8)
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
        """(B, L) bool: position p of row b was a real (non-pad) token. A read-only view."""
        view = self.real[:, : self._length].view(bool)
        view.flags.writeable = False
        return view

    def layer_capacity(self, layer: int) -> int | None:
        """Entries a layer retains: ``sliding_window - 1`` for sliding layers, None (unbounded) for full."""
        return self.config.sliding_window - 1 if self.config.is_sliding(layer) else None

    def cached_slots(self, layer: int) -> int:
        """How many leading slots of ``layer`` the attention kernel must scan (the rest are empty)."""
        cap = self.layer_capacity(layer)
        return self._length if cap is None else min(self._length, cap)

    # ------------------------------------------------------------------ growth
    def reserve(self, total_positions: int) -> None:
        """Make room for ``total_positions`` encoded positions (full layers and the realness table).

        Grows to at least 1.5x the current capacity, rounded up to whole canvases, so that appending
        canvas after canvas reallocates O(log n) times. Existing contents are kept.
        """
        if total_positions <= self._capacity:
            return
        new_cap = max(int(total_positions), (self._capacity * 3) // 2)
        new_cap = -(-new_cap // self._chunk) * self._chunk  # round up to whole canvases
        for layer in range(self.config.num_hidden_layers):
            if self.config.is_sliding(layer):
                continue
            for store in (self.keys, self.values):
                old = store[layer]
                grown = np.zeros(old.shape[:2] + (new_cap, old.shape[3]), dtype=np.float32)
                grown[:, :, : self._length] = old[:, :, : self._length]
                store[layer] = grown
            positions = np.arange(new_cap, dtype=np.int64)
            positions[self._length:] = -1
            self.slot_positions[layer] = positions
        real = np.zeros((self.batch_size, new_cap), dtype=np.uint8)
        real[:, : self._length] = self.real[:, : self._length]
        self.real = real
        self._capacity = new_cap

    # ------------------------------------------------------------------ appending (encoder)
    def begin_append(self, mask: np.ndarray) -> None:
        """Record the realness of the n positions about to be encoded, without advancing the length.

        mask: (B, n) bool/0-1. Reserves room first and labels the full layers' next n slots with their
        positions. Until ``end_append`` nothing becomes visible to a decoder (the length is unchanged).
        """
        n = mask.shape[1]
        self.reserve(self._length + n)
        self.real[:, self._length: self._length + n] = mask
        for layer in range(self.config.num_hidden_layers):
            if not self.config.is_sliding(layer):
                self.slot_positions[layer][self._length: self._length + n] = np.arange(
                    self._length, self._length + n, dtype=np.int64)

    def full_layer_slots(self, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Storage views (B, g, n, d) of the next n positions of a full layer (written in place)."""
        start = self._length
        return self.keys[layer][:, :, start: start + n], self.values[layer][:, :, start: start + n]

    def store_sliding(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Put the newest ``min(n, W - 1)`` of n fresh keys/values (B, g, n, d) into a sliding ring.

        Positions are ``length .. length + n - 1`` (the length advances only in ``end_append``).
        """
        cap = self.layer_capacity(layer)
        n = keys.shape[2]
        keep = min(n, cap)
        positions = np.arange(self._length + n - keep, self._length + n, dtype=np.int64)
        slots = positions % cap
        self.keys[layer][:, :, slots] = keys[:, :, n - keep:]
        self.values[layer][:, :, slots] = values[:, :, n - keep:]
        self.slot_positions[layer][slots] = positions

    def end_append(self, n: int) -> None:
        """Advance the length by n once every layer has stored its keys/values."""
        self._length += n

    # ------------------------------------------------------------------ conversion
    def to_reference(self) -> ReferenceKVCache:
        """The same cache in the reference layout (keys ordered by position, copied)."""
        keys, values = [], []
        for layer in range(self.config.num_hidden_layers):
            order = self._ordered_slots(layer)
            keys.append(self.keys[layer][:, :, order].copy())
            values.append(self.values[layer][:, :, order].copy())
        return ReferenceKVCache(self.config, self.batch_size, keys, values,
                                self.real[:, : self._length].astype(bool))

    @classmethod
    def from_reference(cls, cache: ReferenceKVCache) -> "KVCache":
        """Build a fast cache holding exactly what a reference cache holds."""
        out = cls(cache.config, cache.batch_size)
        L = cache.length
        out.reserve(L)
        out.real[:, :L] = cache.is_real
        for layer in range(cache.config.num_hidden_layers):
            keys, values = cache.keys[layer], cache.values[layer]
            T = keys.shape[2]
            positions = np.arange(L - T, L, dtype=np.int64)
            if cache.config.is_sliding(layer):
                slots = positions % out.layer_capacity(layer)
                out.slot_positions[layer][slots] = positions
            else:
                slots = positions
                out.slot_positions[layer][:L] = positions
            out.keys[layer][:, :, slots] = keys
            out.values[layer][:, :, slots] = values
        out._length = L
        return out

    def copy(self) -> "KVCache":
        """A deep copy (arrays copied)."""
        out = KVCache.__new__(KVCache)
        out.config, out.batch_size = self.config, self.batch_size
        out._length, out._capacity, out._chunk = self._length, self._capacity, self._chunk
        out.keys = [k.copy() for k in self.keys]
        out.values = [v.copy() for v in self.values]
        out.slot_positions = [p.copy() for p in self.slot_positions]
        out.real = self.real.copy()
        return out

    def _ordered_slots(self, layer: int) -> np.ndarray:
        """Slot indices of the retained entries of ``layer``, in position order."""
        n = self.cached_slots(layer)
        positions = self.slot_positions[layer][:n]
        return np.argsort(positions, kind="stable")
