"""The fast CPU path of DiffusionGemma: the reference's model on compiled kernels and reused buffers.

``Model`` has the reference's interface (``from_pretrained(path, device="cpu")``, ``new_cache``, ``encode``,
``denoise``); ``KVCache`` is its preallocated cache; ``generate`` is the reference's one generation loop,
which runs a ``fast.Model`` on its own denoising step (``backend.CpuBackend``: the fused decoder buffer and
sampling pass). Configuration, weight loading, errors, draw sources and ``GenerationConfig`` are the
reference's own (``diffusiongemma.reference``).
"""

if __name__ != "diffusiongemma.fast":  # e.g. ``import fast`` from the repository root
    raise ImportError(f"this package is diffusiongemma.fast; import it under that name (it was imported as "
                      f"{__name__!r}, which would make a second copy of every class)")


# The kernels' OpenMP regions alternate with BLAS calls that have their own thread pool; OpenMP threads that
# spin while idle take the cores the BLAS threads need (with two threads on two cores, a decoder pass became
# 30x slower). Importing the package (diffusiongemma/threads.py) has already loaded GNU OpenMP with passive
# waits and the free cores' count, without writing either into os.environ; a user's setting wins.

from .cache import KVCache  # noqa: E402
from diffusiongemma.reference.generate import generate  # noqa: E402  (the one loop; fast.Model brings its backend)
from .model import DEVICES, Model  # noqa: E402

__all__ = ["Model", "KVCache", "generate", "DEVICES"]
