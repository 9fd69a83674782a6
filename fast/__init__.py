"""The fast CPU path of DiffusionGemma: the reference's model on compiled kernels and reused buffers.

``Model`` has the reference's interface (``from_pretrained(path, device="cpu")``, ``new_cache``, ``encode``,
``denoise``); ``KVCache`` is its preallocated cache; ``generate`` is the reference's generation loop with
the fused sampling pass. Configuration, weight loading, errors, draw sources and ``GenerationConfig`` are
the reference's own (``diffusiongemma.reference``).
"""

from .cache import KVCache
from .generate import generate
from .model import DEVICES, Model

__all__ = ["Model", "KVCache", "generate", "DEVICES"]
