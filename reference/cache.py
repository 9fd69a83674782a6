"""The encoder's KV cache, read by the decoder.

Per layer it stores keys after ``k_norm`` and RoPE and values after the weightless value norm, as
(B, g, T, d) float32 arrays (g = KV heads and d = head dim of that layer). Full-attention layers keep
every encoded token; sliding layers keep only the last ``sliding_window - 1`` tokens, which is what a
transformers ``DynamicCache`` (``DynamicSlidingWindowLayer``) retains (SPEC §6 step 3, traps T5/T6).
The cache also remembers, for every encoded position, whether it was a real token or padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig


@dataclass
class KVCache:
    """Keys and values of everything encoded so far, for a batch of ``batch_size`` rows."""

    config: ModelConfig
    batch_size: int
    keys: list = field(default_factory=list)  # per layer (B, g, T_l, d) float32
    values: list = field(default_factory=list)  # per layer (B, g, T_l, d) float32
    is_real: np.ndarray = None  # (B, L) bool: position p of row b was a real (non-pad) token

    def __post_init__(self) -> None:
        if not self.keys:
            for layer in range(self.config.num_hidden_layers):
                g, d = self.config.layer_num_key_value_heads[layer], self.config.layer_head_dim[layer]
                empty = np.zeros((self.batch_size, g, 0, d), dtype=np.float32)
                self.keys.append(empty)
                self.values.append(empty.copy())
        if self.is_real is None:
            self.is_real = np.zeros((self.batch_size, 0), dtype=bool)

    @property
    def length(self) -> int:
        """L: tokens encoded so far (padding included); the next token sits at position L."""
        return self.is_real.shape[1]

    def layer_capacity(self, layer: int) -> int | None:
        """Entries a layer retains: ``sliding_window - 1`` for sliding layers, None (unbounded) for full."""
        return self.config.sliding_window - 1 if self.config.is_sliding(layer) else None

    def positions(self, layer: int) -> np.ndarray:
        """(T_l,) int64 absolute positions of the entries layer ``layer`` retains (the last T_l)."""
        retained = self.keys[layer].shape[2]
        return np.arange(self.length - retained, self.length, dtype=np.int64)

    def retain(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store [old ++ new] keys/values for ``layer``, dropping what a sliding layer no longer keeps.

        keys, values: (B, g, T_old + n, d), the full key set the encoder attended over.
        Call ``extend_positions`` once per encode call, after every layer has been retained.
        """
        cap = self.layer_capacity(layer)
        if cap is not None and keys.shape[2] > cap:
            keys, values = keys[:, :, -cap:], values[:, :, -cap:]
        self.keys[layer], self.values[layer] = keys, values

    def copy(self) -> "KVCache":
        """A deep copy (arrays copied)."""
        return KVCache(self.config, self.batch_size, [k.copy() for k in self.keys],
                       [v.copy() for v in self.values], self.is_real.copy())
