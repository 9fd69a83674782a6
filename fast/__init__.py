"""The fast CPU path of DiffusionGemma: the reference's model on compiled kernels and reused buffers.

``Model`` has the reference's interface (``from_pretrained(path, device="cpu")``, ``new_cache``, ``encode``,
``denoise``); ``KVCache`` is its preallocated cache; ``generate`` is the reference's one generation loop,
which runs a ``fast.Model`` on its own denoising step (``backend.CpuBackend``: the fused decoder buffer and
sampling pass). Configuration, weight loading, errors, draw sources and ``GenerationConfig`` are the
reference's own (``diffusiongemma.reference``).
"""

import os

# The kernels' OpenMP regions alternate with BLAS calls that have their own thread pool. By default an
# idle OpenMP thread spins for a while after each region, and those spinning threads take the cores the
# BLAS threads need (with two threads on two cores, a decoder pass became 30x slower). Passive waiting
# costs a few microseconds per region and removes the contention. libgomp reads this variable once,
# when it is first loaded; an explicit setting by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .cache import KVCache  # noqa: E402
from diffusiongemma.reference.generate import generate  # noqa: E402  (the one loop; fast.Model brings its backend)
from .model import DEVICES, Model  # noqa: E402

__all__ = ["Model", "KVCache", "generate", "DEVICES"]
