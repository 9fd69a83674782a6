"""The GPU path's KV cache: the fast paths' one cache layout (``fast/cache.py``) over device arrays."""

from __future__ import annotations

from typing import Any

from diffusiongemma.fast.cache import KVCache
from diffusiongemma.reference.config import ModelConfig

__all__ = ["GpuKVCache"]


class GpuKVCache(KVCache):
    """``fast.cache.KVCache`` with its storage on ``device`` (keys, values, slot tables and realness on the
    device, position and realness tables mirrored on the host)."""

    def __init__(self, config: ModelConfig, batch_size: int, device: Any):
        super().__init__(config, batch_size, device=device)
