"""Window stages: which prompt keys a canvas query sees in a sliding-window layer.

The spec (``W_MINUS_1``, transformers) lets every canvas query see every key the sliding layer's cache
retains, the last W - 1 (``masks.canvas_window``). JAX main narrows it per query; older JAX releases kept W
keys. A stage gives the decoder its (C, T) mask over the retained keys (``keys``) and the run its cache
(``new_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..cache import KVCache
from ..stages import RetainedKeys
from ..support.errors import ConfigError


@dataclass(frozen=True)
class PerQueryWindow(RetainedKeys):
    """JAX main's block-local mask AND its per-query sliding mask ``|q - k| < W``: query i (position L + i)
    sees the prompt keys at positions >= L + i - W + 1 and the canvas keys j with |i - j| < W (all of them
    while C <= W). Returns (C, T + C): the retained keys, then the canvas."""

    name: ClassVar[str] = "W-1-i"
    source: ClassVar[str] = ("JAX main since 09e7b48 (2026-07-06): block-local mask AND the per-query sliding "
                             "mask, which also hides canvas keys with |i - j| >= W")

    def keys(self, key_positions: np.ndarray, prompt_end: int, canvas_length: int, window: int) -> np.ndarray:
        i = np.arange(canvas_length)[:, None]
        prompt = np.asarray(key_positions)[None, :] >= prompt_end + i - window + 1
        return np.concatenate([prompt, np.abs(i - i.T) < window], axis=1)


@dataclass(frozen=True)
class WideWindow(RetainedKeys):
    """The last W prompt keys for every canvas query, on a cache whose sliding layers retain W."""

    name: ClassVar[str] = "W"
    source: ClassVar[str] = "JAX 195a977..0360c66: skip_sliding_mask=True, the canvas sees the last W prompt keys"

    def new_cache(self, model: Any, batch_size: int) -> Any:
        cache = model.new_cache(batch_size)
        if type(cache) is not KVCache:
            raise ConfigError("canvas_window 'W' needs the reference's KVCache (a model with another cache cannot "
                              "retain W prompt keys)")
        return WideWindowCache(cache.config, cache.batch_size)


class WideWindowCache(KVCache):
    """A ``KVCache`` whose sliding layers retain the last W keys (JAX releases before 2026-07-06)."""

    def layer_capacity(self, layer: int) -> int | None:
        return self.config.sliding_window if self.config.is_sliding(layer) else None


W_MINUS_1, W_MINUS_1_I, W = RetainedKeys(), PerQueryWindow(), WideWindow()
WINDOWS = {s.name: s for s in (W_MINUS_1, W_MINUS_1_I, W)}
