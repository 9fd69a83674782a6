"""DiffusionGemma on an NVIDIA GPU: CuPy arrays, cuBLAS matrix products and the CUDA kernels of ``cuda/``.

The modules mirror the reference's:

    device.py    the device: CuPy on a CUDA GPU (``CupyDevice``), compiled kernels, host <-> device copies
    build.py     assembling and compiling the CUDA sources (nvcc / NVRTC), register and spill checks
    launch.py    launch geometry and argument checks for every kernel (``Launch`` objects)
    cache.py     the KV cache on the device
    model.py     ``Model``: encoder and decoder on the device (``Model.from_pretrained(path, device="cuda")``)
    sampling.py  one denoising step on the device: sampling pass, acceptance and renoising
    canvas.py    a canvas's steps on the device, the host reading only a stop flag and the committed draft
    graph.py     a denoising step captured once and replayed (a CUDA graph; cuda-sim: the recorded plan)
    counting.py  a device wrapper counting transfers, synchronisations, launches, replays and memory
    cuda/        the kernels (norms, RoPE, attention, MoE, sampling)

CuPy is optional: importing this package never imports it.
"""

from .cache import GpuKVCache
from .device import CupyDevice, gpu_available
from .model import Model, _generate, generate  # noqa: F401 (_generate: the tests' logits hook)

__all__ = ["Model", "GpuKVCache", "CupyDevice", "generate", "gpu_available"]
